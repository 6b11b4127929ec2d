"""Views of shards inside raw byte buffers, and plan execution between buffers in one process.

Buffers are 1-D ``uint8`` numpy arrays (a shared-memory segment, a registered region, a torch
tensor's storage seen through ``.numpy()``). Element views use an unsigned integer dtype of the
same width as the tensor's dtype, since numpy has no bfloat16 and moving bytes needs no
arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from rlsync.core._errors import LayoutError
from rlsync.core.layouts._layout import Layout, Shard, dtype_size
from rlsync.core.layouts._transfer import Transfer

_RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def raw_dtype(dtype: str) -> np.dtype:
    """The unsigned integer numpy dtype as wide as ``dtype`` (``"bfloat16"`` -> ``uint16``)."""
    return np.dtype(_RAW[dtype_size(dtype)])


def allocate(layout: Layout, rank: int) -> dict[str, np.ndarray]:
    """Zeroed, page-touched byte buffers for every buffer of ``rank`` (touching them now avoids
    page faults during the first transfer)."""
    return {b.name: np.zeros(b.numel * dtype_size(b.dtype), dtype=np.uint8) for b in layout.buffers if b.rank == rank}


def shard_view(buffer: np.ndarray, shard: Shard, dtype: str) -> np.ndarray:
    """The strided element view of ``shard`` inside the byte ``buffer`` (writable if the buffer is)."""
    size = dtype_size(dtype)
    if buffer.dtype != np.uint8 or buffer.ndim != 1:
        raise LayoutError(f"buffer {shard.buffer!r} must be a 1-D uint8 array, got {buffer.dtype} {buffer.shape}")
    if shard.box.numel:
        last = (shard.offset + sum((n - 1) * st for n, st in zip(shard.box.sizes, shard.strides)) + 1) * size
        if last > buffer.nbytes:
            raise LayoutError(f"tensor {shard.tensor!r}: shard needs {last} bytes of buffer {shard.buffer!r}, which has {buffer.nbytes}")
    start = buffer[shard.offset * size :]
    return np.lib.stride_tricks.as_strided(
        start.view(raw_dtype(dtype))[:1] if shard.box.numel else start.view(raw_dtype(dtype))[:0],
        shape=shard.box.sizes,
        strides=tuple(st * size for st in shard.strides),
        writeable=buffer.flags.writeable,
    )


def scatter(layout: Layout, rank: int, tensors: Mapping[str, np.ndarray], buffers: Mapping[str, np.ndarray]) -> None:
    """Copy the global ``tensors`` (raw-dtype arrays of full shape) into ``rank``'s buffers."""
    metas = layout.tensor_map()
    for s in layout.shards:
        if s.rank == rank:
            region = tuple(slice(o, o + n) for o, n in zip(s.box.offsets, s.box.sizes))
            np.copyto(shard_view(buffers[s.buffer], s, metas[s.tensor].dtype), tensors[s.tensor][region])


def gather_shards(layout: Layout, rank: int, buffers: Mapping[str, np.ndarray]) -> Iterable[tuple[Shard, np.ndarray]]:
    """Each shard of ``rank`` with its element view."""
    metas = layout.tensor_map()
    for s in layout.shards:
        if s.rank == rank:
            yield s, shard_view(buffers[s.buffer], s, metas[s.tensor].dtype)


def copy_transfers(transfers: Iterable[Transfer], src: Mapping[str, np.ndarray], dst: Mapping[str, np.ndarray]) -> int:
    """Execute transfers between byte buffers in this process; returns the bytes copied."""
    moved = 0
    for t in transfers:
        a, b = src[t.src_buffer], dst[t.dst_buffer]
        for s_off, d_off, n in t.runs():
            if s_off < 0 or d_off < 0 or s_off + n > a.nbytes or d_off + n > b.nbytes:
                raise LayoutError(
                    f"transfer of {t.tensor!r} ({t.src_buffer!r} -> {t.dst_buffer!r}) leaves its buffers: "
                    f"{s_off}+{n} of {a.nbytes}, {d_off}+{n} of {b.nbytes}"
                )
            np.copyto(b[d_off : d_off + n], a[s_off : s_off + n])
            moved += n
    return moved
