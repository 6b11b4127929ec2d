"""``rlsync bench --engine vllm``: weight sync into a running vLLM engine, against the usual routes.

Every figure comes from one run, on one engine: a locally built Qwen2 (random init, about 125M
parameters in bf16) served by vLLM, and a trainer process holding new weights. Measured, per
version, from "the trainer has new weights" to "the engine serves them":

- ``rlsync-shm`` (kind ``transport``): ``WeightsWriter.multi_put`` + ``complete`` while the engine's
  worker extension lands the version and loads it (``rlsync_apply``);
- ``rlsync-shm+canary`` (kind ``transport``): the same with the canary: the trainer computes it (a forward of
  the model it holds), the engine commits the version undoably (a host copy of its weights), checks its prompt
  log-probs before it serves (``apply_next_version``), then settles;
- ``vllm-reload-safetensors-devshm`` (baseline): the trainer saves a safetensors file to /dev/shm and the
  engine runs vLLM's own ``reload_weights(weights_path=...)``;
- ``gloo-broadcast-load_weights`` (baseline): trainer and engine share a gloo group, the trainer
  broadcasts tensor by tensor and the engine feeds them to vLLM's loader as they arrive (what TRL and
  OpenRLHF do, with NCCL on GPUs);
- ``vllm-reload-from-memory`` (kind ``floor``): the engine reloads weights it already holds, no transfer
  at all: the cost of vLLM's reload itself, which every route pays.

All three load through the same vLLM layerwise reload, so the differences are the transfer routes.
After the last version of each path, greedy output must be the same for all three (same weights),
or the benchmark fails. The engine and the trainer are this module run as scripts: the CLI process
never imports vLLM.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from rlsync import ConfigError, SyncOptions

#: about 125M parameters: big enough that transfer, not per-call overhead, dominates
CONFIG: dict[str, Any] = {"model_type": "qwen2", "vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048,
                          "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4,
                          "max_position_embeddings": 256, "tie_word_embeddings": False}
TINY: dict[str, Any] = {**CONFIG, "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
                        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
MODELS = {"125m": CONFIG, "tiny": TINY}
PROMPT = [5, 17, 42, 99, 3, 250, 11]


# ---------------------------------------------------------------------------------------------
# the two worker processes
# ---------------------------------------------------------------------------------------------


def _models(config: dict[str, Any]) -> list[Any]:
    """Two models with different weights; versions alternate between them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    model_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    out = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.05)
        out.append(model.eval())
    return out


