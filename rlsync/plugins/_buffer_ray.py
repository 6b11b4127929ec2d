"""``ray``: the rollout buffer as a Ray actor, for generators and trainers on several machines.

The actor runs the embedded ``RolloutBuffer`` (threaded, so a blocked ``get`` or ``admit`` does
not stop ``put``); ``RayRolloutBuffer`` is the client every process holds, with the same methods.
Ray moves the samples (its own serialization, zero-copy for numpy arrays in its object store).
``RayRolloutBuffer.episodes`` is the ``rlsync.EpisodeLog`` of generators in any process: the actor keeps the
episodes (``MemoryEpisodes``, finishing into its buffer); they outlive a generator, not the actor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlsync import Batch, Claim, MemoryEpisodes, RolloutBuffer, Sample, Ticket


class _BufferActor:
    def __init__(self, options: dict[str, Any]) -> None:
        self.buffer = RolloutBuffer(**options)
        self.tickets: dict[int, Ticket] = {}
        self.episodes = MemoryEpisodes(self.buffer)

    def episode(self, method: str, *args: Any) -> Any:
        """One ``EpisodeLog`` call on the actor's episodes (``LeaseLostError`` reaches the caller as itself)."""
        if method not in ("add", "claim", "record", "finish", "unfinished"):
            raise ValueError(f"no episode method {method!r}")
        return getattr(self.episodes, method)(*args)

    def admit(self, count: int, prompt_id: str | None, timeout: float | None) -> tuple[int, int] | None:
        ticket = self.buffer.admit(count, prompt_id=prompt_id, timeout=timeout)
        if ticket is None:
            return None
        self.tickets[ticket.ticket_id] = ticket
        return ticket.ticket_id, ticket.version

    def put(self, samples: list[Sample], ticket_id: int | None) -> bool:
        ticket = self.tickets.pop(ticket_id, None) if ticket_id is not None else None
        return self.buffer.put(samples, ticket)

    def get(self, batch_size: int | None, max_tokens: int | None, timeout: float | None) -> tuple[list[Sample], int] | None:
        batch = self.buffer.get(batch_size, max_tokens=max_tokens, timeout=timeout)
        return None if batch is None else (batch.samples, batch.trainer_version)

    def publish(self, version: int) -> None:
        self.buffer.publish(version)

    def stats(self) -> dict[str, Any]:
        b = self.buffer
        return {"version": b.version, "consumed": b.consumed, "waiting": b.waiting, "in_flight": b.in_flight,
                "capacity": b.capacity(), **b.telemetry.summary()}


class RayRolloutBuffer:
    """Client of a buffer actor; ``name`` lets other processes attach with ``RayRolloutBuffer.attach``."""

    def __init__(self, *, name: str | None = None, max_concurrency: int = 32, **options: Any) -> None:
        import ray

        actor = ray.remote(_BufferActor).options(name=name, max_concurrency=max_concurrency, num_cpus=0)
        self._actor: Any = actor.remote(options)  # a Ray actor handle: its methods gain .remote
        self._ray = ray

    @classmethod
    def attach(cls, name: str) -> RayRolloutBuffer:
        import ray

        self = cls.__new__(cls)
        self._actor = ray.get_actor(name)
        self._ray = ray
        return self

    def admit(self, count: int = 1, *, prompt_id: str | None = None, timeout: float | None = None) -> Ticket | None:
        got = self._ray.get(self._actor.admit.remote(count, prompt_id, timeout))
        return None if got is None else Ticket(got[0], got[1], count, prompt_id)

    def put(self, samples: Sample | Sequence[Sample], ticket: Ticket | None = None) -> bool:
        batch = [samples] if isinstance(samples, Sample) else list(samples)
        return bool(self._ray.get(self._actor.put.remote(batch, None if ticket is None else ticket.ticket_id)))

    def get(self, batch_size: int | None = None, *, max_tokens: int | None = None, timeout: float | None = None) -> Batch | None:
        got = self._ray.get(self._actor.get.remote(batch_size, max_tokens, timeout))
        return None if got is None else Batch(got[0], got[1])

    def publish(self, version: int) -> None:
        self._ray.get(self._actor.publish.remote(version))

    def stats(self) -> dict[str, Any]:
        return dict(self._ray.get(self._actor.stats.remote()))

    def close(self) -> None:
        self._ray.kill(self._actor)

    @property
    def episodes(self) -> RayEpisodes:
        """The ``rlsync.EpisodeLog`` kept by this buffer's actor (generators of any process claim from it)."""
        return RayEpisodes(self._actor, self._ray)


class RayEpisodes:
    """``rlsync.EpisodeLog`` calls made on a buffer actor; ``RayRolloutBuffer.episodes`` gives one."""

    def __init__(self, actor: Any, ray: Any) -> None:
        self._actor, self._ray = actor, ray

    def _call(self, method: str, *args: Any) -> Any:
        return self._ray.get(self._actor.episode.remote(method, *args))

    def add(self, episode_id: str, prompt: bytes) -> bool:
        return bool(self._call("add", episode_id, bytes(prompt)))

    def claim(self, owner: str, lease_seconds: float, episode_id: str | None = None) -> Claim | None:
        got: Claim | None = self._call("claim", owner, lease_seconds, episode_id)
        return got

    def record(self, episode_id: str, epoch: int, step: int, entry: bytes, lease_seconds: float) -> None:
        self._call("record", episode_id, epoch, step, entry, lease_seconds)

    def finish(self, episode_id: str, epoch: int, sample: Sample | None) -> bool:
        return bool(self._call("finish", episode_id, epoch, sample))

    def unfinished(self) -> int:
        return int(self._call("unfinished"))

    def close(self) -> None:
        pass
