"""The hook specifications follow one shape: ``rlsync_`` prefix, a docstring that says where the
hook is called, historic setup hooks, firstresult deciders."""

import inspect

import rlsync


def _specs() -> dict[str, object]:
    pm = rlsync.make_plugin_manager(autoload=False)
    return {name: caller for name, caller in vars(pm.hook).items() if name.startswith("rlsync_")}


def test_every_hook_is_prefixed_and_documented() -> None:
    specs = _specs()
    assert len(specs) >= 10
    for name, caller in specs.items():
        doc = inspect.getdoc(caller.spec.function) or ""  # type: ignore[attr-defined]
        assert "Called on:" in doc, name
        assert "versionadded" in doc, name


def test_setup_hooks_are_historic_and_deciders_stop_at_first_result() -> None:
    opts = {name: caller.spec.opts for name, caller in _specs().items()}  # type: ignore[attr-defined]
    assert opts["rlsync_addhooks"]["historic"]
    assert opts["rlsync_gate_sample"]["firstresult"]
    assert opts["rlsync_transform_tensor"]["firstresult"]
