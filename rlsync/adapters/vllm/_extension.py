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

import queue
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlsync.core._builders import from_state_dict
from rlsync.core._errors import TransferTimeoutError
from rlsync.core._layout import TensorMeta
from rlsync.core._weights import WeightsReader


class RlsyncWorkerExtension:
    """Mixed into vLLM's worker class by ``worker_extension_cls``; methods reached by ``collective_rpc``."""

    def rlsync_start(self, tensors: Sequence[Sequence[Any]], transport: str = "shm", host: str = "127.0.0.1",
                     apply_timeout: float = 600.0) -> str:
        """Start receiving the HF-named tensors ``[(name, dtype, shape), ...]``; returns the address for the writer."""
        metas = [TensorMeta(str(n), str(d).removeprefix("torch."), tuple(int(x) for x in s)) for n, d, s in tensors]
        layout = from_state_dict(metas)
        self._rlsync_shapes = {m.name: m for m in metas}
        self._rlsync_pending: queue.Queue[tuple[int, dict[str, np.ndarray], threading.Event, dict[str, Any]]] = queue.Queue(1)
        self._rlsync_timeout = apply_timeout
        self._rlsync_version = -1
        self._rlsync_reader = WeightsReader(layout, layout, 0, transport=transport, landing="staged", host=host,
                                            on_version=self._rlsync_stage)
        return self._rlsync_reader.address

    def _rlsync_stage(self, version: int, buffers: dict[str, np.ndarray]) -> None:
        """Reader thread: every byte of ``version`` landed; wait until the engine thread applied it."""
        done, result = threading.Event(), {}
        self._rlsync_pending.put((version, buffers, done, result))
        if not done.wait(self._rlsync_timeout):
            raise TransferTimeoutError(f"vLLM did not apply version {version} within {self._rlsync_timeout} s; call rlsync_apply")
        if "error" in result:
            raise result["error"]

    def rlsync_apply(self, timeout: float = 600.0) -> int:
        """Engine thread: load the next landed version with vLLM's loader; returns its number."""
        import torch

        try:
            version, buffers, done, result = self._rlsync_pending.get(timeout=timeout)
        except queue.Empty:
            raise TransferTimeoutError(f"no weight version arrived within {timeout} s") from None
        try:
            views = (
                (name, torch.from_numpy(buf).view(getattr(torch, meta.dtype)).view(meta.shape))
                for name, meta in self._rlsync_shapes.items()
                for buf in (buffers[name],)
            )
            self.reload_weights(weights_iterator=views)  # type: ignore[attr-defined]
            self._rlsync_version = version
        except Exception as exc:  # noqa: BLE001 - handed to the writer, which raises it
            result["error"] = exc
            raise
        finally:
            done.set()
        return version

    def rlsync_version(self) -> int:
        """The weight version this worker serves (-1 before the first update)."""
        return self._rlsync_version

    def rlsync_stop(self) -> None:
        self._rlsync_reader.close()
