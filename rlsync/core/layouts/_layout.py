"""The layout model: which rank holds which region of which tensor, where and how.

A *tensor* is a global, logical array (``TensorMeta``: name, dtype, shape), the way the
trainer's model defines it (HF names; MoE experts as one stacked ``[E, ...]`` tensor per
projection). A *box* is a rectangular region of it in global coordinates. A *shard* says that
``rank`` holds ``box`` of ``tensor`` inside its local buffer ``buffer``, starting at element
``offset`` with element ``strides`` per box dimension. Fused engine parameters (vLLM's
``qkv_proj``, ``gate_up_proj``, stacked expert weights) are one buffer holding boxes of several
tensors at different offsets. A *layout* is all shards of all tensors across ranks, plus the
buffers they live in.

Everything here is plain, immutable msgspec data: cheap to build, hash, send and compare.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Final, final

import msgspec

from rlsync.core._errors import LayoutError

#: Bytes per element of every dtype rlsync moves, by its torch name without the ``torch.`` prefix.
DTYPE_SIZES: Final[dict[str, int]] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise LayoutError(
            f"unsupported dtype {dtype!r}; rlsync moves: {', '.join(sorted(DTYPE_SIZES))}"
        ) from None


def dtype_name(dtype: object) -> str:
    """``torch.bfloat16`` or ``"torch.bfloat16"`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.")
    dtype_size(name)
    return name


@final
class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    """A global tensor: its name, dtype and full (unsharded) shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_size(self.dtype)


@final
class Box(msgspec.Struct, frozen=True, array_like=True):
    """A rectangular region of a global tensor: ``offsets`` and ``sizes`` per dimension."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def full(cls, shape: Sequence[int]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def intersect(self, other: Box) -> Box | None:
        """The common region, or None if the boxes do not overlap."""
        offsets = []
        sizes = []
        for a0, an, b0, bn in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo = a0 if a0 > b0 else b0
            hi = min(a0 + an, b0 + bn)
            if hi <= lo:
                return None
            offsets.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offsets), tuple(sizes))

    def within(self, shape: Sequence[int]) -> bool:
        return len(shape) == len(self.offsets) and all(
            o >= 0 and s >= 0 and o + s <= d for o, s, d in zip(self.offsets, self.sizes, shape)
        )


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


@final
class Shard(msgspec.Struct, frozen=True, array_like=True):
    """``rank`` holds ``box`` of ``tensor`` in its buffer ``buffer``.

    The box's first element sits at element ``offset`` of the buffer; moving one step along
    box dimension ``d`` moves ``strides[d]`` elements in the buffer.
    """

    tensor: str
    box: Box
    rank: int
    buffer: str
    offset: int
    strides: tuple[int, ...]


@final
class BufferSpec(msgspec.Struct, frozen=True, array_like=True):
    """A local, contiguous buffer on ``rank`` (typically one parameter's storage)."""

    rank: int
    name: str
    dtype: str
    numel: int


@final
class Layout(msgspec.Struct, frozen=True):
    """All shards of all tensors across the ranks of one side (trainer or engine)."""

    tensors: tuple[TensorMeta, ...]
    shards: tuple[Shard, ...]
    buffers: tuple[BufferSpec, ...]

    @property
    def world_size(self) -> int:
        return 1 + max((s.rank for s in self.shards), default=-1)

    def tensor_map(self) -> dict[str, TensorMeta]:
        return {t.name: t for t in self.tensors}

    def fingerprint(self) -> str:
        """A stable hash of the whole layout (msgpack bytes, sha256)."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()


def tensor_fingerprints(layout: Layout) -> dict[str, str]:
    """A hash per tensor of its metadata and shards, to name the first tensor two layouts differ in."""
    by_tensor: dict[str, list[Shard]] = {t.name: [] for t in layout.tensors}
    for shard in layout.shards:
        by_tensor.setdefault(shard.tensor, []).append(shard)
    metas = layout.tensor_map()
    out = {}
    for name, shards in by_tensor.items():
        h = hashlib.blake2b(msgspec.msgpack.encode((metas.get(name), shards)), digest_size=8)
        out[name] = h.hexdigest()
    return out


def make_layout(
    tensors: Iterable[TensorMeta], shards: Iterable[Shard], buffers: Iterable[BufferSpec] | None = None
) -> Layout:
    """Build a layout; buffers default to one contiguous buffer per (rank, buffer name),
    sized to the furthest element any shard touches, with the dtype of its tensors."""
    tensors = tuple(tensors)
    shards = tuple(shards)
    if buffers is None:
        metas = {t.name: t for t in tensors}
        extent: dict[tuple[int, str], tuple[str, int]] = {}
        for s in shards:
            meta = metas.get(s.tensor)
            if meta is None:
                raise LayoutError(f"shard on rank {s.rank} refers to unknown tensor {s.tensor!r}")
            last = s.offset + sum((n - 1) * st for n, st in zip(s.box.sizes, s.strides)) + 1
            key = (s.rank, s.buffer)
            prev = extent.get(key)
            if prev is not None and prev[0] != meta.dtype:
                raise LayoutError(
                    f"buffer {s.buffer!r} on rank {s.rank} mixes dtypes {prev[0]} and {meta.dtype} "
                    f"(tensor {s.tensor!r}); give each dtype its own buffer"
                )
            extent[key] = (meta.dtype, max(last, prev[1] if prev else 0))
        buffers = [BufferSpec(r, b, dt, n) for (r, b), (dt, n) in sorted(extent.items())]
    return Layout(tensors, shards, tuple(buffers))
