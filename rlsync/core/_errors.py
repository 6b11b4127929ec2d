"""Exceptions and warnings raised by rlsync (and ``whole_number``, the check of a constructor's counts that raises
the ConfigError).

Every error rlsync raises on purpose derives from :class:`RlsyncError`, so callers can catch
one type. Errors caused by bad input also derive from :class:`ValueError`, so code written
against plain Python conventions keeps working.

    RlsyncError
    ├── LayoutError (ValueError)      a layout that cannot be right: boxes out of bounds, not tiling
    ├── PlanError (ValueError)        no valid plan: a destination byte no source holds, dtype mismatch
    │   └── PlanMismatchError         a plan applied to layouts other than the ones it was built for
    ├── TransportError                moving bytes failed
    │   ├── PeerLostError             the other side died or stopped answering
    │   └── TransferTimeoutError      a transfer or a version notice took longer than allowed
    ├── VersionError                  a version that goes backwards, is unknown, or was never completed
    ├── WeightMismatchError (ValueError)  names, shapes or dtypes differ between trainer and engine
    ├── RolloutBufferError            rollout buffer misuse: closed buffer, bad sample, lost backend
    │   └── LeaseLostError            another generator claimed the episode this one works on
    ├── PluginError                   a plugin failed to load, or an unknown plugin name was asked for
    └── ConfigError (ValueError)      invalid configuration (for example a non-loopback bind without a secret)

    RlsyncWarning (UserWarning)
"""

from __future__ import annotations

import logging
import operator
import re
from typing import Any

__all__ = [
    "ConfigError",
    "LayoutError",
    "LeaseLostError",
    "PeerLostError",
    "PlanError",
    "PlanMismatchError",
    "PluginError",
    "RolloutBufferError",
    "RlsyncError",
    "RlsyncWarning",
    "TransferTimeoutError",
    "TransportError",
    "VersionError",
    "WeightMismatchError",
]


class RlsyncError(Exception):
    """Base class of every error rlsync raises on purpose. A reader address in its message shows without its key
    (``tcp://host:port#<key>``): error messages end up in logs that others can read."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*(redact(a) if isinstance(a, str) else a for a in args))


class LayoutError(RlsyncError, ValueError):
    """A layout is malformed: a box out of bounds, shards that do not tile their tensor."""


class PlanError(RlsyncError, ValueError):
    """No valid transfer plan exists between two layouts."""


class PlanMismatchError(PlanError):
    """A plan was applied to layouts other than the ones it was built for."""


class TransportError(RlsyncError):
    """Moving bytes between processes failed."""


class PeerLostError(TransportError):
    """The peer process died or stopped answering during a transfer."""


class TransferTimeoutError(TransportError):
    """A transfer or a version notice did not finish within the configured timeout."""


class VersionError(RlsyncError):
    """A weight or policy version is invalid: going backwards, unknown, or never completed."""


class WeightMismatchError(RlsyncError, ValueError):
    """Tensor names, shapes or dtypes differ between the sending and the receiving side."""


class CanaryError(WeightMismatchError):
    """An engine's canary log-probs deviate from the trainer's (``rlsync.Canary``): ``mean`` and ``largest``
    deviation in nats per token, ``at`` = (canary sequence, token position) of the largest."""

    def __init__(self, message: str, mean: float = float("nan"), largest: float = float("nan"),
                 at: tuple[int, int] = (0, 0)) -> None:
        super().__init__(message)
        self.mean, self.largest, self.at = mean, largest, at

    def __reduce__(self) -> Any:  # crosses process boundaries (vLLM's collective_rpc) whole
        return (type(self), (str(self), self.mean, self.largest, self.at))


class RolloutBufferError(RlsyncError):
    """The rollout buffer was misused or its backend was lost."""


class LeaseLostError(RolloutBufferError):
    """Another generator claimed the episode this one works on (its lease ran out): stop working on it."""


class PluginError(RlsyncError):
    """A plugin failed to load, or an unknown plugin name was requested."""


class ConfigError(RlsyncError, ValueError):
    """Configuration is invalid."""


class RlsyncWarning(UserWarning):
    """Base class of warnings rlsync emits."""


# -- reader addresses print without their key ------------------------------------------------------------------------
# An address ``tcp://host:port#KEY`` is a capability: whoever reads the key may set an engine's weights. Errors and
# log lines often end up in files others can read (a shared log directory, a CI log), so every ``RlsyncError`` message
# and every record of the ``rlsync`` logger show ``tcp://host:port#<key>``; the address itself, where code passes it
# on, keeps its key.

# a key follows '#' right after an address's port (tcp://HOST:PORT#KEY; keys are URL-safe base64 or hex)
_KEYED = re.compile(r"(tcp://[^\s#'\"]*:\d+)#[A-Za-z0-9_.\-]+")  # a rank's credential has dots
HIDDEN = "#<key>"


def redact(text: str) -> str:
    """``text`` with the key of every reader address in it replaced by ``#<key>``."""
    return _KEYED.sub(lambda m: m.group(1) + HIDDEN, text) if "#" in text else text


class RedactKeys(logging.Filter):
    """A filter for the ``rlsync`` logger: a record's message (with its arguments) leaves with its keys hidden."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        hidden = redact(message)
        if hidden != message:
            record.msg, record.args = hidden, None
        return True


logging.getLogger("rlsync").addFilter(RedactKeys())  # every module that logs imports this one


# The numbers a public constructor takes, checked at the door: one line naming the argument, the value and what is
# allowed, instead of a hang or a traceback later.
def whole_number(name: str, value: Any, least: int = 0, why: str = "") -> int:
    """``value`` as an int of at least ``least`` (numpy and torch integers too); a bool, a float, a string or a smaller
    number is a ConfigError naming ``name`` (and ``why``, the reason for the bound)."""
    try:
        number = operator.index(value)  # ints of any kind; not floats or strings
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < least:
        raise ConfigError(f"{name}={value!r}: a whole number of at least {least}{f' ({why})' if why else ''}")
    return number
