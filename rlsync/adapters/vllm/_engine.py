"""vLLM's native weight-transfer API with rlsync as its backend (``{"backend": "rlsync"}``).

Registered from the ``vllm.general_plugins`` entry point (``_plugin.register``); select it with
``LLM(..., weight_transfer_config={"backend": "rlsync"})`` or ``--weight-transfer-config
'{"backend": "rlsync"}'``. Per version the driver calls ``start_weight_update()``,
``update_weights({"update_info": {"version": v}})``, ``finish_weight_update(weight_version=...)``
while the trainer's ``WeightsWriter.complete(v)`` runs; ``complete`` returns once
``finish_weight_update`` has loaded the version (staged landing, vLLM's layerwise reload).

The reader binds the address in the init info (the trainer picks it), so the trainer knows
where to connect before the engine answers. One worker (tensor parallel size 1) for now.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from rlsync.core._builders import from_state_dict
from rlsync.core._errors import TransferTimeoutError, VersionError
from rlsync.core._layout import TensorMeta
from rlsync.core._weights import WeightsReader


@dataclass
class RlsyncInitInfo(WeightTransferInitInfo):
    address: str  # tcp://HOST:PORT for this engine's reader to bind
    tensors: list[Any] = field(default_factory=list)  # [[hf_name, dtype, shape], ...]
    transport: str = "shm"


@dataclass
class RlsyncUpdateInfo(WeightTransferUpdateInfo):
    version: int
    timeout: float = 600.0


class RlsyncWeightTransferEngine(WeightTransferEngine[RlsyncInitInfo, RlsyncUpdateInfo]):
    init_info_cls = RlsyncInitInfo
    update_info_cls = RlsyncUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: RlsyncInitInfo) -> None:
        host, port = init_info.address.removeprefix("tcp://").rsplit(":", 1)
        metas = [TensorMeta(str(n), str(d).removeprefix("torch."), tuple(int(x) for x in s)) for n, d, s in init_info.tensors]
        self._metas = metas
        layout = from_state_dict(metas)
        self._pending: queue.Queue[tuple[int, dict[str, np.ndarray], threading.Event, dict[str, Any]]] = queue.Queue(1)
        self._current: tuple[int, threading.Event, dict[str, Any]] | None = None
        self._reader = WeightsReader(layout, layout, 0, transport=init_info.transport, landing="staged", host=host,
                                     port=int(port), on_version=self._stage)

    def _stage(self, version: int, buffers: dict[str, np.ndarray]) -> None:
        """Reader thread: every byte of ``version`` landed; wait until the engine loaded it."""
        done, result = threading.Event(), {}  # type: ignore[var-annotated]
        self._pending.put((version, buffers, done, result))
        if not done.wait(600):
            raise TransferTimeoutError(f"vLLM did not load version {version}: call start/update/finish_weight_update")
        if "error" in result:
            raise result["error"]

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: RlsyncUpdateInfo) -> None:
        import torch

        try:
            version, buffers, done, result = self._pending.get(timeout=update_info.timeout)
        except queue.Empty:
            raise TransferTimeoutError(f"version {update_info.version} did not arrive within {update_info.timeout} s") from None
        self._current = (version, done, result)
        if version != update_info.version:
            result["error"] = VersionError(f"the engine expected version {update_info.version}, the trainer sent {version}")
            done.set()
            raise result["error"]
        self.model.load_weights(
            (m.name, torch.from_numpy(buffers[m.name]).view(getattr(torch, m.dtype)).view(m.shape)) for m in self._metas
        )

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        current, self._current = self._current, None
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except Exception as exc:
            if current is not None:
                current[2]["error"] = exc
            raise
        finally:
            if current is not None:
                current[1].set()

    def shutdown(self) -> None:
        self._reader.close()
