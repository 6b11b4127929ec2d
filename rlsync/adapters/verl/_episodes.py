"""Durable episodes in verl's tool agent loop (verl 0.9's ``ToolAgentLoop``, ``agent_name: tool_agent``).

With ``+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rlsync.episodes=redis://HOST:6379/0``, every
trajectory of verl's tool agent loop runs as an ``rlsync.Episode`` in that Redis (``RedisEpisodes`` named after
``trainer.experiment_name``), in ``RlsyncToolAgentLoop``: each model turn (what verl's server manager returned: the
tokens, log-probs, stop reason, extra fields and routed experts) and each tool call (started, then its response text,
reward and metrics) is recorded before the loop goes on. A worker that runs a trajectory recorded before (the run
was restarted after its rollout worker, engine or node died) replays it: recorded turns are not generated again (the
engine re-reads them as the next turn's prefix), recorded tool calls are not executed again; it goes on from the
first step not recorded. A call in flight when the worker died runs again with the same key
(``tool_call_key()``, ``"<episode>/<step>"``): a tool with side effects dedupes on it.

The episode of a trajectory is named by what verl hands its agent loop and keeps across a restart: the step, the
prompt's dataset index, its rollout number (``rollout_n``, and ``session_id`` in verl's v1 trainer), its position
in the step's batch (``priority``), the fully-async rollouter's sample name (``uid_sample_<epoch>_<n>``; other uids
are random per run) and a digest of the prompt. ``rlsync.patches.verl.apply_episodes`` hands the loop verl's
trajectory (it is not among the loop's arguments) and runs ``tool_agent`` trajectories in this loop when the option
is set. verl takes each trajectory from the loop itself: an episode finishes without a sample, and its steps are
kept (``RedisEpisodes.kept_seconds``, a day): a step re-run after a restart from an earlier checkpoint replays its
finished trajectories too, without a model or tool call.

Parallel tool calls of one turn (``multi_turn.max_parallel_calls`` > 1) run one after another here, each recorded
before the next starts. Tool responses must be text (images are not recorded: refused by name).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import numpy as np
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop
from verl.tools.schemas import ToolResponse
from verl.workers.rollout.replica import TokenOutput

from rlsync import ConfigError, Episode, EpisodeLog, Turn

_log = logging.getLogger("rlsync")

OPTION = "actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rlsync.episodes"
AGENT_NAME = "rlsync_tool_agent"
#: verl's trajectory of the agent loop running in this task (step, sample_index, rollout_n, validate)
TRAJECTORY: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("rlsync_verl_trajectory", default=None)
#: the episode of the trajectory running in this task (its tools and server calls see it)
CURRENT: contextvars.ContextVar[Episode | None] = contextvars.ContextVar("rlsync_verl_episode", default=None)
_TOOL_CALL_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlsync_verl_tool_call_key", default=None)


def tool_call_key() -> str | None:
    """Inside a tool run by ``RlsyncToolAgentLoop``: the call's key, the same when a call that was in flight when its
    worker died runs again (dedupe side effects on it); None elsewhere."""
    return _TOOL_CALL_KEY.get()


def episodes_url(config: Any) -> str | None:
    """The episode log's Redis URL set in verl's ``config`` (``OPTION``), or None."""
    url = OmegaConf.select(config, OPTION, default=None)
    return str(url) if url else None


@functools.cache
def _episode_log(url: str, name: str) -> EpisodeLog:
    from rlsync.plugins import RedisEpisodes

    return RedisEpisodes.from_option(url, name=name, option=OPTION + "={url}")


def episode_id(trajectory: dict[str, Any], prompt: bytes, kwargs: dict[str, Any]) -> str:
    """The trajectory's episode: the same for the same trajectory of a run restarted from its checkpoint."""
    uid = str(kwargs.get("uid", ""))
    parts = ["val" if trajectory.get("validate") else "train", trajectory.get("step"), trajectory.get("sample_index"),
             trajectory.get("rollout_n"), kwargs.get("session_id", ""), kwargs.get("priority", ""),
             uid if uid.startswith("uid_sample_") else "",  # the fully-async rollouter's names; others are uuid4s
             hashlib.sha256(prompt).hexdigest()[:16]]
    return "/".join(str(p) for p in parts)


