"""A vLLM worker extension: each worker runs an rlsync ``WeightsReader`` (staged landing) and
applies a complete version through vLLM's own layerwise reload (``Worker.reload_weights``), which
fuses q/k/v and gate/up and repacks weights the way the engine needs (vLLM on CPU leaves its
linear parameters empty after repacking, so copying into parameters would do nothing).

Driver side::

    llm = LLM(model=path, worker_extension_cls="rlsync.adapters.vllm.RlsyncWorkerExtension", ...)
    boxes = llm.collective_rpc("rlsync_probe", args=(tensors,))      # [(hf_name, dtype, shape), ...]
    addresses = llm.collective_rpc("rlsync_start", args=(tensors, boxes))
    # the trainer: WeightsWriter(from_state_dict(state), engine_layout(tensors, boxes), 0, addresses)
    #              .multi_put(state); .complete(v)     (each worker receives only what its loader reads)
    apply_next_version(llm)   # between generate calls: every worker loads the landed version, then the
                              # prefix cache is reset and the engine's weight version set

The trainer's ``complete(v)`` returns only after ``rlsync_apply`` has loaded version ``v``: a
version is live when the engine serves it. A version whose bytes did not all land (the trainer
died) is never applied; the engine keeps serving the previous one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlsync.adapters.vllm._probe import probe_worker
from rlsync.adapters.vllm._reload import reprocessing_skipped_steps
from rlsync.adapters.vllm._staging import RankBoxes, StagedReceiver
from rlsync.core._errors import ConfigError


class RlsyncWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; methods reached by ``collective_rpc``."""

    def rlsync_probe(self, tensors: Sequence[Sequence[Any]]) -> dict[str, list[list[int]]]:
        """The part of each checkpoint tensor this worker's loader reads: ``{name: [offsets, sizes]}``,
        learned by running vLLM's loader on probe data (cached; see ``_probe``)."""
        return probe_worker(self, tensors)

    def rlsync_start(self, tensors: Sequence[Sequence[Any]], boxes: RankBoxes | None = None, transport: str = "shm",
                     host: str = "127.0.0.1", apply_timeout: float = 600.0) -> str:
        """Start receiving the checkpoint tensors ``[(name, dtype, shape), ...]``; returns the address for the
        writer. ``boxes``: every worker's ``rlsync_probe`` result, so that each receives only its part
        (the trainer then writes to ``engine_layout(tensors, boxes)``); without, each gets all of them."""
        if boxes is None and self.vllm_config.parallel_config.world_size > 1:  # type: ignore[attr-defined]
            raise ConfigError("with more than one vLLM worker pass boxes=llm.collective_rpc('rlsync_probe', args=(tensors,)) "
                              "to rlsync_start, and build the trainer's destination with engine_layout(tensors, boxes)")
        self._rlsync = StagedReceiver(tensors, boxes=boxes, rank=self.rank, transport=transport,  # type: ignore[attr-defined]
                                      host=host, apply_timeout=apply_timeout)
        self._rlsync_version = -1
        return self._rlsync.address

    def rlsync_apply(self, timeout: float = 600.0) -> int:
        """Engine thread: load the next landed version with vLLM's loader; returns its number."""
        version, views, finish = self._rlsync.next(timeout)
        try:
            with reprocessing_skipped_steps(self.model_runner.get_model()):  # type: ignore[attr-defined]
                self.reload_weights(weights_iterator=views)  # type: ignore[attr-defined]
        except Exception as exc:
            finish(exc)  # the writer's complete() raises it
            raise
        finish(None)
        self._rlsync_version = version
        return version

    def rlsync_version(self) -> int:
        """The weight version this worker serves (-1 before the first update)."""
        return self._rlsync_version

    def rlsync_stop(self) -> None:
        self._rlsync.close()
