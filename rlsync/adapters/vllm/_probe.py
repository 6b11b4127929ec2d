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
engine serves. Layers are probed one at a time (by the index in their names) to bound memory: the
probe tensors and the stand-ins are float64 on the host, whatever the engine's device, so the peak is
16 bytes per element of the largest layer (its probe ids and its stand-ins), in host memory only.
Results are cached on disk under a fingerprint of everything they depend on.

The same run checks the tensor list before a byte moves (``learn_parts``, on every worker and every
tensor-parallel size): a tensor the loader refuses, a parameter no tensor fills, or a tensor no worker
reads is a ``ConfigError`` naming it; a tensor no worker reads because it is another's alias in the
engine (the ``lm_head.weight`` of a tied model) is left out instead, so it is never sent. So is an output
embedding the engine's config ties to the input one (``tie_word_embeddings``) when the engine's model has no
module of that name at all (Gemma2's vLLM model computes logits with ``embed_tokens``): its loader would refuse it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from rlsync import Box, ConfigError, TensorMeta

log = logging.getLogger(__name__)

_LAYER_INDEX = re.compile(r"\.(\d+)\.")
# Parameters vLLM never fills from a checkpoint (``reload/meta.py`` ``SKIP_LOAD_TENSORS``, and biases it adds).
_NEVER_LOADED = {"_expert_map", "expert_mask", "expert_global_to_physical", "expert_physical_to_global",
                 "expert_local_to_global", "e_score_correction_bias"}


def _layer_of(name: str) -> int | None:
    match = _LAYER_INDEX.search(name)
    return int(match.group(1)) if match else None


def cache_dir() -> Path:
    return Path(os.environ.get("RLSYNC_CACHE_DIR", Path.home() / ".cache" / "rlsync")) / "vllm-probe"


def fingerprint(model: Any, metas: Sequence[TensorMeta], rank_info: Sequence[int]) -> str:
    """Changes with the vLLM version, the model class, its parameters' loader-side shapes and which of them
    are tied, this rank's place in the parallel layout and the checkpoint tensors offered."""
    import vllm
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    params = []
    for qualname, module in model.named_modules():
        restore, _ = get_layerwise_info(module).restore_metadata
        params += [(f"{qualname}.{n}", list(t.shape), str(t.dtype)) for n, t in sorted(restore.items())]
    blob = json.dumps(["probe-v3", vllm.__version__, type(model).__name__, list(rank_info), params, sorted(_aliases(model)),
                       [[m.name, m.dtype, list(m.shape)] for m in metas]])
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def check_declared_sizes(model: Any, tensors: Sequence[Sequence[Any]], world: int) -> None:
    """Refuse a tensor list that no engine of this model could read, before the probe allocates for it (16 bytes per
    declared element): a tensor larger than ``world`` times the engine's largest parameter, or a list larger than
    ``world`` times all of them (a checkpoint tensor lands in one parameter, or in parts across the workers)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    sizes = [math.prod(t.shape) for _, module in model.named_modules()
             for t in get_layerwise_info(module).restore_metadata[0].values()]
    largest, held = max(sizes, default=0), sum(sizes)
    total = 0
    for entry in tensors:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not isinstance(entry[2], (list, tuple)):
            raise ConfigError(f"tensor list entry {str(entry)[:80]!r}: expected [name, dtype, shape]")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[2]):
            raise ConfigError(f"tensor {str(entry[0])[:80]!r}: its shape must be whole numbers of at least 0")
        numel = math.prod(entry[2])
        if numel > world * largest:
            raise ConfigError(f"tensor {str(entry[0])[:80]!r} of {numel} elements is larger than any parameter of this "
                              f"engine could take ({world} worker(s) x {largest} elements): refused before the probe")
        total += numel
    if total > world * (held + largest):
        raise ConfigError(f"the tensor list declares {total} elements, more than this engine's {world} worker(s) hold "
                          f"({held} elements each): refused before the probe")


def probe_worker(worker: Any, tensors: Sequence[Sequence[Any]]) -> dict[str, list[list[int]]]:
    """``{checkpoint tensor name: [offsets, sizes]}`` of the part ``worker``'s loader reads (the body of the
    worker extension's ``rlsync_probe``)."""
    from vllm.config import set_current_vllm_config

    from rlsync.layouts import tensor_metas

    with set_current_vllm_config(worker.vllm_config):
        boxes, _ = probe_boxes(worker.model_runner.get_model(), tensor_metas(tensors), _rank_info())
    return {name: [list(b.offsets), list(b.sizes)] for name, b in boxes.items()}


def learn_parts(model: Any, tensors: Sequence[Sequence[Any]], group: Any) -> tuple[list[list[Any]], list[dict[str, Any]]]:
    """Every worker's part of every checkpoint tensor, checked: ``(tensors to send, per-rank boxes)``.

    Collective over ``group`` (vLLM's CPU world group): each worker probes its loader, the results are
    exchanged, and every worker reaches the same verdict. Raises ``ConfigError`` naming a tensor the loader
    refuses, a parameter no tensor fills, or a tensor no worker reads; leaves out tensors that are aliases of
    another in the engine (a tied ``lm_head.weight``)."""
    from rlsync.layouts import tensor_metas

    offered, tied = _untied(model, tensors)
    boxes, unfilled = probe_boxes(model, tensor_metas(offered), _rank_info())
    mine = {"boxes": {n: [list(b.offsets), list(b.sizes)] for n, b in boxes.items()}, "unfilled": unfilled}
    every = all_gather_json(mine, group)
    unfilled_anywhere = sorted({name for rank in every for name in rank["unfilled"]})
    if unfilled_anywhere:
        raise ConfigError(f"no checkpoint tensor fills the engine's parameter(s) {unfilled_anywhere[:5]}: the trainer must "
                          f"send them (under the checkpoint's names, as save_pretrained writes them)")
    read = {name for rank in every for name in rank["boxes"]}
    aliases = _aliases(model) | tied
    unread = [str(t[0]) for t in tensors if str(t[0]) not in read]
    wrong = [name for name in unread if name not in aliases]
    if wrong:
        raise ConfigError(f"vLLM's loader reads no part of {wrong[:5]} on any worker: leave them out of the tensor list, "
                          f"or check their names against the checkpoint's")
    if unread:
        log.info("not sending %s: the engine's loader skips them (tied to another tensor)", unread)
    return [list(t) for t in tensors if str(t[0]) in read], [rank["boxes"] for rank in every]


def learn_placements(model: Any, tensors: Sequence[Sequence[Any]]) -> Placements:
    """Where each checkpoint slice lands in this worker's parameters (from the cache ``learn_parts`` filled)."""
    from rlsync.layouts import tensor_metas

    return probe(model, tensor_metas(_untied(model, tensors)[0]), _rank_info())[2]


def _untied(model: Any, tensors: Sequence[Sequence[Any]]) -> tuple[list[Sequence[Any]], set[str]]:
    """``(tensors the loader is offered, output embeddings left out)``: a ``*lm_head.weight`` that the engine's
    config ties to an ``*embed_tokens.weight`` of the same shape in the list, where the engine's model holds no
    ``lm_head`` (Gemma2): a ``state_dict()`` has it, the loader refuses it, the engine uses the embedding."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text, "tie_word_embeddings", False) or any(n.endswith("lm_head") for n, _ in model.named_modules()):
        return list(tensors), set()
    embeddings = {(str(t[1]), tuple(t[2])) for t in tensors if str(t[0]).endswith("embed_tokens.weight")}
    tied = {str(t[0]) for t in tensors if str(t[0]).endswith("lm_head.weight") and (str(t[1]), tuple(t[2])) in embeddings}
    return [t for t in tensors if str(t[0]) not in tied], tied


def _aliases(model: Any) -> set[str]:
    """Names of engine parameters that are another parameter under a second name (tied embeddings)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name for group in names.values() if len(group) > 1 for name in group[1:]}


