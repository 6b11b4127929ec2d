"""Durable episodes in TRL's async rollout worker (``RlsyncRolloutLoop``, with ``RlsyncWeightTransfer(episodes=URL)``).

Every rollout the worker runs (``_generate_one``: a conversation of model turns and tool calls) is an
``rlsync.Episode`` in Redis (``RedisEpisodes`` named after the trainer's ``output_dir``): each model turn (tokens,
the version that sampled each, log-probs) and each turn's tool calls (started, then their tool messages) are recorded
before the conversation goes on. A run resumed from a checkpoint (``resume_from_checkpoint``: TRL starts its worker at
the first untrained prompt, ``dataset_start_index``) runs the same rollouts again: each finds its episode by id (the
prompt's number in the run, its generation number in the group, a digest of the prompt) and replays it, recorded
turns not generated again, recorded tool calls not executed again; it goes on from the first step not recorded.
Finished episodes keep their steps (``RedisEpisodes.kept_seconds``, a day) for such a replay.

A turn's tool calls are one step (TRL runs them one after another in ``_execute_tool_calls``): a worker that died
during them runs them again, each with the same key (``tool_call_key()``, ``"<episode>/<step>#<call>"``), which a
tool with side effects dedupes on.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import inspect
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rlsync import Episode, EpisodeLog

if TYPE_CHECKING:
    from rlsync.plugins import RedisEpisodes

_log = logging.getLogger("rlsync")
#: the episode of the rollout running in this asyncio task (TRL runs each in a task of its own)
CURRENT: contextvars.ContextVar[Episode | None] = contextvars.ContextVar("rlsync_trl_episode", default=None)
_TOOL_CALL_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlsync_trl_tool_call_key", default=None)


def tool_call_key() -> str | None:
    """Inside a tool TRL's worker runs under rlsync's episodes: the call's key, the same when a call that was in
    flight when the worker died runs again (dedupe side effects on it); None elsewhere."""
    return _TOOL_CALL_KEY.get()


def log_for(url: str, name: str) -> RedisEpisodes:
    from rlsync.plugins import RedisEpisodes

    return RedisEpisodes.from_option(url, name=name, option="RlsyncWeightTransfer(episodes={url})")


class Episodes:
    """The worker's episodes: which rollout is which episode, and the claim of it."""

    lease_seconds = 60.0  # a worker that stops recording for this long is presumed dead (renewed every third of it)

    def __init__(self, log: EpisodeLog, dataset_start_index: int) -> None:
        self.log, self.start = log, dataset_start_index
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self._started: dict[int, int] = {}  # group -> rollouts of it started in this worker

    def episode_id(self, prompt: Any, group_id: int, generations: int) -> tuple[str, bytes]:
        """The rollout's episode and prompt bytes; called in the order TRL starts a group's rollouts."""
        k = self._started.get(group_id, 0)
        self._started[group_id] = k + 1
        if k + 1 == generations:
            del self._started[group_id]
        data = json.dumps(prompt, sort_keys=True, default=str).encode()
        return f"{self.start + group_id}/{k}/{hashlib.sha256(data).hexdigest()[:16]}", data

    async def claim(self, episode_id: str, prompt: bytes) -> Episode:
        episode = await Episode.claim_when_free(self.log, episode_id, prompt, self.owner, lease_seconds=self.lease_seconds)
        if episode.resumed:  # its worker died mid-way, or the run resumed from a checkpoint before it
            _log.info("rlsync: episode %s %s %d recorded steps", episode_id,
                      "replays its" if episode.finished else "resumes after", episode.recorded)
        return episode


def keyed_tools(tool_dict: dict[str, Callable[..., Any]], key: str) -> dict[str, Callable[..., Any]]:
    """``tool_dict`` whose tools see ``tool_call_key()`` (TRL runs sync tools in a thread pool, which does not carry
    the task's context): key ``<key>#<n>`` for the n-th call of the turn, in TRL's order."""
    calls = iter(range(1 << 30))

    def wrap(tool: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(tool):
            @functools.wraps(tool)
            async def run_async(**arguments: Any) -> Any:
                token = _TOOL_CALL_KEY.set(f"{key}#{next(calls)}")
                try:
                    return await tool(**arguments)
                finally:
                    _TOOL_CALL_KEY.reset(token)
            return run_async

        @functools.wraps(tool)
        def run(**arguments: Any) -> Any:
            token = _TOOL_CALL_KEY.set(f"{key}#{next(calls)}")
            try:
                return tool(**arguments)
            finally:
                _TOOL_CALL_KEY.reset(token)
        return run

    return {name: wrap(tool) for name, tool in tool_dict.items()}


async def recorded_tool_calls(episode: Episode, tool_calls: list[dict[str, Any]],
                              run: Callable[[str], Awaitable[tuple[list[dict[str, str]], int, int]]]
                              ) -> tuple[list[dict[str, str]], int, int]:
    """A turn's tool calls as one step of ``episode``: recorded, or ``run(key)``'s result, recorded."""
    async def call(key: str) -> dict[str, Any]:
        messages, n_calls, n_failures = await run(key)
        return {"messages": messages, "calls": n_calls, "failures": n_failures}

    got = await episode.tool_async("tools", call, _plain(tool_calls))
    return [dict(m) for m in got["messages"]], int(got["calls"]), int(got["failures"])


def _plain(value: Any) -> Any:
    """TRL's parsed tool calls in msgpack's types (their arguments come from JSON)."""
    return json.loads(json.dumps(value, default=str))
