"""On a CUDA machine: a trainer's CUDA tensors through every transport into a CUDA model, in place.

Skipped without CUDA (CI has none): ``scripts/gpu_check.sh`` runs these where a GPU is. Each version must leave
the CUDA model generating exactly like a fresh model given the new weights, with its parameters at the same
addresses (what CUDA graphs captured), and a writer killed midway must leave the previous version serving.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

pytest.importorskip("transformers")

from _support import hf_writer  # noqa: E402
from _support.cuda_engines import WRITER, device_transports, greedy  # noqa: E402
from _support.cuda_engines import push as _push  # noqa: E402

from rlsync import SyncOptions, WeightsReader, WeightsWriter  # noqa: E402
from rlsync.adapters.hf import ModuleReceiver  # noqa: E402
from rlsync.core import HostStaging, transports  # noqa: E402
from rlsync.layouts import from_state_dict  # noqa: E402


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
            if not transports().get(transport).device_sources:  # shm, tcp: through reused pinned host buffers
                pinned = [b.is_pinned() for b in writer._staging._buffers.values()]
                assert pinned and all(pinned)
            else:  # nixl reads the CUDA tensors as they are: nothing staged on the host
                assert writer._staging.nbytes == 0


def test_a_cuda_writer_killed_midway_leaves_the_previous_version_serving() -> None:
    engine = hf_writer.tiny_qwen2(seed=0).cuda()
    before = greedy(engine)
    with ModuleReceiver(engine) as receiver:
        dying = subprocess.run([sys.executable, str(WRITER), "--address", receiver.address, "--seed", "11", "--version", "1",
                                "--device", "cuda", "--die-after-writes", "3"], capture_output=True, text=True, timeout=150)
        assert dying.returncode == -9, dying.stderr
        assert receiver.version == -1
        with receiver.serving(), torch.no_grad():
            assert greedy(engine) == before
        done = subprocess.run([sys.executable, str(WRITER), "--address", receiver.address, "--seed", "11", "--version", "1",
                               "--device", "cuda"], capture_output=True, text=True, timeout=150)
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


@pytest.mark.parametrize("transport", ["shm", "nixl"])
def test_cuda_tensors_arrive_byte_for_byte_in_a_host_landing(transport: str) -> None:
    """Readers land in host memory (the host transports' regions, NIXL's DRAM); CUDA tensors put into a writer
    arrive exact, version after version (NIXL: through pinned host copies; 64 MiB, where UCX's own path from device
    memory hung at 4 GiB)."""
    if transport == "nixl" and "nixl" not in device_transports():
        pytest.skip("nixl is not installed here")
    state = {f"w{i}": torch.randn(1024, 2048, device="cuda") for i in range(8)}
    state["b"] = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    layout = from_state_dict(state)
    options = SyncOptions(transport=transport, timeout=60)
    with WeightsReader(layout, layout, 0, options=options) as reader, \
            WeightsWriter(layout, layout, 0, [reader.address], options=options) as writer:
        for version in (1, 2, 3):
            for tensor in state.values():
                tensor.add_(1)
            writer.multi_put(state)
            writer.complete(version)
            landed = reader.buffers()
            for name, tensor in state.items():
                assert bytes(landed[name]) == bytes(tensor.cpu().reshape(-1).view(torch.uint8).numpy()), (version, name)


def test_fp8_quantization_on_the_gpu_equals_the_cpu() -> None:
    from rlsync.wire import quantize

    weight = torch.randn(384, 520, dtype=torch.bfloat16)
    q_cpu, s_cpu = quantize(weight)
    q_gpu, s_gpu = quantize(weight.cuda())
    assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))


def test_masked_head_logprobs_on_the_gpu_equal_the_cpu_in_float32_and_run_under_bf16_autocast() -> None:
    """``rlsync.head_logprobs`` (TRL's fused head under the sampling mask) on CUDA: float32 log-probs, entropies and
    gradients as on the CPU; under bf16 autocast (a trainer's mixed precision) finite and within bf16's reach."""
    from rlsync import head_logprobs

    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(300, 64, generator=gen), torch.randn(5000, 64, generator=gen) * 0.1
    tokens = torch.randint(0, 5000, (300,), generator=gen)
    results = []
    for device in ("cpu", "cuda"):
        h, w = hidden.to(device, copy=True).requires_grad_(), weight.to(device, copy=True).requires_grad_()
        logprobs, entropy = head_logprobs(h, w, None, tokens.to(device), temperature=0.9, top_k=50, top_p=0.8, entropy=True)
        (logprobs.sum() + entropy.sum()).backward()
        results.append([t.detach().cpu() for t in (logprobs, entropy, h.grad, w.grad)])
    for cpu, cuda in zip(*results):
        assert torch.allclose(cpu, cuda, atol=1e-4, rtol=1e-4)
    h, w = hidden.cuda().requires_grad_(), weight.cuda().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logprobs, _ = head_logprobs(h, w, None, tokens.cuda(), temperature=0.9, top_k=50, top_p=0.8)
    logprobs.sum().backward()
    assert torch.isfinite(logprobs).all() and torch.isfinite(w.grad).all()
    assert (logprobs.cpu() - results[0][0]).abs().max() < 0.1


@pytest.mark.parametrize("transport", device_transports())
def test_device_staging_lands_gpu_to_gpu_in_place_and_survives_a_killed_writer(transport: str) -> None:
    """A trainer process's CUDA tensors land in the engine's device staging (``cuda_ipc``; NIXL on VRAM) with no
    host staging on the writer, then in the CUDA model in place; checksums (``sum64``, on the GPU) on. A writer
    killed midway leaves the previous version serving and the next writer's version lands."""
    engine = hf_writer.tiny_qwen2(seed=0).cuda()
    addresses = {n: p.data_ptr() for n, p in engine.named_parameters()}
    options = SyncOptions(transport=transport, verify=True, timeout=120, transport_options={"device": "cuda:0"})
    with ModuleReceiver(engine, options=options) as receiver:
        assert receiver.reader.memory == "device"
        for version, seed in ((1, 11), (2, 22)):
            done = _push(receiver.address, seed, version, transport)
            assert done.returncode == 0, done.stderr
            assert json.loads(done.stdout.splitlines()[-1])["host_staging_bytes"] == 0  # nothing bounced through the host
            fresh = hf_writer.tiny_qwen2(seed=seed).cuda()
            with receiver.serving(), torch.no_grad():
                for name, p in engine.named_parameters():
                    assert torch.equal(p, dict(fresh.named_parameters())[name]), name
                assert greedy(engine) == greedy(fresh)
            assert {n: p.data_ptr() for n, p in engine.named_parameters()} == addresses
        before = greedy(engine)
        dying = _push(receiver.address, 33, 3, transport, die_after=3)
        assert dying.returncode == -9, dying.stderr
        assert receiver.version == 2
        with receiver.serving(), torch.no_grad():
            assert greedy(engine) == before
        done = _push(receiver.address, 33, 3, transport)
        assert done.returncode == 0, done.stderr
        with receiver.serving(), torch.no_grad():
            assert greedy(engine) == greedy(hf_writer.tiny_qwen2(seed=33).cuda())


def test_delta_and_checksums_on_the_gpu_equal_the_cpu() -> None:
    """The wire work runs on the tensors' device: the GPU's delta payload and sum64 are the CPU's, bit for bit."""
    from rlsync.core import ChangeLog, Checksums, apply_delta, encode_delta

    def run(device: str) -> tuple[bytes, bytes, int]:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(1 << 20, generator=g).to(torch.bfloat16)
        log = ChangeLog({"w": 2})
        log.record(1, {"w": w.to(device).view(torch.uint8)})
        changed = w.clone()
        mask = torch.rand(w.shape, generator=g) < 0.02
        changed[mask] += 1
        now = changed.to(device).view(torch.uint8)
        log.record(2, {"w": now})
        payload = encode_delta([("w", [(0, 64, now.numel())])], {"w": log.since(1, "w")}, {"w": now}, {"w": 2}, 1 << 30,
                               {"w": log.flips(1, "w")})
        assert payload is not None and payload.device.type == "cpu"  # found and planed on the device, zstd on the host
        region = torch.zeros(64 + now.numel(), dtype=torch.uint8, device=device)
        region[64:] = w.to(device).view(torch.uint8)
        apply_delta(payload, region)
        assert torch.equal(region[64:], now)
        sums = Checksums("sum64")
        sums.add("w", [now[: now.numel() // 2], now[now.numel() // 2 :]])
        return bytes(payload.cpu().numpy()), bytes(region.cpu().numpy()), sums.values["w"]

    assert run("cuda") == run("cpu")


@pytest.mark.parametrize("transport", [*device_transports(), "memory"])
def test_device_transports_keep_the_contract_on_the_gpu(transport: str) -> None:
    """The conformance check with regions on the GPU and sources on it too (cuda_ipc within one process writes its
    own regions: CUDA cannot open a handle in the process that made it)."""
    from rlsync.testing import MemoryTransport, check_transport

    cls = MemoryTransport if transport == "memory" else transports().get(transport)
    check_transport(cls, options={"device": "cuda:0"})


@pytest.mark.parametrize("transport", device_transports())
def test_in_place_writes_the_cuda_parameters_and_undoes_a_killed_writer(transport: str) -> None:
    """``landing="in_place"``: a trainer process writes the CUDA model's own parameters (CUDA IPC / NIXL on VRAM),
    addresses unchanged; a writer killed mid-version is undone from the host copy when the next writer says hello,
    and that writer's version lands."""
    engine = hf_writer.tiny_qwen2(seed=0).cuda()
    addresses = {n: p.data_ptr() for n, p in engine.named_parameters()}
    options = SyncOptions(transport=transport, verify=True, timeout=120)
    with ModuleReceiver(engine, options=options, landing="in_place") as receiver:
        done = _push(receiver.address, 11, 1, transport)
        assert done.returncode == 0, done.stderr
        with receiver.serving(), torch.no_grad():
            assert greedy(engine) == greedy(hf_writer.tiny_qwen2(seed=11).cuda())
        dying = _push(receiver.address, 22, 2, transport, die_after=3)
        assert dying.returncode == -9, dying.stderr
        done = _push(receiver.address, 33, 2, transport)
        assert done.returncode == 0, done.stderr
        assert receiver.reader.discarded == [2] and receiver.version == 2
        with receiver.serving(), torch.no_grad():
            fresh = hf_writer.tiny_qwen2(seed=33).cuda()
            for name, p in engine.named_parameters():
                assert torch.equal(p, dict(fresh.named_parameters())[name]), name
            assert greedy(engine) == greedy(fresh)
        assert {n: p.data_ptr() for n, p in engine.named_parameters()} == addresses
