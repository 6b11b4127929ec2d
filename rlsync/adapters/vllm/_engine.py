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

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlsync.adapters.vllm._reload import reprocessing_skipped_steps
from rlsync.adapters.vllm._staging import Finish, StagedReceiver
from rlsync.core._errors import VersionError


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
        self._receiver = StagedReceiver(init_info.tensors, transport=init_info.transport, host=host, port=int(port))
        self._finish: Finish | None = None

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._fixes = reprocessing_skipped_steps(self.model)
        self._fixes.enter()  # left in finish_weight_update: layers are processed as their weights arrive
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: RlsyncUpdateInfo) -> None:
        version, views, finish = self._receiver.next(update_info.timeout)
        if version != update_info.version:
            error = VersionError(f"the engine expected version {update_info.version}, the trainer sent {version}")
            finish(error)
            raise error
        self._finish = finish
        self.model.load_weights(views)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finish, self._finish = self._finish, None
        try:
            finalize_layerwise_reload(self.model, self.model_config)
        except Exception as exc:
            self._fixes.exit(ok=False)
            if finish is not None:
                finish(exc)
            raise
        self._fixes.exit(ok=True)
        if finish is not None:
            finish(None)

    def shutdown(self) -> None:
        self._receiver.close()
