"""Tensor, pipeline and expert parallel layouts: Megatron on the trainer side, vLLM / SGLang on
the engine side, built from a ``ModelSpec`` (each tensor's role says how it splits).

Engines fuse parameters: q/k/v into ``qkv_proj`` (k/v heads replicated when there are fewer
k/v heads than TP ranks), gate/up into ``gate_up_proj``, stacked expert gate/up into
``w13_weight [E, 2I/tp, H]`` and down into ``w2_weight [E, H, I/tp]``, MLA's q_a/kv_a into
``fused_qkv_a_proj``. Megatron fuses q/k/v per query group (``linear_qkv``: for each local group
its q heads, then its k head, then its v head) and gate/up into ``linear_fc1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rlsync.core.layouts._builders import chunk_bounds, data_parallel, even_bounds, slice_box
from rlsync.core._errors import LayoutError, whole_number
from rlsync.core.layouts._layout import Box, Layout, Shard, contiguous_strides, make_layout
from rlsync.core.layouts._presets import ModelSpec, Param

#: Parameters packed into one local buffer: (buffer name, dim they are stacked along, [(param, box)])
Packed = tuple[str, int, list[tuple[Param, Box]]]


def tp_box(param: Param, spec: ModelSpec, tp_rank: int, tp: int) -> Box:
    """The box of ``param`` that tensor-parallel rank ``tp_rank`` of ``tp`` holds (engine and Megatron alike)."""
    shape = param.meta.shape
    role, name = param.role, param.meta.name
    if tp == 1 or role in ("replicated", "mla_q_a", "mla_kv_a"):
        return Box.full(shape)
    if role == "vocab":
        lo, hi = chunk_bounds(shape[0], tp)[tp_rank]
        return slice_box(shape, 0, lo, hi)
    if role in ("column", "q", "gate", "up"):
        lo, hi = even_bounds(shape[0], tp, name)[tp_rank]
        return slice_box(shape, 0, lo, hi)
    if role in ("row", "down"):
        lo, hi = even_bounds(shape[1], tp, name)[tp_rank]
        return slice_box(shape, 1, lo, hi)
    if role in ("k", "v"):
        kv, hd = spec.num_kv_heads, shape[0] // spec.num_kv_heads
        if kv >= tp:
            lo, hi = even_bounds(shape[0], tp, name)[tp_rank]
            return slice_box(shape, 0, lo, hi)
        if tp % kv:
            raise LayoutError(f"{name}: {kv} k/v heads cannot be replicated evenly over tp={tp}")
        head = tp_rank * kv // tp  # fewer k/v heads than ranks: each head is replicated tp/kv times
        return slice_box(shape, 0, head * hd, (head + 1) * hd)
    if role in ("expert_gate", "expert_up"):
        lo, hi = even_bounds(shape[1], tp, name)[tp_rank]
        return slice_box(shape, 1, lo, hi)
    if role == "expert_down":
        lo, hi = even_bounds(shape[2], tp, name)[tp_rank]
        return slice_box(shape, 2, lo, hi)
    raise LayoutError(f"{name}: unknown role {role!r}")


def _emit(packs: Sequence[Packed], rank: int, shards: list[Shard]) -> None:
    """Stack each pack's boxes along its dim into one contiguous buffer and record the shards."""
    for buffer, dim, parts in packs:
        first = parts[0][1].sizes
        shape = list(first)
        shape[dim] = sum(box.sizes[dim] for _, box in parts)
        strides = contiguous_strides(shape)
        at = 0
        for param, box in parts:
            shards.append(Shard(param.meta.name, box, rank, buffer, at * strides[dim], strides))
            at += box.sizes[dim]


def _pack(items: Sequence[tuple[Param, Box]], buffer_of: Callable[[Param], str | None]) -> list[Packed]:
    packs: dict[str, Packed] = {}
    out: list[Packed] = []
    for param, box in items:
        name = buffer_of(param) or param.meta.name
        dim = 1 if param.role in ("expert_gate", "expert_up") else 0
        if name not in packs:
            packs[name] = (name, dim, [])
            out.append(packs[name])
        packs[name][2].append((param, box))
    return out


def _engine_splits(spec: ModelSpec, tp: int) -> bool:
    """Whether vLLM and SGLang take ``tp`` for this model: its attention heads split evenly (vLLM's
    ``verify_with_parallel_config``: "Total number of attention heads must be divisible by tensor parallel size"), and
    its k/v heads split evenly or replicate evenly (``QKVParallelLinear``)."""
    kv = spec.num_kv_heads or spec.num_heads
    return spec.num_heads % tp == 0 and (kv % tp == 0 if kv >= tp else tp % kv == 0)


def engine_tp(spec: ModelSpec, tp: int, replicas: int = 1) -> Layout:
    """vLLM / SGLang: ``replicas`` engines of ``tp`` ranks each, with fused per-rank parameters. A ``tp`` the engines
    refuse for this model is refused here, with their reason and the sizes they take."""
    tp, replicas = whole_number("tp", tp, 1), whole_number("replicas", replicas, 1)
    if not _engine_splits(spec, tp):
        valid = [n for n in range(1, max(spec.num_heads, 1) + 1) if spec.num_heads % n == 0 and _engine_splits(spec, n)]
        raise LayoutError(f"tp={tp}: vLLM and SGLang refuse it for this model, whose {spec.num_heads} attention heads "
                          f"({spec.num_kv_heads} k/v heads) do not split evenly over {tp} ranks (vLLM: \"Total number of "
                          f"attention heads must be divisible by tensor parallel size\"); they take tp in {valid}")
    shards: list[Shard] = []
    for r in range(tp):
        items = [(p, tp_box(p, spec, r, tp)) for p in spec.params]
        _emit(_pack(items, lambda p: p.fused), r, shards)
    return data_parallel(make_layout(spec.tensors, shards), replicas)


