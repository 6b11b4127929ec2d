"""Routing replay in OpenRLHF for MoE policies (launcher ``--routing-replay auto|on|off``; auto: wherever the model
is MoE): every forward of the policy (the experience maker's log-probs and the PPO loss alike) sends each generated
sequence's tokens to the experts that sampled them (``rlsync.adapters.hf.replay_routes``).

The route of a sample, hop by hop:

- OpenRLHF's engine actor (``RolloutRayActor``): its workers record every MoE layer's experts per token
  (``rlsync_record_routes``, rlsync's worker extension, which OpenRLHF's ``WorkerWrap`` is in a launched run); each
  request ``generate`` makes inside ``generate_responses`` is remembered by its tokens, and when the responses are
  ready the last request of each (a multi-turn agent's last turn ran every position before it again: prefix caching
  is off) is taken from the workers into the response (``rlsync_routes``).
- The driver: OpenRLHF's ``SamplesGenerator._process_response_into_experience`` moves it onto the sample
  (``Experience.rlsync_routes``, as ``rlsync_versions``); ``BasePPOTrainer.train_step`` puts the routes of the
  samples it trains on into a named Ray actor (``RouteStore``), keyed by their tokens, and takes them out when the
  step is done. Samples that never train (filtered, evaluation) take their routes with them.
- Every trainer rank (``ActorPPOTrainer.__init__``, then ``install``): a forward pre-hook on the policy (OpenRLHF's ``Actor``) asks the store for its rows' routes by
  their tokens (one Ray call per forward) and replays them, unpadded as ``Actor.forward`` unpads them with
  ``--ds.packing_samples``. The replay stays open through the backward (a gradient-checkpointed layer routes again
  there), and closes when ``training_step`` returns or, for a no-grad forward, at once. Rows without routes (none
  recorded, a sequence OpenRLHF truncated) route themselves, as does the reference model. ``training_step``'s status
  gets ``rlsync/routes_replayed`` (rows with routes) and ``rlsync/routes_differing`` (replayed token-layers the
  trainer would have routed elsewhere).

Ring attention (``--ds.ring_attn_size`` > 1) splits a packed row across ranks: not supported with replay.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from rlsync import ConfigError
from rlsync.adapters.hf import HeldReplay, routers, routes_at_rows, token_rows
from rlsync.adapters.vllm import compact_routes
from rlsync.patches.openrlhf import options

STORE = "rlsync-openrlhf-route-store"
CHOICES = {"auto": None, "on": True, "off": False}
_log = logging.getLogger("rlsync")


def wanted(opts: dict[str, Any] | None) -> bool | None:
    """The launcher's ``--routing-replay``: True (on), None (auto: wherever the model is MoE), False (off)."""
    return CHOICES[(opts or {}).get("routing_replay", "auto")]


def key(tokens: Sequence[int] | np.ndarray) -> bytes:
    """A sequence's routes are found by its tokens (the engine's ids never reach the trainer)."""
    return np.asarray(tokens, dtype=np.int64).tobytes()


