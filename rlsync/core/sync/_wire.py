"""``WireCodec``: a per-tensor encoding that a writer applies before its bytes cross (fp8 is one).

A codec changes what the writer's layout holds (an fp8 weight and its block scales instead of a bf16
weight) and turns each tensor the trainer ``put``-s into the tensors of that layout. Codecs register by
name through the ``rlsync_register_wire_codecs`` hook; ``SyncOptions(wire="fp8")`` picks one, and
``"fp8+delta"`` adds delta sending on top. Delta itself is not a codec: it is part of the writer/reader
protocol, because it depends on what the reader's slot holds (``rlsync.core.sync._delta``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from rlsync.core.layouts import Layout


@runtime_checkable
class WireCodec(Protocol):
    """Made once per writer (trainer rank): ``codec = factory(src_layout, rank)``.

    ``layout`` is what crosses the wire instead of the trainer's layout: the reader must hold that
    layout (the engine that serves the encoded format). ``encode(name, tensor)`` is called from
    ``WeightsWriter.put`` for every tensor this rank puts; it returns the tensors to send in its place
    (keyed by buffer name of ``layout``) or None to send ``tensor`` unchanged. Raise
    ``WeightMismatchError`` naming the tensor for input the codec cannot encode.

    Called on: the trainer's process, each rank: built in ``WeightsWriter.__init__``, ``encode`` in every ``put``.
    """

    layout: Layout

    def encode(self, name: str, tensor: Any) -> Mapping[str, Any] | None: ...
