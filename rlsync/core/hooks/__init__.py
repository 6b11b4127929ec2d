"""Hooks: rlsync's extension points and the plugin manager that calls them.

Owns the hook specifications (``rlsync.hookspec``: every place a plugin may add a transport, a buffer backend, a
gate, a wire codec or observe an event), the registries plugins fill, and the process's plugin manager (built-ins
first, then the ``rlsync_plugins`` entry points). The specifications import no implementation module: the
implementations live in ``rlsync.plugins`` and are found through the manager.
"""

from __future__ import annotations

from rlsync.core.hooks._hookspecs import hookimpl, hookspec
from rlsync.core.hooks._registry import Registry
from rlsync.core.hooks._plugins import BUILTIN_PLUGINS, ENTRY_POINT_GROUP, buffer_backends, collect, default_plugin_manager, make_plugin_manager, transports, wire_codecs

__all__ = ["BUILTIN_PLUGINS", "ENTRY_POINT_GROUP", "Registry", "buffer_backends", "collect", "default_plugin_manager", "hookimpl", "hookspec", "make_plugin_manager", "transports", "wire_codecs"]
