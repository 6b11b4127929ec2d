"""The hook specifications follow one shape: ``rlsync_`` prefix, a docstring that says where the
hook is called, historic setup hooks, firstresult factory hooks."""

import inspect

import pluggy

from rlsync.core import _hookspecs


def _specs() -> dict[str, object]:
    return {n: f for n, f in vars(_hookspecs).items() if n.startswith("rlsync_") and callable(f)}


def test_every_hook_is_prefixed_and_documented() -> None:
    specs = _specs()
    assert len(specs) >= 10
    for name, func in specs.items():
        doc = inspect.getdoc(func) or ""
        assert "Called on:" in doc, name
        assert "versionadded" in doc, name


def test_setup_hooks_are_historic_and_deciders_stop_at_first_result() -> None:
    pm = pluggy.PluginManager(_hookspecs.PROJECT)
    pm.add_hookspecs(_hookspecs)
    opts = {name: getattr(pm.hook, name).spec.opts for name in _specs()}
    assert opts["rlsync_addhooks"]["historic"] and opts["rlsync_configure"]["historic"]
    assert opts["rlsync_gate_sample"]["firstresult"]
    assert opts["rlsync_transform_tensor"]["firstresult"]
