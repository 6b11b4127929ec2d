"""Plugin discovery: built-ins, entry points, blocking, and registry errors."""

from __future__ import annotations

import importlib.metadata
import types
from typing import Any

import pytest

import rlsync
from rlsync.core import ENTRY_POINT_GROUP, make_plugin_manager, transports


class _FakeEntryPoint:
    def __init__(self, name: str, obj: object) -> None:
        self.name = name
        self.group = ENTRY_POINT_GROUP
        self.value = f"{name}:plugin"
        self._obj = obj

    def load(self) -> object:
        return self._obj


class _FakeDist:
    def __init__(self, entry_points: list[_FakeEntryPoint]) -> None:
        self.entry_points = entry_points
        self.metadata = {"name": "rlsync-fake-plugin"}


def _plugin_module() -> types.ModuleType:
    mod = types.ModuleType("rlsync_fake_plugin")

    @rlsync.hookimpl
    def rlsync_register_transports(registry: Any) -> None:
        registry.add("carrier-pigeon", lambda: "pigeon")

    mod.rlsync_register_transports = rlsync_register_transports  # type: ignore[attr-defined]
    return mod


def test_entry_point_plugin_registers_a_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    dist = _FakeDist([_FakeEntryPoint("pigeon", _plugin_module())])
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [dist])
    registry = transports(make_plugin_manager())
    assert registry.create("carrier-pigeon") == "pigeon"


def test_autoload_can_be_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    dist = _FakeDist([_FakeEntryPoint("pigeon", _plugin_module())])
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [dist])
    monkeypatch.setenv("RLSYNC_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = transports(make_plugin_manager())
    assert "carrier-pigeon" not in registry


def test_unknown_name_lists_the_registered_ones() -> None:
    registry: rlsync.Registry[int] = rlsync.Registry("transport")
    registry.add("shm", lambda: 1)
    registry.add("tcp", lambda: 2)
    with pytest.raises(rlsync.PluginError, match=r"unknown transport 'rdma'; registered: shm, tcp"):
        registry.create("rdma")


def test_first_registration_wins() -> None:
    registry: rlsync.Registry[int] = rlsync.Registry("gate")
    registry.add("drop", lambda: 1)
    registry.add("drop", lambda: 2)
    assert registry.create("drop") == 1