class RouteStore:
    """The routes of the samples the current train step trains on, by their tokens (a named Ray actor)."""

    def __init__(self) -> None:
        self.records: dict[bytes, np.ndarray] = {}

    def put(self, records: dict[bytes, np.ndarray]) -> None:
        self.records.update(records)

    def get(self, keys: Sequence[bytes]) -> list[np.ndarray | None]:
        return [self.records.get(k) for k in keys]

    def drop(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self.records.pop(k, None)

    def size(self) -> int:
        return len(self.records)


_handle: list[Any] = []  # held for the life of this process: Ray collects an actor no handle refers to


def store() -> Any:
    """The run's route store (created by whoever asks first: the launcher's driver)."""
    import ray

    if not _handle:
        _handle.append(ray.remote(num_cpus=0)(RouteStore).options(name=STORE, get_if_exists=True).remote())
    return _handle[0]


# --- OpenRLHF's engine actor -------------------------------------------------------------------------------------

_rollout: contextvars.ContextVar[bool] = contextvars.ContextVar("rlsync_rollout", default=False)


# The wrappers below reach the context variable through these module functions: Ray pickles the engine actor's
# class by value, closures included, and a context variable does not pickle (a module function goes by name).
def _in_rollout() -> bool:
    return _rollout.get()


@contextmanager
def _responses_in_making() -> Iterator[None]:
    """Requests made inside the block (the agent's tasks copy this context) belong to responses."""
    entered = _rollout.set(True)
    try:
        yield
    finally:
        _rollout.reset(entered)


async def start_recording(actor: Any) -> None:
    """In ``RolloutRayActor.__init__``, once the engine is built: its workers record routes when the run replays them
    and the model is MoE. ``actor._rlsync_requests`` (tokens -> request ids, the requests of responses in the making)
    is None where nothing is recorded."""
    actor._rlsync_requests = None
    opts = options()
    want = wanted(opts)
    if opts is None or want is False:  # not a launched run (the vLLM side is OpenRLHF's own), or replay off
        return
    layers = set(await actor.llm.collective_rpc("rlsync_moe_layers"))
    if layers == {0}:
        if want:
            raise ConfigError("--routing-replay on, but the rollout model has no MoE layer: routing replay is for MoE "
                              "models (use --routing-replay auto or off)")
        return
    if actor.kwargs.get("enable_prefix_caching"):
        raise ConfigError("routing replay needs every position of a sequence routed in its own request, and a prefix-"
                          "cache hit runs no router: drop --vllm.enable_prefix_caching, or run with --routing-replay off")
    await actor.llm.collective_rpc("rlsync_record_routes")
    actor._rlsync_requests = {}


def wrap_generate(original: Any) -> Any:
    """``RolloutRayActor.generate``: a request made for a response is remembered by its tokens; any other (the
    canary, a user's direct call) has its routes taken and dropped at once."""

    @functools.wraps(original)
    async def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = await original(self, *args, **kwargs)
        requests = getattr(self, "_rlsync_requests", None)
        if requests is None:
            return output
        if _in_rollout():
            tokens = tuple(output.prompt_token_ids) + tuple(output.outputs[0].token_ids)
            requests.setdefault(tokens, []).append(output.request_id)  # samples alike: one request each
        else:
            await self.llm.collective_rpc("rlsync_take_routes", args=([output.request_id],))
        return output

    return generate


def _pop_request(requests: dict[tuple[int, ...], list[str]], tokens: tuple[int, ...]) -> str | None:
    ids = requests.get(tokens)
    if not ids:
        return None
    if len(ids) == 1:
        del requests[tokens]
    return ids.pop()


def wrap_generate_responses(original: Any) -> Any:
    """``RolloutRayActor.generate_responses``: each response gets the routes of its last request (``rlsync_routes``,
    ``[positions, layers, top_k]``: every position of its tokens up to that request's last one, which was sampled
    and never run), or None where they are incomplete."""

    @functools.wraps(original)
    async def generate_responses(self: Any, *args: Any, **kwargs: Any) -> Any:
        requests = getattr(self, "_rlsync_requests", None)
        if requests is None:
            return await original(self, *args, **kwargs)
        with _responses_in_making():
            responses = await original(self, *args, **kwargs)
        lasts, ids = [], []
        for response in responses:
            tokens = list(response["observation_tokens"])
            turns = [_pop_request(requests, tuple(tokens[:end])) for _, end in response["action_ranges"]]
            ids += [t for t in turns if t is not None]
            lasts.append((turns[-1], response["action_ranges"][-1][1] - 1) if turns else (None, 0))
        taken = (await self.llm.collective_rpc("rlsync_take_routes", args=(ids,)))[0] if ids else {}
        for response, (request, ran) in zip(responses, lasts):
            record = taken.get(str(request))
            if record is not None and len(record) >= ran and (record[:ran] >= 0).all():
                response["rlsync_routes"] = compact_routes(record[:ran])
            else:
                response["rlsync_routes"] = None
        return responses

    return generate_responses


# --- the driver ----------------------------------------------------------------------------------------------------

def _sample_key(sample: Any) -> bytes:
    row = token_rows(sample.sequences, sample.attention_mask)[0]  # the driver's samples are on the host already
    return key(row[row >= 0])


def wrap_process_response(original: Any) -> Any:
    """``SamplesGenerator._process_response_into_experience``: the response's routes go onto its sample."""

    @functools.wraps(original)
    def process(self: Any, response: Any, **kwargs: Any) -> Any:
        sample = original(self, response, **kwargs)
        sample.rlsync_routes = response.get("rlsync_routes")
        return sample

    return process


def wrap_train_step(original: Any) -> Any:
    """``BasePPOTrainer.train_step``: the routes of the step's samples are in the store while it runs."""

    @functools.wraps(original)
    def train_step(self: Any, rollout_samples: Any, global_step: int) -> Any:
        records = {_sample_key(s): s.rlsync_routes for s in rollout_samples
                   if getattr(s, "rlsync_routes", None) is not None}
        if not records:
            return original(self, rollout_samples, global_step)
        import ray

        ray.get(store().put.remote(records))
        try:
            return original(self, rollout_samples, global_step)
        finally:
            ray.get(store().drop.remote(list(records)))

    return train_step


# --- every trainer rank --------------------------------------------------------------------------------------------

class RouteReplay:
    """On the policy of one trainer rank (``ActorPPOTrainer.actor``, OpenRLHF's ``Actor``)."""

    def __init__(self, actor: Any) -> None:
        found = routers(actor)
        self.layers, self.top_k = len(found), int(getattr(found[0], "top_k", 0))
        self.signature = inspect.signature(actor.forward)
        self._held = HeldReplay()
        self.reset()
        actor.register_forward_pre_hook(self.before_forward, with_kwargs=True)
        actor.register_forward_hook(self.after_forward)

    def before_forward(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        import ray

        self.close()  # the previous forward's backward, if any, is done
        given = self.signature.bind(*args, **kwargs).arguments
        rows = token_rows(given["sequences"], given.get("attention_mask"))
        records = ray.get(store().get.remote([key(row[row >= 0]) for row in rows]))  # one call per forward
        routes, found = routes_at_rows(rows, records, self.layers, self.top_k)
        self.rows += len(rows)
        self.replayed_rows += found
        if not found:
            return
        if getattr(module, "packing_samples", False):  # Actor.forward unpads the batch into one row, row by row
            routes = routes[rows >= 0][None]
        self._held.open(module, routes)

    def after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():  # no backward follows (the experience maker's log-probs)
            self.close()

    def close(self) -> None:
        log = self._held.close()
        if log is not None:
            self.differing += log.differing
            self.replayed += log.replayed

    def reset(self) -> None:
        self.rows = self.replayed_rows = self.differing = self.replayed = 0

    def report(self, status: dict[str, Any]) -> None:
        """The training step's shares into its status (every rank, so OpenRLHF's all-reduce sees the same keys)."""
        shares = {"rlsync/routes_replayed": self.replayed_rows / max(self.rows, 1),
                  "rlsync/routes_differing": self.differing / max(self.replayed, 1)}
        for name, value in shares.items():
            status["metrics"][name] = torch.tensor(value)
            status["weights"][name] = "sample"


def install(trainer: Any) -> None:
    """After ``ActorPPOTrainer.__init__`` on every rank: replay on the policy where the run wants it."""
    opts = options()
    want = wanted(opts)
    if opts is None or want is False:
        return
    if not routers(trainer.actor):
        if want:
            raise ConfigError(f"--routing-replay on, but the policy ({type(trainer.actor.model).__name__}) has no MoE "
                              "router: routing replay is for MoE models (use --routing-replay auto or off)")
        return
    if getattr(trainer.strategy, "ring_attn_group", None) is not None:  # a packed row is split across ranks
        message = "routing replay with ring attention (--ds.ring_attn_size > 1) is not supported"
        if want:
            raise ConfigError(f"{message}: run with --routing-replay off, or without ring attention")
        _log.warning("rlsync: MoE policy without routing replay: %s", message)
        return
    trainer._rlsync_route_replay = RouteReplay(trainer.actor)


def wrap_init(original: Any) -> Any:
    """``ActorPPOTrainer.__init__``: then ``install``."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        install(self)

    return __init__


def wrap_training_step(original: Any) -> Any:
    """``ActorPPOTrainer.training_step``: its replay ends with it (after the backward), its shares in its status."""

    @functools.wraps(original)
    def training_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        replay: RouteReplay | None = getattr(self, "_rlsync_route_replay", None)
        if replay is None:
            return original(self, *args, **kwargs)
        replay.close()  # the experience maker's forwards are not this step's
        replay.reset()
        try:
            status = original(self, *args, **kwargs)
        finally:
            replay.close()
        replay.report(status)
        return status

    return training_step
