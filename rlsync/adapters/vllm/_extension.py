"""A vLLM worker extension: each worker runs an rlsync ``WeightsReader`` (staged landing) and
applies a complete version through vLLM's own layerwise reload (``Worker.reload_weights``), which
fuses q/k/v and gate/up and repacks weights the way the engine needs (vLLM on CPU leaves its
linear parameters empty after repacking, so copying into parameters would do nothing).

Driver side::

    llm = LLM(model=path, worker_extension_cls="rlsync.adapters.vllm.RlsyncWorkerExtension", ...)
    addresses = llm.collective_rpc("rlsync_start", args=(tensors,))   # [(hf_name, dtype, shape), ...]
    # the trainer: WeightsWriter(from_state_dict(state), None, 0, addresses).multi_put(state); .complete(v)
    #              (the layout comes from the engine: each worker receives only what its loader reads)
    apply_next_version(llm)   # between generate calls: every worker loads the landed version, then the
                              # prefix cache is reset and the engine's weight version set

``rlsync_start`` checks the tensor list against vLLM's loader on every worker before a byte moves
(``learn_parts``). The trainer's ``complete(v)`` returns only after ``rlsync_apply`` has loaded version
``v``: a version is live when the engine serves it. A version whose bytes did not all land (the
trainer died) is never applied, and a load that fails is rolled back (``EngineCommit``: in place where it can, vLLM's loader, atomic, where it must): the
engine keeps serving the previous version either way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import Any

import msgspec

from rlsync import DEFAULT_TIMEOUT, CanaryError, ConfigError, Finish, StagedReceiver, SyncOptions
from rlsync.adapters.vllm._commit import EngineCommit
from rlsync.adapters.vllm._probe import learn_parts, learn_placements, probe_worker
from rlsync.adapters.vllm._routes import encode_routes, moe_runners, worker_recorder
from rlsync.layouts import RankBoxes


@cache
def _warn_unchecked_once() -> None:
    logging.getLogger("rlsync").warning(
        "the trainer sent a canary with its version, but this engine's caller loads versions without checking it "
        "(rlsync_apply without hold): use rlsync.adapters.vllm.apply_next_version(llm), which checks it")


class RlsyncWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; methods reached by ``collective_rpc``."""

    def rlsync_probe(self, tensors: Sequence[Sequence[Any]]) -> dict[str, list[list[int]]]:
        """The part of each checkpoint tensor this worker's loader reads: ``{name: [offsets, sizes]}``,
        learned by running vLLM's loader on probe data (cached; see ``_probe``)."""
        return probe_worker(self, tensors)

    def rlsync_start(self, tensors: Sequence[Sequence[Any]], boxes: RankBoxes | None = None,
                     options: Mapping[str, Any] | None = None) -> str:
        """Start receiving the checkpoint tensors ``[(name, dtype, shape), ...]``; returns the address for the
        writer. Every worker checks the list against its loader and learns its part of each tensor (a
        collective: call it on all workers, as ``collective_rpc`` does); tied aliases are left out. ``boxes``
        (every worker's ``rlsync_probe``) is optional and must agree with what the workers learn. ``options``: the
        keys of ``rlsync.SyncOptions`` as plain data (it crosses ``collective_rpc``)."""
        from vllm.config import set_current_vllm_config
        from vllm.distributed.parallel_state import get_world_group

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            kept, learned = learn_parts(model, tensors, get_world_group().cpu_group)
            self._rlsync_commit = EngineCommit(model, learn_placements(model, tensors))
        if boxes is not None and json.loads(json.dumps([dict(b) for b in boxes])) != learned:
            raise ConfigError("the boxes given to rlsync_start differ from what the workers' loaders read: drop the "
                              "boxes argument (rlsync_start learns them)")
        self._rlsync = StagedReceiver(kept, boxes=learned, rank=self.rank,  # type: ignore[attr-defined]
                                      options=SyncOptions.from_mapping(options, where="rlsync_start"))
        self._rlsync_version = -1
        self._rlsync_digest: str | None = None  # of the version this worker serves
        self._rlsync_landed_digest: str | None = None  # of the version being loaded (until it is live or undone)
        self._rlsync_held: tuple[int, Finish, Callable[[], None]] | None = None  # committed, canary not yet checked
        return self._rlsync.address

    def rlsync_apply(self, timeout: float = DEFAULT_TIMEOUT, hold: bool = False) -> int:
        """Engine thread: load the next landed version with vLLM's loader, all or nothing; returns its number.

        ``hold``: the caller checks the version's canary, if the trainer sent one (``rlsync_canary``), and then calls
        ``rlsync_settle``: the version is committed but not yet live (the trainer's ``complete`` waits), and can
        still be undone. Without ``hold`` a canary that came is not checked (said once in the log)."""
        from vllm.config import set_current_vllm_config

        version, views, finish = self._rlsync.next(timeout)
        # read now, while the reader hands this version over: its ``digest`` changes only after ``finish``, on the
        # reader's thread, which a caller asking right after this version went live could outrun
        self._rlsync_landed_digest = self._rlsync.reader.landed_digest
        canary = self._rlsync.reader.landed_canary if self._rlsync.reader.options.canary else None
        if canary is not None and not hold:
            _warn_unchecked_once()
            canary = None
        runner = self.model_runner  # type: ignore[attr-defined]
        try:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                undo = self._rlsync_commit.load(runner.get_model(), self.vllm_config.model_config, views,  # type: ignore[attr-defined]
                                                undoable=canary is not None, verify=self._rlsync.reader.options.verify)
        except Exception as exc:
            finish(exc)  # the writer's complete() raises it
            raise
        self._rlsync_reset()
        if undo is not None:
            self._rlsync_held = (version, finish, undo)
            return version
        finish(None)
        self._rlsync_version, self._rlsync_digest = version, self._rlsync_landed_digest
        return version

    def rlsync_canary(self) -> dict[str, Any] | None:
        """The trainer's canary of the version ``rlsync_apply(hold=True)`` committed and holds, as plain data
        (``rlsync.Canary``'s fields); None when no version is held."""
        canary = self._rlsync.reader.landed_canary
        return None if self._rlsync_held is None or canary is None else msgspec.structs.asdict(canary)

    def rlsync_settle(self, refused: str | None = None, deviation: float | None = None) -> int:
        """End a held version: live (``refused`` None; ``deviation``, the canary's, goes to the trainer), or undone
        (``refused``: why; the engine is back on its previous version and the trainer's ``complete`` raises
        ``CanaryError`` with that reason). Returns the version the engine serves."""
        from vllm.config import set_current_vllm_config

        held, self._rlsync_held = self._rlsync_held, None
        if held is None:
            raise ConfigError("rlsync_settle: no version is held (call rlsync_apply(timeout, hold=True) first)")
        version, finish, undo = held
        if refused is not None:
            with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
                undo()
            self._rlsync_reset()
            finish(CanaryError(refused))
            return int(self._rlsync_version)
        self._rlsync.reader.canary_deviation = deviation
        finish(None)
        self._rlsync_version, self._rlsync_digest = int(version), self._rlsync_landed_digest
        return int(version)

    def _rlsync_reset(self) -> None:
        runner = self.model_runner  # type: ignore[attr-defined]
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as Worker.reload_weights does
            getattr(runner, reset, lambda: None)()

    def rlsync_digest(self) -> str | None:
        """With verify: the fingerprint of the version this worker serves (``WeightsReader.digest`` once the reader
        has caught up), else None."""
        return self._rlsync_digest

    def rlsync_version(self) -> int:
        """The weight version this worker serves (-1 before the first update)."""
        return self._rlsync_version

    def rlsync_stop(self) -> None:
        self._rlsync.close()

    def rlsync_moe_layers(self) -> int:
        """How many MoE layers this worker's model has (0: it has no routes to record)."""
        return len(moe_runners(self.model_runner.get_model()))  # type: ignore[attr-defined]

    def rlsync_record_routes(self) -> int:
        """Record every MoE layer's experts for each token from now on (``rlsync.adapters.vllm.record_routes``);
        returns the number of MoE layers."""
        return worker_recorder(self).layers

    def rlsync_take_routes(self, request_ids: Sequence[str]) -> dict[str, Any]:
        """The recorded routes of these finished requests, taken (``rlsync.adapters.vllm.take_routes``)."""
        return worker_recorder(self).take(request_ids)

    def rlsync_take_routes_of(self, sequences_json: str) -> dict[str, Any]:
        """The recorded routes of the requests that ran these token sequences (a JSON list of token lists: a server's
        ``/collective_rpc`` passes strings only), taken; JSON-safe (``rlsync.adapters.vllm.VllmServer.take_routes``)."""
        return {"routes": [None if r is None else encode_routes(r)
                           for r in worker_recorder(self).take_matching(json.loads(sequences_json))]}

    def rlsync_lora_start(self, tensors: Sequence[Sequence[Any]], peft_config: dict[str, Any], keep: int = 1,
                          options: Mapping[str, Any] | None = None) -> str:
        """Start receiving LoRA adapter versions (``[(name, dtype, shape), ...]`` of the PEFT state dict and its
        ``adapter_config``); returns the address for the writer. See ``rlsync.adapters.vllm._lora``."""
        from rlsync.adapters.vllm._lora import LoraReceiver

        self._rlsync_lora = LoraReceiver(self, tensors, peft_config, keep=keep,
                                         options=SyncOptions.from_mapping(options, where="rlsync_lora_start"))
        return self._rlsync_lora.address

    def rlsync_lora_apply(self, timeout: float = DEFAULT_TIMEOUT, hold: bool = False) -> int:
        """Engine thread: register the next landed adapter version; returns it (``apply_next_lora``). ``hold``: see
        ``rlsync_apply``; then ``rlsync_lora_canary`` and ``rlsync_lora_settle``."""
        return self._rlsync_lora.apply_next(timeout, hold)

    def rlsync_lora_canary(self) -> dict[str, Any] | None:
        """The trainer's canary of the adapter version held by ``rlsync_lora_apply(hold=True)``, or None."""
        return self._rlsync_lora.canary()

    def rlsync_lora_settle(self, refused: str | None = None, deviation: float | None = None) -> int:
        """Keep the held adapter version, or remove it (``refused``: why; the trainer's ``complete`` raises it)."""
        return self._rlsync_lora.settle(refused, deviation)

    def rlsync_lora_stop(self) -> None:
        self._rlsync_lora.close()
