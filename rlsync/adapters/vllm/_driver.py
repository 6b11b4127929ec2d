"""Driver side of the worker-extension route: one call per version, from the process that owns the ``LLM``."""

from __future__ import annotations

from typing import Any

from rlsync import DEFAULT_TIMEOUT, VersionError


def apply_next_version(llm: Any, timeout: float = DEFAULT_TIMEOUT) -> int:
    """Every worker loads the next version that has fully landed (``rlsync_apply``); then the prefix cache is
    reset (cached prefixes hold activations computed with the old weights) and the version becomes the
    engine's weight version, which vLLM reports on every output. Call it between ``generate`` calls.
    Returns the version; raises if none arrives within ``timeout`` (the engine keeps the old weights)."""
    versions = llm.collective_rpc("rlsync_apply", args=(timeout,))
    if len(set(versions)) != 1:
        raise VersionError(f"vLLM workers loaded different weight versions {versions}: restart the update")
    llm.reset_prefix_cache()
    llm.update_weight_version(str(versions[0]))
    return int(versions[0])
