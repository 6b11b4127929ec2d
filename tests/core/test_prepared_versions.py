"""Prepared versions (issue #56): a trainer that puts the same tensors every step (changed in place by its optimizer)
pays a few Python calls per reader and version, not several per tensor: the link prepares the version once
(``Link.prepare``) and replays it (``Link.write_prepared``). Judged by the bytes that land, version after version,
and by what makes a writer prepare again: a tensor bound anew (another storage, a ``put`` between, a transform)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pluggy
import pytest
import torch

from rlsync import SyncOptions, WeightsReader, WeightsWriter, hookimpl, make_plugin_manager
from rlsync.layouts import from_state_dict
from rlsync.plugins import ShmLink


def model(n: int = 300) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(17 + i % 5, generator=generator) for i in range(n)}


def lands(reader: WeightsReader, state: dict[str, torch.Tensor]) -> bool:
    live = reader.buffers()
    return all(np.array_equal(np.asarray(live[n]), t.contiguous().view(torch.uint8).numpy()) for n, t in state.items())


def step_and_send(writer: WeightsWriter, state: dict[str, torch.Tensor], version: int) -> None:
    """An optimizer step (every tensor changed in place), then the version sent: what a trainer does each step."""
    with torch.no_grad():
        for t in state.values():
            t.mul_(1.5).add_(version)
    writer.multi_put(state)
    writer.complete(version)


@pytest.fixture
def prepares(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many parts each ``ShmLink.prepare`` call was given (the versions it prepared)."""
    calls: list[int] = []
    real = ShmLink.prepare

    def counted(self: ShmLink, parts: Any) -> Any:
        calls.append(len(parts))
        return real(self, parts)

    monkeypatch.setattr(ShmLink, "prepare", counted)
    return calls


def test_the_same_tensors_changed_in_place_are_prepared_once_per_slot_and_land_every_version(prepares: list[int]) -> None:
    state = model()
    layout = from_state_dict(state)
    options = SyncOptions(transport="shm")
    with WeightsReader(layout, layout, 0, options=options) as reader, \
            WeightsWriter(layout, layout, 0, [reader.address], options=options) as writer:
        for version in range(1, 7):
            step_and_send(writer, state, version)
            assert reader.version == version and lands(reader, state), version
    assert prepares == [300, 300]  # one per slot of the direct landing, then replayed


def test_a_tensor_bound_anew_is_prepared_again(prepares: list[int]) -> None:
    """Another storage (a re-allocated tensor, a Parameter whose .data was replaced: the same object), a put between
    two multi_puts: each lands, the version prepared again."""
    state = model(20)
    params = {n: torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in state.items()}
    layout = from_state_dict(state)
    options = SyncOptions(transport="shm")
    with WeightsReader(layout, layout, 0, options=options) as reader, \
            WeightsWriter(layout, layout, 0, [reader.address], options=options) as writer:
        writer.multi_put(params)
        writer.complete(1)
        writer.multi_put(params)
        writer.complete(2)
        params["layers.3.weight"].data = torch.full_like(state["layers.3.weight"], 7.0)  # same object, new storage
        writer.multi_put(params)
        writer.complete(3)
        assert lands(reader, params)
        writer.put("layers.0.weight", torch.zeros_like(state["layers.0.weight"]))
        writer.multi_put(params)  # binds layers.0 back to the parameter
        writer.complete(4)
        assert lands(reader, params)
        fresh = {n: t.clone() + 1 for n, t in params.items()}  # every tensor re-allocated
        writer.multi_put(fresh)
        writer.complete(5)
        assert lands(reader, fresh)
    assert len(prepares) == 5  # versions 1 and 2 (one per slot), then 3, 4 and 5 each bound something anew


class Doubling:
    @hookimpl
    def rlsync_transform_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        return tensor * 2


