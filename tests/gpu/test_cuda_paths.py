"""On a CUDA machine: what a GPU user meets beyond the basic paths of ``test_cuda_sync.py``.

Storages that share one allocator segment (and more than torch's 1000 IPC events), with and without
``expandable_segments``; a CUDA graph captured before a sync and replayed after it; bf16 through the device
transports; a trainer whose tensors are strided and produced on a side stream, sent as deltas to two readers at once.
Skipped without CUDA (CI has none): ``scripts/gpu_check.sh`` runs these where a GPU is.
"""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

pytest.importorskip("transformers")

from _support import hf_writer  # noqa: E402
from _support.cuda_engines import device_transports, greedy  # noqa: E402
from _support.cuda_engines import push as _push  # noqa: E402

from rlsync import SyncOptions, WeightsWriter  # noqa: E402
from rlsync.adapters.hf import ModuleReceiver  # noqa: E402
from rlsync.layouts import from_state_dict  # noqa: E402

# a writer process: maps the described regions (cuda_ipc) and writes region i full of (i % 251) + 1
_IPC_WRITER = """
import sys, msgspec, torch
from rlsync.plugins._transport_cuda_ipc import CudaIpcTransport
description = msgspec.msgpack.decode(bytes.fromhex(sys.stdin.read()))
link = CudaIpcTransport.open(description)
for i, (*_, nbytes) in enumerate(description["regions"]):
    source = torch.full((nbytes,), i % 251 + 1, dtype=torch.uint8, device="cuda")
    link.write(source, [(0, i, 0, nbytes)])
link.flush()
"""


