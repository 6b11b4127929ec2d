"""Per-token weight versions in TRL's async GRPO trainer (``trl.experimental.async_grpo``).

TRL's rollout worker asks vLLM's ``/v1/completions``, which says nothing of the weights that sampled a completion, and
stamps each sample with the one ``model_version`` it read when the prompt's group started. A request that runs across
a sync (TRL pauses generation, syncs and resumes it) is sampled by two versions. ``RlsyncRolloutLoop`` asks vLLM's
token-in/token-out route instead (``/inference/v1/generate``, on a server started with ``--enable-scale-out``), whose
``weight_versions`` spans say which version sampled which tokens, and every sample it hands the trainer is an
``RlsyncRolloutSample``: TRL's ``RolloutSample`` plus ``token_versions``, one per position of ``input_ids`` (-1 for
the prompt and tool output, the version for every sampled token). Its metrics gain ``rlsync/sample_versions`` (how
many versions sampled the row: 2 when it ran across a sync), which TRL logs with the rest.

TRL's own staleness gate keeps working as it did: ``model_version`` is the version read when the group started, never
newer than its oldest token, except for a rollout replayed from its durable episode (``episodes=``, a resumed run):
its recorded turns were sampled by older versions than the resumed run's, so its ``model_version`` is its oldest
replayed token's, and TRL's gate drops it as it would have dropped the rollout in the run that sampled it. Versions
are the server's (rlsync's labels): on a fresh server they count syncs as TRL's ``model_version`` does.

``RlsyncWeightTransfer`` installs the loop (``install()``: ``AsyncRolloutWorker._loop_cls``, where it is TRL's own
loop; a subclass such as TRL's OpenEnv harness is left alone). TRL spawns the worker, and the spawned process imports
this module to build the loop, which applies the row-building patch (``rlsync.patches.trl``) there too.
"""

from __future__ import annotations

import argparse
import asyncio
import random
from typing import Any

import aiohttp
import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import RolloutSample, _AsyncRolloutLoop

from rlsync import ConfigError, Turn
from rlsync.adapters.trl import _episodes
from rlsync.adapters.vllm import token_versions
from rlsync.patches import trl as _patches

_patches.apply_rollout_versions()  # in every process that builds the loop: TRL's worker is a spawned one

GENERATE_ROUTE = "/inference/v1/generate"
NO_ROUTE = (f"the vLLM server has no {GENERATE_ROUTE} (vLLM's token-in/token-out route, which reports the weight "
            "version of every sampled token): start it with --enable-scale-out")


def install() -> None:
    """Make TRL's async rollout worker run ``RlsyncRolloutLoop`` (idempotent)."""
    from trl.experimental.async_grpo import async_rollout_worker

    worker = async_rollout_worker.AsyncRolloutWorker
    if worker._loop_cls is _AsyncRolloutLoop:
        worker._loop_cls = RlsyncRolloutLoop


class VersionedLogprobs(list[float]):
    """A turn's sampled log-probs, as TRL's worker keeps them, with the version that sampled each token beside;
    ``replayed``: the turn was read from its episode's record, not sampled in this run."""

    def __init__(self, logprobs: list[float], versions: list[int], *, replayed: bool = False) -> None:
        super().__init__(logprobs)
        self.versions = versions
        self.replayed = replayed


