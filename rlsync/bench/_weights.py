"""``rlsync bench``: weight sync from a trainer process to a receiver process on this machine.

Every figure comes from one run: the machine's own memcpy bandwidth, each rlsync transport
(direct landing: the version is live when ``complete`` returns), and the baselines users would
otherwise pick: a torch.distributed (gloo) broadcast in 256 MiB buckets, and safetensors saved
to and loaded from /dev/shm. Then publishing one version to 1, 2 and 4 readers (engines) at once
over the first transport, against 1, 2 and 4 times the one-reader time (what posting to readers one
after another would cost). The worker processes are this module run as a script.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rlsync import ConfigError, SyncOptions
from rlsync.layouts import model_spec

BUCKET = 256 * 2**20
FANOUT = (1, 2, 4)  # readers a version is published to at once
_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
          "TB": 10**12}


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:  # a usage error, not a crash: the CLI prints it as one
        raise ConfigError(f"--size {text!r}: use a number with a unit, e.g. 1GiB, 256MiB")
    nbytes = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if nbytes < 2**20:  # 0 hung the bench; each kind of bench checks the top against the memory it would take
        raise ConfigError(f"--size {text!r}: at least 1MiB, e.g. 256MiB")
    return nbytes


def check_fits(nbytes: int, copies: float, what: str, fix: str = "a smaller --size", held_by: str = "") -> None:
    """Refuse a run whose ``copies`` of ``nbytes`` (``held_by``: which) would not fit this machine's available memory,
    before it starts."""
    available = available_bytes()
    if available is not None and nbytes * copies > available:
        raise ConfigError(f"{what}: needs about {nbytes * copies / 1e9:.1f} GB of memory{f' ({held_by})' if held_by else ''}, "
                          f"this machine has {available / 1e9:.1f} GB available: use {fix}")


def available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


#: the default run's peak memory per byte of --size: the trainer's weights, each reader's two slots, and 4 readers at
#: once at the end (measured: 9.7 GB for 1 GiB); its seconds at --repeats 3 on a 2-core machine: a fixed part (processes,
#: imports, the baselines' start: 64MiB took 107 s) and a part per GiB (1GiB took 4.5 min on a Xeon)
MEMORY_PER_BYTE, FIXED_SECONDS, SECONDS_PER_GIB = 9.5, 90.0, 180.0
QUICKER = 256 * 2**20  # the size the start line suggests for a quicker run, when more was asked
DEFAULT_SIZE = "1GiB"


def sized_run(size: str | None, repeats: int, names: list[str]) -> int:
    """The bytes of the default run, said before it starts (memory, about how long); a default that would not fit this
    machine's memory is halved until it does (said), a --size given that would not fit is refused."""
    nbytes = parse_size(size or DEFAULT_SIZE)
    if size is not None:  # asked for: refused where it would not fit, not shrunk
        check_fits(nbytes, MEMORY_PER_BYTE, f"rlsync bench --size {size}",
                   held_by="the trainer, two slots per reader, 4 readers at once")
    available = available_bytes()
    if available is not None and nbytes * MEMORY_PER_BYTE > available:
        while nbytes > 64 * 2**20 and nbytes * MEMORY_PER_BYTE > available:
            nbytes //= 2
        print(f"rlsync bench: {DEFAULT_SIZE} would need about {parse_size(DEFAULT_SIZE) * MEMORY_PER_BYTE / 1e9:.1f} GB "
              f"of memory, {available / 1e9:.1f} GB is available: measuring {nbytes / 2**20:.0f} MiB", file=sys.stderr)
    seconds = FIXED_SECONDS + SECONDS_PER_GIB * nbytes / 2**30 * (repeats + 1) / 4
    took = f"{seconds / 60:.0f}-{2 * seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f}-{2 * seconds:.0f} s"
    print(f"rlsync bench: {nbytes / 2**20:,.0f} MiB of bf16 weights through {', '.join(names)} ({repeats} timed runs "
          f"each), the gloo and safetensors baselines, then 1, 2 and 4 readers at once: about "
          f"{nbytes * MEMORY_PER_BYTE / 1e9:.1f} GB of memory and {took} on a 2-core machine"
          + (" (--size 256MiB for a quicker run)" if nbytes > QUICKER else ""), file=sys.stderr, flush=True)
    return nbytes


