"""``landing="in_place"``: the writer writes the engine's own tensors (one copy per byte, no staging), the engine paused
from a version's first byte to its commit, and a failed or abandoned version undone from a host copy of the last
one. Here with ``ModuleReceiver`` on a transformers model and the in-process ``MemoryTransport`` (the same reader
and writer lines ``cuda_ipc`` and NIXL drive on a GPU)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

pytest.importorskip("transformers")

from _support.faulty_transports import dying, flipping  # noqa: E402
from _support.hf_writer import tiny_qwen2  # noqa: E402

from rlsync import ConfigError, SyncOptions, TransportError, WeightMismatchError, WeightsWriter  # noqa: E402
from rlsync.adapters.hf import ModuleReceiver  # noqa: E402
from rlsync.layouts import from_state_dict  # noqa: E402
from rlsync.testing import MemoryTransport  # noqa: E402

PROMPT = torch.tensor([[3, 17, 42, 99, 5, 64]])


def greedy(model: torch.nn.Module) -> list[int]:
    out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=8, do_sample=False,  # type: ignore[operator]
                         pad_token_id=0)
    return list(out[0, PROMPT.shape[1]:].tolist())


def same_weights(model: torch.nn.Module, other: torch.nn.Module) -> bool:
    theirs = dict(other.named_parameters())
    return all(torch.equal(p, theirs[n]) for n, p in model.named_parameters())


def publish(receiver: ModuleReceiver, seed: int, version: int, options: SyncOptions) -> WeightsWriter:
    trainer = tiny_qwen2(seed=seed)
    state = dict(trainer.named_parameters())
    writer = WeightsWriter(from_state_dict(state), None, 0, [receiver.address], options=options)
    writer.multi_put({n: p.detach() for n, p in state.items()})
    writer.complete(version)
    return writer


OPTIONS = SyncOptions(transport=MemoryTransport, verify=True, timeout=30)


@pytest.mark.parametrize("transport", ["memory", "nixl"])
def test_versions_land_in_the_parameters_themselves(transport: str) -> None:
    """Over the in-memory transport and over NIXL (UCX registering the model's own parameter memory)."""
    from rlsync.core import transports

    if transport == "nixl" and not transports().get("nixl").available():
        pytest.skip("nixl is not installed")
    options = OPTIONS.replace(transport=MemoryTransport if transport == "memory" else "nixl")
    engine = tiny_qwen2(seed=0)
    addresses = {n: p.data_ptr() for n, p in engine.named_parameters()}
    with ModuleReceiver(engine, options=options, landing="in_place") as receiver:
        for version, seed in ((1, 11), (2, 22)):
            writer = publish(receiver, seed, version, options)
            assert writer.last_bytes == writer.bytes_per_version
            writer.close()
            assert receiver.version == version
            fresh = tiny_qwen2(seed=seed)
            with receiver.serving(), torch.no_grad():
                assert same_weights(engine, fresh) and greedy(engine) == greedy(fresh)
        assert {n: p.data_ptr() for n, p in engine.named_parameters()} == addresses


def test_no_byte_lands_while_the_model_is_serving() -> None:
    """The writer asks first; the reader pauses the model (``serving`` released) before it says go."""
    engine = tiny_qwen2(seed=0)
    before = {n: p.detach().clone() for n, p in engine.named_parameters()}
    with ModuleReceiver(engine, options=OPTIONS, landing="in_place") as receiver:
        errors: list[BaseException] = []

        def train() -> None:
            try:
                publish(receiver, 11, 1, OPTIONS).close()
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)

        with receiver.serving():
            trainer = threading.Thread(target=train)
            trainer.start()
            time.sleep(1.0)
            assert trainer.is_alive() and receiver.version == -1
            assert all(torch.equal(p, before[n]) for n, p in engine.named_parameters())  # untouched while serving
        trainer.join(30)
        assert not errors and receiver.version == 1
        with receiver.serving():
            assert same_weights(engine, tiny_qwen2(seed=11))


