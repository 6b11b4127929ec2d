"""Where each buffer sits in a reader's landing region, the runs a writer copies, and tensors as bytes.

Both sides compute these from the same plan, so nothing but fingerprints crosses the control plane.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from rlsync.core._errors import WeightMismatchError
from rlsync.core.layouts import Layout, dtype_size
from rlsync.core.layouts import Transfer

#: every buffer starts on this byte boundary inside its region
ALIGN = 64

#: ``[(source buffer, [(src_offset, region_offset, nbytes), ...]), ...]`` for one (writer rank, reader rank) pair
PairRuns = list[tuple[str, list[tuple[int, int, int]]]]


def region_offsets(layout: Layout, rank: int) -> tuple[dict[str, int], int]:
    """Byte offset of each of ``rank``'s buffers inside its landing region, and the region size."""
    offsets: dict[str, int] = {}
    at = 0
    for b in layout.buffers:
        if b.rank == rank:
            offsets[b.name] = at
            at += -(-(b.numel * dtype_size(b.dtype)) // ALIGN) * ALIGN
    return offsets, at


def runs_by_pair(transfers: Iterable[Transfer], offsets: Mapping[str, int]) -> dict[tuple[int, int], PairRuns]:
    """``{(src_rank, dst_rank): [(src_buffer, [(src_off, region_off, nbytes), ...]), ...]}`` in plan order,
    adjacent runs merged."""
    out: dict[tuple[int, int], PairRuns] = {}
    for t in transfers:
        groups = out.setdefault((t.src_rank, t.dst_rank), [])
        if not groups or groups[-1][0] != t.src_buffer:
            groups.append((t.src_buffer, []))
        runs = groups[-1][1]
        base = offsets[t.dst_buffer]
        for s, d, n in t.runs():
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == base + d:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
            else:
                runs.append((s, base + d, n))
    return out


def as_bytes(name: str, tensor: Any) -> torch.Tensor:
    """A 1-D ``uint8`` view of a contiguous tensor (any device) or numpy array (no copy)."""
    if isinstance(tensor, np.ndarray):
        if not tensor.flags.c_contiguous:
            raise WeightMismatchError(f"tensor {name!r} is not contiguous; pass np.ascontiguousarray(...)")
        raw: torch.Tensor = torch.from_numpy(tensor.reshape(-1).view(np.uint8))
        return raw
    if not tensor.is_contiguous():
        raise WeightMismatchError(f"tensor {name!r} is not contiguous; call .contiguous() before put()")
    flat: torch.Tensor = tensor.detach().reshape(-1).view(torch.uint8)
    return flat


def as_tensor(region: Any) -> torch.Tensor:
    """A landing region or a slice of one (host numpy array or device tensor) as a torch tensor (no copy)."""
    tensor: torch.Tensor = torch.from_numpy(region) if isinstance(region, np.ndarray) else region
    return tensor
