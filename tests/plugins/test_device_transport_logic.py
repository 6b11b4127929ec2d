"""The device transports' logic that needs no GPU, checked on the CPU: how ``cuda_ipc`` tells storages apart, how
NIXL's raised errors reach the writer, and that a writer given more addresses than the engine has ranks says so."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from rlsync import ConfigError, PeerLostError, SyncOptions, WeightsReader, WeightsWriter
from rlsync.layouts import from_state_dict
from rlsync.plugins._transport_cuda_ipc import storage_key


def _entry(handle: bytes, offset: int) -> list[Any]:
    """A described region as ``CudaIpcLanding`` lists it: ``_share_cuda_()`` less its device (handle, storage size,
    offset of the storage in its segment, ref-counter file, its offset, event handle, sync needed), then the
    region's offset in the storage and its size."""
    return [handle, 4096, offset, b"/torch_ref", 0, b"event", True, 0, 4096]


def test_cuda_ipc_tells_storages_of_one_segment_apart() -> None:
    """The caching allocator shares a whole segment: storages in it have one handle and differ by offset
    (torch's CUDACachingAllocator::shareIpcHandle); keyed by the handle alone, all would map onto the first."""
    segment = b"\x01" * 64
    first, second = _entry(segment, 0), _entry(segment, 4096)
    assert storage_key(first) != storage_key(second)
    assert storage_key(first) == storage_key(_entry(segment, 0))  # the same storage, described again: mapped once
    assert storage_key(_entry(b"\x02" * 64, 0)) != storage_key(first)


class nixlRemoteDisconnectError(RuntimeError):  # noqa: N801 - named as NIXL's binding names it
    """Stands in for the exception nixl_cu13's bindings raise when the peer agent is gone (nixl-cu13 1.5.1)."""


nixlRemoteDisconnectError.__module__ = "nixl_cu13._bindings"


class _DisconnectedAgent:
    """A NIXL agent whose peer restarted: posting and polling raise, as nixl-cu13 1.5.1's bindings do."""

    def transfer(self, handle: Any) -> str:
        raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")

    def check_xfer_state(self, handle: Any) -> str:
        raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")


def _link_with(agent: Any) -> Any:
    from rlsync import CurrentStreams
    from rlsync.plugins._transport_nixl import NixlLink

    link = NixlLink.__new__(NixlLink)
    link._agent, link._peer = agent, "rlsync-reader-1"
    link._registered, link._used, link._handles, link._posted, link._held = {}, set(), {}, [], []
    link._writes, link._after, link._host, link._host_used, link._remote_type = [], CurrentStreams(), {}, set(), "DRAM"
    link._prepared, link._last_prepared = [], []
    return link


def test_a_nixl_peer_that_restarted_is_a_lost_peer_not_a_raw_error() -> None:
    pytest.importorskip("nixl")
    source = np.zeros(64, dtype=np.uint8)
    link = _link_with(_DisconnectedAgent())
    key = (source.ctypes.data, 64, "DRAM")
    link._registered[key] = object()  # registered and prepared already: the post is what fails
    link._handles[((key, 0, ((0, 0, 0, 64),)),)] = object()
    link.write(source, [(0, 0, 0, 64)])  # gathered: the version's writes are posted at flush, as one transfer
    with pytest.raises(PeerLostError, match="restarted or died"):
        link.flush()
    link._posted = [object()]
    with pytest.raises(PeerLostError, match="restarted or died"):
        link.flush()


def test_other_errors_from_nixl_calls_are_not_hidden() -> None:
    from rlsync.plugins._transport_nixl import nixl_failure

    assert nixl_failure(nixlRemoteDisconnectError("x"))
    assert not nixl_failure(ValueError("x")) and not nixl_failure(TypeError("x"))


def test_a_writer_given_an_address_per_replica_says_one_writer_per_replica() -> None:
    state = {"w": torch.arange(8, dtype=torch.float32)}
    layout = from_state_dict(state)
    with WeightsReader(layout, layout, 0) as one, WeightsReader(layout, layout, 0) as other:
        with pytest.raises(ConfigError, match="one WeightsWriter per engine replica"):
            WeightsWriter(layout, None, 0, [one.address, other.address], options=SyncOptions(timeout=10))


def test_current_streams_note_nothing_for_host_tensors() -> None:
    """Off CUDA there is no stream to wait for: a writer of host tensors orders nothing (the lines a GPU runs are
    in tests/gpu)."""
    from rlsync import CurrentStreams

    streams = CurrentStreams()
    streams.note(torch.zeros(4))
    streams.note(np.zeros(4))
    assert streams.streams() == []