@pytest.mark.parametrize("regions", [3, 1100])
def test_cuda_ipc_maps_each_storage_of_a_segment_to_itself(regions: int) -> None:
    """Small tensors allocated together share one allocator segment, hence one IPC handle at other offsets: each
    must be written where it is (keyed by handle and offset), also past torch's 1000 IPC events."""
    from rlsync.plugins._transport_cuda_ipc import CudaIpcLanding

    tensors = [torch.zeros(512 + 16 * (i % 7), dtype=torch.uint8, device="cuda") for i in range(regions)]
    landing = CudaIpcLanding.over(tensors)
    handles = {bytes(entry[0]) for entry in landing.describe()["regions"]}
    assert len(handles) < regions  # the premise: storages share a segment's handle
    payload = msgspec.msgpack.encode(landing.describe()).hex()
    done = subprocess.run([sys.executable, "-c", _IPC_WRITER], input=payload, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for i, t in enumerate(tensors):
        assert bool((t == i % 251 + 1).all()), f"region {i} holds {t[:4].tolist()}"
    landing.close()


def test_cuda_ipc_with_expandable_segments() -> None:
    """The same with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in both processes."""
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    node = f"{__file__}::test_cuda_ipc_maps_each_storage_of_a_segment_to_itself[3]"
    # pytest-benchmark, where installed beside xdist, warns at start, and this project's warnings are errors
    done = subprocess.run([sys.executable, "-m", "pytest", node, "-q", "-p", "no:cacheprovider", "-p", "no:benchmark"], env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A forward through most of the model's parameters (embeddings, every MLP and norm, the head), with no host
    synchronization, so that it can be captured in a CUDA graph."""
    inner = model.model  # type: ignore[attr-defined]
    h = inner.embed_tokens(ids)
    for layer in inner.layers:
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(inner.norm(h))  # type: ignore[attr-defined, no-any-return, operator]


@pytest.mark.parametrize(("transport", "landing"), [("cuda_ipc", "in_place"), ("cuda_ipc", "staged"),
                                                    ("nixl", "in_place"), ("shm", "staged")])
def test_a_cuda_graph_captured_before_a_sync_computes_with_the_new_weights(transport: str, landing: str) -> None:
    if transport not in [*device_transports(), "shm"]:
        pytest.fail(f"transport {transport!r} is not available on this GPU machine")
    engine = hf_writer.tiny_qwen2(seed=0).cuda()
    ids = torch.tensor([[3, 17, 42, 99, 5, 64]], device="cuda")
    with torch.no_grad():
        _logits(engine, ids)  # warm-up on the capturing stream's device, as torch.cuda.graphs asks
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _logits(engine, ids)
    device_staging = {"device": "cuda:0"} if landing == "staged" and transport != "shm" else {}
    options = SyncOptions(transport=transport, verify=True, timeout=120, transport_options=device_staging)
    with ModuleReceiver(engine, options=options, landing=landing) as receiver:
        done = _push(receiver.address, 11, 1, transport)
        assert done.returncode == 0, done.stderr
        with receiver.serving(), torch.no_grad():
            graph.replay()
            torch.cuda.synchronize()
            expected = _logits(hf_writer.tiny_qwen2(seed=11).cuda(), ids)
            torch.testing.assert_close(out, expected)
            assert not torch.allclose(out, _logits(hf_writer.tiny_qwen2(seed=0).cuda(), ids))


@pytest.mark.parametrize("landing", ["staged", "in_place"])
@pytest.mark.parametrize("transport", device_transports())
def test_bf16_weights_through_the_device_transports(transport: str, landing: str) -> None:
    engine = hf_writer.tiny_qwen2(seed=0).to("cuda", torch.bfloat16)
    device_staging = {"device": "cuda:0"} if landing == "staged" else {}
    options = SyncOptions(transport=transport, verify=True, timeout=120, transport_options=device_staging)
    with ModuleReceiver(engine, options=options, landing=landing) as receiver:
        done = _push(receiver.address, 11, 1, transport, dtype="bfloat16")
        assert done.returncode == 0, done.stderr
        fresh = hf_writer.tiny_qwen2(seed=11).to("cuda", torch.bfloat16)
        with receiver.serving(), torch.no_grad():
            for name, p in engine.named_parameters():
                assert torch.equal(p, dict(fresh.named_parameters())[name]), name
            assert greedy(engine) == greedy(fresh)


@pytest.mark.parametrize("transport", device_transports())
def test_strided_side_stream_deltas_to_two_engines(transport: str) -> None:
    """A trainer that makes its weights on a side stream and puts strided views of them, then publishes from its
    default stream, as deltas, to two engines (a writer each): each version equals the trainer's bit for bit in
    both engines (a copy unordered with the side stream would read the old bytes), and later versions are deltas."""
    engines = [hf_writer.tiny_qwen2(seed=0).cuda() for _ in range(2)]
    options = SyncOptions(transport=transport, verify=True, timeout=120, wire="delta", transport_options={"device": "cuda:0"})
    trainer = hf_writer.tiny_qwen2(seed=1).cuda()
    params = dict(trainer.named_parameters())
    full = sum(p.numel() * p.element_size() for p in params.values())
    side = torch.cuda.Stream()
    layout = from_state_dict({n: p.detach() for n, p in params.items()})
    receivers = [ModuleReceiver(e, options=options) for e in engines]
    writers = [WeightsWriter(layout, None, 0, [r.address], options=options) for r in receivers]
    try:
        for version in (1, 2, 3):
            target = dict(hf_writer.tiny_qwen2(seed=11).cuda().named_parameters()) if version == 1 else None
            with torch.cuda.stream(side), torch.no_grad():
                torch.cuda._sleep(200_000_000)  # the side stream is busy for a while: an unordered read sees old bytes
                for name, p in params.items():
                    if target is not None:
                        p.copy_(target[name])
                    else:  # an RL step's change: a few values move
                        p.view(-1)[version::97] += 0.5
                # strided views where the trainer has them (a transposed weight), contiguous otherwise
                views = {n: (p.detach().t().contiguous().t() if p.dim() == 2 else p.detach()) for n, p in params.items()}
                for writer in writers:
                    writer.multi_put(views)
            for writer, receiver, engine in zip(writers, receivers, engines):
                writer.complete(version)  # from the default stream
                assert receiver.version == version
                with receiver.serving(), torch.no_grad():
                    for name, p in engine.named_parameters():
                        assert torch.equal(p, params[name]), (version, name)
                if version == 3:
                    assert 0 < writer.last_bytes < full / 4  # a delta, not the full version
    finally:
        for writer in writers:
            writer.close()
        for receiver in receivers:
            receiver.close()


def test_current_streams_notes_each_stream_a_tensor_was_put_from_once() -> None:
    """What a device link's copies wait for: the stream current where each tensor was put, one entry per stream
    however many tensors (the raw-pointer lookup must find the same stream the slow lookup does)."""
    from rlsync import CurrentStreams

    streams, side = CurrentStreams(), torch.cuda.Stream()
    tensor = torch.zeros(4, device="cuda")
    for _ in range(3):
        streams.note(tensor)
    with torch.cuda.stream(side):
        streams.note(tensor)
        streams.note(tensor)
    assert [s.cuda_stream for s in streams.streams()] == [torch.cuda.current_stream().cuda_stream, side.cuda_stream]
    streams.clear()
    assert streams.streams() == []


def test_a_cuda_trainers_delta_over_tcp_is_found_on_the_gpu_and_lands_bit_exact() -> None:
    """``wire="delta"`` over tcp (a slow link) from CUDA tensors: the full version goes through host staging as
    before, but the changes are found and encoded on the GPU (the change log's copy lives there), and only the
    compressed delta crosses to the host; every version bit-exact in a host reader, later versions deltas."""
    from rlsync import WeightsReader

    trainer = hf_writer.tiny_qwen2(seed=1).cuda()
    params = dict(trainer.named_parameters())
    full = sum(p.numel() * p.element_size() for p in params.values())
    options = SyncOptions(transport="tcp", verify=True, timeout=120, wire="delta")
    reader = WeightsReader(None, None, 0, replicas=1, landing="direct", options=options)
    writer = WeightsWriter(from_state_dict({n: p.detach() for n, p in params.items()}), None, 0, [reader.address],
                           options=options)
    try:
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in params.values():
                    p.view(-1)[version::89] += 0.25
            writer.multi_put({n: p.detach() for n, p in params.items()})
            writer.complete(version)
            assert reader.version == version
            landed = reader.buffers()
            for name, p in params.items():
                assert bytes(landed[name]) == p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), (version, name)
            if version > 1:
                assert 0 < writer.last_bytes < full / 4
        shadows = writer._changes._shadow.values()
        assert shadows and all(s.is_cuda for s in shadows)  # found on the GPU, not on the staged host copies
    finally:
        writer.close()
        reader.close()


def test_prepared_versions_of_many_tensors_land_exactly_through_the_device_transports() -> None:
    """#56: after its first versions a writer hands ``cuda_ipc`` and NIXL the version it prepared (one batch of
    views, one transfer found by identity), into the reader's slots, its device staging and the engine's own
    tensors; 3,000 tensors, four versions a path, each path's engine compared with the trainer at the end."""
    from rlsync.bench._device import device_config, measure

    nbytes = 64 * 2**20
    report = measure("cuda", nbytes, device_transports(), repeats=2, config=device_config(nbytes, tensors=3000))
    assert report["tensors"] == 3000 and report["failed"] == [], report["failed"]
    rows = {r["name"]: r for r in report["results"]}
    assert {"cuda_ipc/direct", "cuda_ipc/in_place"} <= set(rows), sorted(rows)
    assert all(r["exact"] for r in rows.values()), {n: r["exact"] for n, r in rows.items()}