@pytest.mark.parametrize("recovery", ["writer restarts", "timeout"])
def test_a_writer_dying_mid_version_is_undone_and_the_old_version_serves(recovery: str) -> None:
    engine = tiny_qwen2(seed=0)
    timeout = 1.5 if recovery == "timeout" else 30
    options = OPTIONS.replace(timeout=timeout)
    with ModuleReceiver(engine, options=options, landing="in_place") as receiver:
        publish(receiver, 11, 1, options).close()
        with pytest.raises(Exception, match="died|not live"):
            publish(receiver, 22, 2, options.replace(transport=dying(MemoryTransport, writes=3)))
        if recovery == "timeout":
            deadline = time.monotonic() + 10
            while not receiver.reader.discarded and time.monotonic() < deadline:
                time.sleep(0.05)
            assert receiver.reader.discarded == [2]
            with receiver.serving(), torch.no_grad():  # not blocked: the model was resumed
                assert same_weights(engine, tiny_qwen2(seed=11))
        publish(receiver, 33, 2, options).close()  # a restarted writer: the half-written version is undone first
        assert receiver.version == 2 and receiver.reader.discarded == [2]
        with receiver.serving(), torch.no_grad():
            assert same_weights(engine, tiny_qwen2(seed=33)) and greedy(engine) == greedy(tiny_qwen2(seed=33))


def test_a_version_that_fails_its_checksums_is_undone() -> None:
    engine = tiny_qwen2(seed=0)
    with ModuleReceiver(engine, options=OPTIONS, landing="in_place") as receiver:
        publish(receiver, 11, 1, OPTIONS).close()
        with pytest.raises(WeightMismatchError, match="checksum mismatch"):
            publish(receiver, 22, 2, OPTIONS.replace(transport=flipping(MemoryTransport, at=0, bit=1)))
        assert receiver.version == 1 and receiver.reader.discarded == [2]
        with receiver.serving():
            assert same_weights(engine, tiny_qwen2(seed=11))


def test_transports_that_allocate_their_own_memory_say_which_can_land_in_place() -> None:
    with pytest.raises(TransportError, match="cannot land in memory it did not allocate.*cuda_ipc"):
        ModuleReceiver(tiny_qwen2(seed=0), options=SyncOptions(transport="shm"), landing="in_place")
    with pytest.raises(ConfigError, match="wire 'full'"):
        ModuleReceiver(tiny_qwen2(seed=0), options=SyncOptions(transport=MemoryTransport, wire="fp8"), landing="in_place")


def test_sharded_writers_land_their_parts_at_the_right_places_inside_each_tensor() -> None:
    """Two FSDP writer ranks, each holding half the rows of every tensor: the second half's runs start in the middle
    of the engine's tensors, and land there (verified with checksums on)."""
    from rlsync import WeightsReader
    from rlsync.layouts import fsdp

    state = {"w": torch.arange(64 * 8, dtype=torch.float32).view(64, 8), "b": torch.arange(10, dtype=torch.float32)}
    engine = {name: torch.zeros_like(t) for name, t in state.items()}
    dst = from_state_dict(state)
    src = fsdp(dst.tensors, 2)
    targets = {name: t.reshape(-1).view(torch.uint8) for name, t in engine.items()}
    with WeightsReader(src, dst, 0, options=OPTIONS, landing="in_place", targets=targets) as reader:
        errors: list[BaseException] = []

        def train(rank: int) -> None:
            try:
                with WeightsWriter(src, dst, rank, [reader.address], options=OPTIONS) as writer:
                    for name, t in state.items():
                        half = t.shape[0] // 2
                        writer.put(name, (t[:half] if rank == 0 else t[half:]).contiguous())
                    writer.complete(1)
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)

        ranks = [threading.Thread(target=train, args=(r,)) for r in (0, 1)]
        for thread in ranks:
            thread.start()
        for thread in ranks:
            thread.join(30)
        assert not errors, errors
        assert reader.version == 1
        for name, t in state.items():
            assert torch.equal(engine[name], t), name
