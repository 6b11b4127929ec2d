"""The vLLM adapter takes the vLLM versions whose reload internals it was written against, and refuses others by
name (a fake ``vllm`` module stands in for the version number only)."""

from __future__ import annotations

import sys
import types

import pytest

from rlsync import ConfigError
from rlsync.adapters.vllm._reload import _check_vllm_version


@pytest.mark.parametrize(("version", "ok"), [("0.32.0", True), ("0.33.0", True), ("0.31.2", False), ("0.34.0", False)])
def test_supported_vllm_versions(version: str, ok: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    if ok:
        _check_vllm_version()
    else:
        with pytest.raises(ConfigError, match=rf"this is vLLM {version}"):
            _check_vllm_version()
