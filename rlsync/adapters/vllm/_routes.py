"""Recording, in a vLLM worker, the experts every MoE layer routed each token to: the rollout's half of routing replay
(the trainer's half is ``rlsync.adapters.hf.replay_routes``).

vLLM 0.32 returns routed experts only with its Model Runner V2 (``enable_return_routed_experts``), which needs Triton,
so not on CPU. Its MoE routers have the hook that capturer uses, though (``router.set_capture_fn``: called with each
step's expert ids, before any expert-parallel remapping), and that is what rlsync binds. The model runner's
``execute_model`` is wrapped to file each step's ids by request: the batch holds the scheduled tokens of each request
in the input batch's order, starting at the request's count of computed tokens. So a request that was preempted and
is computed again overwrites the same positions, and one that runs on across a sync (a partial rollout) keeps the
routes of the tokens it already has. Positions a prefix-cache hit skipped were never routed in this request; taking
such a record raises (start the engine with ``enable_prefix_caching=False``).

A request is taken by its id (the offline ``LLM``, whose outputs carry it) or by its tokens (a server's clients never
see the engine's ids: ``VllmServer.take_routes``): the recorder keeps the token each routed position ran on.
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Sequence
from functools import cache, partial
from typing import Any

import numpy as np

from rlsync import ConfigError


@cache
def _warn_dropped_once(bound: int) -> None:
    logging.getLogger("rlsync").warning(
        "rlsync: more than %d finished requests' routes were never taken; the oldest are dropped (take them with "
        "take_routes, or raise RLSYNC_MAX_ROUTE_RECORDS)", bound)


def moe_runners(model: Any) -> list[Any]:
    """vLLM's MoE layers of ``model`` (their runners: each has the router rlsync binds), in layer order."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return sorted((m for m in model.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)


class RouteRecorder:
    """Installed once per worker (``rlsync_record_routes``); keeps each request's routes until they are taken."""

    def __init__(self, worker: Any) -> None:
        self.runner = worker.model_runner
        moes = moe_runners(self.runner.model)
        if not moes:
            raise ConfigError(f"{type(self.runner.model).__name__} has no MoE layer: there are no routes to record")
        self.layers = len(moes)
        self._step: dict[int, Any] = {}
        # per internal request id: [positions, layers, top_k] (-1: not run), grown as the request runs (a whole
        # max_model_len record per request up front is tens of MB at real sizes), and the token each position ran on
        self.routes: dict[str, np.ndarray] = {}
        self.tokens: dict[str, np.ndarray] = {}
        self._finished: dict[str, None] = {}  # finished and not taken yet, oldest first
        self.keep_finished = int(os.environ.get("RLSYNC_MAX_ROUTE_RECORDS", "4096"))
        for index, moe in enumerate(moes):
            moe.router.set_capture_fn(partial(self._capture, index))
        run = self.runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._step.clear()
            out = run(scheduler_output, *args, **kwargs)
            self._file(scheduler_output)
            return out

        self.runner.execute_model = execute_model

    def _capture(self, layer: int, topk_ids: Any) -> None:
        self._step[layer] = topk_ids.to("cpu", copy=True)

    def _file(self, scheduled: Any) -> None:
        if len(self._step) != self.layers:
            return  # a step that ran no MoE layer (nothing scheduled)
        starts = {r.req_id: r.num_computed_tokens for r in scheduled.scheduled_new_reqs}
        cached = scheduled.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        step = np.stack([self._step[layer].numpy() for layer in range(self.layers)], 1)  # [tokens, layers, top_k]
        at = 0
        for req in self.runner.input_batch.req_ids:  # the batch's order: each request's tokens, in turn
            count = scheduled.num_scheduled_tokens.get(req, 0)
            if not count:
                continue
            start = starts[req]
            record = self._grow(req, start + count, step.shape[1:])
            record[start : start + count] = step[at : at + count]
            row = self.runner.input_batch.req_id_to_index[req]
            self.tokens[req][start : start + count] = self.runner.input_batch.token_ids_cpu[row, start : start + count]
            at += count
        self._forget_beyond_bound(scheduled.finished_req_ids)

    def _grow(self, req: str, end: int, shape: tuple[int, ...]) -> np.ndarray:
        """The request's record, at least ``end`` positions long (doubling, at most max_model_len)."""
        record = self.routes.get(req)
        if record is not None and len(record) >= end:
            return record
        size = min(max(end, 2 * (0 if record is None else len(record)), 64), max(end, self.runner.max_model_len))
        grown = np.full((size, *shape), -1, np.int16)
        tokens = np.full(size + 1, -1, np.int64)  # one past the last position: "nothing ran there" for take_matching
        if record is not None:
            grown[: len(record)] = record
            tokens[: len(record)] = self.tokens[req][: len(record)]
        self.routes[req], self.tokens[req] = grown, tokens
        return grown

    def _forget_beyond_bound(self, finished: Any) -> None:
        """Finished records wait to be taken; past ``RLSYNC_MAX_ROUTE_RECORDS`` of them the oldest are dropped (a
        client that never takes them would otherwise grow the worker without bound), said once."""
        for req in finished or ():
            if req in self.routes:
                self._finished[req] = None
        while len(self._finished) > self.keep_finished:
            oldest = next(iter(self._finished))
            del self._finished[oldest]
            self.routes.pop(oldest, None)
            self.tokens.pop(oldest, None)
            _warn_dropped_once(self.keep_finished)

    def take(self, request_ids: Sequence[str]) -> dict[str, np.ndarray]:
        """The routes of the finished requests ``request_ids`` (the ids vLLM's outputs carry), every position run:
        ``[positions, layers, top_k]``; forgotten here afterwards."""
        out = {}
        for internal in list(self.routes):
            external = internal.rsplit("-", 1)[0]  # vLLM's engine adds a suffix to the request's own id
            if external in request_ids or internal in request_ids:
                record = self.routes.pop(internal)
                self.tokens.pop(internal, None)
                self._finished.pop(internal, None)
                ran = np.flatnonzero((record >= 0).all((1, 2)))
                out[external] = record[: ran.max() + 1] if ran.size else record[:0]
        return out

    def take_matching(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray | None]:
        """For each finished sequence (prompt and completion tokens), the routes of its positions that ran
        (``[len - 1, layers, top_k]``) of a request that ran exactly those tokens, taken; None where none did (or a
        position of it was never routed: a prefix-cache hit). Sequences alike (a prompt sampled alike twice) take one
        request each."""
        out: list[np.ndarray | None] = []
        for sequence in sequences:
            ran = np.asarray(sequence[:-1], dtype=np.int64)
            found = None
            for req, tokens in self.tokens.items():
                if len(ran) < len(tokens) and tokens[len(ran)] == -1 and (tokens[: len(ran)] == ran).all():
                    found = req
                    break
            if found is None:
                out.append(None)
                continue
            record = self.routes.pop(found)[: len(ran)]
            del self.tokens[found]
            self._finished.pop(found, None)
            out.append(record if (record >= 0).all() else None)
        return out


