"""The transport contract: how bytes move from a writer's memory into a reader's memory.

A transport is three small classes, each used by one process:

* ``Landing`` (reader process): allocates ``slots`` regions of ``nbytes`` each in memory the
  transport can write into, exposes each as a ``Region``, and ``describe()``-s them as plain data
  for the writer (it crosses the control plane as msgpack: no pickle).
* ``Link`` (writer process): made by ``Transport.open(description)``; ``write(source, runs)`` copies
  contiguous ``Run``-s from the writer's ``source`` into the reader's regions; ``flush()`` returns once
  every write issued so far has landed (or raises ``TransportError``).
* ``Transport``: the registered name that ties the two together (``rlsync_register_transports``).

Lifecycle, as ``WeightsReader`` and ``WeightsWriter`` drive it::

    reader: landing = T.landing(nbytes, slots, options)   once, at start
            landing.describe()                            once per writer that says hello
            landing.progress()                            often, from the reader's service thread
            landing.close()                               once, at the end
    writer: link = T.open(description, options)           once per reader
            link.write(source, runs) ...; link.flush()    every version
            link.close()                                  once, or when the reader is lost

Memory: a host landing (``memory = "host"``) exposes 1-D ``uint8`` numpy arrays whose pages are
touched; a device landing (``memory = "device"``, an instance attribute where an option decides it)
exposes 1-D ``uint8`` torch tensors on its device; ``Region`` names both. Sources handed to ``write``
are host numpy arrays, or, where the transport says ``device_sources = True``, also 1-D ``uint8`` torch
tensors in device memory (a GPU trainer's own tensors: the writer then never copies them to the host;
for any other transport it copies them into reused pinned host buffers first).
A transport is one-sided unless ``one_sided`` is False: a write lands without the reader's code running.

A subclass must override: ``Landing.regions``, ``Landing.describe``, ``Link.write``, ``Transport.open``,
and set ``name`` and ``landing``. It may override: ``available`` (cheap, never raises; import optional
dependencies inside the transport's own module), ``progress``, ``flush``, ``close``, and the capability
flags. ``rlsync.testing.check_transport`` checks a transport against this contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Union

import numpy as np
import pluggy

from rlsync.core._errors import TransportError
from rlsync.core.hooks import transports

if TYPE_CHECKING:
    import torch

#: one landing region or one writer's source: a 1-D ``uint8`` host array, or a ``uint8`` device tensor
Region = Union[np.ndarray, "torch.Tensor"]


#: one contiguous piece of a write, ``(src_offset, dst_slot, dst_offset, nbytes)``: ``nbytes`` bytes from
#: ``source[src_offset:]`` into ``regions[dst_slot][dst_offset:]``
Run = tuple[int, int, int, int]


class Landing(ABC):
    """Reader-side memory that a transport writes into.

    Called on: the reader's process (engine worker): built once per reader, ``describe`` once per writer that
    says hello, ``progress`` from the reader's service thread, ``close`` at the end.
    """

    #: registry name, the same as its ``Transport``'s (e.g. ``"shm"``)
    name: ClassVar[str]
    #: writes land without the reader's code running
    one_sided: ClassVar[bool] = True
    #: reader and writer must share a host
    same_host_only: ClassVar[bool] = False
    #: where the regions live: ``"host"`` (numpy arrays) or ``"device"`` (torch tensors on a device)
    memory: Literal["host", "device"] = "host"

    @classmethod
    def available(cls) -> bool:
        """Whether this transport can run here (its optional dependencies import). Cheap; never raises."""
        return True

    def __init__(self, nbytes: int, slots: int, options: Mapping[str, Any] | None = None) -> None:
        self.nbytes = nbytes
        self.slots = slots
        self.options = dict(options or {})

    @classmethod
    def over(cls, regions: Sequence[Region], options: Mapping[str, Any] | None = None) -> Landing:
        """A landing whose regions are memory the caller owns (an engine's parameters, for ``landing="in_place"``),
        one region per buffer; written, never allocated or freed. May override; the default says this transport
        cannot (host transports land in memory they allocate themselves)."""
        raise TransportError(f"transport {cls.name!r} cannot land in memory it did not allocate (landing='in_place'): "
                             f"use 'cuda_ipc' or 'nixl' (or 'memory' in one process)")

    def admit(self, token: bytes, writable: Callable[[int, int, int], bool]) -> None:
        """The writer that proves ``token`` (the reader hands it one in its session's ``Welcome``; its link gets it as
        ``options["token"]``) may write ``nbytes`` at ``offset`` of slot ``slot`` only where ``writable(slot, offset,
        nbytes)``: its own part of the slot being written, never another rank's or the live slot. A two-sided landing
        (``one_sided = False``: its own code receives every byte) checks every write and, once it admitted a token,
        takes only connections that prove one. May override; a one-sided landing cannot check (its writers write
        memory directly) and takes the default, which does nothing: there ``verify`` catches a rank's bytes outside
        its part (the other rank's checksums fail)."""

    def revoke(self, token: bytes) -> None:
        """``token`` no longer opens a connection (its session is gone). May override."""

    @property
    @abstractmethod
    def regions(self) -> Sequence[Region]:
        """One writable ``uint8`` region of ``nbytes`` per slot (host: pages already touched). Must override."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What a writer needs to reach the regions: plain data (str, int, float, bytes, lists, dicts). Must override."""

    def progress(self) -> None:
        """Called often by the reader's service thread; transports whose target must make progress
        (UCX over tcp) do it here. May override."""

    def close(self) -> None:
        """Free the regions. Called once, by the reader. May override."""


class Link(ABC):
    """Writer-side connection to one reader's landing.

    Called on: the writer's process (trainer rank): made by ``Transport.open`` once per reader; ``write`` and
    ``flush`` every version, from one thread per reader; ``close`` once.
    """

    @abstractmethod
    def write(self, source: Any, runs: Sequence[Run]) -> None:
        """Copy ``runs`` from ``source`` (1-D ``uint8``: a numpy array, or a device tensor where the transport
        has ``device_sources``) into the reader's regions; may return before the bytes have landed. The source
        stays unchanged until ``flush`` returns. Raises ``TransportError`` (``PeerLostError`` when the reader is gone). Must override."""

    def prepare(self, parts: Sequence[tuple[Any, Sequence[Run]]]) -> Any:
        """What ``write_prepared`` takes to write ``parts`` (each a source and its runs, as ``write`` takes them) again,
        version after version: the writer prepares a version once and replays it while its sources stay where they
        were, so that a version costs a few Python calls per link, not several per tensor. Default: the parts as
        they are; a transport that can do better prepares views, descriptors or a batched copy. May override."""
        return list(parts)

    def write_prepared(self, prepared: Any) -> None:
        """Write what ``prepare`` made, as ``write`` would write its parts. May override (default: ``write`` each)."""
        for source, runs in prepared:
            self.write(source, runs)

    def flush(self) -> None:
        """Return once every write issued so far has landed. May override (default: writes are synchronous)."""

    def close(self) -> None:
        """Release the link. Called once, by the writer. May override."""


class Transport(ABC):
    """A named transport: its ``Landing`` class (reader side) and ``open`` (writer side).

    Register it from a plugin (``rlsync_register_transports``) or pass the class itself wherever a
    transport name is accepted (``SyncOptions(transport=MyTransport)``).

    Called on: both sides: the reader's process builds ``landing``; the writer's process calls ``open``.
    """

    name: ClassVar[str]
    landing: ClassVar[type[Landing]]
    #: ``Link.write`` takes sources in device memory (torch tensors) as well as host numpy arrays
    device_sources: ClassVar[bool] = False
    #: the link is slow next to the host (a network socket): a delta's planes are zstd-compressed on the host
    #: before they go (~1.3 instead of ~6 bytes per changed bf16 value); False: they go as they are, and never
    #: leave the device they were found on (compressing costs more than it saves on a memory-speed link)
    compress_deltas: ClassVar[bool] = False

    @classmethod
    def available(cls) -> bool:
        return cls.landing.available()

    @classmethod
    @abstractmethod
    def open(cls, description: dict[str, Any], options: Mapping[str, Any] | None = None) -> Link:
        """Writer side: reach a reader's landing from its ``describe()`` output. Must override.

        The description is the reader's word, and a reader may be buggy or hostile: a link opens nothing it cannot
        verify as a landing (a file rlsync made, of this user, of the size the plan says) and sizes nothing by it.
        ``options["region_bytes"]``: the bytes of one landing slot as the writer's plan has it (None: unknown)."""


def resolve_transport(transport: str | type[Transport], pm: pluggy.PluginManager | None = None) -> type[Transport]:
    """A transport class from a registered name (or the class itself), checked to run here."""
    cls: type[Transport] = transports(pm).get(transport) if isinstance(transport, str) else transport  # type: ignore[assignment]  # registered classes
    if not cls.available():
        raise TransportError(f"transport {cls.name!r} cannot run here; install its extra (pip install 'rlsync[{cls.name}]') or pick another")
    return cls
