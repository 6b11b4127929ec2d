"""After several updates, everything a vLLM-CPU engine computes with equals what a fresh engine loaded with the same
weights holds: every parameter, and every copy vLLM keeps beside them (issue #36). vLLM-CPU repacks its linears at
load (``dispatch_cpu_unquantized_gemm``: on AMX CPUs sgl's ``convert_weight_packed`` copies and float32 biases, on
others oneDNN handlers), and those copies live in closures (``layer.cpu_linear``), not parameters: so each
linear's output on a fixed input is compared too, which reads whatever copy the layer really uses. A copy an update
left stale would differ here even where greedy output happens to agree."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from _support.vllm_engines import TRAINER, engine, save, trainer  # noqa: E402

from rlsync.adapters.vllm import apply_next_version  # noqa: E402


def computed_with(worker: Any) -> dict[str, str]:
    """A digest of every parameter and of every linear's output on a fixed input (through its ``cpu_linear``)."""
    model = worker.model_runner.model
    seen: dict[str, str] = {}
    for name, p in model.named_parameters():
        seen[f"param {name}"] = hashlib.sha256(p.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, module in model.named_modules():
            linear = getattr(module, "cpu_linear", None)
            width = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
            if linear is None or width is None:
                continue
            x = torch.randn(3, int(width), generator=generator).to(torch.bfloat16)
            out = linear(x, module.weight, getattr(module, "bias", None))
            seen[f"output {name}"] = hashlib.sha256(out.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
    return seen


@pytest.mark.parametrize("arch", ["qwen2", "qwen2-tied"])
def test_after_updates_every_parameter_and_packed_copy_equals_a_fresh_engines(arch: str, tmp_path: Path,
                                                                            cleanup: list[object]) -> None:
    seeds = [101, 102, 103]
    llm = engine(save(arch, 100, tmp_path / "v0"))
    cleanup.append(llm)
    [address] = llm.collective_rpc("rlsync_start", args=(trainer.tensors(trainer.build(arch, 100)),))
    child = subprocess.Popen([sys.executable, str(TRAINER), "--arch", arch, "--address", address,
                              "--seeds", *map(str, seeds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for version in (1, 2, 3):
            assert apply_next_version(llm, 120.0) == version
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    finally:
        if child.poll() is None:
            child.kill()
    [updated] = llm.collective_rpc(computed_with)
    fresh = engine(save(arch, seeds[-1], tmp_path / "v3"))
    cleanup.append(fresh)
    [loaded] = fresh.collective_rpc(computed_with)
    assert sum(k.startswith("output ") for k in loaded) >= 4, sorted(loaded)  # the packed linears were found
    differing = sorted(k for k in loaded if updated.get(k) != loaded[k])
    assert not differing, f"the updated engine computes with other bytes than a fresh one in: {differing}"
