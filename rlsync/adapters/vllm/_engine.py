"""vLLM's native weight-transfer API with rlsync as its backend (``{"backend": "rlsync"}``).

Registered from the ``vllm.general_plugins`` entry point (``_plugin.register``); select it with
``LLM(..., weight_transfer_config={"backend": "rlsync"})`` or ``--weight-transfer-config
'{"backend": "rlsync"}'``. Per version the driver calls ``start_weight_update()``,
``update_weights({"update_info": {"version": v}})``, ``finish_weight_update(weight_version=...)``
while the trainer's ``WeightsWriter.complete(v)`` runs; ``complete`` returns once
``finish_weight_update`` has loaded the version (staged landing, vLLM's layerwise reload).

Worker ``r`` binds port ``PORT + r`` of the address in the init info (the trainer picks it), so the
trainer knows where to connect before the engine answers. With more than one worker the init info
carries ``boxes`` (each worker's part of every tensor, from ``probe_worker``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlsync.adapters.vllm._probe import _rank_info, probe_boxes
from rlsync.adapters.vllm._reload import reprocessing_skipped_steps
from rlsync.adapters.vllm._staging import Finish, StagedReceiver, tensor_metas
from rlsync.core._errors import ConfigError, VersionError


@dataclass
class RlsyncInitInfo(WeightTransferInitInfo):
    address: str  # tcp://HOST:PORT: worker r's reader binds PORT + r
    tensors: list[Any] = field(default_factory=list)  # [[hf_name, dtype, shape], ...]
    transport: str = "shm"
    # With more than one worker each receives only its part of every tensor: give ``boxes`` (per worker
    # {name: [offsets, sizes]}, e.g. from a worker extension's rlsync_probe), or ``boxes_file``: the
    # workers learn their parts from vLLM's loader and worker 0 writes them there as JSON for the trainer.
    boxes: list[Any] | None = None
    boxes_file: str | None = None


@dataclass
class RlsyncUpdateInfo(WeightTransferUpdateInfo):
    version: int
    timeout: float = 600.0


class RlsyncWeightTransferEngine(WeightTransferEngine[RlsyncInitInfo, RlsyncUpdateInfo]):
    init_info_cls = RlsyncInitInfo
    update_info_cls = RlsyncUpdateInfo
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: RlsyncInitInfo) -> None:
        from vllm.distributed.parallel_state import get_world_group

        world = get_world_group()
        boxes = init_info.boxes
        if boxes is None and init_info.boxes_file is not None:
            mine = probe_boxes(self.model, tensor_metas(init_info.tensors), _rank_info())
            boxes = _all_gather_json({n: [list(b.offsets), list(b.sizes)] for n, b in mine.items()}, world.cpu_group)
            if world.rank == 0:
                Path(init_info.boxes_file).write_text(json.dumps(boxes))
        if boxes is None and self.parallel_config.world_size > 1:
            raise ConfigError("with more than one vLLM worker add 'boxes_file': PATH to the init info (the workers "
                              "write their parts there) and build the trainer's destination with "
                              "engine_layout(tensors, json.load(open(PATH)))")
        host, port = init_info.address.removeprefix("tcp://").rsplit(":", 1)
        rank = world.rank
        self._receiver = StagedReceiver(init_info.tensors, boxes=boxes, rank=rank,
                                        transport=init_info.transport, host=host, port=int(port) + rank)
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


def _all_gather_json(obj: Any, group: Any) -> list[Any]:
    """Every worker's ``obj``, in rank order, over vLLM's CPU process group (as JSON bytes, no pickle)."""
    import torch
    import torch.distributed as dist

    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    size = torch.tensor([data.numel()])
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: data.numel()] = data
    chunks = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(chunks, padded, group=group)
    return [json.loads(bytes(c[: int(s.item())].numpy()).decode()) for c, s in zip(chunks, sizes)]
