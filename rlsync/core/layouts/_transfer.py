"""One planned transfer: a strided region copied from a source buffer to a destination buffer.

The planner emits these; transports execute them as contiguous byte runs (``Transfer.runs``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import final

import msgspec


@final
class Transfer(msgspec.Struct, frozen=True, array_like=True):
    """Copy a region of shape ``sizes`` (elements of ``itemsize`` bytes).

    Source: buffer ``src_buffer`` on ``src_rank``, first element at element ``src_offset``,
    ``src_strides`` elements per step in each dimension; likewise the destination.
    ``tensor`` names the (first) global tensor the region belongs to, for messages.
    """

    tensor: str
    sizes: tuple[int, ...]
    itemsize: int
    src_rank: int
    src_buffer: str
    src_offset: int
    src_strides: tuple[int, ...]
    dst_rank: int
    dst_buffer: str
    dst_offset: int
    dst_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """Contiguous pieces as ``(src_byte_offset, dst_byte_offset, nbytes)`` within the buffers.

        Trailing dimensions that are contiguous on both sides are merged first, so a region
        that is contiguous in both buffers yields a single run.
        """
        sizes = [n for n in self.sizes]
        src = list(self.src_strides)
        dst = list(self.dst_strides)
        # Drop size-1 dimensions: their stride never matters.
        keep = [i for i, n in enumerate(sizes) if n != 1]
        sizes = [sizes[i] for i in keep]
        src = [src[i] for i in keep]
        dst = [dst[i] for i in keep]
        if not sizes or self.numel == 0:
            if self.numel:
                yield self.src_offset * self.itemsize, self.dst_offset * self.itemsize, self.itemsize
            return
        # Innermost run: elements contiguous on both sides.
        run = 1
        while sizes and src[-1] == run and dst[-1] == run:
            run *= sizes[-1]
            sizes.pop()
            src.pop()
            dst.pop()
        for index in itertools.product(*(range(n) for n in sizes)):
            s = self.src_offset + sum(i * st for i, st in zip(index, src))
            d = self.dst_offset + sum(i * st for i, st in zip(index, dst))
            yield s * self.itemsize, d * self.itemsize, run * self.itemsize
