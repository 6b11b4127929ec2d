"""The transport interface: how bytes move from a writer's memory into a reader's memory.

A transport has two halves, each created by the process that uses it:

* ``Landing`` (reader process): allocates ``slots`` regions of ``nbytes`` each in memory the
  transport can write into (shared memory, NIXL-registered memory, ...), exposes each region as
  a 1-D ``uint8`` numpy array, and ``describe()``-s them as plain data (msgspec-encodable: no
  pickle) for the writer. ``close()`` frees them.
* ``Link`` (writer process): ``open(description)`` reaches the reader's regions; ``write(source,
  runs)`` copies contiguous runs ``(src_offset, dst_slot, dst_offset, nbytes)`` from the writer's
  byte array ``source`` into the reader's regions; ``flush()`` returns once every write issued so
  far has landed (or raises ``TransportError``); ``close()`` releases the link.

Transports are one-sided unless ``one_sided`` is False: a write lands without the reader's code
running. The version notice that follows ``flush()`` goes over the control plane, not the
transport. Subclasses set the class attributes below; ``available()`` must be cheap and must not
raise (it imports optional dependencies inside the transport's own module).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

#: ``(src_offset, dst_slot, dst_offset, nbytes)``: one contiguous piece of a write.
Run = tuple[int, int, int, int]


class Landing(ABC):
    """Reader-side memory that a transport writes into (see the module docstring)."""

    #: registry name, e.g. ``"shm"``
    name: ClassVar[str]
    #: writes land without the reader's code running
    one_sided: ClassVar[bool] = True
    #: reader and writer must share a host
    same_host_only: ClassVar[bool] = False

    @classmethod
    def available(cls) -> bool:
        """Whether this transport can run here (its optional dependencies import)."""
        return True

    def __init__(self, nbytes: int, slots: int, options: dict[str, Any] | None = None) -> None:
        self.nbytes = nbytes
        self.slots = slots
        self.options = dict(options or {})

    @property
    @abstractmethod
    def regions(self) -> Sequence[np.ndarray]:
        """One writable ``uint8`` array of ``nbytes`` per slot, pages already touched."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What a writer needs to reach the regions (plain data: str, int, bytes, lists, dicts)."""

    def progress(self) -> None:
        """Called often by the reader's service thread; transports that need the target to make
        progress (UCX over tcp) do it here."""

    def close(self) -> None:
        """Free the regions. Called once, by the reader."""


class Link(ABC):
    """Writer-side connection to one reader's landing (see the module docstring)."""

    @abstractmethod
    def write(self, source: np.ndarray, runs: Sequence[Run]) -> None:
        """Copy ``runs`` from ``source`` (1-D ``uint8``) into the reader's regions; may return before
        the bytes have landed."""

    def flush(self) -> None:
        """Return once every write issued so far has landed."""

    def close(self) -> None:
        """Release the link. Called once, by the writer."""


class Transport(ABC):
    """A named pair of factories; registered through ``rlsync_register_transports``."""

    name: ClassVar[str]
    landing: ClassVar[type[Landing]]

    @classmethod
    def available(cls) -> bool:
        return cls.landing.available()

    @classmethod
    @abstractmethod
    def open(cls, description: dict[str, Any], options: dict[str, Any] | None = None) -> Link:
        """Writer side: reach a reader's landing from its ``describe()`` output."""
