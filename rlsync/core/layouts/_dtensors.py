"""A trainer's layout read off its DTensors (FSDP2, HSDP, DTensor-sharded modules): each rank's own local shard, so a
sync sends what a rank holds and gathers nothing.

``from_dtensors(named)`` (or ``from_placements`` of each tensor's shape, mesh and placements) describes every rank's part of each tensor from the DTensor's global shape, device mesh and
placements alone (the same on every rank, no collective): ``Shard(d)`` splits dimension ``d`` as ``torch.chunk``
does (FSDP2's uneven last shards, and ranks that hold nothing of a small tensor), several ``Shard`` placements nest
in mesh-dimension order, and ``Replicate`` copies (HSDP's replica groups) are sent by the first of them only. A
plain tensor is the first rank's. The writer rank of a process is its place in the mesh (``writer_rank``). A
placement that has no whole rows to send (``Partial``, FSDP2+TP's strided shards) is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rlsync.core._errors import LayoutError
from rlsync.core.layouts._builders import chunk_bounds, own_buffer_shard
from rlsync.core.layouts._layout import Box, Layout, TensorMeta, dtype_name, make_layout


def _mesh_of(named: Mapping[str, Any]) -> Any:
    """The one device mesh every DTensor of ``named`` lives on (None: no DTensor at all)."""
    from torch.distributed.tensor import DTensor

    return _one_mesh(t.device_mesh for t in named.values() if isinstance(t, DTensor))


def _one_mesh(meshes: Any) -> Any:
    found = {id(m): m for m in meshes if m is not None}
    if len(found) > 1:
        raise LayoutError("the tensors live on more than one device mesh: a layout from placements describes one mesh's "
                          "sharding")
    return next(iter(found.values()), None)


def writer_rank(named: Mapping[str, Any], global_rank: int, *, mesh: Any = None) -> int:
    """This process's writer rank: its place among the mesh's ranks (0 when nothing is a DTensor). ``mesh``: the
    device mesh itself, instead of reading it off ``named``."""
    mesh = mesh if mesh is not None else _mesh_of(named)
    if mesh is None:
        return 0
    ranks = [int(r) for r in mesh.mesh.flatten().tolist()]
    if global_rank not in ranks:
        raise LayoutError(f"rank {global_rank} is not on the tensors' device mesh {ranks}")
    return ranks.index(global_rank)


def _box(shape: tuple[int, ...], placements: Any, coordinate: tuple[int, ...], sizes: tuple[int, ...],
         name: str) -> Box | None:
    """The part of a tensor of ``shape`` at mesh ``coordinate`` (None: a replica that does not send)."""
    from torch.distributed.tensor import Replicate, Shard as DShard

    offsets, extent = [0] * len(shape), list(shape)
    for axis, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            if coordinate[axis]:
                return None
        elif type(placement) is DShard:  # exactly Shard: _StridedShard subclasses it and is not a row range
            dim = placement.dim % max(len(shape), 1)
            lo, hi = chunk_bounds(extent[dim], sizes[axis])[coordinate[axis]]
            offsets[dim] += lo
            extent[dim] = hi - lo
        else:
            raise LayoutError(f"{name}: placement {placement!r} is not a whole part of the tensor on each rank "
                              f"(Partial sums, or FSDP2+TP's strided shards): send its full_tensor() instead")
    if any(e == 0 for e in extent) and shape:
        return None
    return Box(tuple(offsets), tuple(extent))


def from_dtensors(named: Mapping[str, Any], dtype: str | None = None) -> Layout:
    """The layout of every rank's local part of ``named`` (``{name: DTensor or tensor}``, a module's ``state_dict()``
    or ``named_parameters()``), in ``dtype`` if given (what crosses: the engine's, say ``"bfloat16"``), else each
    tensor's own. Each rank puts ``t.to_local()`` (cast to ``dtype``) under the tensor's name, as its writer rank
    ``writer_rank(named, torch.distributed.get_rank())``."""
    from torch.distributed.tensor import DTensor

    return from_placements({name: (dtype or dtype_name(t.dtype), tuple(int(d) for d in t.shape),
                                   t.device_mesh if isinstance(t, DTensor) else None,
                                   tuple(t.placements) if isinstance(t, DTensor) else None) for name, t in named.items()})


def from_placements(entries: Mapping[str, tuple[str, tuple[int, ...], Any, Any]]) -> Layout:
    """``from_dtensors`` from each tensor's ``(dtype, global shape, device mesh, placements)`` (mesh and placements
    None: a plain tensor, the first rank's), as a trainer that exports its local shards describes them (verl's
    ``ShardSpec``: ``full_shape``, ``mesh``, ``placements``)."""
    import itertools

    mesh = _one_mesh(m for _, _, m, _ in entries.values())
    sizes = tuple(int(s) for s in mesh.mesh.shape) if mesh is not None else ()
    coordinates = list(itertools.product(*(range(s) for s in sizes)))  # row-major: the writer ranks' order
    metas, shards = [], []
    for name, (dtype, shape, tensor_mesh, placements) in entries.items():
        meta = TensorMeta(name, dtype, tuple(int(d) for d in shape))
        metas.append(meta)
        if tensor_mesh is None:
            shards.append(own_buffer_shard(meta, Box.full(meta.shape), 0))
            continue
        for rank, coordinate in enumerate(coordinates):
            box = _box(meta.shape, placements, coordinate, sizes, name)
            if box is not None:
                shards.append(own_buffer_shard(meta, box, rank))
    return make_layout(metas, shards)