def bench_spec(nbytes: int) -> dict[str, Any]:
    """A Qwen2-shaped config whose bf16 weights come close to ``nbytes``."""
    big = nbytes >= 512 * 2**20
    hidden, inter, vocab = (896, 4864, 151936) if big else (256, 1024, 4096)
    base = dict(model_type="qwen2", hidden_size=hidden, num_hidden_layers=1, num_attention_heads=hidden // 64,
                num_key_value_heads=2, intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=True)
    one, two = model_spec(base).nbytes, model_spec({**base, "num_hidden_layers": 2}).nbytes
    layers = max(1, round((nbytes - (2 * one - two)) / (two - one)))
    return {**base, "num_hidden_layers": layers}


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    """Single-thread memcpy into already-touched memory: the physical limit of a one-copy path."""
    a = np.ones(nbytes, np.uint8)
    b = np.zeros(nbytes, np.uint8)
    best = min(_timed(lambda: np.copyto(b, a)) for _ in range(repeats))
    return nbytes / best / 1e9


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ---------------------------------------------------------------------------------------------
# worker processes
# ---------------------------------------------------------------------------------------------


def _state(config: dict[str, Any]) -> dict[str, Any]:
    import torch

    spec = model_spec(config)
    rng = np.random.default_rng(0)
    return {
        p.meta.name: torch.from_numpy(rng.integers(0, 2**14, size=p.meta.shape, dtype=np.int16)).view(torch.bfloat16)
        for p in spec.params
    }


def _emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def worker(role: str, config: dict[str, Any], arg: str, versions: int) -> None:
    import torch

    from rlsync import WeightsReader, WeightsWriter
    from rlsync.layouts import from_state_dict

    if role == "reader":  # arg: TRANSPORT or TRANSPORT/RANK/READERS (every reader receives the whole model)
        from rlsync.layouts import replicated

        transport, reader_rank, readers = (arg.split("/") + ["0", "1"])[:3]
        metas = [p.meta for p in model_spec(config).params]
        dst = replicated(metas, tuple(range(int(readers))))
        with WeightsReader(None, dst, int(reader_rank), landing="direct", options=SyncOptions(transport=transport)) as reader:  # src from the writer
            _emit({"address": reader.address})
            reader.wait_for_version(versions, timeout=600)
        return
    state = _state(config)
    layout = from_state_dict(state)
    if role == "writer":  # arg: TRANSPORT@ADDRESS[,ADDRESS...]
        transport, addresses = arg.split("@", 1)
        with WeightsWriter(layout, None, 0, addresses.split(","), options=SyncOptions(transport=transport, timeout=600)) as writer:
            times = []
            for version in range(1, versions + 1):
                for t in state.values():
                    t.view(torch.int16).add_(1)  # a new version: every byte changes, in place like an optimizer step
                writer.multi_put(state)
                times.append(_timed(lambda v=version: writer.complete(v)))
                _emit({"tick": version})
        _emit({"seconds": times})
        return
    if role in ("gloo-send", "gloo-recv"):
        _gloo(role, state, arg, versions)
        return
    if role in ("st-save", "st-load"):
        _safetensors(role, state, arg)
        return
    raise SystemExit(f"unknown role {role}")


def _gloo(role: str, state: dict[str, Any], arg: str, versions: int) -> None:
    """The baseline: torch.distributed's broadcast over gloo, in buckets (``arg``: the rendezvous port)."""
    import torch
    import torch.distributed as dist

    rank = 0 if role == "gloo-send" else 1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{arg}", rank=rank, world_size=2)
    tensors = list(state.values())
    buckets: list[list[Any]] = [[]]
    for t in tensors:  # the usual recipe: flatten into buckets of at most 256 MiB, broadcast, unflatten
        if buckets[-1] and sum(x.nbytes for x in buckets[-1]) + t.nbytes > BUCKET:
            buckets.append([])
        buckets[-1].append(t)
    done = torch.zeros(1)
    times = []
    for _ in range(versions):
        started = time.perf_counter()
        for bucket in buckets:
            flat = torch.cat([t.reshape(-1) for t in bucket]) if rank == 0 else torch.empty(sum(t.numel() for t in bucket), dtype=torch.bfloat16)
            dist.broadcast(flat, src=0)
            if rank == 1:
                at = 0
                for t in bucket:
                    t.reshape(-1).copy_(flat[at : at + t.numel()])
                    at += t.numel()
        dist.broadcast(done, src=1)  # the receiver has every tensor in place
        times.append(time.perf_counter() - started)
        if rank == 0:
            _emit({"tick": len(times)})
    if rank == 0:
        _emit({"seconds": times})
    dist.destroy_process_group()


