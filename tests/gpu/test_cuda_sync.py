"""On a CUDA machine: a trainer's CUDA tensors through every host transport into a CUDA model, in place.

Skipped without CUDA (CI has none): ``scripts/gpu_check.sh`` runs these where a GPU is. Each version must leave
the CUDA model generating exactly like a fresh model given the new weights, with its parameters at the same
addresses (what CUDA graphs captured), and a writer killed midway must leave the previous version serving.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

pytest.importorskip("transformers")

from _support import hf_writer  # noqa: E402

from rlsync import SyncOptions, WeightsReader, WeightsWriter  # noqa: E402
from rlsync.adapters.hf import ModuleReceiver  # noqa: E402
from rlsync.core import HostStaging, transports  # noqa: E402
from rlsync.layouts import from_state_dict  # noqa: E402

PROMPT = [[3, 17, 42, 99, 5, 64]]
WRITER = Path(hf_writer.__file__)


def greedy(model: torch.nn.Module) -> list[int]:
    prompt = torch.tensor(PROMPT, device="cuda")
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,  # type: ignore[operator]
                         pad_token_id=0)
    return list(out[0, prompt.shape[1]:].tolist())


def host_transports() -> list[str]:
    registry = transports()
    return [n for n in ("shm", "tcp", "nixl") if n in registry and registry.get(n).available()]


@pytest.mark.parametrize("transport", host_transports())
def test_cuda_trainer_tensors_land_in_a_cuda_model_in_place(transport: str) -> None:
    engine = hf_writer.tiny_qwen2(seed=0).cuda()
    addresses = {n: p.data_ptr() for n, p in engine.named_parameters()}
    options = SyncOptions(transport=transport, verify=True, timeout=120)
    with ModuleReceiver(engine, options=options) as receiver:
        trainer = hf_writer.tiny_qwen2(seed=1).cuda()
        with WeightsWriter(from_state_dict(trainer.state_dict()), None, 0, [receiver.address], options=options) as writer:
            for version, seed in ((1, 11), (2, 22), (3, 33)):
                fresh = hf_writer.tiny_qwen2(seed=seed).cuda()
                trainer.load_state_dict(fresh.state_dict())  # the trainer's new weights, on the GPU
                writer.multi_put(trainer.state_dict())  # CUDA tensors: staged through reused pinned buffers
                writer.complete(version)
                assert receiver.version == version
                with receiver.serving(), torch.no_grad():
                    for name, p in engine.named_parameters():
                        assert torch.equal(p, dict(fresh.named_parameters())[name]), name
                    assert greedy(engine) == greedy(fresh)
                assert {n: p.data_ptr() for n, p in engine.named_parameters()} == addresses
            pinned = [b.is_pinned() for b in writer._staging._buffers.values()]
            assert pinned and all(pinned)


def test_a_cuda_writer_killed_midway_leaves_the_previous_version_serving() -> None:
    engine = hf_writer.tiny_qwen2(seed=0).cuda()
    before = greedy(engine)
    with ModuleReceiver(engine) as receiver:
        dying = subprocess.run([sys.executable, str(WRITER), "--address", receiver.address, "--seed", "11", "--version", "1",
                                "--device", "cuda", "--die-after-writes", "3"], capture_output=True, text=True, timeout=300)
        assert dying.returncode == -9, dying.stderr
        assert receiver.version == -1
        with receiver.serving(), torch.no_grad():
            assert greedy(engine) == before
        done = subprocess.run([sys.executable, str(WRITER), "--address", receiver.address, "--seed", "11", "--version", "1",
                               "--device", "cuda"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        with receiver.serving(), torch.no_grad():
            assert greedy(engine) == greedy(hf_writer.tiny_qwen2(seed=11).cuda())


def test_staging_from_cuda_is_asynchronous_and_exact() -> None:
    staging = HostStaging()
    source = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    staged = staging.stage("x", source)
    assert staged.is_pinned()
    staging.wait()
    assert torch.equal(staged, source.cpu())
    again = staging.stage("x", source.t())  # a strided CUDA view: same buffer name, other shape: a new buffer
    staging.wait()
    assert torch.equal(again, source.t().cpu())


def test_cuda_tensors_arrive_byte_for_byte_in_a_host_landing() -> None:
    """Readers land in host memory (the host transports' regions); a CUDA tensor put into a writer arrives exact."""
    state = {"w": torch.randn(256, 256, device="cuda"), "b": torch.randn(256, device="cuda", dtype=torch.bfloat16)}
    layout = from_state_dict(state)
    with WeightsReader(layout, layout, 0) as reader, WeightsWriter(layout, layout, 0, [reader.address]) as writer:
        writer.multi_put(state)
        writer.complete(1)
        landed = reader.buffers()
        for name, tensor in state.items():
            assert bytes(landed[name]) == bytes(tensor.cpu().reshape(-1).view(torch.uint8).numpy()), name


def test_fp8_quantization_on_the_gpu_equals_the_cpu() -> None:
    from rlsync.wire import quantize

    weight = torch.randn(384, 520, dtype=torch.bfloat16)
    q_cpu, s_cpu = quantize(weight)
    q_gpu, s_gpu = quantize(weight.cuda())
    assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
