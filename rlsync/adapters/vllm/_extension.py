"""A vLLM worker extension: each worker runs an rlsync ``WeightsReader`` (staged landing) and
applies a complete version through vLLM's own layerwise reload (``Worker.reload_weights``), which
fuses q/k/v and gate/up and repacks weights the way the engine needs (vLLM on CPU leaves its
linear parameters empty after repacking, so copying into parameters would do nothing).

Driver side::

    llm = LLM(model=path, worker_extension_cls="rlsync.adapters.vllm.RlsyncWorkerExtension", ...)
    [address] = llm.collective_rpc("rlsync_start", args=(tensors,))   # [(hf_name, dtype, shape), ...]
    # the trainer: WeightsWriter(layout, layout, 0, [address]).multi_put(state); .complete(v)
    llm.collective_rpc("rlsync_apply")      # between generate calls: load the landed version
    llm.reset_prefix_cache()                # cached prefixes hold activations of the old weights

The trainer's ``complete(v)`` returns only after ``rlsync_apply`` has loaded version ``v``: a
version is live when the engine serves it. A version whose bytes did not all land (the trainer
died) is never applied; the engine keeps serving the previous one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlsync.adapters.vllm._reload import reprocessing_skipped_steps
from rlsync.adapters.vllm._staging import StagedReceiver


class RlsyncWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; methods reached by ``collective_rpc``."""

    def rlsync_start(self, tensors: Sequence[Sequence[Any]], transport: str = "shm", host: str = "127.0.0.1",
                     apply_timeout: float = 600.0) -> str:
        """Start receiving the HF-named tensors ``[(name, dtype, shape), ...]``; returns the address for the writer."""
        self._rlsync = StagedReceiver(tensors, transport=transport, host=host, apply_timeout=apply_timeout)
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
