"""Checks of the numbers a public constructor takes, at the door: one line naming the argument, the value and what
is allowed (a ``ConfigError``), instead of a hang or a traceback later."""

from __future__ import annotations

import operator
from typing import Any

from rlsync.core._errors import ConfigError


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
