"""Writer and reader processes for the weight-sync tests (run as scripts: ``python sync_processes.py ...``).

The layouts and the values of each version are pure functions of their names, so the test
process can check what landed without sharing memory with the writers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np
import torch

from rlsync import Layout, SyncOptions, TensorMeta
from rlsync.adapters.vllm import engine_layout
from rlsync.layouts import allocate, engine_tp, from_state_dict, fsdp, model_spec, replicated, scatter

TINY_QWEN2 = dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, vocab_size=96)
PLAIN = [TensorMeta(f"layer{i}.weight", "bfloat16", (96, 64)) for i in range(6)] + [TensorMeta("norm.weight", "float32", (64,))]
# what a probe of vLLM's loader finds at tensor parallelism 2: row halves (column-parallel), column
# halves (row-parallel), a replicated norm; layer5 is read by rank 1 only
BOXES_TP2 = [
    {**{f"layer{i}.weight": [[0, 0], [48, 64]] for i in range(3)},
     **{f"layer{i}.weight": [[0, 0], [96, 32]] for i in range(3, 5)}, "norm.weight": [[0], [64]]},
    {**{f"layer{i}.weight": [[48, 0], [48, 64]] for i in range(3)},
     **{f"layer{i}.weight": [[0, 32], [96, 32]] for i in range(3, 6)}, "norm.weight": [[0], [64]]},
]


def layouts(kind: str) -> tuple[Layout, Layout]:
    if kind == "plain":  # one writer, one reader
        return from_state_dict(PLAIN), from_state_dict(PLAIN)
    if kind == "large":  # 32 MiB, for a network path that loses packets: enough of them to lose
        large = [TensorMeta(f"layer{i}.weight", "bfloat16", (1024, 1024)) for i in range(16)]
        return from_state_dict(large), from_state_dict(large)
    if kind == "two_writers":  # FSDP over 2 trainer ranks -> one reader that holds everything
        return fsdp(PLAIN, 2), from_state_dict(PLAIN)
    if kind == "fanout":  # one writer, two readers that each need everything
        return from_state_dict(PLAIN), replicated(PLAIN, (0, 1))
    if kind == "boxes_tp2":  # whole tensors -> two vLLM workers that each hold the box their loader reads
        return from_state_dict(PLAIN), engine_layout([[t.name, t.dtype, t.shape] for t in PLAIN], BOXES_TP2)
    if kind == "fsdp2_tp2":  # FSDP over 2 trainer ranks -> vLLM-style TP=2 with fused qkv / gate_up
        spec = model_spec(TINY_QWEN2)
        return fsdp(spec.tensors, 2), engine_tp(spec, 2)
    raise SystemExit(f"unknown layout kind {kind}")


def values(layout: Layout, version: int) -> dict[str, np.ndarray]:
    """The global tensors of ``version`` as raw unsigned integers (bf16 bits for bf16)."""
    gen = torch.Generator().manual_seed(1000 + version)
    out = {}
    for t in layout.tensors:
        x = torch.randn(t.shape, generator=gen).to(getattr(torch, t.dtype))
        out[t.name] = x.view({2: torch.int16, 4: torch.int32}[x.element_size()]).numpy().view(
            {2: np.uint16, 4: np.uint32}[x.element_size()]
        )
    return out


def delta_values(layout: Layout, version: int, share: float = 0.02) -> dict[str, np.ndarray]:
    """Like ``values(layout, 0)``, then for each version 1..``version`` a new ``share`` of the elements changes
    (the way an RL step changes a few bf16 values): consecutive versions differ in a few percent of values."""
    out = {name: v.copy() for name, v in values(layout, 0).items()}
    for k in range(1, version + 1):
        gen = np.random.default_rng(2000 + k)
        for name in sorted(out):
            flat = out[name].reshape(-1)
            picked = gen.random(flat.size) < share
            flat[picked] = gen.integers(0, 2**15, picked.sum()).astype(flat.dtype)
    return out


def writer_main(args: argparse.Namespace) -> None:
    from rlsync import WeightsWriter

    src, dst = layouts(args.layout)
    readers = {int(k): v for k, v in json.loads(args.readers).items()}
    writer = WeightsWriter(src, None if args.replicas else dst, args.rank, readers,
                           options=SyncOptions(transport=args.transport, timeout=args.timeout, verify=args.checksum,
                                               wire="delta" if args.delta else "full"))
    if args.die_after_writes:
        budget = [args.die_after_writes]
        original_open = writer._transport.open

        def open_then_die(description, options=None):  # type: ignore[no-untyped-def]
            link = original_open(description, options)
            original_write = link.write

            def write(source, runs):  # type: ignore[no-untyped-def]
                if budget[0] == 0:  # die mid-version, like an OOM-killed trainer (or hang, its connections open)
                    os.kill(os.getpid(), signal.SIGSTOP if args.hang else signal.SIGKILL)
                budget[0] -= 1
                original_write(source, runs)

            link.write = write
            link.prepare = lambda parts: list(parts)  # a prepared version written part by part: it dies between two
            link.write_prepared = lambda prepared: [write(source, runs) for source, runs in prepared]
            return link

        writer._transport = type("DyingTransport", (writer._transport,), {"open": staticmethod(open_then_die)})
    for version in args.versions:
        began = time.monotonic()
        buffers = allocate(src, args.rank)
        scatter(src, args.rank, (delta_values if args.delta else values)(src, version), buffers)
        dtypes = {b.name: b.dtype for b in src.buffers if b.rank == args.rank}
        writer.multi_put({name: torch.from_numpy(buf).view(getattr(torch, dtypes[name])) for name, buf in buffers.items()})
        if args.wait_for:  # a test cuts the network here (the version's bytes are put, not yet complete)
            print(json.dumps({"put": version}), flush=True)
            while not os.path.exists(f"{args.wait_for}.{version}"):
                time.sleep(0.01)
        started = time.monotonic()
        try:
            writer.complete(version)
        except Exception as exc:  # noqa: BLE001 - reported; --keep-going goes on with the next version
            print(json.dumps({"failed": version, "error": f"{type(exc).__name__}: {exc}",
                              "seconds": time.monotonic() - started}), flush=True)
            if not args.keep_going:
                raise
            continue
        print(json.dumps({"completed": version, "bytes": writer.last_bytes, "seconds": time.monotonic() - started,
                          "with_put": time.monotonic() - began}), flush=True)
    writer.close()


def reader_main(args: argparse.Namespace) -> None:
    from rlsync import WeightsReader

    src, dst = layouts(args.layout)
    try:
        options = SyncOptions(transport=args.transport, host=args.host)
        if args.replicas:  # one of N engines holding a whole copy each: the layout comes from the writers
            reader = WeightsReader(None, None, args.rank, replicas=args.replicas, options=options)
        else:
            reader = WeightsReader(src, dst, args.rank, options=options)
    except Exception as exc:  # noqa: BLE001 - a refused configuration is what some tests look for
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return
    print(json.dumps({"address": reader.address}), flush=True)
    deadline = time.monotonic() + args.timeout
    seen: int | None = None
    refused: str | None = None
    while time.monotonic() < deadline:
        said = reader.refusal or reader.last_rejection  # a writer refused, or a peer that failed the handshake
        if said != refused:
            refused = said
            print(json.dumps({"refused": refused}), flush=True)
        if reader.version != seen:
            report: dict[str, object] = {}
            with reader.lock:  # the version and its bytes together: the next may go live between two reads
                seen = reader.version
                report["version"] = seen
                if args.check and seen > 0:  # every byte that landed, against the values the writer sent for it
                    expected = values(src if args.replicas else dst, seen)
                    got = {name: np.empty_like(array) for name, array in expected.items()}
                    reader.multi_get(got)
                    report["exact"] = all(np.array_equal(got[n], expected[n]) for n in expected)
            print(json.dumps(report), flush=True)
        time.sleep(0.01)
    reader.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["writer", "reader"])
    parser.add_argument("--layout", default="plain")
    parser.add_argument("--transport", default="shm")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--readers", default="{}")
    parser.add_argument("--versions", type=int, nargs="*", default=[1])
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--checksum", action="store_true")
    parser.add_argument("--die-after-writes", type=int, default=0)
    parser.add_argument("--hang", action="store_true", help="writer: at --die-after-writes, stop (SIGSTOP) instead")
    parser.add_argument("--delta", action="store_true", help="send deltas; versions change a few values each")
    parser.add_argument("--host", default="127.0.0.1", help="reader: the address it listens on")
    parser.add_argument("--check", action="store_true", help="reader: compare every landed version with its values")
    parser.add_argument("--wait-for", default="", help="writer: before completing version V, wait for file PATH.V")
    parser.add_argument("--keep-going", action="store_true", help="writer: a version that fails is reported, then the next")
    parser.add_argument("--replicas", type=int, default=0, help="N engines that hold a whole copy each (layout from the writer)")
    ns = parser.parse_args()
    (writer_main if ns.role == "writer" else reader_main)(ns)
    sys.exit(0)
