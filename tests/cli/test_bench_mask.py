"""``rlsync bench --sampling-mask``: each way measures in a process of its own and reports seconds and peak memory;
the table names the ways that could not run and why."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rlsync.bench import _mask


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_mask, "TOKENS", 16)
    monkeypatch.setattr(_mask, "HIDDEN", 8)
    monkeypatch.setattr(_mask, "VOCAB", 64)


def test_each_way_reports_seconds_and_a_peak(small: None) -> None:
    for way in _mask.WAYS:
        if _mask._available(way) is None:
            got = _mask._measure(way, "cpu", 2)
            assert got["seconds"] > 0 and got["peak_bytes"] >= 0, way


def test_the_report_has_every_way_with_its_ratio_or_why_it_did_not_run(small: None, monkeypatch: pytest.MonkeyPatch,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    def child(args: list[str], **_: Any) -> Any:  # the child's work, in this process (the shape patched above)
        from types import SimpleNamespace

        return SimpleNamespace(returncode=0, stdout=json.dumps(_mask._measure(args[3], args[4], int(args[5]), int(args[6]))),
                               stderr="")

    monkeypatch.setattr(_mask.subprocess, "run", child)
    _mask.run(device=None, repeats=1, json_output=True, tokens=16)
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 16
    assert list(report["results"]) == list(_mask.WAYS) and report["results"]["chunked"]["x_chunked_seconds"] == 1.0
    assert all("x_chunked_seconds" in row or "skipped" in row for row in report["results"].values())
