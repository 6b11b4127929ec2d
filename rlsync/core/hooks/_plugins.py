"""The plugin manager: built-in plugins first, then the ``rlsync_plugins`` entry points.

``plugin_manager()`` is the process's one manager, built on first use and kept: every reader, writer
and buffer calls its hooks unless handed another. ``make_plugin_manager()`` builds a fresh one (tests,
or a process that wants other plugins). Set ``RLSYNC_DISABLE_PLUGIN_AUTOLOAD=1`` to skip entry points;
pass ``blocked=("name",)`` to keep a plugin (built-in or third-party) from registering.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Iterable
from typing import Any

import pluggy

from rlsync.core.hooks import _hookspecs
from rlsync.core._errors import PluginError
from rlsync.core.hooks._registry import Registry

ENTRY_POINT_GROUP = "rlsync_plugins"

#: Modules under ``rlsync.plugins`` that register built-in pieces. Each is imported only when
#: a plugin manager is built, never when ``rlsync`` is imported.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "rlsync.plugins.transports",
    "rlsync.plugins.buffers",
    "rlsync.plugins.gates",
    "rlsync.plugins.wires",
)

_default: pluggy.PluginManager | None = None
_default_lock = threading.Lock()


def make_plugin_manager(
    *, blocked: Iterable[str] = (), autoload: bool | None = None
) -> pluggy.PluginManager:
    """A fresh plugin manager with the built-ins and (unless disabled) third-party plugins."""
    pm = pluggy.PluginManager(_hookspecs.PROJECT)
    pm.add_hookspecs(_hookspecs)
    for name in blocked:
        pm.set_blocked(name)
    for module_name in BUILTIN_PLUGINS:
        if pm.is_blocked(module_name):
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:  # not built yet in this tree
                continue
            raise PluginError(f"built-in plugin {module_name!r} failed to import: {exc}") from exc
        pm.register(module, name=module_name)
    if autoload is None:
        autoload = os.environ.get("RLSYNC_DISABLE_PLUGIN_AUTOLOAD", "") in ("", "0")
    if autoload:
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        except Exception as exc:  # name the plugin: pluggy's own error does not
            raise PluginError(
                f"a plugin in entry-point group {ENTRY_POINT_GROUP!r} failed to load: {exc!r}. "
                f"Uninstall or fix it, or set RLSYNC_DISABLE_PLUGIN_AUTOLOAD=1."
            ) from exc
    pm.hook.rlsync_addhooks.call_historic(kwargs={"pluginmanager": pm})
    try:  # a hook implementation whose name matches no hookspec (a typo) is an error, not silence
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"{exc}. Fix the plugin's hook name (rlsync's hooks: rlsync.hookspec) or block it.") from exc
    return pm


def default_plugin_manager() -> pluggy.PluginManager:
    """The process's plugin manager, built once on first use (``rlsync.plugin_manager``)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = make_plugin_manager()
        return _default


def collect(pm: pluggy.PluginManager | None, hook_name: str, kind: str) -> Registry[Any]:
    """Call a ``rlsync_register_*`` hook and return the filled registry."""
    registry: Registry[Any] = Registry(kind)
    getattr((pm or default_plugin_manager()).hook, hook_name)(registry=registry)
    return registry


def transports(pm: pluggy.PluginManager | None = None) -> Registry[Any]:
    return collect(pm, "rlsync_register_transports", "transport")


def buffer_backends(pm: pluggy.PluginManager | None = None) -> Registry[Any]:
    return collect(pm, "rlsync_register_buffer_backends", "buffer backend")


def wire_codecs(pm: pluggy.PluginManager | None = None) -> Registry[Any]:
    return collect(pm, "rlsync_register_wire_codecs", "wire codec")
