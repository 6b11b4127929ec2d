"""``rlsync bench --wire delta``: full versions against delta versions, on what RL training does to weights.

A Qwen2-shaped model (transformers, float32 master weights, on ``--device``: a GPU trainer finds and encodes its
changes on the GPU) takes real AdamW steps at an RL learning
rate (1e-6 by default) on a language-model loss over random tokens; after each step its bfloat16 copy
is published twice, by a full writer and by a delta writer (``WeightsWriter(options=SyncOptions(wire="delta"))``), each into
its own reader process (tcp by default, where deltas matter and are compressed; direct landing). Per version: the share of bf16 values that changed,
bytes moved and seconds to live for both, and whether the delta reader's bytes equal the trainer's
(CRC-32 of every tensor, computed on both sides). The machine's memcpy bandwidth is measured in the
same run: a full version cannot go live faster than one copy of the model.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
import zlib
from typing import Any

import numpy as np

from rlsync import ConfigError, SyncOptions
from rlsync.bench._link import Link, slow_link
from rlsync.bench._weights import _read, available_bytes, bench_spec, memcpy_gbps, parse_size
from rlsync.plugins import remove_stale_regions


#: engine ranks on the far host behind one ``NodeRelay`` (``--link-gbps``), unless ``--fanout-ranks`` says otherwise
FANOUT = 4


def memory_needed(nbytes: int, device: str, fanout: int) -> dict[str, float]:
    """Bytes of host memory the run takes, by who takes them (``nbytes``: the model in bf16). The trainer on the
    host: float32 weights, gradients and AdamW's two moments (10x the bf16 bytes), its bf16 copy and the last one,
    activations, and one copy per delta writer to find changes against (measured: 13.4 GB for a 1.08 GB model with
    two delta writers); on a GPU only what its writers stage in host memory for tcp. Each reader two slots, a delta
    reader its inbox too; a relay host its own landing and two slots per rank. At 1 GiB with 4 relay ranks that is
    about 30 GB: on a 24 GB machine the kernel killed the run, which then said nothing."""
    deltas = 2 if fanout else 1  # delta writers (the relay host's is one), beside the full writer
    trainer = nbytes * (11 + deltas if device == "cpu" else 1 + deltas)
    readers = nbytes * (2 + 2.25)
    relay = nbytes * (2.25 + 2 * fanout) if fanout else 0.0
    return {"trainer": trainer, "readers": readers, "relay host": relay}


def _check_memory(nbytes: int, device: str, fanout: int, size: str) -> None:
    """Refuse a run that would not fit this machine's memory, naming what to change (before a process starts).
    Shared memory that killed runs left (their readers' landings: 8 GB after a relay host the kernel killed) is freed
    first: only the next shared-memory landing would free it otherwise, and a run over tcp creates none."""
    remove_stale_regions()
    needed = memory_needed(nbytes, device, fanout)
    available = available_bytes()
    if available is None or sum(needed.values()) <= available:
        return
    parts = ", ".join(f"{who} {n / 1e9:.1f}" for who, n in needed.items() if n)
    fix = "--fanout-ranks 0 (no relay host) or " if fanout else ""
    raise ConfigError(f"rlsync bench --wire delta --size {size}: needs about {sum(needed.values()) / 1e9:.1f} GB of memory "
                      f"({parts}), this machine has {available / 1e9:.1f} GB available: use {fix}a smaller --size")


def _crcs(buffers: dict[str, Any]) -> dict[str, int]:
    return {name: zlib.crc32(np.asarray(buf).data) for name, buf in sorted(buffers.items())}


def reader(transport: str, host: str = "127.0.0.1") -> None:
    """A reader process: one whole copy of what the writer sends; answers ``check`` with its tensors' CRCs."""
    from rlsync import WeightsReader

    options = SyncOptions(transport=transport, host=host)
    with WeightsReader(None, None, 0, replicas=1, landing="direct", options=options) as r:
        print(json.dumps({"address": r.address}), flush=True)
        for line in sys.stdin:
            version = int(line)
            r.wait_for_version(version, timeout=600)  # the next version is sent only after this answer: no flip meanwhile
            print(json.dumps({"version": r.version, "crc": _crcs(r.buffers()), "delta_seconds": r.delta_seconds}), flush=True)


def relay(transport: str, host: str, ranks: str) -> None:
    """A host of ``ranks`` engine ranks (each a whole copy, over shared memory) behind one ``NodeRelay``; answers
    ``check`` with the CRCs of the first rank's tensors if every rank holds the same bytes, else with none."""
    from rlsync import NodeRelay, WeightsReader

    local = SyncOptions(transport="shm", timeout=600)
    engines = [WeightsReader(None, None, 0, replicas=1, landing="direct", options=local) for _ in range(int(ranks))]
    with NodeRelay([[e.address] for e in engines], options=SyncOptions(transport=transport, host=host, timeout=600),
                   local=local) as node:
        print(json.dumps({"address": node.address}), flush=True)
        for line in sys.stdin:
            version = int(line)
            node.wait_for_version(version, timeout=600)
            crcs = [_crcs(e.buffers()) for e in engines]
            same = all(c == crcs[0] for c in crcs) and all(e.version == version for e in engines)
            print(json.dumps({"version": node.version, "crc": crcs[0] if same else {}, "delta_seconds": 0.0}), flush=True)
    for engine in engines:
        engine.close()


def _spawn_reader(transport: str, link: Link | None, role: str = "reader", *extra: str) -> subprocess.Popen[str]:
    """A reader (or relay) process; across ``link``, in the engine's namespace, listening on its address."""
    where = [] if link is None else ["ip", "netns", "exec", link.engine_namespace]
    host = ["127.0.0.1"] if link is None else [link.engine_address]
    return subprocess.Popen([*where, sys.executable, "-m", "rlsync.bench._wire", role, transport, *host, *extra],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _check(child: subprocess.Popen[str], version: int) -> tuple[dict[str, int], float]:
    """The reader's CRCs of what it serves at ``version``, and its seconds spent applying deltas so far."""
    assert child.stdin is not None
    child.stdin.write(f"{version}\n")
    child.stdin.flush()
    got = _read(child)
    return dict(got["crc"]), float(got["delta_seconds"])


def measure(nbytes: int, steps: int, lr: float, transport: str = "tcp", progress: Any = None,
            device: str = "cpu", fanout: int = FANOUT) -> dict[str, Any]:
    """Run the comparison and return the ``--json`` object."""
    try:
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except ImportError:
        raise ConfigError("rlsync bench --wire delta trains a small model with transformers: pip install 'rlsync[hf]'") from None
    from rlsync import WeightsWriter
    from rlsync.layouts import from_state_dict

    config = bench_spec(nbytes)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{k: v for k, v in config.items() if k != "model_type"},  # type: ignore[no-untyped-call, unused-ignore]
                                         max_position_embeddings=256))
    model.to(device)  # type: ignore[arg-type, unused-ignore]  # transformers wraps .to
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    params = dict(model.named_parameters())
    state = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in params.items()}
    layout = from_state_dict(state)
    total = sum(t.nbytes for t in state.values())
    mem = memcpy_gbps(total)
    link = Link.from_env()  # run inside the trainer's namespace by `--link-gbps`: the readers are across the link
    readers = {"full": _spawn_reader(transport, link), "delta": _spawn_reader(transport, link)}
    if link is not None and fanout:  # and a host of engine ranks behind one relay, sent deltas: the link carries one copy
        readers["fanout"] = _spawn_reader(transport, link, "relay", str(fanout))
    rows: list[dict[str, Any]] = []
    try:
        addresses = {kind: _read(child)["address"] for kind, child in readers.items()}
        writers = {kind: WeightsWriter(layout, None, 0, [addresses[kind]], options=SyncOptions(
            transport=transport, timeout=600, wire="full" if kind == "full" else "delta")) for kind in readers}
        previous = {name: t.clone() for name, t in state.items()}
        applying = dict.fromkeys(readers, 0.0)  # each reader's delta seconds so far
        for version in range(1, steps + 1):
            if progress is not None:
                progress(f"step {version}/{steps}")
            if version > 1:  # version 1: the model as initialized
                tokens = torch.randint(0, int(config["vocab_size"]), (2, 64), device=device)
                model(input_ids=tokens, labels=tokens).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for name, p in params.items():
                        state[name].copy_(p)
            changed = sum(int((state[n].view(torch.int16) != previous[n].view(torch.int16)).sum()) for n in state)
            for name, t in state.items():
                previous[name].copy_(t)
            row: dict[str, Any] = {"version": version, "changed_fraction": changed / (total // 2)}
            for kind, writer in writers.items():
                writer.multi_put(state)
                sent_before = 0 if link is None else link.tx_bytes()
                started = time.perf_counter()
                writer.complete(version)
                row[kind] = {"bytes": writer.last_bytes, "seconds": time.perf_counter() - started,
                             "encode_seconds": writer.last_delta_seconds}
                if link is not None:  # what crossed the link: the version, its control messages, TCP/IP's headers
                    row[kind]["link_bytes"] = link.tx_bytes() - sent_before
            want = _crcs({n: t.view(-1).view(torch.uint8).cpu().numpy() for n, t in state.items()})
            for kind, child in readers.items():
                crcs, applied = _check(child, version)
                row[kind]["bit_exact"] = crcs == want
                row[kind]["apply_seconds"] = applied - applying[kind]
                applying[kind] = applied
            rows.append(row)
        for writer in writers.values():
            writer.close()
    finally:
        for child in readers.values():
            if child.stdin is not None:
                child.stdin.close()
            child.wait(timeout=60)
    summary = {"wire": "delta", "transport": transport, "device": device, "link_gbps": None if link is None else link.gbps,
               "model_bytes": total, "parameters": total // 2, "lr": lr, "memcpy_gbps": mem,
               "memcpy_seconds": total / mem / 1e9, "steps": rows}
    return {**summary, "summary": _summary(rows, link is not None, fanout if "fanout" in readers else None)}


def _summary(rows: list[dict[str, Any]], over_link: bool, fanout: int | None) -> dict[str, Any]:
    """Medians over the versions after the first (version 1 fills the reader in full; deltas from version 2)."""
    later = [r for r in rows if r["version"] > 1] or rows
    full_s = statistics.median(r["full"]["seconds"] for r in later)
    delta_s = statistics.median(r["delta"]["seconds"] for r in later)
    return {
        "versions": [r["version"] for r in later],
        "changed_fraction_median": statistics.median(r["changed_fraction"] for r in later),
        "full_bytes": statistics.median(r["full"]["bytes"] for r in later),
        "delta_bytes_median": statistics.median(r["delta"]["bytes"] for r in later),
        "bytes_ratio": statistics.median(r["delta"]["bytes"] / r["full"]["bytes"] for r in later),
        "full_seconds_median": full_s, "delta_seconds_median": delta_s, "speedup": full_s / delta_s,
        "encode_seconds_median": statistics.median(r["delta"]["encode_seconds"] for r in later),
        "apply_seconds_median": statistics.median(r["delta"]["apply_seconds"] for r in later),
        **({} if not over_link else {
            "full_link_bytes_median": statistics.median(r["full"]["link_bytes"] for r in later),
            "delta_link_bytes_median": statistics.median(r["delta"]["link_bytes"] for r in later),
            "fanout_ranks": fanout or 0}),
        **({} if fanout is None else {
            "fanout_link_bytes": [r["fanout"]["link_bytes"] for r in rows],
            "fanout_seconds_median": statistics.median(r["fanout"]["seconds"] for r in later),
            "fanout_bit_exact": all(r["fanout"]["bit_exact"] for r in rows)}),
        "delta_bit_exact": all(r["delta"]["bit_exact"] for r in rows),
        "full_bit_exact": all(r["full"]["bit_exact"] for r in rows),
    }

def run(*, size: str, steps: int, lr: float, transport: str = "tcp", json_output: bool, link_gbps: float | None = None,
        device: str = "cpu", fanout: int = FANOUT) -> None:
    from rich.console import Console
    from rich.table import Table

    from rlsync.bench._progress import progress

    if link_gbps is None:
        fanout = 0  # the relay host sits across the link
    inside = Link.from_env() is not None  # the re-run in the trainer's namespace: checked and linked by its caller
    if not inside:
        _check_memory(parse_size(size), device, fanout, size)
    if link_gbps is not None and not inside:  # make the link, run this inside the trainer's namespace
        if transport != "tcp":  # across namespaces shm would cross nothing
            raise ConfigError(f"--link-gbps measures over tcp (the namespaces share /dev/shm); got --transports {transport}")
        with slow_link(link_gbps) as (trainer, env):
            again = ["ip", "netns", "exec", trainer, sys.executable, "-m", "rlsync.cli", "bench", "--wire", "delta",
                     "--size", size, "--steps", str(steps), "--lr", str(lr), "--transports", "tcp", "--device", device,
                     "--link-gbps", str(link_gbps), "--fanout-ranks", str(fanout), *(["--json"] if json_output else [])]
            code = subprocess.run(again, env={**os.environ, **env}, check=False).returncode
        if code < 0:  # killed: say so (an out-of-memory kill prints nothing of its own)
            raise SystemExit(f"rlsync bench: the benchmark in the trainer's namespace was killed by signal {-code} "
                             f"({signal.Signals(-code).name}{': out of memory?' if -code == signal.SIGKILL else ''})")
        if code:
            raise SystemExit(code)
        return
    with progress(steps, "full vs delta versions") as advance:
        report = measure(parse_size(size), steps, lr, transport, progress=advance, device=device, fanout=fanout)
    if json_output:
        print(json.dumps(report))
    else:
        over = transport if report["link_gbps"] is None else f"a {report['link_gbps']:g} Gbit/s link (tcp)"
        over += f", the trainer on {device}"
        table = Table(title=f"full vs delta versions over {over}: {report['parameters'] / 1e6:.0f}M bf16 values "
                            f"({report['model_bytes'] / 1e6:.0f} MB), AdamW lr {lr:g}, memcpy {report['memcpy_gbps']:.2f} GB/s "
                            f"({report['memcpy_seconds']:.3f} s for the model)")
        for col in ("v", "changed", "full s", "delta MB", "of full", "delta s", "encode s", "apply s", "exact"):
            table.add_column(col, overflow="fold")
        for r in report["steps"]:
            f, d = r["full"], r["delta"]
            table.add_row(str(r["version"]), f"{r['changed_fraction']:.2%}", f"{f['seconds']:.3f}", f"{d['bytes'] / 1e6:.2f}",
                          f"{d['bytes'] / f['bytes']:.1%}", f"{d['seconds']:.3f}", f"{d['encode_seconds']:.3f}",
                          f"{d['apply_seconds']:.3f}", "yes" if d["bit_exact"] and f["bit_exact"] else "NO")
        Console().print(table)
        summary = report["summary"]
        if report["link_gbps"] is not None:
            print(f"over the link (median of versions {summary['versions'][0]}-{summary['versions'][-1]}): a full version "
                  f"put {summary['full_link_bytes_median'] / 1e6:.1f} MB on it in {summary['full_seconds_median']:.3f} s, "
                  f"a delta {summary['delta_link_bytes_median'] / 1e6:.2f} MB in {summary['delta_seconds_median']:.3f} s "
                  f"({summary['speedup']:.1f}x sooner)")
            if summary["fanout_ranks"]:
                print(f"a host of {summary['fanout_ranks']} engine ranks behind one relay (deltas): "
                      f"{', '.join(f'{b / 1e6:.2f}' for b in summary['fanout_link_bytes'])} MB on the link per version, "
                      f"{summary['fanout_seconds_median']:.3f} s per version, bit-exact on every rank: "
                      f"{'yes' if summary['fanout_bit_exact'] else 'NO'}")
    if not report["summary"]["delta_bit_exact"]:
        raise SystemExit("rlsync bench: the delta reader's bytes differ from the trainer's (a bug: please report it)")


if __name__ == "__main__":
    (relay if sys.argv[1] == "relay" else reader)(*sys.argv[2:])
