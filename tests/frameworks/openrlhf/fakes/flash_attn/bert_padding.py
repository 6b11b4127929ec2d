"""FAKE of ``flash_attn.bert_padding`` (see the package docstring): ``rearrange`` is einops' (as flash-attn's is)."""

from typing import Any

from einops import rearrange  # noqa: F401  (flash_attn.bert_padding re-exports einops.rearrange)


def _unavailable(*_: Any, **__: Any) -> Any:
    raise NotImplementedError("FAKE flash_attn (rlsync tests): packed-sample training is not available on CPU")


index_first_axis = pad_input = unpad_input = _unavailable