def all_gather_json(obj: Any, group: Any) -> list[Any]:
    """Every worker's ``obj``, in rank order, over a CPU process group (as JSON bytes, no pickle)."""
    import torch
    import torch.distributed as dist

    if dist.get_world_size(group) == 1:
        return [json.loads(json.dumps(obj))]
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


def _rank_info() -> tuple[int, ...]:
    """This worker's place in the parallel layout (part of the probe cache's fingerprint)."""
    from vllm.distributed import parallel_state

    return (parallel_state.get_world_group().rank, parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pp_group().rank_in_group)


#: where a checkpoint tensor's slice lands in an engine parameter: ``[tensor, src_offsets, src_sizes, dst_offsets,
#: dst_sizes]``: the tensor's box is the parameter's box, element for element in row-major order (the sizes agree
#: but for dims of size 1: a stacked expert's index in the parameter, say)
Segment = list[Any]
#: per engine parameter (qualified name): ``{"from": [checkpoint tensors that reach it], "segments": [...] or
#: None}``; None when the loader computes with the values (it does not only place them) or places them in no
#: box-to-box way: such a parameter is loaded by vLLM's loader
Placements = dict[str, dict[str, Any]]


def probe_boxes(model: Any, metas: Sequence[TensorMeta], rank_info: Sequence[int] = ()) -> tuple[dict[str, Box], list[str]]:
    """``({tensor name: box of it this rank loads}, [parameters of this rank no tensor fills])``, from the cache
    when this exact setup was probed before."""
    boxes, unfilled, _ = probe(model, metas, rank_info)
    return boxes, unfilled


