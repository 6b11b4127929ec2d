"""Built-in staleness gates."""

from __future__ import annotations

from rlsync.core._gates import MaxStaleness
from rlsync.core._hookspecs import hookimpl
from rlsync.core._registry import Registry


@hookimpl(trylast=True)
def rlsync_register_gates(registry: Registry) -> None:  # type: ignore[type-arg]
    registry.add("max_staleness", MaxStaleness)
