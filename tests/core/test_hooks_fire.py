"""Every hookspec fires, with the arguments its docstring promises, from the code path that promises it;
the process's default manager is built once and its hooks fire without anyone passing ``plugins=``."""

from __future__ import annotations

import importlib.metadata
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pluggy
import pytest
import torch

import rlsync
from rlsync import Decision, Sample, SyncOptions, WeightsReader, WeightsWriter, hookimpl
from rlsync.layouts import from_state_dict
from rlsync.testing import MemoryTransport


class Recorder:
    """Implements every hook and records each call's arguments."""

    def __init__(self) -> None:
        self.calls: dict[str, list[dict[str, Any]]] = {}

    def _seen(self, hook: str, **kwargs: Any) -> None:
        self.calls.setdefault(hook, []).append(kwargs)

    @hookimpl
    def rlsync_addhooks(self, pluginmanager: pluggy.PluginManager) -> None:
        self._seen("rlsync_addhooks", pluginmanager=pluginmanager)

    @hookimpl
    def rlsync_register_transports(self, registry: rlsync.Registry[Any]) -> None:
        self._seen("rlsync_register_transports", registry=registry)

    @hookimpl
    def rlsync_register_buffer_backends(self, registry: rlsync.Registry[Any]) -> None:
        self._seen("rlsync_register_buffer_backends", registry=registry)

    @hookimpl
    def rlsync_register_wire_codecs(self, registry: rlsync.Registry[Any]) -> None:
        self._seen("rlsync_register_wire_codecs", registry=registry)

    @hookimpl
    def rlsync_before_export(self, version: int, names: list[str]) -> None:
        self._seen("rlsync_before_export", version=version, names=list(names))

    @hookimpl
    def rlsync_transform_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        self._seen("rlsync_transform_tensor", name=name)
        return tensor * 2 if name == "w" else None  # the writer must send the transformed tensor

    @hookimpl
    def rlsync_after_export(self, version: int, stats: dict[str, Any]) -> None:
        self._seen("rlsync_after_export", version=version, stats=dict(stats))

    @hookimpl
    def rlsync_weights_applied(self, version: int, stats: dict[str, Any]) -> None:
        self._seen("rlsync_weights_applied", version=version, stats=dict(stats))

    @hookimpl
    def rlsync_on_put(self, samples: list[Sample]) -> None:
        self._seen("rlsync_on_put", ids=[s.prompt_id for s in samples])

    @hookimpl
    def rlsync_on_get(self, batch: rlsync.Batch) -> None:
        self._seen("rlsync_on_get", ids=[s.prompt_id for s in batch.samples])

    @hookimpl
    def rlsync_gate_sample(self, sample: Sample, trainer_version: int, max_staleness: int) -> Decision | None:
        self._seen("rlsync_gate_sample", prompt=sample.prompt_id, trainer_version=trainer_version, max_staleness=max_staleness)
        return Decision.DROP if sample.prompt_id == "banned" else None

    @hookimpl
    def rlsync_report(self, kind: str, stats: dict[str, Any]) -> None:
        self._seen("rlsync_report", kind=kind, stats=dict(stats))


@pytest.fixture
def recorded() -> Iterator[tuple[pluggy.PluginManager, Recorder]]:
    pm = rlsync.make_plugin_manager(autoload=False)
    recorder = Recorder()
    pm.register(recorder, name="recorder")
    yield pm, recorder


def _installed(module: types.ModuleType) -> Any:
    """A distribution that declares ``module`` in the ``rlsync_plugins`` entry-point group, as pip would install it."""
    entry_point = types.SimpleNamespace(name=module.__name__, group="rlsync_plugins", value=f"{module.__name__}:plugin",
                                        load=lambda: module)
    return types.SimpleNamespace(entry_points=[entry_point], metadata={"name": module.__name__.replace("_", "-")})


def _sample(prompt: str, version: int) -> Sample:
    return Sample(prompt, np.arange(4), 2, np.zeros(2, np.float32), np.full(2, version, np.int64))


def test_setup_and_registration_hooks_fire(recorded: tuple[pluggy.PluginManager, Recorder]) -> None:
    pm, recorder = recorded
    [addhooks] = recorder.calls["rlsync_addhooks"]  # historic: a plugin registered after the build still sees it
    assert addhooks["pluginmanager"] is pm
    assert "shm" in rlsync.core.transports(pm)
    assert "memory" in rlsync.core.buffer_backends(pm)
    assert "fp8" in rlsync.core.wire_codecs(pm)
    kinds = {h: recorder.calls[h][0]["registry"].kind for h in
             ("rlsync_register_transports", "rlsync_register_buffer_backends", "rlsync_register_wire_codecs")}
    assert kinds == {"rlsync_register_transports": "transport", "rlsync_register_buffer_backends": "buffer backend",
                     "rlsync_register_wire_codecs": "wire codec"}


def test_export_hooks_fire_around_a_version(recorded: tuple[pluggy.PluginManager, Recorder]) -> None:
    pm, recorder = recorded
    state = {"w": torch.ones(8, 4), "b": torch.full((3,), 5.0)}
    layout = from_state_dict(state)
    options = SyncOptions(transport=MemoryTransport, timeout=20)
    with WeightsReader(layout, layout, 0, options=options, plugins=pm) as reader:
        with WeightsWriter(layout, layout, 0, [reader.address], options=options, plugins=pm) as writer:
            writer.multi_put(state)
            writer.complete(7)
        live = reader.buffers()
        assert np.array_equal(live["w"].view(np.float32), np.full(32, 2.0, np.float32))  # transformed: doubled
        assert np.array_equal(live["b"].view(np.float32), np.full(3, 5.0, np.float32))  # None: unchanged
    assert sorted(c["name"] for c in recorder.calls["rlsync_transform_tensor"]) == ["b", "w"]
    assert recorder.calls["rlsync_before_export"] == [{"version": 7, "names": ["b", "w"]}]
    [after] = recorder.calls["rlsync_after_export"]
    assert after["version"] == 7 and after["stats"]["bytes"] == 32 * 4 + 3 * 4 and after["stats"]["seconds"] >= 0
    assert recorder.calls["rlsync_weights_applied"] == [{"version": 7, "stats": {"rank": 0, "writers": [0]}}]