def probe(model: Any, metas: Sequence[TensorMeta], rank_info: Sequence[int] = ()) -> tuple[dict[str, Box], list[str], Placements]:
    """``probe_boxes`` and, per engine parameter, where each checkpoint slice lands in it (``Placements``)."""
    path = cache_dir() / f"{fingerprint(model, metas, rank_info)}.json"
    if path.exists():
        cached = json.loads(path.read_text())
        return ({name: Box(tuple(o), tuple(s)) for name, (o, s) in cached["boxes"].items()}, cached["unfilled"],
                cached["placements"])
    boxes, unfilled, placements = _probe(model, metas)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"boxes": {n: [list(b.offsets), list(b.sizes)] for n, b in boxes.items()}, "unfilled": unfilled,
                               "placements": placements}))
    tmp.replace(path)  # atomic: ranks sharing a cache directory never read half a file
    return boxes, unfilled, placements


def _probe(model: Any, metas: Sequence[TensorMeta]) -> tuple[dict[str, Box], list[str], Placements]:
    import torch

    groups: dict[int | None, list[TensorMeta]] = {}
    for meta in metas:
        groups.setdefault(_layer_of(meta.name), []).append(meta)
    modules: dict[int | None, list[tuple[str, Any]]] = {}
    for qualname, module in model.named_modules():
        modules.setdefault(_layer_of(qualname + "."), []).append((qualname, module))
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    params: dict[str, bool] = {}  # loadable parameter of this rank (loader-side shape) -> filled by some tensor
    for qualname, module in model.named_modules():
        recorded, _ = get_layerwise_info(module).restore_metadata
        for name, param in {**dict(module.named_parameters(recurse=False)), **recorded}.items():
            if param.dtype.is_floating_point and math.prod(param.shape) and name not in _NEVER_LOADED:
                params[f"{qualname}.{name}".lstrip(".")] = False

    lows: dict[str, np.ndarray] = {}
    highs: dict[str, np.ndarray] = {}
    placements: Placements = {}
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
                _collect([t for _, t in scratch], group, starts, lows, highs, key)
                for names, tensor in scratch:
                    if bool((tensor.detach() > 0).any()):
                        params.update({n: True for n in names if n in params})
                        placements.update({n: _placement(tensor, group, starts) for n in names})
        if refused is not None:
            name = _first_refused(model, group, modules.get(key, []))
            raise ConfigError(f"vLLM's loader refused checkpoint tensor {name!r} ({type(refused).__name__}: {refused}); "
                              f"offer tensors under the checkpoint's own names (as save_pretrained writes them), "
                              f"or leave this one out") from refused
    boxes = {m.name: Box(tuple(int(x) for x in lows[m.name]), tuple(int(x) for x in highs[m.name] - lows[m.name] + 1))
             for m in metas if m.name in lows}
    return boxes, sorted(name for name, filled in params.items() if not filled), placements


