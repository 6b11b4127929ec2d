"""``SyncOptions``: the settings every weight-sync piece shares, declared once.

A ``WeightsWriter``, a ``WeightsReader``, a ``StagedReceiver`` and every framework adapter take one
``SyncOptions`` (or build it from the keys a user typed: ``SyncOptions.from_mapping``) instead of
re-declaring transport, host, secret, timeout, verification and wire format with defaults of their own.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, Final, final

from rlsync.core._errors import ConfigError

#: seconds one sync may take before the side waiting for it gives up (one default, everywhere)
DEFAULT_TIMEOUT: Final = 300.0
#: what a writer may put on the wire (``SyncOptions(wire=...)``)
WIRES: Final = ("full", "delta", "fp8", "fp8+delta")
EXTRA_TENSORS: Final = ("warn", "error", "ignore")  # SyncOptions.extra_tensors


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@final
@dataclasses.dataclass(frozen=True)
class SyncOptions:
    """How weights travel, shared by writers, readers and adapters.

    * ``transport``: a registered transport name (``shm``, ``tcp``, ``nixl``, ``torchdist`` or a plugin's)
      or a ``Transport`` subclass.
    * ``host``/``port``: where a reader listens (loopback by default; any other address needs ``secret``).
    * ``secret``: the shared secret that signs control messages (default: ``RLSYNC_SECRET``).
    * ``timeout``: seconds a sync may take before the waiting side raises ``TransferTimeoutError``.
    * ``verify``: writers send a CRC-32 per tensor and readers refuse a version whose bytes differ.
    * ``wire``: ``"full"``, ``"delta"``, ``"fp8"`` or ``"fp8+delta"`` (writer side; see ``rlsync.wire``).
    * ``transport_options``: passed to the transport as they are.
    * ``canary``: adapters that hold the trainer's model send a ``Canary`` with every version, and engines check
      it before the version serves (``rlsync.Canary``); False turns both off.
    * ``extra_tensors``: what a writer does with tensors the trainer puts that the engine does not hold (a
      mistyped or renamed parameter, a buffer the engine recomputes): ``"warn"`` (once per writer, naming them),
      ``"error"`` (``PlanError`` before a byte moves) or ``"ignore"``. A tied model's second name for one tensor
      (``lm_head.weight`` beside the embedding) is never extra: the engine ties it itself.

    Called on: every process that moves weights; plain data, so a launcher can hand it to the processes it
    starts (``to_mapping``/``from_mapping``).
    """

    transport: Any = "shm"
    host: str = "127.0.0.1"
    port: int = 0
    secret: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    verify: bool = False
    wire: str = "full"
    transport_options: Mapping[str, Any] | None = None
    canary: bool = True
    extra_tensors: str = "warn"

    def __post_init__(self) -> None:
        """Every field checked when the options are built, each error naming the field and what it takes: a typo
        fails here, not at the first sync."""
        self._check_transport()
        if not isinstance(self.host, str) or not self.host:
            raise ConfigError(f"host={self.host!r}: the address a reader listens on, a string such as '127.0.0.1'")
        if not _integer(self.port) or not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port!r}: an integer port, 0 (any free one) to 65535")
        if self.secret is not None and (not isinstance(self.secret, str) or not self.secret):
            raise ConfigError(f"secret={self.secret!r}: a non-empty string (the same on every process), or None")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ConfigError(f"timeout={self.timeout!r}: a number of seconds above 0 (e.g. timeout=300)")
        for flag in ("verify", "canary"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag}={getattr(self, flag)!r}: True or False")
        if self.extra_tensors not in EXTRA_TENSORS:
            raise ConfigError(f"extra_tensors={self.extra_tensors!r}: use one of {', '.join(EXTRA_TENSORS)}")
        if self.wire not in WIRES:
            raise ConfigError(f"wire={self.wire!r}: use one of {', '.join(WIRES)}")
        if self.transport_options is not None and not isinstance(self.transport_options, Mapping):
            raise ConfigError(f"transport_options={self.transport_options!r}: a mapping (dict) passed to the transport, or None")

    def _check_transport(self) -> None:
        from rlsync.core.hooks import transports
        from rlsync.core.sync._transport import Transport

        if isinstance(self.transport, type) and issubclass(self.transport, Transport):
            return
        if not isinstance(self.transport, str):
            raise ConfigError(f"transport={self.transport!r}: a transport's name (e.g. 'shm') or a Transport subclass")
        names = transports().names()
        if self.transport not in names:
            near = difflib.get_close_matches(self.transport, names, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(f"transport={self.transport!r} is not a registered transport: {hint}registered: "
                              f"{', '.join(sorted(names))} (a plugin's own, passed by name, must be registered in "
                              f"rlsync's plugin manager; or pass its Transport class)")

    @property
    def link_options(self) -> dict[str, Any]:
        """What the transport's landings and links get: the reader's address and the secret (a reader's landing
        listens where its control socket does, with the same secret), the timeout (a link that waits longer on a
        lost peer would outlive its version), then ``transport_options`` as they are."""
        return {"host": self.host, "secret": self.secret, "timeout": self.timeout, **(self.transport_options or {})}

    @property
    def delta(self) -> bool:
        """Whether a writer sends only what changed where it can."""
        return "delta" in self.wire

    @property
    def codec(self) -> str | None:
        """The per-tensor wire codec (``"fp8"``), if any: a name registered through ``rlsync_register_wire_codecs``."""
        name = self.wire.replace("delta", "").strip("+")
        return None if name in ("", "full") else name

    def replace(self, **changes: Any) -> SyncOptions:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None, *, where: str = "options") -> SyncOptions:
        """Options from user-typed keys (a verl ``engine_kwargs`` block, a launcher's JSON): unknown keys are an
        error that lists the known ones."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(values.keys() - known)
        if unknown:
            raise ConfigError(f"{where}: unknown rlsync option(s) {unknown}; known: {sorted(known)}")
        if "timeout" in values:
            values["timeout"] = float(values["timeout"])
        if "port" in values:
            values["port"] = int(values["port"])
        for flag in ("verify", "canary"):
            if flag in values and isinstance(values[flag], str):
                values[flag] = values[flag].lower() in ("1", "true", "yes")
        return cls(**values)

    def to_mapping(self) -> dict[str, Any]:
        """Plain data (for a launcher's environment variable); a transport class travels by its name."""
        out = dataclasses.asdict(self)
        if not isinstance(self.transport, str):
            out["transport"] = self.transport.name
        out["transport_options"] = None if self.transport_options is None else dict(self.transport_options)
        return out
