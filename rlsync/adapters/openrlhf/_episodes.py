"""Durable episodes in OpenRLHF's agent executors (``rlsync launch openrlhf --episodes redis://HOST:6379/0 -- ...``).

Every rollout OpenRLHF's engine actor runs (``RolloutRayActor.generate_responses`` runs ``executor.execute`` once per
sample of a prompt) is an ``rlsync.Episode`` in that Redis (``RedisEpisodes`` named after the run's ``--ckpt.path``):
each model turn (what the executor's ``llm_engine.generate`` returned: tokens, text, log-probs, finish reason) and,
for a ``MultiTurnAgentExecutor``, each ``reset`` and ``step`` of its ``AgentInstance`` (the environment: tool calls,
rewards) is recorded before the rollout goes on. A run restarted from its checkpoint (OpenRLHF does not restart a
dead engine actor: the run fails, and ``--ckpt.load_enable`` resumes it) sends the same prompts again under the same
episodes: recorded turns are not generated again, recorded steps not run again; each rollout goes on from the first
step not recorded, and a finished one replays whole (its steps are kept a day, ``?kept_seconds=N`` in the URL).

The episode of a rollout is named where OpenRLHF hands out prompts, in its driver (``SamplesGenerator``): the prompt's
number in the run (OpenRLHF's ``total_consumed_prompts``, which its checkpoint restores with the dataloader's
position), a digest of the prompt and label, and the sample's number among the prompt's ``n_samples_per_prompt``.
The driver passes the name in the request's ``SamplingParams.extra_args`` (``EXTRA``; vLLM leaves extra_args to
plugins), and the engine actor takes it out before vLLM sees the request. Evaluation rollouts are not recorded (an
evaluation after a restart runs again whole).

A step's instance state: an ``AgentInstance`` that keeps state between its steps on itself (a step counter, say) gets
it back on a replay: every recorded step keeps, beside its result, the instance's attributes that hold plain data
(str, numbers, bools, lists, dicts, tensors), and a replayed step sets them again. Other attributes (clients,
sessions) stay as ``__init__`` made them. A step that was in flight when its actor died runs again with the same key
(``tool_call_key()``, ``"<episode>/<step>"``): a step with side effects dedupes on it. A step's result must be plain
data too (a tensor reward, text, ``SamplingParams`` are fine; images are refused by name).

A replayed sample's tokens were sampled before the restart, under versions the resumed run does not number: its
oldest version is counted as the resumed run's first (``rlsync.adapters.openrlhf._versions.tag_samples``).
"""

from __future__ import annotations

import asyncio
import collections
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

import msgspec

from rlsync import ConfigError, Episode, EpisodeLog, Turn
from rlsync.patches.openrlhf import options

if TYPE_CHECKING:
    from rlsync.plugins import RedisEpisodes

_log = logging.getLogger("rlsync")

OPTION = "rlsync launch openrlhf --episodes"
EXTRA = "rlsync_episode"  # the SamplingParams.extra_args key naming a prompt's episode, from the driver to the engine actor
lease_seconds = 60.0  # an engine actor that stops recording for this long is presumed dead (renewed every third of it)
#: the episode of the rollout running in this asyncio task (OpenRLHF runs each sample's ``execute`` in a task of its own)
CURRENT: contextvars.ContextVar[Episode | None] = contextvars.ContextVar("rlsync_openrlhf_episode", default=None)
#: the episode names the samples of the ``generate_responses`` running in this task take, one each, in order
_PENDING: contextvars.ContextVar[collections.deque[str] | None] = contextvars.ContextVar("rlsync_openrlhf_pending", default=None)
_TOOL_CALL_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("rlsync_openrlhf_tool_call_key", default=None)


def tool_call_key() -> str | None:
    """Inside an ``AgentInstance``'s ``reset`` or ``step`` run under rlsync's episodes: the step's key, the same when a
    step that was in flight when its engine actor died runs again (dedupe side effects on it); None elsewhere."""
    return _TOOL_CALL_KEY.get()


def current_episode() -> Episode | None:
    """The episode of the rollout running here (inside an executor's ``execute``), for an executor of one's own that
    records its tool calls itself (``await current_episode().tool_async(name, call, arguments)``); None elsewhere."""
    return CURRENT.get()


def episodes_name(ckpt_path: str) -> str:
    """The run's episodes: named after its checkpoint folder, which a resumed run names again."""
    return f"rlsync-episodes:openrlhf:{os.path.abspath(ckpt_path)}"


def open_log(url: str, name: str) -> RedisEpisodes:
    """The Redis episode log at ``url`` (checked by the launcher at the door: the extra, the URL, ``?kept_seconds``)."""
    from rlsync.plugins import RedisEpisodes

    return RedisEpisodes.from_option(url, name=name, option=OPTION + "={url}")