def _plain(value: Any) -> Any:
    """``value`` in msgpack's types (verl's fields hold numpy scalars and arrays)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    return value


def _turn_of(output: TokenOutput) -> Turn:
    extra: dict[str, Any] = {"stop_reason": output.stop_reason, "num_preempted": output.num_preempted,
                             "extra_fields": _plain(output.extra_fields)}
    if output.routed_experts is not None:
        routes = np.ascontiguousarray(np.asarray(output.routed_experts))
        extra["routed_experts"] = {"dtype": routes.dtype.str, "shape": list(routes.shape), "data": routes.tobytes()}
    step = output.extra_fields.get("global_steps")  # the weights' step (verl's server manager sets it; 0 is one)
    version = -1 if step is None else int(step)
    return Turn(list(output.token_ids), [version] * len(output.token_ids), list(output.log_probs or []), extra=extra)


def _output_of(turn: Turn) -> TokenOutput:
    extra = turn.extra
    routes = extra.get("routed_experts")
    routed = None if routes is None else np.frombuffer(routes["data"], dtype=routes["dtype"]).reshape(routes["shape"]).copy()
    return TokenOutput(token_ids=list(turn.tokens), log_probs=list(turn.logprobs) or None, routed_experts=routed,
                       stop_reason=extra.get("stop_reason"), num_preempted=extra.get("num_preempted"),
                       extra_fields=dict(extra.get("extra_fields") or {}))


def wrap_run_agent_loop(run: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """verl's ``AgentLoopWorker._run_agent_loop``, handing its trajectory to the agent loop (``TRAJECTORY``: an
    asyncio task's own) and running ``tool_agent`` trajectories in ``RlsyncToolAgentLoop`` when ``OPTION`` is set."""

    @functools.wraps(run)
    async def run_agent_loop(self: Any, sampling_params: dict[str, Any], trajectory: dict[str, Any], *,
                             agent_name: str, **kwargs: Any) -> Any:
        if agent_name == "tool_agent" and episodes_url(self.config) is not None:
            agent_name = AGENT_NAME
        token = TRAJECTORY.set(dict(trajectory))
        try:
            return await run(self, sampling_params, trajectory, agent_name=agent_name, **kwargs)
        finally:
            TRAJECTORY.reset(token)

    return run_agent_loop


class _RecordedServer:
    """verl's server manager for one episode: ``generate`` answers a recorded turn, or asks the server and records
    its answer; everything else is the server manager's."""

    def __init__(self, server: Any, episode: Episode) -> None:
        self._server, self._episode = server, episode

    async def generate(self, request_id: Any, **kwargs: Any) -> TokenOutput:
        async def ask() -> Turn:
            return _turn_of(await self._server.generate(request_id, **kwargs))

        return _output_of(await self._episode.turn_async(ask))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


@register(AGENT_NAME)
class RlsyncToolAgentLoop(ToolAgentLoop):  # type: ignore[misc]
    """verl's ``ToolAgentLoop`` whose turns and tool calls are an ``rlsync.Episode``'s (see the module docstring)."""

    lease_seconds = 60.0  # a worker that stops renewing for this long is presumed dead (renewed every third of it)
    server_manager: Any  # verl's LLMServerClient; the episode's recording one once ``run`` claimed its episode

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        url = episodes_url(self.config)
        if url is None:
            raise ConfigError(f"agent loop {AGENT_NAME!r} records episodes in Redis: set +{OPTION}=redis://HOST:6379/0")
        name = f"rlsync-episodes:{OmegaConf.select(self.config, 'trainer.experiment_name', default='verl')}"
        self._episodes = _episode_log(url, name)
        self._owner = f"{socket.gethostname()}:{os.getpid()}"
        self._episode: Episode | None = None
        self._tools_in_order = asyncio.Lock()

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        trajectory = TRAJECTORY.get()
        if trajectory is None:
            raise ConfigError(f"agent loop {AGENT_NAME!r} runs under verl's AgentLoopWorker (rlsync.patches.verl hands it "
                              "the trajectory); this verl is not one rlsync's patches were written for")
        prompt = json.dumps(_plain(list(kwargs["raw_prompt"])), sort_keys=True, default=str).encode()
        name = episode_id(trajectory, prompt, kwargs)
        episode = await Episode.claim_when_free(self._episodes, name, prompt, self._owner, lease_seconds=self.lease_seconds)
        if episode.resumed:  # its worker died mid-way, or the run was restarted and re-runs its step
            _log.info("rlsync: episode %s %s %d recorded steps", name, "replays its" if episode.finished else "resumes after",
                      episode.recorded)
        self._episode = episode
        self.server_manager = _RecordedServer(self.server_manager, episode)  # this loop is made for one trajectory
        keep = asyncio.ensure_future(episode.keep_lease())
        token = CURRENT.set(episode)
        try:
            output = await super().run(sampling_params, **kwargs)
        finally:
            CURRENT.reset(token)
            keep.cancel()
        episode.finish(None)  # verl takes the trajectory from here
        return output

    async def _call_tool(self, tool_call: Any, tools_kwargs: dict[str, Any], agent_data: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        call: Callable[[str], Awaitable[dict[str, Any]]] = functools.partial(self._run_tool, tool_call, tools_kwargs, agent_data)
        async with self._tools_in_order:  # one step at a time in the log
            assert self._episode is not None
            recorded = await self._episode.tool_async(tool_call.name, call, {"arguments": tool_call.arguments})
        return ToolResponse(text=recorded["text"]), recorded["reward"], dict(recorded["metrics"])

    async def _run_tool(self, tool_call: Any, tools_kwargs: dict[str, Any], agent_data: Any, key: str) -> dict[str, Any]:
        token = _TOOL_CALL_KEY.set(key)
        try:
            response, reward, metrics = await super()._call_tool(tool_call, tools_kwargs, agent_data)
        finally:
            _TOOL_CALL_KEY.reset(token)
        if response.image or response.video:
            raise ConfigError(f"tool {tool_call.name!r} answered an image or video: {AGENT_NAME} records text tool "
                              f"responses only (unset {OPTION} for this run)")
        record = {"text": response.text, "reward": _plain(reward), "metrics": _plain(metrics or {})}
        try:
            msgspec.msgpack.encode(record)
        except (TypeError, msgspec.EncodeError) as exc:
            raise ConfigError(f"tool {tool_call.name!r} returned metrics rlsync cannot record ({exc}): return str, "
                              "numbers, lists and dicts") from None
        return record
