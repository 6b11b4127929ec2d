"""Built-in rollout-buffer backends: ``memory`` (the embedded default), ``redis`` (durable),
``ray`` (an actor other machines reach). Each factory takes ``RolloutBuffer``'s options plus
its own (``url``, ``name``, ``retry_seconds`` for Redis; ``name`` for Ray), and ``plugins``, the manager
whose hooks the buffer fires."""

from __future__ import annotations

from typing import Any

from rlsync import Registry, hookimpl


def _memory(**options: Any) -> Any:
    from rlsync import RolloutBuffer

    return RolloutBuffer(**options)


def _redis(*, url: str = "redis://127.0.0.1:6379/0", name: str = "rlsync", retry_seconds: float = 30.0, **options: Any) -> Any:
    from rlsync import RolloutBuffer
    from rlsync.plugins._buffer_redis import RedisStorage

    return RolloutBuffer(storage=RedisStorage(url, name=name, retry_seconds=retry_seconds), **options)


def _ray(*, plugins: Any = None, **options: Any) -> Any:
    from rlsync.plugins._buffer_ray import RayRolloutBuffer

    # the buffer runs in a Ray actor: its hooks are the plugins of that process (its own default manager)
    return RayRolloutBuffer(**options)


@hookimpl(trylast=True)
def rlsync_register_buffer_backends(registry: Registry[Any]) -> None:
    registry.add("memory", _memory)
    registry.add("redis", _redis)
    registry.add("ray", _ray)