def _safetensors(role: str, state: dict[str, Any], arg: str) -> None:
    """The baseline: a safetensors file saved by the trainer and loaded by the engine (``arg``: its path)."""
    if role == "st-save":
        from safetensors.torch import save_file

        for _request in sys.stdin:
            started = time.perf_counter()
            save_file(state, arg)
            _emit({"saved": time.perf_counter() - started})
        return
    from safetensors.torch import load_file

    _emit({"ready": True})
    for _request in sys.stdin:
        started = time.perf_counter()
        loaded = load_file(arg)
        for name, t in state.items():  # into the model's own parameters, as load_state_dict does
            t.copy_(loaded[name])
        _emit({"loaded": time.perf_counter() - started})

# ---------------------------------------------------------------------------------------------
# the orchestrating process
# ---------------------------------------------------------------------------------------------


def _spawn(role: str, config: dict[str, Any], arg: str, versions: int, stdin: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "rlsync.bench._weights", role, json.dumps(config), arg, str(versions)],
        stdout=subprocess.PIPE, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, text=True,
    )


def _read(child: subprocess.Popen[str], tick: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """The child's next JSON object; its ``tick`` lines (a version done) go to ``tick`` on the way."""
    assert child.stdout is not None
    for line in child.stdout:  # libraries may log to stdout too: our lines are JSON objects
        if line.startswith("{"):
            obj = dict(json.loads(line))
            if "tick" not in obj:
                return obj
            tick()
    child.wait()
    raise RuntimeError(f"benchmark worker {child.args!r} exited with {child.returncode}")


def run_transport(name: str, config: dict[str, Any], versions: int, readers: int = 1,
                  tick: Callable[[], None] = lambda: None) -> list[float]:
    procs = [_spawn("reader", config, f"{name}/{r}/{readers}", versions) for r in range(readers)]
    try:
        addresses = [_read(p)["address"] for p in procs]
        writer = _spawn("writer", config, f"{name}@{','.join(addresses)}", versions)
        times: list[float] = _read(writer, tick)["seconds"]
        writer.wait()
        for p in procs:
            p.wait(timeout=60)
        return times
    finally:
        for p in procs:
            p.kill()


def run_gloo(config: dict[str, Any], versions: int, tick: Callable[[], None] = lambda: None) -> list[float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    sender = _spawn("gloo-send", config, port, versions)
    receiver = _spawn("gloo-recv", config, port, versions)
    try:
        times: list[float] = _read(sender, tick)["seconds"]
        return times
    finally:
        sender.wait(timeout=120)
        receiver.wait(timeout=120)


def run_safetensors(config: dict[str, Any], versions: int, tick: Callable[[], None] = lambda: None) -> list[float]:
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        path = os.path.join(tmp, "weights.safetensors")
        saver = _spawn("st-save", config, path, versions, stdin=True)
        loader = _spawn("st-load", config, path, versions, stdin=True)
        assert saver.stdin is not None and loader.stdin is not None
        _read(loader)
        times = []
        try:
            for _ in range(versions):
                started = time.perf_counter()
                saver.stdin.write("go\n")
                saver.stdin.flush()
                _read(saver)
                loader.stdin.write("go\n")
                loader.stdin.flush()
                _read(loader)
                times.append(time.perf_counter() - started)
                tick()
        finally:
            saver.stdin.close()
            loader.stdin.close()
            saver.wait(timeout=60)
            loader.wait(timeout=60)
        return times


DEFAULT_TRANSPORTS = ("shm", "nixl", "tcp", "torchdist")


def steps_of(transports: list[str], repeats: int) -> int:
    """Timed versions the run goes through (its progress units): every path, then the fan-out."""
    return (len(transports) + 2 + (len(FANOUT) if transports else 0)) * (repeats + 1)


def measure(nbytes: int, transports: list[str], repeats: int, progress: Any = None) -> dict[str, Any]:
    """Run everything and return the ``--json`` object; ``progress(step)`` hears of each version done."""
    config = bench_spec(nbytes)
    total = model_spec(config).nbytes
    versions = repeats + 1  # the first version pays for connecting and registering memory
    say = progress or (lambda _step: None)
    paths: list[tuple[str, str, Any]] = [(t, "transport", lambda tick, t=t: run_transport(t, config, versions, tick=tick))
                                         for t in transports]
    paths += [("gloo-broadcast-256MiB", "baseline", lambda tick: run_gloo(config, versions, tick)),
              ("safetensors-devshm", "baseline", lambda tick: run_safetensors(config, versions, tick))]
    results = []
    mem = memcpy_gbps(total)
    for name, kind, fn in paths:
        seconds = statistics.median(fn(lambda name=name: say(name))[1:])
        results.append({"name": name, "kind": kind, "seconds": seconds, "gbps": total / seconds / 1e9})
    fanout: list[dict[str, Any]] = []
    for readers in FANOUT if transports else ():
        step = f"{transports[0]} to {readers} readers"
        seconds = statistics.median(run_transport(transports[0], config, versions, readers, tick=lambda: say(step))[1:])
        one = float(fanout[0]["seconds"]) if fanout else seconds
        fanout.append({"readers": readers, "transport": transports[0], "seconds": seconds,
                       "x_one_reader": seconds / one, "one_after_another_seconds": readers * one})
    return {"memcpy_gbps": mem, "bytes": total, "results": results, "fanout": fanout}


def choose_transports(asked: str | None) -> tuple[list[str], list[dict[str, str]]]:
    """The transports to measure and the ones skipped: by default every one that runs here (a plain install has no
    NIXL); one asked for by name that cannot run here is an error that names its extra."""
    from rlsync import ConfigError
    from rlsync.core import transports as registered

    registry = registered()
    if asked is None:
        names = [t for t in DEFAULT_TRANSPORTS if t in registry and getattr(registry.get(t), "available")()]
        skipped = [{"name": t, "why": f"not installed here (pip install 'rlsync[{t}]' to measure it)"}
                   for t in DEFAULT_TRANSPORTS if t not in names]
        return names, skipped
    names = [t.strip() for t in asked.split(",") if t.strip()]
    for t in names:
        if t not in registry:
            raise ConfigError(f"--transports: no transport {t!r}; registered: {', '.join(registry.names())}")
        if not getattr(registry.get(t), "available")():
            raise ConfigError(f"--transports: {t!r} cannot run here (install its extra, e.g. pip install 'rlsync[{t}]'), "
                              f"or leave it out")
    return names, []


def run(*, size: str | None, transports: str | None, repeats: int, json_output: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    from rlsync.bench._progress import progress, say_skipped

    names, skipped = choose_transports(transports)
    say_skipped(skipped)
    nbytes = sized_run(size, repeats, names)
    with progress(steps_of(names, repeats), "weight sync") as advance:
        report = measure(nbytes, names, repeats, advance)
    report["skipped"] = skipped
    if json_output:
        print(json.dumps(report))
        return
    baselines = [r for r in report["results"] if r["kind"] == "baseline"]
    table = Table(title=f"weight sync, {report['bytes'] / 2**30:.2f} GiB bf16, memcpy {report['memcpy_gbps']:.2f} GB/s",
                  caption="speed-up: the baseline's seconds over the path's (gloo: torch.distributed broadcast in "
                          "256 MiB buckets; safetensors: saved to and loaded from /dev/shm)")
    for col in ("path", "seconds to live", "GB/s", "x memcpy", *(f"speed-up vs {b['name'].split('-')[0]}" for b in baselines)):
        table.add_column(col, overflow="fold")
    for r in report["results"]:
        table.add_row(r["name"], f"{r['seconds']:.3f}", f"{r['gbps']:.2f}", f"{r['gbps'] / report['memcpy_gbps']:.2f}",
                      *(f"{b['seconds'] / r['seconds']:.1f}x" for b in baselines))
    Console().print(table)
    if report["fanout"]:
        fan = Table(title=f"publishing one version to several readers at once ({report['fanout'][0]['transport']})",
                    caption="the readers land at once and share this machine's memory bandwidth and cores: on a "
                            "few cores 'x one reader' grows with their number (up to N times one, as one after another "
                            "would take); with a core and a link per reader it stays near 1")
        for col in ("readers", "seconds to live on all", "x one reader", "one after another would take"):
            fan.add_column(col, overflow="fold")
        for f in report["fanout"]:
            fan.add_row(str(f["readers"]), f"{f['seconds']:.3f}", f"{f['x_one_reader']:.2f}", f"{f['one_after_another_seconds']:.3f}")
        Console().print(fan)


if __name__ == "__main__":
    worker(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
