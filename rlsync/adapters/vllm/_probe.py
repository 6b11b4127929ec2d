"""Learn from vLLM's own loader which part of each checkpoint tensor an engine rank loads.

No per-architecture map: the worker runs the model's ``load_weights`` once on probe tensors whose
elements carry their own id (a float64 counting from 1), into zeroed float64 stand-ins for its
parameters; an id found in a parameter afterwards is an element that lands on this rank. Fusion
(q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, per-expert tensors into ``w13_weight``),
tensor-parallel slicing, GQA head replication and tied embeddings all come out of the loader
itself. The result per tensor is the bounding box of the elements that landed (a superset when
they are not rectangular, so always correct); tensors that land nowhere on this rank are left out.

The stand-ins have the shapes the loader expects (vLLM records them for its layerwise reload,
before CPU repacking empties the live linears: ``reload/layerwise.py`` ``LAYERWISE_INFO``); the
live parameters are swapped back untouched afterwards, so a probe never disturbs the weights the
engine serves. Layers are probed one at a time (by the index in their names) to bound memory.
Results are cached on disk under a fingerprint of everything they depend on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from rlsync.core._errors import ConfigError
from rlsync.core._layout import Box, TensorMeta

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else None


def cache_dir() -> Path:
    return Path(os.environ.get("RLSYNC_CACHE_DIR", Path.home() / ".cache" / "rlsync")) / "vllm-probe"


def fingerprint(model: Any, metas: Sequence[TensorMeta], rank_info: Sequence[int]) -> str:
    """Changes with the vLLM version, the model class, its parameters' loader-side shapes, this rank's
    place in the parallel layout and the checkpoint tensors offered."""
    import vllm
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    params = []
    for qualname, module in model.named_modules():
        restore, _ = get_layerwise_info(module).restore_metadata
        params += [(f"{qualname}.{n}", list(t.shape), str(t.dtype)) for n, t in sorted(restore.items())]
    blob = json.dumps([vllm.__version__, type(model).__name__, list(rank_info), params,
                       [[m.name, m.dtype, list(m.shape)] for m in metas]])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def probe_worker(worker: Any, tensors: Sequence[Sequence[Any]]) -> dict[str, list[list[int]]]:
    """``{checkpoint tensor name: [offsets, sizes]}`` of the part ``worker``'s loader reads (the body of the
    worker extension's ``rlsync_probe``)."""
    from vllm.config import set_current_vllm_config

    from rlsync.adapters.vllm._staging import tensor_metas

    with set_current_vllm_config(worker.vllm_config):
        boxes = probe_boxes(worker.model_runner.get_model(), tensor_metas(tensors), _rank_info())
    return {name: [list(b.offsets), list(b.sizes)] for name, b in boxes.items()}


def _rank_info() -> tuple[int, ...]:
    """This worker's place in the parallel layout (part of the probe cache's fingerprint)."""
    from vllm.distributed import parallel_state

    return (parallel_state.get_world_group().rank, parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pp_group().rank_in_group)


def probe_boxes(model: Any, metas: Sequence[TensorMeta], rank_info: Sequence[int] = ()) -> dict[str, Box]:
    """``{tensor name: box of it this rank loads}``, from the cache when this exact setup was probed before."""
    path = cache_dir() / f"{fingerprint(model, metas, rank_info)}.json"
    if path.exists():
        return {name: Box(tuple(o), tuple(s)) for name, (o, s) in json.loads(path.read_text()).items()}
    boxes = _probe(model, metas)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({n: [list(b.offsets), list(b.sizes)] for n, b in boxes.items()}))
    tmp.replace(path)  # atomic: ranks sharing a cache directory never read half a file
    return boxes


def _probe(model: Any, metas: Sequence[TensorMeta]) -> dict[str, Box]:
    import torch

    groups: dict[int | None, list[TensorMeta]] = {}
    for meta in metas:
        groups.setdefault(_layer_of(meta.name), []).append(meta)
    modules: dict[int | None, list[Any]] = {}
    for qualname, module in model.named_modules():
        modules.setdefault(_layer_of(qualname + "."), []).append(module)

    lows: dict[str, np.ndarray] = {}
    highs: dict[str, np.ndarray] = {}
    for key, group in groups.items():
        starts = np.cumsum([0] + [m.numel for m in group])  # element ids: starts[i] + flat index + 1
        probes = [(m.name, torch.arange(1, m.numel + 1, dtype=torch.float64).add_(int(starts[i])).view(m.shape))
                  for i, m in enumerate(group)]
        with _stand_ins(modules.get(key, [])) as scratch, torch.no_grad():
            try:
                model.load_weights(iter(probes))
                refused = None
            except Exception as exc:  # noqa: BLE001 - re-raised below, naming the tensor
                refused = exc
            if refused is None:
                _collect(scratch, group, starts, lows, highs, key)
        if refused is not None:
            name = _first_refused(model, group, modules.get(key, []))
            raise ConfigError(f"vLLM's loader refused checkpoint tensor {name!r} ({type(refused).__name__}: {refused}); "
                              f"offer tensors under the checkpoint's own names (as save_pretrained writes them), "
                              f"or leave this one out") from refused
    return {m.name: Box(tuple(int(x) for x in lows[m.name]), tuple(int(x) for x in highs[m.name] - lows[m.name] + 1))
            for m in metas if m.name in lows}


