"""The built-ins pass the same conformance checks a plugin author runs (``rlsync.testing``); the Redis
storage's run is in ``test_buffer_redis.py``, beside its server fixture."""

from __future__ import annotations

from rlsync import MemoryStorage
from rlsync.core import transports
from rlsync.testing import MemoryTransport, check_storage, check_transport


def test_every_registered_transport_keeps_the_contract(transport: str) -> None:
    check_transport(transports().get(transport))


def test_the_in_memory_transport_keeps_the_contract() -> None:
    check_transport(MemoryTransport)


def test_the_memory_storage_keeps_the_contract() -> None:
    check_storage(MemoryStorage)


def test_the_in_memory_transport_on_device_memory_keeps_the_contract() -> None:
    """Regions as torch tensors (``memory="device"``, here on the CPU): the lines a GPU landing runs."""
    check_transport(MemoryTransport, options={"device": "cpu"})
