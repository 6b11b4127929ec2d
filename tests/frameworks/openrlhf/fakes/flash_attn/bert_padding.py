"""FAKE of ``flash_attn.bert_padding`` (see the package docstring). flash-attn's padding helpers are plain PyTorch
(no kernel), so this fake implements their contract (flash-attn 2.8, ``flash_attn/bert_padding.py``) for
OpenRLHF's packed-sample forward (``openrlhf/models/ring_attn_utils.py``): ``unpad_input(hidden, mask)`` returns the
unmasked rows of ``hidden`` in row-major order, their flat ``indices``, ``cu_seqlens`` (int32, from 0),
``max_seqlen`` and the per-row lengths; ``index_first_axis(x, indices)`` is ``x[indices]``; ``pad_input(x, indices,
batch, seqlen)`` scatters rows back into zeros of ``[batch, seqlen, ...]``. ``rearrange`` is einops' (as flash-attn's
is)."""

from typing import Any

import torch
from einops import rearrange  # noqa: F401  (flash_attn.bert_padding re-exports einops.rearrange)


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return x[indices]


def unpad_input(hidden: torch.Tensor, attention_mask: torch.Tensor, unused_mask: Any = None) -> tuple[Any, ...]:
    lengths = attention_mask.sum(-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    flat = hidden.reshape(-1, *hidden.shape[2:])
    return flat[indices], indices, cu_seqlens, int(lengths.max()), lengths


def pad_input(x: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    out = torch.zeros(batch * seqlen, *x.shape[1:], dtype=x.dtype, device=x.device)
    out[indices] = x
    return out.view(batch, seqlen, *x.shape[1:])
