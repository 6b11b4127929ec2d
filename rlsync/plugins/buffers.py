"""Built-in rollout-buffer storage backends: ``memory`` (default) and ``redis``."""

from __future__ import annotations

from typing import Any

from rlsync.core._hookspecs import hookimpl
from rlsync.core._registry import Registry


def _redis(**options: Any) -> Any:
    from rlsync.plugins._buffer_redis import RedisStorage

    return RedisStorage(**options)


def _memory(**options: Any) -> Any:
    from rlsync.core._buffer import MemoryStorage

    return MemoryStorage(**options)


@hookimpl(trylast=True)
def rlsync_register_buffer_backends(registry: Registry) -> None:  # type: ignore[type-arg]
    registry.add("memory", _memory)
    registry.add("redis", _redis)