def test_a_transforming_plugin_sees_every_put_of_every_version() -> None:
    plugins: pluggy.PluginManager = make_plugin_manager(autoload=False)
    plugins.register(Doubling())
    state = model(10)
    layout = from_state_dict(state)
    options = SyncOptions(transport="shm")
    with WeightsReader(layout, layout, 0, options=options) as reader, \
            WeightsWriter(layout, layout, 0, [reader.address], options=options, plugins=plugins) as writer:
        for version in (1, 2, 3):
            with torch.no_grad():
                for t in state.values():
                    t.add_(1)
            writer.multi_put(state)
            writer.complete(version)
            assert lands(reader, {n: t * 2 for n, t in state.items()}), version


@pytest.mark.parametrize("landing", ["direct", "in_place"])
def test_a_device_links_prepared_version_is_one_batch_of_views_made_once(landing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``cuda_ipc`` does on a GPU (``rlsync.BatchedCopies``), run here by the memory transport into torch regions:
    after the first version of each slot, a version is one batch of 300 copies prepared before, no view made again
    (no loose write), into the reader's slots or, in place, into the engine's own tensors; every version exact."""
    from rlsync import BatchedCopies
    from rlsync.testing import MemoryTransport

    prepared: list[int] = []
    loose: list[int] = []
    batches: list[list[int]] = []
    real_prepare, real_add, real_copy = BatchedCopies.prepare, BatchedCopies.add, BatchedCopies.copy
    monkeypatch.setattr(BatchedCopies, "prepare", lambda self, parts: prepared.append(len(parts)) or real_prepare(self, parts))
    monkeypatch.setattr(BatchedCopies, "add", lambda self, source, runs: loose.append(len(runs)) or real_add(self, source, runs))
    monkeypatch.setattr(BatchedCopies, "copy", staticmethod(
        lambda taken: batches.append([len(b.targets) for b in taken]) or real_copy(taken)))
    state = model()
    layout = from_state_dict(state)
    engine = {n: torch.zeros_like(t) for n, t in state.items()}
    targets = {n: t.view(torch.uint8) for n, t in engine.items()} if landing == "in_place" else None
    options = SyncOptions(transport=MemoryTransport, transport_options={"device": "cpu"}, timeout=30)
    with WeightsReader(layout, layout, 0, options=options, landing=landing, targets=targets) as reader, \
            WeightsWriter(layout, layout, 0, [reader.address], options=options) as writer:
        for version in range(1, 7):
            step_and_send(writer, state, version)
            assert reader.version == version
            assert lands(reader, state) if landing == "direct" else all(torch.equal(engine[n], t) for n, t in state.items())
    assert len(prepared) <= 2 and set(prepared) == {300} and loose == []  # made once per slot, then handed over
    assert batches == [[300]] * 6  # one batched copy a version


def test_nixl_posts_a_prepared_version_as_the_transfer_it_made_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """NIXL (host memory here, UCX's shared memory): a prepared version is registered and grouped once, and each
    later version posts the transfer prepared for it (found by identity, not by hashing every write), exactly."""
    from rlsync.core import transports

    if not transports().get("nixl").available():
        pytest.skip("nixl is not installed")
    from rlsync.plugins._transport_nixl import NixlLink

    loose: list[int] = []
    posted: list[tuple[str, int]] = []
    real_write, real_post = NixlLink.write, NixlLink._post_writes
    monkeypatch.setattr(NixlLink, "write", lambda self, source, runs: loose.append(1) or real_write(self, source, runs))
    monkeypatch.setattr(NixlLink, "_post_writes", lambda self, writes, mem_type: posted.append(
        (type(writes).__name__, len(writes))) or real_post(self, writes, mem_type))
    state = model(200)
    layout = from_state_dict(state)
    options = SyncOptions(transport="nixl", timeout=60)
    with WeightsReader(layout, layout, 0, options=options) as reader, \
            WeightsWriter(layout, layout, 0, [reader.address], options=options) as writer:
        for version in range(1, 6):
            step_and_send(writer, state, version)
            assert reader.version == version and lands(reader, state), version
        handles = len(writer._links[0]._handles)
    assert loose == [] and posted == [("_PreparedWrites", 200)] * 5  # one prepared transfer a version, never loose
    assert handles <= 2  # one per slot, made once