@functools.cache
def _log_of_run(url: str, name: str) -> EpisodeLog:
    """One Redis client per process (an engine actor runs many rollouts at once)."""
    return open_log(url, name)


def _run_log() -> EpisodeLog | None:
    opts = options() or {}
    url = opts.get("episodes")
    return None if not url else _log_of_run(str(url), str(opts["episodes_name"]))


# --- the driver: naming each prompt's episode ----------------------------------------------------------------------

def prompt_id(number: int, prompt: Any, label: Any) -> str:
    """A prompt's episode name (its samples add ``/<k>``): its number in the run and a digest of prompt and label."""
    data = json.dumps([prompt, label], sort_keys=True, default=str).encode()
    return f"{number}/{hashlib.sha256(data).hexdigest()[:16]}"


class _NamedCall:
    """``engine.generate_responses``, whose ``.remote(...)`` names the prompt's episode in the request's sampling
    parameters and counts the prompt."""

    def __init__(self, method: Any, generator: Any) -> None:
        self._method, self._generator = method, generator

    def remote(self, **kwargs: Any) -> Any:
        number = int(getattr(self._generator, "_rlsync_prompts", 0))
        self._generator._rlsync_prompts = number + 1
        params = kwargs["sampling_params"].clone()
        params.extra_args = {**(params.extra_args or {}), EXTRA: prompt_id(number, kwargs.get("prompt"), kwargs.get("label"))}
        return self._method.remote(**{**kwargs, "sampling_params": params})


class _NamingEngine:
    """An engine actor's handle whose ``generate_responses`` names episodes; everything else is the handle's."""

    def __init__(self, engine: Any, generator: Any) -> None:
        self._engine, self._generator = engine, generator

    @property
    def generate_responses(self) -> _NamedCall:
        return _NamedCall(self._engine.generate_responses, self._generator)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def wrap_dispatch(original: Any) -> Any:
    """``SamplesGenerator._dispatch_prompts_to_vllm``: with ``--episodes``, every training prompt it sends is named
    (one after another, in OpenRLHF's order: the dataloader's)."""

    @functools.wraps(original)
    def dispatch(self: Any, prompts: Any, labels: Any, **kwargs: Any) -> Any:
        if not (options() or {}).get("episodes") or getattr(self, "_rlsync_evaluating", False):
            return original(self, prompts, labels, **kwargs)
        engines = self.vllm_engines
        self.vllm_engines = [_NamingEngine(e, self) for e in engines]
        try:
            return original(self, prompts, labels, **kwargs)
        finally:
            self.vllm_engines = engines

    return dispatch


def wrap_eval_samples(original: Any) -> Any:
    """``SamplesGenerator.generate_eval_samples``: its prompts are not numbered among the run's (not recorded)."""

    @functools.wraps(original)
    def generate_eval_samples(self: Any, **kwargs: Any) -> Any:
        self._rlsync_evaluating = True
        try:
            return original(self, **kwargs)
        finally:
            self._rlsync_evaluating = False

    return generate_eval_samples


def wrap_checkpoint_states(original: Any) -> Any:
    """``BasePPOTrainer.init_checkpoint_states`` (``PPOTrainer.fit`` starts with it): the run's generator numbers its
    next prompt where the checkpoint's ``total_consumed_prompts`` says (0 for a fresh run)."""

    @functools.wraps(original)
    def init_checkpoint_states(self: Any, *args: Any, **kwargs: Any) -> Any:
        states = original(self, *args, **kwargs)
        generator = getattr(self, "samples_generator", None)  # the async trainer's is in its GenerateSamplesActor
        if generator is not None:
            generator._rlsync_prompts = int(states.get("total_consumed_prompts", 0))
        return states

    return init_checkpoint_states


def wrap_generator_fit(original: Any) -> Any:
    """``GenerateSamplesActor.fit`` (the async trainer's generator, handed the checkpoint's count): as above."""

    @functools.wraps(original)
    def fit(self: Any, episode: int, total_consumed_prompts: int, *args: Any, **kwargs: Any) -> Any:
        self.samples_generator._rlsync_prompts = int(total_consumed_prompts)
        return original(self, episode, total_consumed_prompts, *args, **kwargs)

    return fit


def wrap_process_response(original: Any) -> Any:
    """``SamplesGenerator._process_response_into_experience``: a sample marks whether its rollout replayed a turn."""

    @functools.wraps(original)
    def process(self: Any, response: Any, **kwargs: Any) -> Any:
        sample = original(self, response, **kwargs)
        sample.rlsync_replayed = bool(response.get("rlsync_replayed"))
        return sample

    return process


# --- the engine actor: running each sample as an episode -----------------------------------------------------------

