"""Layout exchange: a writer (or a trainer) asks a reader which destination layout it receives into."""

from __future__ import annotations

from rlsync.core.sync._control import AskLayout, LayoutIs, Refuse, open_channel
from rlsync.core._errors import TransferTimeoutError, TransportError, WeightMismatchError
from rlsync.core.layouts import Layout
from rlsync.core.sync._options import DEFAULT_TIMEOUT


def reader_layout(address: str, *, secret: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> Layout:
    """The destination layout the ``WeightsReader`` at ``address`` receives into (every rank's part).

    A writer built with ``dst=None`` asks for it; engines derive their layout from their own loader,
    so the trainer need not know it."""
    return ask_layout(address, None, secret, timeout)[0]


def ask_layout(address: str, src: Layout | None, secret: str | None, timeout: float) -> tuple[Layout, int]:
    """``(destination layout, live version)`` of the reader at ``address``; ``src`` lets a replica reader
    (``dst=None, replicas=N``) derive its layout from the writers'."""
    channel, challenge = open_channel(address, secret, timeout)
    try:
        channel.send(AskLayout(src if challenge.needs_src else None))
        got = channel.recv(timeout_ms=int(timeout * 1000))
    finally:
        channel.close()
    if got is None:
        raise TransferTimeoutError(f"the reader at {address} did not answer within {timeout} s: is the engine up, "
                                   f"and is this its address?")
    msg = got[1]
    if isinstance(msg, Refuse):
        raise WeightMismatchError(f"the reader at {address} refused: {msg.reason}")
    if not isinstance(msg, LayoutIs):
        raise TransportError(f"the reader at {address} answered {type(msg).__name__} to a layout request")
    return msg.layout, msg.live_version