def _first_refused(model: Any, group: Sequence[TensorMeta], modules: Sequence[Any]) -> str:
    import torch

    for meta in group:
        with _stand_ins(modules), torch.no_grad():
            try:
                model.load_weights(iter([(meta.name, torch.ones(meta.shape, dtype=torch.float64))]))
            except Exception:  # noqa: BLE001 - looking for the one the loader refuses
                return meta.name
    return ", ".join(m.name for m in group)  # only refused together


def _collect(scratch: Sequence[Any], group: Sequence[TensorMeta], starts: np.ndarray, lows: dict[str, np.ndarray],
             highs: dict[str, np.ndarray], key: int | None) -> None:
    """Fold the ids found in the stand-ins into each tensor's bounding box of landed elements."""
    for tensor in scratch:
        values = tensor.detach().reshape(-1).numpy()
        ids = values[values > 0]
        if ids.size == 0:
            continue
        if not np.array_equal(ids, np.floor(ids)) or ids.max() > starts[-1]:
            # The loader computed with the values instead of placing them: the whole group
            # must reach this rank whole, and the loader does the rest.
            log.warning("vLLM's loader transforms layer %s's weights; this rank receives them whole", key)
            for m in group:
                lows[m.name], highs[m.name] = np.zeros(len(m.shape), np.int64), np.array(m.shape) - 1
            break
        ids = ids.astype(np.int64) - 1
        which = np.searchsorted(starts, ids, side="right") - 1
        for i in np.unique(which):
            meta = group[i]
            index = np.stack(np.unravel_index(ids[which == i] - starts[i], meta.shape))
            lo, hi = index.min(axis=1), index.max(axis=1)
            if meta.name in lows:
                lo, hi = np.minimum(lo, lows[meta.name]), np.maximum(hi, highs[meta.name])
            lows[meta.name], highs[meta.name] = lo, hi


@contextmanager
def _stand_ins(modules: Sequence[Any]) -> Iterator[list[Any]]:
    """Swap every tensor of ``modules`` for a zeroed float64 stand-in with the loader-side shape, class
    and attributes (its ``weight_loader`` among them); put the live tensors back afterwards."""
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    saved = [(m, dict(m._parameters), dict(m._buffers)) for m in modules]
    made: dict[object, Any] = {}  # tied tensors get one shared stand-in
    scratch: list[Any] = []

    def stand_in(key: object, source: Any, module: Any, device: Any) -> Any:
        if key not in made:
            dtype = torch.float64 if source.dtype.is_floating_point else source.dtype
            tensor = torch.zeros(tuple(source.shape), dtype=dtype, device=device if source.is_meta else source.device)
            tensor.__class__ = source.__class__  # vLLM parameter classes carry the loading logic
            tensor.__dict__ = dict(source.__dict__)
            made[key] = restore_layer_refs(tensor, module)
            if dtype == torch.float64:
                scratch.append(made[key])
        return made[key]

    def swap(module: Any, slots: dict[str, Any], live: dict[str, Any], recorded: dict[str, Any], device: Any) -> None:
        for name in live.keys() | recorded.keys():
            tensor = live.get(name)
            source = recorded.get(name, tensor)  # the loader-side shape when vLLM recorded one
            if source is not None:
                key = id(tensor) if tensor is not None else (id(module), name)
                slots[name] = stand_in(key, source, module, device)

    try:
        for module, params, buffers in saved:
            info = get_layerwise_info(module)
            restore_params, restore_buffers = info.restore_metadata
            swap(module, module._parameters, params, restore_params, info.restore_device)
            swap(module, module._buffers, buffers, restore_buffers, info.restore_device)
        yield scratch
    finally:
        for module, params, buffers in saved:
            module._parameters.clear()
            module._parameters.update(params)
            module._buffers.clear()
            module._buffers.update(buffers)
