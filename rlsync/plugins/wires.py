"""Built-in wire codecs: ``fp8`` (``rlsync.wire.Fp8Codec``), registered like a third-party plugin's."""

from __future__ import annotations

from typing import Any

from rlsync import Registry, hookimpl


@hookimpl(trylast=True)
def rlsync_register_wire_codecs(registry: Registry[Any]) -> None:
    from rlsync.wire import Fp8Codec  # imports torch: only when a writer asks for a codec

    registry.add("fp8", Fp8Codec)
