"""``make_buffer``: a rollout buffer from a backend name (a plugin registry lookup)."""

from __future__ import annotations

from typing import Any

import pluggy

from rlsync.core.hooks import buffer_backends, default_plugin_manager


def make_buffer(backend: str = "memory", *, plugins: pluggy.PluginManager | None = None, **options: Any) -> Any:
    """``make_buffer("memory", batch_size=64, max_staleness=2)``; ``"redis"`` (``url=...``), ``"ray"``,
    or any backend a plugin registers. The buffer fires the hooks of ``plugins`` (default: the process's
    manager, ``rlsync.plugin_manager()``); a backend running in another process (Ray) fires that process's."""
    pm = plugins or default_plugin_manager()
    return buffer_backends(pm).create(backend, plugins=pm, **options)
