"""FAKE of ``flash_attn.utils.distributed`` (see the package docstring)."""

from typing import Any


def all_gather(*_: Any, **__: Any) -> Any:
    raise NotImplementedError("FAKE flash_attn (rlsync tests): ring attention is not available on CPU")
