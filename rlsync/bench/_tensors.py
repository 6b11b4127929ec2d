"""``rlsync bench --tensors N``: what a version costs per tensor on the host, beside its bytes.

The same bytes (``--size``, default 64 MiB of bf16) as one tensor and as N tensors, each synced from a writer to a
reader (``--transports``, shm by default) in one process, version after version as a trainer does it: the same
tensors changed in place (an optimizer step), ``multi_put``, ``complete``. Per version and kind of model:

* writer: ``multi_put`` + ``complete`` less the reader's commit (it runs in the same process, within ``complete``);
* reader: its commit (``WeightsReader.last_commit_seconds``: from the completing Done to the version live).

The host cost per tensor is the difference between N tensors and one, divided by N, over the versions after the
first (the first prepares what later versions reuse). Beside it, the copy limit: the machine's memcpy of the bytes,
measured in the same run. Every version is checked bit-exact.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import numpy as np

from rlsync import ConfigError, SyncOptions
from rlsync.bench._weights import memcpy_gbps, parse_size


def _versions(tensors: int, nbytes: int, versions: int, transport: str) -> dict[str, Any]:
    import torch

    from rlsync import WeightsReader, WeightsWriter
    from rlsync.layouts import from_state_dict

    per = max(1, nbytes // 2 // tensors)  # bf16 elements per tensor
    rng = np.random.default_rng(0)
    state = {f"layers.{i}.weight": torch.from_numpy(rng.integers(0, 2**14, per, dtype=np.int16)).view(torch.bfloat16)
             for i in range(tensors)}
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
    return {"tensors": tensors, "bytes": per * 2 * tensors, "writer_seconds": writer_s, "reader_seconds": reader_s,
            "writer_median": statistics.median(writer_s[later]), "reader_median": statistics.median(reader_s[later]),
            "bit_exact": exact}


def measure(tensors: int, nbytes: int, versions: int, transport: str) -> dict[str, Any]:
    one = _versions(1, nbytes, versions, transport)
    many = _versions(tensors, nbytes, versions, transport)
    mem = memcpy_gbps(many["bytes"])
    return {
        "transport": transport, "tensors": tensors, "bytes": many["bytes"], "versions": versions,
        "memcpy_gbps": mem, "copy_limit_seconds": many["bytes"] / mem / 1e9, "one_tensor": one, "many_tensors": many,
        "writer_us_per_tensor": (many["writer_median"] - one["writer_median"]) / tensors * 1e6,
        "reader_us_per_tensor": (many["reader_median"] - one["reader_median"]) / tensors * 1e6,
        "bit_exact": one["bit_exact"] and many["bit_exact"],
    }


MAX_TENSORS = 1_000_000  # beyond it the bench's own set-up (a Python object per tensor) is what it would measure


def run(*, tensors: int, size: str | None, versions: int, transport: str, json_output: bool) -> None:
    if tensors < 1 or versions < 2:
        raise ConfigError(f"--tensors {tensors} with --repeats {versions - 1}: at least 1 tensor and 1 repeat (a first "
                          f"version prepares what the later ones reuse; they are what is measured)")
    nbytes = parse_size(size or "64MiB")
    if tensors > min(MAX_TENSORS, nbytes // 2):
        raise ConfigError(f"--tensors {tensors}: at most {min(MAX_TENSORS, nbytes // 2):,} for --size {size or '64MiB'} "
                          f"(one bf16 value each at least, and {MAX_TENSORS:,} in all: a MoE of 1T parameters has about "
                          f"70,000)")
    report = measure(tensors, nbytes, versions, transport)
    if json_output:
        print(json.dumps(report))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"host cost per tensor: {report['bytes'] / 2**20:.0f} MiB of bf16 as 1 and as {tensors} tensors, "
                        f"{transport}, versions 2-{versions} (median)")
    for column in ("", "writer (put + complete)", "reader (commit)"):
        table.add_column(column, justify="right")
    for key, label in (("one_tensor", "1 tensor, ms"), ("many_tensors", f"{tensors} tensors, ms")):
        table.add_row(label, f"{report[key]['writer_median'] * 1e3:.2f}", f"{report[key]['reader_median'] * 1e3:.2f}")
    table.add_row("per tensor, µs", f"{report['writer_us_per_tensor']:.2f}", f"{report['reader_us_per_tensor']:.2f}")
    Console().print(table)
    Console().print(f"copy limit (memcpy of the bytes, {report['memcpy_gbps']:.1f} GB/s here): "
                    f"{report['copy_limit_seconds'] * 1e3:.2f} ms; every version bit-exact: {report['bit_exact']}")
