"""Transports that break on purpose, for tests: each wraps a real transport's links (``rlsync.testing.MemoryTransport``,
shm, ...) so that what they write goes wrong in one chosen way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlsync import Transport, TransportError

Write = Callable[[Any, Any], None]


def writes_one_by_one(link: Any) -> Any:
    """``link`` writing a prepared version part by part through ``link.write`` (whatever replaced it), as the
    ``Link`` contract's defaults do: a transport's own batched ``write_prepared`` would pass a wrapped ``write`` by."""
    link.prepare = lambda parts: list(parts)
    link.write_prepared = lambda prepared: [link.write(source, runs) for source, runs in prepared]
    return link


def wrapping_writes(base: type[Transport], wrap: Callable[[Write], Write]) -> type[Transport]:
    """``base`` whose links' ``write`` is ``wrap(the link's own write)``; same name, so readers of ``base`` accept it."""

    class Wrapped(base):  # type: ignore[valid-type, misc]
        @classmethod
        def open(cls, description: dict[str, Any], options: Any = None) -> Any:
            link = base.open(description, options)
            link.write = wrap(link.write)
            return writes_one_by_one(link)

    return Wrapped


def flipping(base: type[Transport], *, at: int, bit: int, applies: Callable[[Any], bool] = lambda source: True) -> type[Transport]:
    """``base`` flipping ``bit`` of byte ``at`` of every host source ``applies`` accepts (a bad NIC, a bug in a copy)."""

    def wrap(write: Write) -> Write:
        def flip_then_write(source: Any, runs: Any) -> None:
            if applies(source):
                source = source.copy()
                source[at] ^= bit
            write(source, runs)

        return flip_then_write

    return wrapping_writes(base, wrap)


def dying(base: type[Transport], writes: int) -> type[Transport]:
    """``base`` whose writer is gone after ``writes`` writes on a link (as if killed mid-version)."""

    def wrap(write: Write) -> Write:
        count = [0]

        def write_then_die(source: Any, runs: Any) -> None:
            count[0] += 1
            if count[0] > writes:
                raise TransportError("the writer died")
            write(source, runs)

        return write_then_die

    return wrapping_writes(base, wrap)
