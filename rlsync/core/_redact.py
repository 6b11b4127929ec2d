"""Reader addresses print without their key. An address ``tcp://host:port#KEY`` is a capability: whoever reads the
key may set an engine's weights. Errors and log lines often end up in files others can read (a shared log
directory, a CI log), so every ``RlsyncError`` message and every record of the ``rlsync`` logger shows
``tcp://host:port#<key>`` instead; the address itself, where code passes it on, keeps its key."""

from __future__ import annotations

import logging
import re

# a key follows '#' right after an address's port (tcp://HOST:PORT#KEY; keys are URL-safe base64 or hex)
_KEYED = re.compile(r"(tcp://[^\s#'\"]*:\d+)#[A-Za-z0-9_\-]+")
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


def install() -> None:
    logger = logging.getLogger("rlsync")
    if not any(isinstance(f, RedactKeys) for f in logger.filters):
        logger.addFilter(RedactKeys())