class RlsyncRolloutSample(RolloutSample):  # type: ignore[misc]
    """TRL's ``RolloutSample`` and, per position of ``input_ids``, the weight version that sampled it (-1: not
    sampled: prompt, tool output)."""

    __slots__ = ("token_versions",)

    def __init__(self, *args: Any, token_versions: np.ndarray, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.token_versions = token_versions


class RlsyncRolloutLoop(_AsyncRolloutLoop):  # type: ignore[misc]
    """TRL's rollout loop, asking the route that reports versions (see the module docstring). ``rlsync_adapter``
    (set by ``RlsyncWeightTransfer`` when it syncs a PEFT adapter alone): requests name the adapter version
    ``NAME@V`` of the trainer's ``model_version`` V, and every token of such a request is V's (a request's adapter
    never changes under it: each version is an adapter of its own)."""

    def __init__(self, *args: Any, rlsync_adapter: str | None = None, rlsync_episodes: tuple[str, str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rlsync_adapter = rlsync_adapter
        self.rlsync_episodes = None if rlsync_episodes is None else _episodes.Episodes(
            _episodes.log_for(*rlsync_episodes), int(kwargs.get("dataset_start_index", 0)))

    async def _generate_one(self, prompt: Any, tool_dict: dict[str, Any], tools: list[Any], group_id: int = 0) -> Any:
        """TRL's rollout, as an ``rlsync.Episode`` where ``RlsyncWeightTransfer(episodes=...)`` asks for them."""
        episodes = self.rlsync_episodes
        if episodes is None:
            return await super()._generate_one(prompt, tool_dict, tools, group_id)
        name, data = episodes.episode_id(prompt, group_id, self.num_generations)  # before any await: TRL's order
        episode = await episodes.claim(name, data)
        token = _episodes.CURRENT.set(episode)  # this task's (TRL runs each rollout in a task of its own)
        keep = asyncio.ensure_future(episode.keep_lease())
        try:
            result = await super()._generate_one(prompt, tool_dict, tools, group_id)
        finally:
            keep.cancel()
            _episodes.CURRENT.reset(token)
        episode.finish(None)  # TRL scores and queues the rollout itself
        return result

    async def _execute_tool_calls(self, tool_calls: list[dict[str, Any]], tool_dict: dict[str, Any]) -> Any:
        episode = _episodes.CURRENT.get()
        if episode is None:
            return await super()._execute_tool_calls(tool_calls, tool_dict)

        async def run(key: str) -> Any:
            return await super(RlsyncRolloutLoop, self)._execute_tool_calls(tool_calls, _episodes.keyed_tools(tool_dict, key))

        return await _episodes.recorded_tool_calls(episode, tool_calls, run)

    @property
    def _request_model(self) -> str:
        version = self.model_version
        if self.rlsync_adapter is None or version == 0:  # version 0: the base model, before the first sync
            return str(super()._request_model)
        return f"{self.rlsync_adapter}@{version}"

    async def _generate_one_turn(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        episode = _episodes.CURRENT.get()
        if episode is None:
            return await self._ask_one_turn(prompt_ids)

        asked = False

        async def ask() -> Turn:
            nonlocal asked
            asked = True
            tokens, logprobs = await self._ask_one_turn(prompt_ids)
            return Turn(tokens, list(logprobs.versions), list(logprobs))

        turn = await episode.turn_async(ask)
        return list(turn.tokens), VersionedLogprobs(list(turn.logprobs), list(turn.versions), replayed=not asked)

    async def _ask_one_turn(self, prompt_ids: list[int]) -> tuple[list[int], VersionedLogprobs]:
        params: dict[str, Any] = {
            "max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty, "n": 1, "logprobs": 0,
            "seed": random.getrandbits(63),  # as TRL does: engines seeded alike would otherwise sample alike
        }
        if self.min_p is not None:
            params["min_p"] = self.min_p
        model = self._request_model
        payload = {"token_ids": list(prompt_ids), "sampling_params": params, "model": model}
        output = await self._retry(lambda: self._generate(payload), max_attempts=30, label=f"vllm {GENERATE_ROUTE}")
        choice = output["choices"][0]
        tokens = list(choice["token_ids"])
        if self.rlsync_adapter is not None and model.startswith(self.rlsync_adapter + "@"):
            # the engine's spans carry its newest label, not the adapter this request named
            versions = np.full(len(tokens), int(model.rsplit("@", 1)[1]), dtype=np.int64)
        else:
            spans = [argparse.Namespace(**span) for span in choice.get("weight_versions") or ()]
            versions = token_versions(argparse.Namespace(token_ids=tokens, weight_versions=spans))
        logprobs = [float(entry["logprob"]) for entry in choice["logprobs"]["content"]]
        return tokens, VersionedLogprobs(logprobs, [int(v) for v in versions])

    async def _generate(self, payload: dict[str, Any]) -> Any:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        async with self.session.post(self.vllm_server_url + GENERATE_ROUTE, json=payload, timeout=timeout) as response:
            if response.status == 404:  # not retried: no server started without the route grows one
                raise ConfigError(f"{NO_ROUTE} ({self.vllm_server_url})")
            response.raise_for_status()
            return await response.json()

    async def _score_group(self, group: Any) -> list[RolloutSample]:
        samples = await super()._score_group(group)
        rows = [row for rows in group.completions_sequences for row in rows]  # TRL's order: conversation, then row
        if len(rows) != len(samples):
            raise RuntimeError(f"TRL scored {len(samples)} rows of {len(rows)}: rlsync's TRL patch no longer matches "
                               "this TRL")
        return [_with_versions(sample, row) for sample, row in zip(samples, rows)]


def _with_versions(sample: RolloutSample, row: Any) -> RlsyncRolloutSample:
    versions = np.asarray(row.rlsync_versions, dtype=np.int64)
    if len(versions) != len(sample.input_ids):
        raise RuntimeError(f"{len(versions)} versions for a row of {len(sample.input_ids)} tokens: rlsync's TRL patch "
                           "no longer matches this TRL")
    sampled = versions[versions >= 0]
    metrics = {**sample.metrics, "rlsync/sample_versions": float(len(np.unique(sampled)))}
    fields = {name: getattr(sample, name) for name in RolloutSample.__dataclass_fields__}
    replayed = getattr(row, "rlsync_oldest_replayed", None)  # TRL's gate reads model_version: the replayed tokens' own
    if replayed is not None and replayed < sample.model_version:
        fields["model_version"] = replayed
    return RlsyncRolloutSample(**{**fields, "metrics": metrics}, token_versions=versions)