def compact_routes(record: np.ndarray) -> np.ndarray:
    """Recorded expert ids in the smallest unsigned dtype that holds them (what ``rlsync.Sample`` carries)."""
    return record.astype(np.uint8 if record.max(initial=0) < 256 else np.uint16)


def encode_routes(record: np.ndarray) -> dict[str, Any]:
    """A route record as JSON-safe data (a server's ``/collective_rpc`` answers JSON)."""
    record = compact_routes(record)
    return {"shape": list(record.shape), "dtype": str(record.dtype), "data": base64.b64encode(record.tobytes()).decode()}


def decode_routes(encoded: dict[str, Any]) -> np.ndarray:
    dtype = np.dtype(encoded["dtype"])
    if dtype not in (np.uint8, np.uint16):
        raise ConfigError(f"route record of dtype {dtype}: expected uint8 or uint16")
    shape = tuple(int(x) for x in encoded["shape"])
    data = base64.b64decode(encoded["data"])
    if len(shape) != 3 or int(np.prod(shape)) * dtype.itemsize != len(data):
        raise ConfigError(f"route record of shape {shape} holds {len(data)} bytes")
    return np.frombuffer(data, dtype).reshape(shape)


def worker_recorder(worker: Any) -> RouteRecorder:
    recorder: RouteRecorder | None = getattr(worker, "_rlsync_routes", None)
    if recorder is None:
        recorder = worker._rlsync_routes = RouteRecorder(worker)
    return recorder


def record_routes(llm: Any) -> None:
    """From now on every worker of ``llm`` (an offline ``vllm.LLM`` with ``RlsyncWorkerExtension``) records the
    experts each MoE layer routes every token to; ``take_routes`` hands them over per finished request."""
    llm.collective_rpc("rlsync_record_routes")


def take_routes(llm: Any, outputs: Sequence[Any]) -> list[np.ndarray]:
    """For each finished ``vllm.RequestOutput`` (one completion each), the routes of every position the engine ran:
    ``[len(prompt) + len(completion) - 1, layers, top_k]`` (the last token was sampled, never run), the prompt's
    positions first: ``rlsync.Sample(routes=...)`` as it is. Raises naming the request where a position was not
    routed in it (a prefix-cache hit)."""
    ids = [str(o.request_id) for o in outputs]
    taken = llm.collective_rpc("rlsync_take_routes", args=(ids,))[0]  # every worker routes every token alike
    out = []
    for output in outputs:
        record = taken.get(str(output.request_id))
        want = len(output.prompt_token_ids) + len(output.outputs[0].token_ids) - 1
        if record is None or len(record) < want or (record[:want] < 0).any():
            missing = "none" if record is None else np.flatnonzero((record[:want] < 0).any((1, 2))).tolist()[:8]
            raise ConfigError(f"request {output.request_id!r}: no routes recorded for positions {missing} of {want}: "
                              f"call record_routes(llm) before generating, and start the engine with "
                              f"enable_prefix_caching=False (a prefix-cache hit runs no router for those positions)")
        out.append(compact_routes(record[:want]))
    return out
