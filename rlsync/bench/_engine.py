"""``rlsync bench --engine``: syncing into a running inference engine (not written yet)."""

from __future__ import annotations

from rlsync.core._errors import ConfigError


def run(*, engine: str, json_output: bool, repeats: int) -> None:
    raise ConfigError(
        f"rlsync bench --engine {engine!r} is not available yet; run `rlsync bench` (process to process) "
        f"or the vLLM tests (`nox -s vllm`) meanwhile"
    )