def test_buffer_hooks_fire_and_the_gate_hook_decides(recorded: tuple[pluggy.PluginManager, Recorder]) -> None:
    pm, recorder = recorded
    buffer = rlsync.make_buffer("memory", plugins=pm, batch_size=2, max_staleness=1)
    buffer.publish(3)
    buffer.put([_sample("ok", 3), _sample("banned", 3), _sample("stale", 1), _sample("fine", 2)])
    batch = buffer.get(timeout=5)
    assert batch is not None and [s.prompt_id for s in batch.samples] == ["fine", "ok"]  # oldest version first
    assert recorder.calls["rlsync_on_put"] == [{"ids": ["ok", "banned", "stale", "fine"]}]
    assert recorder.calls["rlsync_on_get"] == [{"ids": ["fine", "ok"]}]
    buffer.put(_sample("last", 3))
    rest = buffer.get(1, timeout=5)
    assert rest is not None and [s.prompt_id for s in rest.samples] == ["last"]  # "banned" never trains
    gated = {c["prompt"]: (c["trainer_version"], c["max_staleness"]) for c in recorder.calls["rlsync_gate_sample"]}
    assert gated == {"stale": (3, 1), "fine": (3, 1), "ok": (3, 1), "banned": (3, 1), "last": (3, 1)}
    assert buffer.telemetry.dropped == 2  # "banned" by the plugin, "stale" by the built-in MaxStaleness
    buffer.report()
    [report] = recorder.calls["rlsync_report"]
    assert report["kind"] == "buffer" and report["stats"]["dropped"] == 2


def test_every_hookspec_has_a_firing_test(recorded: tuple[pluggy.PluginManager, Recorder]) -> None:
    pm, _ = recorded
    specs = {name for name in vars(pm.hook) if name.startswith("rlsync_")}
    implemented = {name for name in vars(Recorder) if name.startswith("rlsync_")}
    assert specs == implemented, f"hookspecs without a firing test: {sorted(specs - implemented)}"


def test_a_buffers_own_gate_is_asked_first_and_only_there() -> None:
    dropped_by_mine: list[str] = []

    def no_odd(sample: Sample, trainer_version: int) -> Decision | None:
        if sample.prompt_id.startswith("odd"):
            dropped_by_mine.append(sample.prompt_id)
            return Decision.DROP
        return None

    mine = rlsync.RolloutBuffer(batch_size=1, max_staleness=5, gates=[no_odd])
    other = rlsync.RolloutBuffer(batch_size=1, max_staleness=5)
    for buffer in (mine, other):
        buffer.publish(1)
        buffer.put([_sample("odd-1", 1), _sample("even", 1)])
    got_mine, got_other = mine.get(timeout=5), other.get(timeout=5)
    assert got_mine is not None and got_mine.samples[0].prompt_id == "even"
    assert got_other is not None and got_other.samples[0].prompt_id == "odd-1"
    assert dropped_by_mine == ["odd-1"]


def test_the_default_manager_is_built_once_and_fires_without_plugins_argument() -> None:
    calls: list[int] = []

    class AfterExport:
        @hookimpl
        def rlsync_after_export(self, version: int, stats: dict[str, Any]) -> None:
            calls.append(version)

    manager = rlsync.plugin_manager()
    assert manager is rlsync.plugin_manager()  # one per process
    plugin = AfterExport()
    manager.register(plugin, name="after-export-recorder")  # what an installed plugin's entry point amounts to
    try:
        state = {"w": torch.ones(4)}
        layout = from_state_dict(state)
        options = SyncOptions(transport=MemoryTransport, timeout=20)
        with WeightsReader(layout, layout, 0, options=options) as reader, \
                WeightsWriter(layout, layout, 0, [reader.address], options=options) as writer:
            writer.multi_put(state)
            writer.complete(1)
    finally:
        manager.unregister(plugin)
    assert calls == [1]  # the plugin's hook ran, though nobody passed plugins=


def test_a_misspelled_hook_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("rlsync_typo_plugin")

    @hookimpl
    def rlsync_after_exprot(version: int) -> None:  # the typo
        pass

    module.rlsync_after_exprot = rlsync_after_exprot  # type: ignore[attr-defined]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [_installed(module)])
    with pytest.raises(rlsync.PluginError, match="rlsync_after_exprot"):
        rlsync.make_plugin_manager()


def test_a_gate_plugin_registered_after_the_buffer_was_built_is_asked() -> None:
    pm = rlsync.make_plugin_manager(autoload=False)
    buffer = rlsync.make_buffer("memory", plugins=pm, batch_size=1, max_staleness=5)

    class NoBanned:
        @hookimpl
        def rlsync_gate_sample(self, sample: Sample) -> Decision | None:
            return Decision.DROP if sample.prompt_id == "banned" else None

    pm.register(NoBanned(), name="late-gate")  # after the buffer: its fast path must not skip this gate
    buffer.publish(1)
    buffer.put([_sample("banned", 1), _sample("ok", 1)])
    batch = buffer.get(timeout=5)
    assert batch is not None and [s.prompt_id for s in batch.samples] == ["ok"]
