"""``rlsync bench --tensors N``: what a version costs per tensor on the host, beside its bytes.

The same bytes (``--size``, default 64 MiB of bf16) as one tensor and as N tensors (or a preset's own tensors with
``--model``: every tensor as a trainer holds it, experts one by one, each ``--scale`` of its size), each synced from a
writer to a reader (``--transports``, shm by default) in one process, version after version as a trainer does it: the same
tensors changed in place (an optimizer step), ``multi_put``, ``complete``. Per version and kind of model:

* writer: ``multi_put`` + ``complete`` less the reader's commit (it runs in the same process, within ``complete``);
* reader: its commit (``WeightsReader.last_commit_seconds``: from the completing Done to the version live).

The host cost per tensor is the difference between N tensors and one, divided by N, over the versions after the
first (the first prepares what later versions reuse). Beside it, the copy limit: the machine's memcpy of the bytes,
measured in the same run. Every version is checked bit-exact.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any

import numpy as np

from rlsync import ConfigError, SyncOptions
from rlsync.bench._weights import check_fits, memcpy_gbps, parse_size


def _versions(sizes: dict[str, int], versions: int, transport: str) -> dict[str, Any]:
    import torch

    from rlsync import WeightsReader, WeightsWriter
    from rlsync.layouts import from_state_dict

    rng = np.random.default_rng(0)
    state = {name: torch.from_numpy(rng.integers(0, 2**14, n, dtype=np.int16)).view(torch.bfloat16)
             for name, n in sizes.items()}  # bf16 values, n of them
    layout = from_state_dict(state)
    options = SyncOptions(transport=transport, timeout=600)
    writer_s, reader_s, exact = [], [], True
    with WeightsReader(layout, layout, 0, options=options) as reader, \
            WeightsWriter(layout, layout, 0, [reader.address], options=options) as writer:
        for version in range(1, versions + 1):
            for t in state.values():
                t.view(torch.int16).add_(1)  # every byte changes, in place, as an optimizer step changes them
            started = time.perf_counter()
            writer.multi_put(state)
            writer.complete(version)
            total = time.perf_counter() - started
            reader_s.append(reader.last_commit_seconds)
            writer_s.append(total - reader.last_commit_seconds)
            live = reader.buffers()
            exact &= all(np.array_equal(np.asarray(live[n]), t.view(torch.uint8).numpy()) for n, t in state.items())
    later = slice(1, None) if versions > 1 else slice(None)
    return {"tensors": len(sizes), "bytes": 2 * sum(sizes.values()), "writer_seconds": writer_s, "reader_seconds": reader_s,
            "writer_median": statistics.median(writer_s[later]), "reader_median": statistics.median(reader_s[later]),
            "bit_exact": exact}


def measure(sizes: dict[str, int], versions: int, transport: str) -> dict[str, Any]:
    """``sizes``: bf16 values per tensor; measured against one tensor of all their values."""
    tensors = len(sizes)
    one = _versions({"all.weight": sum(sizes.values())}, versions, transport)
    many = _versions(sizes, versions, transport)
    mem = memcpy_gbps(many["bytes"])
    return {
        "transport": transport, "tensors": tensors, "bytes": many["bytes"], "versions": versions,
        "memcpy_gbps": mem, "copy_limit_seconds": many["bytes"] / mem / 1e9, "one_tensor": one, "many_tensors": many,
        "writer_us_per_tensor": (many["writer_median"] - one["writer_median"]) / tensors * 1e6,
        "reader_us_per_tensor": (many["reader_median"] - one["reader_median"]) / tensors * 1e6,
        "bit_exact": one["bit_exact"] and many["bit_exact"],
    }


def model_sizes(model: str, scale: float) -> dict[str, int]:
    """A preset's tensors as a trainer holds them, each ``scale`` of its values (one at least): stacked experts split
    into one tensor per expert (an HF checkpoint's and a trainer's names), so the count is the trainer's (a
    Qwen3-30B-A3B about 19,000, a Kimi-K2 about 70,000)."""
    from rlsync.layouts import PRESETS, load_model_spec

    if model not in PRESETS:
        raise ConfigError(f"--model {model!r}: a preset, one of {', '.join(sorted(PRESETS))}")
    sizes: dict[str, int] = {}
    for param in load_model_spec(model).params:
        meta = param.meta
        numel = math.prod(meta.shape)
        if param.role.startswith("expert_"):  # [E, ...]: E tensors of the rest
            for e in range(meta.shape[0]):
                sizes[f"{meta.name}.{e}"] = max(1, round(numel // meta.shape[0] * scale))
        else:
            sizes[meta.name] = max(1, round(numel * scale))
    return sizes


def parse_scale(text: str) -> float:
    """``"1/256"`` or ``"0.004"`` -> a fraction in (0, 1]."""
    top, _, bottom = text.partition("/")
    try:
        scale = float(top) / float(bottom or 1)
    except (ValueError, ZeroDivisionError):
        scale = -1.0
    if not 0 < scale <= 1:
        raise ConfigError(f"--scale {text!r}: a fraction of the model's size above 0 and at most 1, e.g. 1/256")
    return scale


MAX_TENSORS = 1_000_000  # beyond it the bench's own set-up (a Python object per tensor) is what it would measure


def run(*, tensors: int | None, size: str | None, versions: int, transport: str, json_output: bool,
        model: str | None = None, scale: str = "1/256") -> None:
    if versions < 2:
        raise ConfigError(f"--repeats {versions - 1}: at least 1 (a first version prepares what the later ones reuse; "
                          f"they are what is measured)")
    if model is not None:
        if tensors is not None or size is not None:
            raise ConfigError("--model takes its tensors and their sizes from the preset (and --scale): leave out "
                              "--tensors and --size")
        sizes = model_sizes(model, parse_scale(scale))
        check_fits(2 * sum(sizes.values()), 4, f"rlsync bench --model {model} --scale {scale}", "a smaller --scale")
    else:
        if tensors is None or tensors < 1:
            raise ConfigError(f"--tensors {tensors}: at least 1 tensor")
        nbytes = parse_size(size or "64MiB")
        if tensors > min(MAX_TENSORS, nbytes // 2):
            raise ConfigError(f"--tensors {tensors}: at most {min(MAX_TENSORS, nbytes // 2):,} for --size {size or '64MiB'} "
                              f"(one bf16 value each at least, and {MAX_TENSORS:,} in all: a MoE of 1T parameters has "
                              f"about 70,000)")
        check_fits(nbytes, 4, f"rlsync bench --tensors {tensors} --size {size}")  # the tensors, one, two reader slots
        per = max(1, nbytes // 2 // tensors)
        sizes = {f"layers.{i}.weight": per for i in range(tensors)}
    report = measure(sizes, versions, transport)
    report["model"] = None if model is None else f"{model} x {scale}"
    tensors = len(sizes)
    if json_output:
        print(json.dumps(report))
        return
    from rich.console import Console
    from rich.table import Table

    what = f"{report['model']}'s {tensors:,} tensors" if model else f"{tensors} tensors"
    table = Table(title=f"host cost per tensor: {report['bytes'] / 2**20:.0f} MiB of bf16 as 1 tensor and as {what}, "
                        f"{transport}, versions 2-{versions} (median)")
    for column in ("", "writer (put + complete)", "reader (commit)"):
        table.add_column(column, justify="right")
    for key, label in (("one_tensor", "1 tensor, ms"), ("many_tensors", f"{tensors:,} tensors, ms")):
        table.add_row(label, f"{report[key]['writer_median'] * 1e3:.2f}", f"{report[key]['reader_median'] * 1e3:.2f}")
    table.add_row("per tensor, µs", f"{report['writer_us_per_tensor']:.2f}", f"{report['reader_us_per_tensor']:.2f}")
    Console().print(table)
    Console().print(f"copy limit (memcpy of the bytes, {report['memcpy_gbps']:.1f} GB/s here): "
                    f"{report['copy_limit_seconds'] * 1e3:.2f} ms; every version bit-exact: {report['bit_exact']}")