def _states(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The two models' weights under checkpoint names."""
    return [_state(model) for model in _models(config)]


def _state(model: Any) -> dict[str, Any]:
    return {n: p.detach().contiguous() for n, p in model.named_parameters()}


def _gloo(port: int, rank: int) -> Any:
    """A two-process gloo group of its own (vLLM holds torch.distributed's default group in the engine)."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=300))  # type: ignore[attr-defined]  # not re-exported
    return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=300))


def _trainer(config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    from rlsync import Canary, WeightsWriter
    from rlsync.adapters.vllm import engine_layout
    from rlsync.layouts import from_state_dict

    models = _models(config)  # the trainer's: the canary path computes its canary with them
    states = [_state(model) for model in models]
    writer = group = None
    _emit({"ready": True, "params": sum(t.numel() for t in states[0].values()),
           "bytes": sum(t.numel() * t.element_size() for t in states[0].values())})
    for line in sys.stdin:
        cmd = json.loads(line)
        state = states[cmd.get("version", 0) % 2]
        if cmd["cmd"] in ("rlsync", "rlsync-canary"):
            if writer is None:
                dst = engine_layout([[n, t.dtype, t.shape] for n, t in state.items()])
                writer = WeightsWriter(from_state_dict(state), dst, 0, [cmd["address"]], options=SyncOptions(timeout=600))
            canary = Canary.of(models[cmd["version"] % 2]) if cmd["cmd"] == "rlsync-canary" else None
            writer.multi_put(state)
            writer.complete(cmd["version"], canary=canary)
        elif cmd["cmd"] == "save":
            save_file(state, os.path.join(cmd["dir"], "model.safetensors"))
        elif cmd["cmd"] == "gloo":
            group = group or _gloo(cmd["port"], 0)
            for tensor in state.values():
                group.broadcast(tensor, 0).wait()
        _emit({"done": cmd["cmd"]})
    if writer is not None:
        writer.close()


def _engine(config: dict[str, Any], model_dir: str) -> None:
    import torch
    from vllm import LLM, SamplingParams

    from rlsync.adapters.vllm import apply_next_version

    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", seed=0,
              distributed_executor_backend="uni", max_model_len=256,
              worker_extension_cls="rlsync.adapters.vllm.RlsyncWorkerExtension")
    metas = [(n, t.dtype, tuple(t.shape)) for n, t in _states(config)[0].items()]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, detokenize=False)
    group = None
    states: list[dict[str, Any]] = []

    def gloo_stream(port: int) -> Any:
        nonlocal group
        group = group or _gloo(port, 1)
        for name, dtype, shape in metas:  # received as the loader asks for them, like TRL / OpenRLHF
            tensor = torch.empty(shape, dtype=dtype)
            group.broadcast(tensor, 0).wait()
            yield name, tensor

    _emit({"ready": True})
    for line in sys.stdin:
        cmd = json.loads(line)
        reply: dict[str, Any] = {"done": cmd["cmd"]}
        if cmd["cmd"] == "start":
            [reply["address"]] = llm.collective_rpc("rlsync_start", args=([[n, str(d), list(s)] for n, d, s in metas],))
        elif cmd["cmd"] == "rlsync":
            llm.collective_rpc("rlsync_apply", args=(600.0,))
        elif cmd["cmd"] == "rlsync-canary":
            apply_next_version(llm, 600.0)
        elif cmd["cmd"] == "reload":
            llm.collective_rpc("reload_weights", kwargs={"weights_path": cmd["dir"]})
        elif cmd["cmd"] == "gloo":
            stream = gloo_stream(cmd["port"])
            llm.collective_rpc(lambda worker, s=stream: worker.reload_weights(weights_iterator=s))
        elif cmd["cmd"] == "floor":  # weights already in this process: what vLLM's reload alone costs
            states = states or _states(config)
            state = states[cmd["version"] % 2]
            llm.collective_rpc(lambda worker, st=state: worker.reload_weights(weights_iterator=iter(st.items())))
        elif cmd["cmd"] == "generate":
            out = llm.generate([{"prompt_token_ids": PROMPT}], greedy, use_tqdm=False)  # type: ignore[arg-type, unused-ignore]
            reply["tokens"] = list(out[0].outputs[0].token_ids)
        if cmd["cmd"] in ("rlsync", "rlsync-canary", "reload", "gloo", "floor"):
            llm.reset_prefix_cache()
        _emit(reply)
    llm.collective_rpc("rlsync_stop")


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


# ---------------------------------------------------------------------------------------------
# the driver (the CLI process)
# ---------------------------------------------------------------------------------------------


class _Proc:
    """A worker process spoken to in JSON lines (stdin: commands, stdout: one reply each)."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        self.role = args[0]
        self.p = subprocess.Popen([sys.executable, "-m", "rlsync.bench._engine", *args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)
        self.hello = self.read()

    def send(self, **cmd: Any) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()

    def read(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        while line := self.p.stdout.readline():
            if line.startswith("{"):  # vLLM prints its own lines too
                return json.loads(line)  # type: ignore[no-any-return]
        raise RuntimeError(f"benchmark {self.role} process exited with {self.p.wait()} (its error is above)")

    def close(self) -> None:
        if self.p.stdin is not None:
            self.p.stdin.close()
        try:
            self.p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.p.kill()


def _both(a: _Proc, b: _Proc, **cmd: Any) -> float:
    started = time.perf_counter()
    a.send(**cmd)
    b.send(**cmd)
    a.read()
    b.read()
    return time.perf_counter() - started


def _one(proc: _Proc, **cmd: Any) -> float:
    started = time.perf_counter()
    proc.send(**cmd)
    proc.read()
    return time.perf_counter() - started


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(config: dict[str, Any], repeats: int, progress: Any = None) -> dict[str, Any]:
    """Run the three paths on one engine and return the ``--json`` object."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("rlsync bench --engine vllm builds its model with transformers: pip install 'rlsync[vllm]'") from None
    from rlsync.bench._weights import memcpy_gbps

    step = progress or (lambda _name: None)
    tmp = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="rlsync-bench-")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_RPC_BASE_PATH": tmp, "TMPDIR": tmp}
    step("building the model")
    model_dir = os.path.join(tmp, "model")
    _save_initial(config, model_dir)
    versions = repeats + 1  # the first version of each path pays for connecting and warming up
    step("starting vLLM")
    engine = _Proc("engine", json.dumps(config), model_dir, env=env)
    trainer = _Proc("trainer", json.dumps(config), env=env)
    try:
        engine.send(cmd="start")
        address = engine.read()["address"]
        times: dict[str, list[float]] = {}
        tokens: dict[str, list[int]] = {}
        step("rlsync-shm")
        times["rlsync-shm"] = [_both(trainer, engine, cmd="rlsync", address=address, version=v) for v in range(1, versions + 1)]
        engine.send(cmd="generate")
        tokens["rlsync-shm"] = engine.read()["tokens"]
        step("rlsync-shm+canary")  # later versions, ending on the same weights as every other path
        times["rlsync-shm+canary"] = [_both(trainer, engine, cmd="rlsync-canary", address=address, version=v)
                                      for v in range(2 * versions + 1, 3 * versions + 1)]
        engine.send(cmd="generate")
        tokens["rlsync-shm+canary"] = engine.read()["tokens"]
        step("vllm-reload-safetensors-devshm")
        reload_dir = os.path.join(tmp, "reload")
        os.mkdir(reload_dir)
        times["vllm-reload-safetensors-devshm"] = [_save_and_reload(trainer, engine, reload_dir, v) for v in range(1, versions + 1)]
        engine.send(cmd="generate")
        tokens["vllm-reload-safetensors-devshm"] = engine.read()["tokens"]
        step("gloo-broadcast-load_weights")
        port = _free_port()
        times["gloo-broadcast-load_weights"] = [_both(trainer, engine, cmd="gloo", port=port, version=v) for v in range(1, versions + 1)]
        engine.send(cmd="generate")
        tokens["gloo-broadcast-load_weights"] = engine.read()["tokens"]
        step("vllm-reload-from-memory (floor)")
        times["vllm-reload-from-memory"] = [_one(engine, cmd="floor", version=v) for v in range(1, versions + 1)]
    finally:
        trainer.close()
        engine.close()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    if len({json.dumps(t) for t in tokens.values()}) != 1:
        raise AssertionError(f"the paths disagree on greedy output after loading the same weights: {tokens}")
    nbytes = trainer.hello["bytes"]
    kinds = {"rlsync-shm": "transport", "rlsync-shm+canary": "transport", "vllm-reload-from-memory": "floor"}
    results = [{"name": name, "kind": kinds.get(name, "baseline"),
                "seconds": statistics.median(ts[1:]), "gbps": nbytes / statistics.median(ts[1:]) / 1e9}
               for name, ts in times.items()]
    return {"engine": "vllm", "params": trainer.hello["params"], "bytes": nbytes, "memcpy_gbps": memcpy_gbps(nbytes),
            "greedy_equal": True, "results": results}


def _save_and_reload(trainer: _Proc, engine: _Proc, model_dir: str, version: int) -> float:
    started = time.perf_counter()
    trainer.send(cmd="save", dir=model_dir, version=version)
    trainer.read()
    engine.send(cmd="reload", dir=model_dir)
    engine.read()
    return time.perf_counter() - started


def _save_initial(config: dict[str, Any], model_dir: str) -> None:
    """The engine starts from a checkpoint directory (config.json + safetensors), built here."""
    subprocess.run([sys.executable, "-m", "rlsync.bench._engine", "save", json.dumps(config), model_dir], check=True)


def _save(config: dict[str, Any], model_dir: str) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig

    cfg = dict(config)
    AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(model_dir)
    save_file(_states(config)[0], os.path.join(model_dir, "model.safetensors"))


def run(*, engine: str, json_output: bool, repeats: int, model: str = "125m") -> None:
    from rich.console import Console
    from rich.table import Table

    from rlsync.bench._progress import progress

    if model not in MODELS:
        raise ConfigError(f"--engine-model {model!r}: pick one of {sorted(MODELS)}")
    if engine != "vllm":
        raise ConfigError(f"rlsync bench --engine {engine!r}: only 'vllm' runs here (SGLang needs a GPU; see docs/engines/sglang.md)")
    probe = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        raise ConfigError("vLLM does not import in this environment: pip install 'rlsync[vllm]' (on a machine without "
                          "a GPU also `pip uninstall torchvision torchaudio torchcodec`, whose PyPI builds need CUDA); "
                          f"the import said: {probe.stderr.strip().splitlines()[-1:]}")
    console = Console(stderr=True)
    with progress(7, "weight sync into vLLM") as advance:
        report = measure(MODELS[model], repeats, advance)
    if json_output:
        print(json.dumps(report))
        return
    baselines = [r for r in report["results"] if r["kind"] == "baseline"]
    floor = next(r for r in report["results"] if r["kind"] == "floor")
    table = Table(title=f"weight sync into vLLM, {report['params'] / 1e6:.0f}M parameters bf16 "
                        f"({report['bytes'] / 2**20:.0f} MiB), memcpy {report['memcpy_gbps']:.2f} GB/s; greedy output equal on every path")
    for col in ("path", "seconds to live", "GB/s", "x memcpy", "over the reload floor",
                *(f"speed-up vs {b['name']}" for b in baselines)):
        table.add_column(col, overflow="fold")
    for r in report["results"]:
        table.add_row(r["name"], f"{r['seconds']:.3f}", f"{r['gbps']:.2f}", f"{r['gbps'] / report['memcpy_gbps']:.2f}",
                      f"+{r['seconds'] - floor['seconds']:.3f} s", *(f"{b['seconds'] / r['seconds']:.2f}x" for b in baselines))
    Console().print(table)
    console.print("floor: vLLM reloading weights already in its own memory (no transfer); on CPU the reload "
                  "repacks every linear layer, which no transfer route avoids")


if __name__ == "__main__":
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    if role == "trainer":
        _trainer(cfg)
    elif role == "engine":
        _engine(cfg, sys.argv[3])
    elif role == "save":
        _save(cfg, sys.argv[3])