def _megatron_buffer(param: Param) -> str | None:
    if param.fused is None or param.role in ("mla_q_a", "mla_kv_a"):
        return None  # Megatron keeps MLA's down projections apart
    return (
        param.fused.replace("self_attn.qkv_proj", "self_attention.linear_qkv")
        .replace("mlp.gate_up_proj", "mlp.linear_fc1")
        .replace("shared_experts.gate_up_proj", "shared_experts.linear_fc1")
        .replace("experts.w13_weight", "experts.linear_fc1.weight")
        .replace("experts.w2_weight", "experts.linear_fc2.weight")
    )


def _megatron_qkv(spec: ModelSpec, params: Sequence[Param], tp_rank: int, tp: int, rank: int, shards: list[Shard]) -> None:
    """Megatron's ``linear_qkv``: per local query group, its q heads, its k head, its v head."""
    kv = spec.num_kv_heads
    if kv % tp:
        raise LayoutError(f"Megatron needs num_key_value_heads ({kv}) divisible by tp ({tp})")
    q, k, v = params
    per_group = spec.num_heads // kv
    hd = q.meta.shape[0] // spec.num_heads
    groups = kv // tp
    rows = groups * (per_group + 2) * hd
    tail = q.meta.shape[1:]
    strides = contiguous_strides((rows, *tail))
    buffer = _megatron_buffer(q) or q.meta.name
    for j in range(groups):
        g = tp_rank * groups + j
        base = j * (per_group + 2) * hd
        for param, lo, n, at in (
            (q, g * per_group * hd, per_group * hd, base),
            (k, g * hd, hd, base + per_group * hd),
            (v, g * hd, hd, base + (per_group + 1) * hd),
        ):
            box = slice_box(param.meta.shape, 0, lo, lo + n)
            shards.append(Shard(param.meta.name, box, rank, buffer, at * strides[0], strides))


def _stage_of(param: Param, spec: ModelSpec, pp: int) -> int:
    if param.layer is None:
        return 0 if param.meta.name.endswith("embed_tokens.weight") else pp - 1
    return param.layer * pp // spec.num_layers


def megatron(spec: ModelSpec, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, etp: int | None = None) -> Layout:
    """Megatron-Core: ranks ordered tp fastest, then dp, then pp (``rank = (pp_i*dp + dp_i)*tp + tp_i``).

    Layers split into ``pp`` contiguous stages (embedding on the first, final norm and lm_head on
    the last). Dense tensors are TP-split and replicated over dp. Experts are split over ``ep``
    expert-parallel ranks carved out of the stage's tp*dp ranks, and over ``etp`` (default ``tp``)
    expert-tensor-parallel ranks; what is left over (tp*dp / (ep*etp)) are expert replicas.
    """
    tp, pp, dp, ep = (whole_number(name, value, 1) for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep)))
    etp = tp if etp is None else whole_number("etp", etp, 1)
    if spec.num_layers < pp:
        raise LayoutError(f"pp={pp} exceeds the model's {spec.num_layers} layers")
    if spec.num_experts and (tp * dp) % (ep * etp):
        raise LayoutError(f"ep*etp ({ep}*{etp}) must divide tp*dp ({tp}*{dp}) for the expert layout")
    if spec.num_experts % max(ep, 1):
        raise LayoutError(f"{spec.num_experts} experts do not split over ep={ep}")
    by_stage: list[list[Param]] = [[] for _ in range(pp)]
    for p in spec.params:
        by_stage[_stage_of(p, spec, pp)].append(p)
    shards: list[Shard] = []
    for pp_i in range(pp):
        params = by_stage[pp_i]
        qkv_groups: dict[str, list[Param]] = {}
        dense = []
        experts = []
        for p in params:
            if p.role in ("q", "k", "v"):
                qkv_groups.setdefault(p.fused or p.meta.name, []).append(p)
            elif p.role.startswith("expert_"):
                experts.append(p)
            else:
                dense.append(p)
        for dp_i in range(dp):
            for tp_i in range(tp):
                rank = (pp_i * dp + dp_i) * tp + tp_i
                for group in qkv_groups.values():
                    _megatron_qkv(spec, group, tp_i, tp, rank, shards)
                _emit(_pack([(p, tp_box(p, spec, tp_i, tp)) for p in dense], _megatron_buffer), rank, shards)
                if experts:
                    flat = dp_i * tp + tp_i
                    etp_i, ep_i = flat % etp, (flat // etp) % ep
                    items = []
                    for p in experts:
                        box = tp_box(p, spec, etp_i, etp)
                        lo, hi = even_bounds(p.meta.shape[0], ep, p.meta.name)[ep_i]
                        items.append((p, Box((lo, *box.offsets[1:]), (hi - lo, *box.sizes[1:]))))
                    _emit(_pack(items, _megatron_buffer), rank, shards)
    return make_layout(spec.tensors, shards)