def _placement(stand_in: Any, group: Sequence[TensorMeta], starts: np.ndarray) -> dict[str, Any]:
    """Which checkpoint tensors reached one parameter's stand-in and, if they landed box to box, where."""
    values = stand_in.detach().reshape(-1).numpy()
    where = np.flatnonzero(values > 0)
    ids = values[where]
    if not np.array_equal(ids, np.floor(ids)) or ids.max() > starts[-1]:  # computed with: any tensor of the layer
        return {"from": [m.name for m in group], "segments": None}
    ids = ids.astype(np.int64) - 1
    which = np.searchsorted(starts, ids, side="right") - 1
    return {"from": [group[int(i)].name for i in np.unique(which)], "segments": _segments(stand_in, where, ids, which, group, starts)}


def _segments(stand_in: Any, where: np.ndarray, ids: np.ndarray, which: np.ndarray, group: Sequence[TensorMeta],
              starts: np.ndarray) -> list[Segment] | None:
    """Where each checkpoint tensor's elements landed in one parameter's stand-in, as box-to-box copies; None when
    some did not land box to box."""
    shape = tuple(stand_in.shape)
    segments: list[Segment] = []
    for i in np.unique(which):
        meta = group[int(i)]
        mine = which == i
        dst = np.stack(np.unravel_index(where[mine], shape))  # already in row-major order of the parameter
        src = np.stack(np.unravel_index(ids[mine] - int(starts[i]), meta.shape))
        dst_lo, src_lo = dst.min(axis=1), src.min(axis=1)
        dst_sizes, src_sizes = dst.max(axis=1) - dst_lo + 1, src.max(axis=1) - src_lo + 1
        count = int(mine.sum())
        squeezed = [int(n) for n in dst_sizes if n != 1], [int(n) for n in src_sizes if n != 1]
        if count != int(np.prod(dst_sizes)) or count != int(np.prod(src_sizes)) or squeezed[0] != squeezed[1]:
            return None  # not one box onto one box
        # the same element order on both sides: the copy is a reshape
        src_rank = np.ravel_multi_index(tuple(src - src_lo[:, None]), tuple(int(n) for n in src_sizes))
        if not np.array_equal(src_rank, np.arange(count)):
            return None
        segments.append([meta.name, [int(x) for x in src_lo], [int(x) for x in src_sizes],
                         [int(x) for x in dst_lo], [int(x) for x in dst_sizes]])
    return segments


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
def _stand_ins(named: Sequence[tuple[str, Any]]) -> Iterator[list[tuple[list[str], Any]]]:
    """Swap every tensor of ``modules`` for a zeroed float64 stand-in on the host with the loader-side shape, class
    and attributes (its ``weight_loader`` among them); put the live tensors back afterwards."""
    import torch
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

    saved = [(m, dict(m._parameters), dict(m._buffers)) for _, m in named]
    qualnames = {id(m): q for q, m in named}
    made: dict[object, Any] = {}  # tied tensors get one shared stand-in
    scratch: list[tuple[list[str], Any]] = []  # (the parameter names it stands in for, stand-in)

    def stand_in(key: object, source: Any, module: Any, device: Any, name: str) -> Any:
        qualified = f"{qualnames[id(module)]}.{name}".lstrip(".")
        if key in made:
            for names, tensor in scratch:
                if tensor is made[key]:
                    names.append(qualified)
        else:
            dtype = torch.float64 if source.dtype.is_floating_point else source.dtype
            # on the host whatever the engine's device: the ids are read back with numpy, and a GPU engine's memory
            # is taken by its weights and KV cache (one layer's stand-ins at a time: 8 bytes per element)
            tensor = torch.zeros(tuple(source.shape), dtype=dtype, device="cpu")
            tensor.__class__ = source.__class__  # vLLM parameter classes carry the loading logic
            tensor.__dict__ = dict(source.__dict__)
            made[key] = restore_layer_refs(tensor, module)
            if dtype == torch.float64:
                scratch.append(([qualified], made[key]))
        return made[key]

    def swap(module: Any, slots: dict[str, Any], live: dict[str, Any], recorded: dict[str, Any], device: Any) -> None:
        for name in live.keys() | recorded.keys():
            tensor = live.get(name)
            source = recorded.get(name, tensor)  # the loader-side shape when vLLM recorded one
            if source is not None:
                key = id(tensor) if tensor is not None else (id(module), name)
                slots[name] = stand_in(key, source, module, device, name)

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
