"""The engine-neutral staged receiver: a ``WeightsReader`` whose complete versions wait for the engine's
loader (vLLM's, SGLang's, any engine that loads HF-named tensors).

Complete versions reach the engine thread through ``LandedVersions``: the trainer's ``complete(v)``
returns only when the engine serves ``v``, and a loader error reaches the trainer.

Each worker stores only the box of each checkpoint tensor its loader reads (``rlsync_probe``),
compactly, yet vLLM's loader wants whole tensors (it narrows them to the worker's slice itself).
So the loader gets a whole-tensor-shaped view whose strides are the box's: the box's elements are
exactly where the loader reads, and the elements it never reads alias neighbouring memory of the
landing region. Two slack buffers, each as large as the largest tensor, open and close every
worker's region so that such views stay inside it. Host memory per worker is then its share of
the model plus two tensors, not the whole model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rlsync.core.layouts import from_state_dict, own_buffer_shard
from rlsync.core._errors import ConfigError
from rlsync.core.sync._handoff import Finish, LandedVersions
from rlsync.core.layouts import Box, BufferSpec, Layout, TensorMeta, contiguous_strides, make_layout
from rlsync.core.sync._options import SyncOptions
from rlsync.core.sync._reader import WeightsReader
from rlsync.core.sync._regions import as_tensor, region_offsets

#: Per engine rank, ``{checkpoint tensor name: [offsets, sizes]}`` of the part that rank loads
#: (what an engine's loader probe returns, one entry per worker in rank order).
RankBoxes = Sequence[Mapping[str, Sequence[Sequence[int]]]]
SLACK = ("rlsync.slack.head", "rlsync.slack.tail")  # first and last buffer of every worker's region


def tensor_metas(tensors: Sequence[Sequence[Any]]) -> list[TensorMeta]:
    """``[(name, dtype, shape), ...]`` (dtype as ``torch.bfloat16`` or ``bfloat16``) as TensorMetas."""
    return [TensorMeta(str(n), str(d).removeprefix("torch."), tuple(int(x) for x in s)) for n, d, s in tensors]


def engine_layout(tensors: Sequence[Sequence[Any]], boxes: RankBoxes | None = None) -> Layout:
    """The layout an engine receives into: with ``boxes`` (from the engine's loader probe), each rank gets only the
    part of each checkpoint tensor its loader reads; without, one rank gets every tensor whole.
    The trainer builds its ``WeightsWriter`` with this as the destination layout."""
    metas = tensor_metas(tensors)
    if boxes is None or (len(boxes) == 1 and all(list(boxes[0].get(m.name, [[], []])[1]) == list(m.shape) for m in metas)):
        return from_state_dict(metas)  # one worker reading every tensor whole: no views, no slack
    held = {name for rank in boxes for name in rank}
    unread = [m.name for m in metas if m.name not in held]
    if unread:
        raise ConfigError(f"the engine's loader reads no part of {len(unread)} tensor(s) on any worker, e.g. {unread[:3]}: "
                          f"leave them out of the tensor list (a tied lm_head.weight is one such) or check their names")
    slack = max(m.nbytes for m in metas)
    shards, buffers = [], []
    for rank, held_here in enumerate(boxes):
        buffers.append(BufferSpec(rank, SLACK[0], "uint8", slack))
        for meta in metas:
            if meta.name in held_here:
                offsets, sizes = held_here[meta.name]
                box = Box(tuple(offsets), tuple(sizes))
                shards.append(own_buffer_shard(meta, box, rank))
                buffers.append(BufferSpec(rank, meta.name, meta.dtype, box.numel))
        buffers.append(BufferSpec(rank, SLACK[1], "uint8", slack))
    return make_layout(metas, shards, buffers)


def whole_tensor_view(region: Any, byte_offset: int, meta: TensorMeta, box: Box) -> Any:
    """A tensor of ``meta``'s whole shape whose ``box`` is the compact buffer at ``byte_offset`` of
    ``region`` (a ``uint8`` numpy array or tensor, on any device); outside the box its elements alias other
    memory of the region (never read by a loader that narrows to the box)."""
    import torch

    dtype = getattr(torch, meta.dtype)
    itemsize = int(dtype.itemsize)
    strides = contiguous_strides(box.sizes)
    start = byte_offset - sum(o * st for o, st in zip(box.offsets, strides)) * itemsize
    words = as_tensor(region)[: len(region) // itemsize * itemsize].view(dtype)
    return words.as_strided(meta.shape, strides, start // itemsize)


class StagedReceiver:
    """Receives the HF-named ``tensors`` (``[(name, dtype, shape), ...]``) into a staging area, for an engine
    thread that loads each version (``next``) and says when it did (``finish``). The trainer's
    ``WeightsWriter(src, None, rank, addresses)`` learns this layout from the reader.

    ``boxes``: per engine rank, the part of each tensor that rank's loader reads (default: all of it).
    ``options``: ``SyncOptions`` (transport, host, port, secret, ``verify``; ``timeout`` is how long a
    landed version may wait for the engine to load it before the writers hear that it failed).
    ``live_version``: the version the engine serves as this receiver starts (one that replaces another in the same
    engine: the writers go on after it). Called on: the engine's worker process, one receiver per worker rank; ``next``
    from the engine's own thread.
    """

    def __init__(self, tensors: Sequence[Sequence[Any]], *, boxes: RankBoxes | None = None, rank: int = 0,
                 options: SyncOptions | None = None, live_version: int = -1) -> None:
        options = options or SyncOptions()
        layout = engine_layout(tensors, boxes)
        self.boxes = {s.tensor: s.box for s in layout.shards if s.rank == rank}
        self.metas = [m for m in layout.tensors if m.name in self.boxes]  # what this rank's loader reads
        self._offsets, self._region_nbytes = region_offsets(layout, rank)
        self._landed = LandedVersions(options.timeout)
        # the writers' layout comes with their hello: one trainer process or many, whole tensors or shards;
        # with verify, a version whose CRCs differ is refused and the engine waiting for it hears why at once
        self.reader = WeightsReader(None, layout, rank, options=options, landing="staged",
                                    on_version=self._landed.on_version, on_refused=self._landed.on_refused,
                                    live_version=live_version, on_lost=self._landed.on_lost)
        self._landed.refusal = lambda: self.reader.refusal  # a refused writer fails the engine's wait at once

    @property
    def address(self) -> str:
        return self.reader.address

    def next(self, timeout: float) -> tuple[int, Iterator[tuple[str, Any]], Finish]:
        """Engine thread: the next landed version, its tensors as views, and ``finish(error or None)``."""
        import torch

        version, buffers, finish = self._landed.next(timeout)
        if SLACK[0] in buffers:  # boxes: whole-tensor views over the region, which starts at the head slack
            region = self.reader.region(0)  # the staging slot this version landed in (and the only one)
            views = ((m.name, whole_tensor_view(region, self._offsets[m.name], m, self.boxes[m.name])) for m in self.metas)
        else:  # host landing: numpy views as tensors; device landing: the device tensors themselves
            views = ((m.name, as_tensor(buffers[m.name]).view(getattr(torch, m.dtype)).view(m.shape)) for m in self.metas)
        return version, views, finish

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> StagedReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