def wrap_generate_responses(original: Any) -> Any:
    """``RolloutRayActor.generate_responses``: a prompt the driver named runs each of its samples as an episode
    (``<name>/<k>``), the k-th ``executor.execute`` taking the k-th. (Ray ships this wrapper to the engine actor by
    value, with the globals it names: it names module functions only, which go by reference.)"""

    @functools.wraps(original)
    async def generate_responses(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await _named_responses(original, self, args, kwargs)

    return generate_responses


async def _named_responses(original: Any, actor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # the driver's patch sends every argument by keyword (as OpenRLHF's dispatch does): a named request has them there
    params = kwargs.get("sampling_params")
    extra = dict(getattr(params, "extra_args", None) or {})
    name = extra.pop(EXTRA, None)
    if name is None or params is None:
        return await original(actor, *args, **kwargs)
    if _run_log() is None:
        raise ConfigError(f"a request names episode {name!r}, but this engine actor was not started with {OPTION}")
    params = params.clone()  # what vLLM sees: the extra argument taken out again
    params.extra_args = extra or None
    _instrument(actor.executor)
    samples = int(kwargs.get("num_samples", 1))
    token = _PENDING.set(collections.deque(f"{name}/{k}" for k in range(samples)))
    try:
        return await original(actor, *args, **{**kwargs, "sampling_params": params})
    finally:
        _PENDING.reset(token)


def _instrument(executor: Any) -> None:
    """The executor's ``execute`` runs as an episode where one is pending; a ``MultiTurnAgentExecutor``'s instances
    record their ``reset`` and ``step`` (once per executor)."""
    if getattr(executor, "_rlsync_episodes", False):
        return
    from openrlhf.utils.agent import MultiTurnAgentExecutor

    executor.execute = _episodic(executor.execute)
    if isinstance(executor, MultiTurnAgentExecutor):
        executor.agent_instance_cls = _recording(executor.agent_instance_cls)
    executor._rlsync_episodes = True


def _episodic(execute: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(execute)
    async def run(*args: Any, **kwargs: Any) -> Any:
        pending, log = _PENDING.get(), _run_log()
        if not pending or log is None:  # a call of its own (an evaluation, a user's)
            return await execute(*args, **kwargs)
        name = pending.popleft()
        prompt = json.dumps([kwargs.get("prompt"), kwargs.get("label")], sort_keys=True, default=str).encode()
        episode = await Episode.claim_when_free(log, name, prompt, f"{socket.gethostname()}:{os.getpid()}",
                                                lease_seconds=lease_seconds)
        if episode.resumed:  # its engine actor died mid-way, or the run restarted from a checkpoint before it
            _log.info("rlsync: episode %s %s %d recorded steps", name, "replays its" if episode.finished else "resumes after",
                      episode.recorded)
        keep = asyncio.ensure_future(episode.keep_lease())
        token = CURRENT.set(episode)
        try:
            response = await execute(*args, **kwargs)
        finally:
            CURRENT.reset(token)
            keep.cancel()
        episode.finish(None)  # OpenRLHF takes the response from here
        if isinstance(response, dict):
            response["rlsync_replayed"] = episode.replayed > 0
        return response

    return run


def wrap_generate(original: Any) -> Any:
    """``RolloutRayActor.generate`` (an executor's ``llm_engine.generate``): inside an episode, the next model turn is
    the recorded one (vLLM's ``RequestOutput`` rebuilt from it), or vLLM's answer, recorded."""

    @functools.wraps(original)
    async def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await _recorded_turn(original, self, args, kwargs)

    return generate


async def _recorded_turn(original: Any, actor: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    episode = CURRENT.get()
    if episode is None:
        return await original(actor, *args, **kwargs)
    prompt_token_ids = inspect.signature(original).bind(actor, *args, **kwargs).arguments["prompt_token_ids"]
    answered: list[Any] = []

    async def ask() -> Turn:
        output = await original(actor, *args, **kwargs)
        answered.append(output)
        return turn_of(output)

    turn = await episode.turn_async(ask)
    return answered[0] if answered else output_of(turn, prompt_token_ids, f"rlsync-replayed-{episode.episode_id}")


def _completion_record(completion: Any) -> dict[str, Any]:
    logprobs = None
    if completion.logprobs is not None:
        logprobs = [[[int(t), float(p.logprob), p.rank, p.decoded_token] for t, p in position.items()]
                    for position in completion.logprobs]
    return {"token_ids": [int(t) for t in completion.token_ids], "text": completion.text,
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            "cumulative_logprob": completion.cumulative_logprob, "logprobs": logprobs}


def turn_of(output: Any) -> Turn:
    """vLLM's ``RequestOutput`` as a recorded turn: the first completion's tokens and their log-probs (the version is
    unknown here: -1), and every completion as vLLM gave it, for the replay."""
    completions = [_completion_record(c) for c in output.outputs]
    first = output.outputs[0]
    tokens = [int(t) for t in first.token_ids]
    logprobs = [float(position[t].logprob) for t, position in zip(tokens, first.logprobs)] if first.logprobs else []
    return Turn(tokens, [-1] * len(tokens), logprobs, extra={"completions": completions})


def output_of(turn: Turn, prompt_token_ids: list[int], request_id: str) -> Any:
    """The ``RequestOutput`` a recorded turn stands for (what OpenRLHF's executors read of it)."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    outputs = []
    for index, c in enumerate(turn.extra["completions"]):
        logprobs = None
        if c["logprobs"] is not None:
            logprobs = [{t: Logprob(logprob=p, rank=rank, decoded_token=text) for t, p, rank, text in position}
                        for position in c["logprobs"]]
        outputs.append(CompletionOutput(index=index, text=c["text"], token_ids=list(c["token_ids"]),
                                        cumulative_logprob=c["cumulative_logprob"], logprobs=logprobs,
                                        finish_reason=c["finish_reason"], stop_reason=c["stop_reason"]))
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=list(prompt_token_ids), prompt_logprobs=None,
                         outputs=outputs, finished=True)


# --- an AgentInstance's reset and step as recorded steps -----------------------------------------------------------

def _recording(cls: type) -> type:
    """``cls`` (a user's ``AgentInstance``) whose ``reset`` and ``step`` are steps of the running episode."""

    class Recording(cls):  # type: ignore[misc]
        async def reset(self, states: dict[str, Any], **kwargs: Any) -> Any:
            return await _recorded_step(self, "reset", lambda: super(Recording, self).reset(states, **kwargs), None)

        async def step(self, state_dict: dict[str, Any], **kwargs: Any) -> Any:
            return await _recorded_step(self, "step", lambda: super(Recording, self).step(state_dict, **kwargs),
                                        {"action_text": state_dict.get("action_text")})

    Recording.__name__, Recording.__qualname__ = cls.__name__, cls.__qualname__
    return Recording


async def _recorded_step(instance: Any, name: str, run: Callable[[], Awaitable[Any]], arguments: Any) -> Any:
    episode = CURRENT.get()
    if episode is None:
        return await run()
    results: list[Any] = []

    async def call(key: str) -> dict[str, Any]:
        token = _TOOL_CALL_KEY.set(key)
        try:
            result = await run()
        finally:
            _TOOL_CALL_KEY.reset(token)
        results.append(result)
        try:
            return {"result": plain(result), "instance": _plain_state(instance)}
        except TypeError as exc:
            raise ConfigError(f"{type(instance).__name__}.{name} returned {exc}: rlsync's episodes record str, numbers, "
                              f"bools, lists, dicts, tensors and SamplingParams (run without {OPTION} for this agent)") from None

    recorded = await episode.tool_async(name, call, arguments)
    if results:  # run now: the agent goes on with what its step returned
        return results[0]
    for attribute, value in recorded["instance"].items():  # replayed: the instance as the step left it
        setattr(instance, attribute, restored(value))
    return restored(recorded["result"])


_TENSOR, _PARAMS = "rlsync:tensor", "rlsync:sampling_params"


def plain(value: Any) -> Any:
    """``value`` in msgpack's types: tensors and vLLM's ``SamplingParams`` tagged (``restored`` undoes it), tuples as
    lists, numpy scalars as numbers; anything else raises ``TypeError`` naming its type."""
    import numpy as np
    import torch

    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("a dict with keys other than str")
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):  # its bytes as they are: exact for every dtype, no Python per element
        data = value.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()
        return {_TENSOR: [str(value.dtype).removeprefix("torch."), list(value.shape), data]}
    if isinstance(value, np.generic):
        return value.item()
    if type(value).__name__ == "SamplingParams" and isinstance(value, msgspec.Struct):
        return {_PARAMS: msgspec.to_builtins(value)}
    raise TypeError(f"a {type(value).__module__}.{type(value).__qualname__}")


def restored(value: Any) -> Any:
    """What ``plain`` was given (tuples come back as lists)."""
    if isinstance(value, list):
        return [restored(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1 and _TENSOR in value:
            import torch

            name, shape, data = value[_TENSOR]
            dtype = getattr(torch, name)
            return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape) if data else torch.empty(shape, dtype=dtype)
        if len(value) == 1 and _PARAMS in value:
            from vllm import SamplingParams

            return msgspec.convert(value[_PARAMS], SamplingParams)
        return {k: restored(v) for k, v in value.items()}
    return value


def _plain_state(instance: Any) -> dict[str, Any]:
    """The instance's attributes that hold plain data (the others are left to its ``__init__`` on a replay)."""
    state = {}
    for attribute, value in vars(instance).items():
        try:
            state[attribute] = plain(value)
        except TypeError:
            continue
    return state
