"""``rlsync bench --device cuda`` (or ``cpu``): a model-shaped bf16 state dict from a trainer process into an engine
process's parameters on the same device, through every transport and landing that runs there.

Measured in the same run:

* the limits, in one process: one device copy of all the bytes, and a copy per tensor into tensors that stay;
* the recipe users have today: pack into a 2 GiB shared bucket, the engine unpacks into its parameters, bucket
  after bucket (what verl's colocated checkpoint engine and vLLM's ``ipc`` weight transfer do; the bucket is
  shared through CUDA IPC on a GPU, shared memory on a CPU);
* rlsync per transport and landing: ``device`` staging (the version lands in device memory, then one device
  copy into the parameters), ``host`` staging (it lands in host memory, then an upload: the staged-through-host
  path), ``in_place`` (the writer writes the parameters, the engine paused; a host copy of the last version is
  refreshed after each commit, off the clock), and ``direct`` (two slots the engine reads itself);
* delta: finding and encoding the changed values on the device (``--changed``, the share of bf16 values an
  AdamW step at an RL learning rate changes: about 2 %, ``rlsync bench --wire delta``), applying them, the link
  speed below which sending the delta beats sending everything, and a delta version end to end.

Every path ends with the engine's parameters compared with the trainer's tensors (``sum64`` on both sides):
``exact`` in the output. The worker processes are this module run as a script; they talk JSON lines on pipes.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from rlsync import ConfigError, SyncOptions
from rlsync.bench._weights import _read, bench_spec, check_fits, parse_size
from rlsync.layouts import model_spec

BUCKET = 2 * 2**30  # the colocated recipe's bucket (verl's default update_weights_bucket_megabytes is 2048)
STEP_SECONDS = 0.5  # between two versions: far shorter than an RL training step, long enough for what follows a commit
CHANGED = 0.02  # bf16 values an RL AdamW step changes (docs/benchmarks.md, rlsync bench --wire delta)
#: (transport, landing) pairs tried, in this order; a pair whose transport cannot run on the device is left out
PATHS = {
    "cuda": [("cuda_ipc", "device"), ("cuda_ipc", "in_place"), ("cuda_ipc", "direct"), ("nixl", "device"),
             ("nixl", "in_place"), ("nixl", "host"), ("shm", "host"), ("tcp", "host")],
    "cpu": [("shm", "host"), ("shm", "direct"), ("nixl", "host"), ("nixl", "in_place"), ("tcp", "host")],
}


def _torch() -> Any:
    import torch

    return torch


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        _torch().cuda.synchronize(_torch().device(device))  # the benchmarked device, not the current one


def _timed(fn: Callable[[], Any], device: str) -> float:
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


def _shapes(config: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """The bench model's tensors (bf16): a Qwen2-shaped config's (``bench_spec``), ``{"tensors": N, "values": V}``
    (``--tensors N``: N tensors of V values) or ``{"model": PRESET, "scale": S}`` (``--model``: a preset's own tensors
    as a trainer holds them, experts one by one, each S of its size)."""
    if "tensors" in config:
        return [(f"layers.{i}.weight", [int(config["values"])]) for i in range(int(config["tensors"]))]
    if "model" in config:
        from rlsync.bench._tensors import model_sizes

        return [(name, [n]) for name, n in model_sizes(str(config["model"]), float(config["scale"])).items()]
    return [(p.meta.name, list(p.meta.shape)) for p in model_spec(config).params]


def _nbytes(config: dict[str, Any]) -> int:
    return sum(2 * math.prod(shape) for _, shape in _shapes(config))


def device_config(nbytes: int, tensors: int | None = None, model: str | None = None, scale: str = "1/256") -> dict[str, Any]:
    """What the bench syncs: ``nbytes`` as a Qwen2-shaped model, the same bytes as ``tensors`` equal tensors, or a
    preset's own tensors (``model``, each ``scale`` of its size)."""
    from rlsync.bench._tensors import MAX_TENSORS, parse_scale

    if model is not None:
        if tensors is not None:
            raise ConfigError("--model takes its tensors from the preset: leave out --tensors")
        return {"model": model, "scale": parse_scale(scale)}
    if tensors is None:
        return bench_spec(nbytes)
    if not 1 <= tensors <= min(MAX_TENSORS, nbytes // 2):
        raise ConfigError(f"--tensors {tensors}: from 1 to {min(MAX_TENSORS, nbytes // 2):,} for {nbytes:,} bytes (one bf16 "
                          f"value each at least, and {MAX_TENSORS:,} in all: a MoE of 1T parameters has about 70,000)")
    return {"tensors": tensors, "values": nbytes // 2 // tensors}


def _tensors(config: dict[str, Any], device: str, fill: bool) -> dict[str, Any]:
    torch = _torch()
    out = {}
    for i, (name, shape) in enumerate(_shapes(config)):
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        if fill:
            t.view(torch.int16).copy_(torch.arange(t.numel(), dtype=torch.int32, device=device).view(t.shape) % 16381 + i)
        else:
            t.zero_()
        out[name] = t
    return out


def _sum64(tensors: dict[str, Any]) -> dict[str, int]:
    from rlsync.core import Checksums

    sums = Checksums("sum64")
    for name, t in tensors.items():
        sums.add(name, [t.reshape(-1).view(_torch().uint8)])
    return sums.values


def _step(state: dict[str, Any], changed: float) -> None:
    """A new version in place, as an optimizer step: every value (``changed`` 1) or that share of them."""
    torch = _torch()
    for t in state.values():
        words = t.view(torch.int16)
        if changed >= 1:
            words.add_(1)
        else:
            words.add_((torch.rand(words.shape, device=t.device) < changed).to(torch.int16))


# -- worker processes ----------------------------------------------------------------------------


def engine(device: str, config: dict[str, Any], transport: str, landing: str) -> None:
    """The engine: parameters on ``device``, a reader landing versions in ``landing`` memory; answers ``check``."""
    from rlsync import WeightsReader
    from rlsync.core import LandingMode
    from rlsync.layouts import from_state_dict

    torch = _torch()
    if device == "cpu":  # the commit runs in the reader's service thread, where torch's CPU thread pool oversubscribes
        torch.set_num_threads(1)  # a small machine (2 cores here: 50-75 ms per 256 MiB instead of 21)
    params = _tensors(config, device, fill=False)
    layout = from_state_dict(params)

    flat = {n: p.reshape(-1).view(torch.uint8) for n, p in params.items()}

    def commit(version: int, buffers: dict[str, Any]) -> None:  # the staged version into the parameters, in place
        with torch.no_grad():  # one batched copy, as an engine that cares would do it
            torch._foreach_copy_(list(flat.values()), [torch.as_tensor(buffers[n]) for n in flat], non_blocking=True)
        _sync(device)

    on_device = landing == "device" or (landing == "direct" and device != "cpu")  # regions in device memory
    options = SyncOptions(transport=transport, timeout=600, transport_options={"device": device} if on_device else {})
    mode: LandingMode = "direct" if landing == "direct" else "in_place" if landing == "in_place" else "staged"
    targets = {n: p.reshape(-1).view(torch.uint8) for n, p in params.items()} if landing == "in_place" else None
    with WeightsReader(layout, layout, 0, options=options, landing=mode, targets=targets,
                       on_version=commit if mode == "staged" else None) as reader:
        print(json.dumps({"address": reader.address, "memory": reader.memory}), flush=True)
        for _ in sys.stdin:
            if landing == "direct":
                live = {n: torch.as_tensor(b).view(torch.bfloat16) for n, b in reader.buffers().items()}
                print(json.dumps({"sum64": _sum64(live)}), flush=True)
            else:
                print(json.dumps({"sum64": _sum64(params)}), flush=True)


def bucket_engine(device: str, config: dict[str, Any], transport: str) -> None:
    """The recipe's engine: a shared bucket; ``unpack [[name, offset, nbytes], ...]`` copies it into the parameters."""
    from rlsync.core import transports

    torch = _torch()
    params = _tensors(config, device, fill=False)
    total = sum(t.numel() * 2 for t in params.values())
    cls: Any = transports().get(transport)
    bucket = cls.landing(min(BUCKET, total), 1, {"device": device} if device != "cpu" else {})
    region = torch.as_tensor(bucket.regions[0])
    print(json.dumps({"bucket": msgspec.msgpack.encode(bucket.describe()).hex()}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command == "check":
            print(json.dumps({"sum64": _sum64(params)}), flush=True)
            continue
        with torch.no_grad():
            for name, offset, nbytes in command:
                params[name].reshape(-1).view(torch.uint8).copy_(region[offset : offset + nbytes], non_blocking=True)
        _sync(device)
        print(json.dumps({"ok": True}), flush=True)


def _child(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", "from rlsync.bench._device import main; main()", *args],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _ask(child: subprocess.Popen[str], command: Any) -> dict[str, Any]:
    assert child.stdin is not None
    child.stdin.write(json.dumps(command) + "\n")
    child.stdin.flush()
    return _read(child)


def trainer(device: str, config: dict[str, Any], transport: str, landing: str, versions: int, changed: float) -> None:
    """The trainer: starts its engine, publishes ``versions`` versions, and reports seconds, bytes and exactness."""
    from rlsync import WeightsWriter
    from rlsync.layouts import from_state_dict

    state = _tensors(config, device, fill=True)
    child = _child("engine", device, json.dumps(config), transport, landing)
    try:
        hello = _read(child)
        wire = "delta" if changed < 1 else "full"
        options = SyncOptions(transport=transport, timeout=600, wire=wire)
        times, sent = [], []
        with WeightsWriter(from_state_dict(state), from_state_dict(state), 0, [hello["address"]], options=options) as writer:
            for version in range(1, versions + 1):
                # a training step's time between versions (off the clock): what an engine does after a commit (in
                # place: refresh its host copy of the version) is done before the next, as in a real run
                time.sleep(STEP_SECONDS if version > 1 else 0)
                _step(state, 1.0 if version <= 2 else changed)  # a delta needs a version in the slot it updates
                writer.multi_put(state)
                times.append(_timed(functools.partial(writer.complete, version), device))
                sent.append(writer.last_bytes)
        exact = _ask(child, "check")["sum64"] == _sum64(state)
        print(json.dumps({"seconds": times, "bytes": sent, "exact": exact, "memory": hello["memory"]}), flush=True)
    finally:
        child.kill()


def bucket_trainer(device: str, config: dict[str, Any], transport: str, versions: int) -> None:
    """The recipe's trainer: pack a bucket, have the engine unpack it, next bucket; per version."""
    from rlsync.core import transports

    torch = _torch()
    state = _tensors(config, device, fill=True)
    child = _child("bucket-engine", device, json.dumps(config), transport)
    try:
        description = msgspec.msgpack.decode(bytes.fromhex(_read(child)["bucket"]))
        cls: Any = transports().get(transport)
        link = cls.open(description, {})
        capacity = min(BUCKET, sum(t.numel() * 2 for t in state.values()))

        def publish() -> None:
            packed: list[list[Any]] = []
            at = 0
            for name, t in state.items():
                nbytes = t.numel() * 2
                if at + nbytes > capacity:  # full: the engine unpacks before the bucket is reused
                    link.flush()
                    _ask(child, packed)
                    packed, at = [], 0
                source = t.reshape(-1).view(torch.uint8)
                link.write(source.numpy() if device == "cpu" else source, [(0, 0, at, nbytes)])
                packed.append([name, at, nbytes])
                at += -(-nbytes // 256) * 256
            link.flush()
            _ask(child, packed)

        times = []
        for _ in range(versions):
            _step(state, 1.0)
            times.append(_timed(publish, device))
        exact = _ask(child, "check")["sum64"] == _sum64(state)
        link.close()
        print(json.dumps({"seconds": times, "exact": exact}), flush=True)
    finally:
        child.kill()


# -- in the orchestrating process --------------------------------------------------------------------


def limits(device: str, config: dict[str, Any], repeats: int) -> dict[str, float]:
    """Seconds of one copy of every byte, and of a copy per tensor into tensors that stay (best of ``repeats``)."""
    torch = _torch()
    one = _one_copy(device, _nbytes(config), repeats)
    src, dst = _tensors(config, device, fill=True), _tensors(config, device, fill=False)
    names = list(src)
    per = min(_timed(lambda: torch._foreach_copy_([dst[n] for n in names], [src[n] for n in names]), device)
              for _ in range(repeats + 1))
    return {"one_copy": one, "per_tensor": per}


def _one_copy(device: str, nbytes: int, repeats: int) -> float:
    torch = _torch()
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return min(_timed(lambda: target.copy_(source), device) for _ in range(repeats + 1))


def delta_on_device(device: str, config: dict[str, Any], changed: float, repeats: int) -> dict[str, Any]:
    """Find + encode a ``changed`` delta over the whole state on ``device``, and apply it into a region there: as
    a fast link sends it (the planes as they are, on the device) and, under ``zstd``, as a slow one does."""
    torch = _torch()
    state = _tensors(config, device, fill=True)
    sources = {n: t.reshape(-1).view(torch.uint8) for n, t in state.items()}
    total = sum(s.numel() for s in sources.values())
    report: dict[str, Any] = {"changed": changed, "full_bytes": total}
    report.update(_delta_figures(device, state, sources, total, changed, repeats, compress=False))
    report["zstd"] = _delta_figures(device, state, sources, total, changed, repeats, compress=True)
    return report


def _delta_figures(device: str, state: dict[str, Any], sources: dict[str, Any], total: int, changed: float,
                   repeats: int, compress: bool) -> dict[str, Any]:
    from rlsync.core import ChangeLog, apply_delta, encode_delta

    torch = _torch()
    starts = itertools.accumulate((s.numel() for s in sources.values()), initial=0)  # a reader's region: one after another
    groups = [(n, [(0, at, s.numel())]) for (n, s), at in zip(sources.items(), starts)]
    best: tuple[float, float, int] | None = None
    for version in range(2, repeats + 3):
        log = ChangeLog({n: 2 for n in sources}, depth=2)
        log.record(version - 1, sources)
        _step(state, changed)
        found: dict[str, Any] = {}

        def find_and_encode() -> None:
            log.record(version, sources)
            found["payload"] = encode_delta(groups, {n: log.since(version - 1, n) for n in sources}, sources,
                                            {n: 2 for n in sources}, total, {n: log.flips(version - 1, n) for n in sources},
                                            compress)

        encode_s = _timed(find_and_encode, device)
        payload = found["payload"]
        region = torch.zeros(total, dtype=torch.uint8, device=device)
        apply_s = _timed(lambda: apply_delta(payload, region), device)  # XOR into zeros: other bytes, the same work
        if best is None or encode_s + apply_s < best[0] + best[1]:
            best = (encode_s, apply_s, int(payload.numel()))
    assert best is not None
    encode_s, apply_s, nbytes = best
    return {"find_encode_seconds": encode_s, "find_encode_gbps": total / encode_s / 1e9, "apply_seconds": apply_s,
            "delta_bytes": nbytes, "full_bytes": total,
            # delta pays on a link slower than this: full/L > encode + apply + delta/L
            "pays_below_gbps": (total - nbytes) / (encode_s + apply_s) / 1e9}


class BenchStopped(BaseException):  # not an Exception: a failing path's handler must not swallow it
    """The benchmark was asked to stop (SIGTERM): the paths measured so far are still reported."""


def _stop_on_sigterm() -> None:
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise BenchStopped("stopped by SIGTERM before every path ran")

    signal.signal(signal.SIGTERM, stop)


PATH_TIMEOUT = 600.0  # seconds one path may take before it counts as failed (--path-timeout)


def _run(args: list[str], timeout: float = PATH_TIMEOUT) -> dict[str, Any]:
    """A worker's one JSON line; a worker that fails, or outlasts ``timeout``, raises (and is killed)."""
    child = _child(*args)
    timer = threading.Timer(timeout, child.kill)  # _read returns when the killed worker's stdout closes
    timer.start()
    try:
        return _read(child)
    except RuntimeError as exc:
        if not timer.is_alive():
            raise RuntimeError(f"did not finish within {timeout:g} s (--path-timeout), so it was stopped") from exc
        raise
    finally:
        timer.cancel()
        if child.poll() is None:
            child.kill()
        child.wait()


def measure(device: str, nbytes: int, transports: list[str] | None, repeats: int, changed: float = CHANGED,
            progress: Callable[[str], None] | None = None, path_timeout: float = PATH_TIMEOUT,
            config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run everything and return the ``--json`` object. A path that fails (or outlasts ``path_timeout``) is a row
    with its ``error``, and the others still run: one broken transport does not hide the figures of the rest.
    ``config``: the tensors (``device_config``; default: ``nbytes`` as a Qwen2-shaped model)."""
    from rlsync.core import transports as registered

    kind = "cuda" if device.startswith("cuda") else "cpu"
    registry = registered()
    config = config if config is not None else bench_spec(nbytes)
    total = _nbytes(config)
    versions = repeats + 2  # the first pays for connecting and registering; the second fills the other slot
    say = progress or (lambda _step: None)
    say("device copy limits")
    limit = limits(device, config, repeats)
    rows: list[dict[str, Any]] = []

    failed: list[dict[str, Any]] = []

    def add(name: str, kind_: str, args: list[str], **extra: Any) -> None:
        try:
            got = _run(args, path_timeout)
        except Exception as exc:  # noqa: BLE001 - recorded in the report, and the next path runs
            failed.append({"name": name, "kind": kind_, "error": str(exc), **extra})
            return
        seconds = statistics.median(got["seconds"][2:] or got["seconds"][-1:])
        extra.update({"memory": got["memory"]} if "memory" in got else {})
        if "bytes" in got:
            extra["bytes"] = statistics.median(got["bytes"][2:] or got["bytes"][-1:])
        rows.append({"name": name, "kind": kind_, "seconds": seconds, "gbps": total / seconds / 1e9,
                     "exact": got["exact"], **extra})

    stopped = None
    delta: dict[str, Any] = {}
    try:
        bucket_transport = "cuda_ipc" if kind == "cuda" else "shm"
        say("bucketed recipe (2 GiB)")
        add("bucketed-2GiB", "baseline", ["bucket-trainer", device, json.dumps(config), bucket_transport, str(versions)],
            transport=bucket_transport)
        runs_here = {t for t in registry.names() if getattr(registry.get(t), "available")()}
        paths = [(t, landing) for t, landing in PATHS[kind] if (transports is None or t in transports) and t in runs_here]
        for transport, landing in paths:
            say(f"{transport}, {landing} landing")
            add(f"{transport}/{landing}", "rlsync", ["trainer", device, json.dumps(config), transport, landing, str(versions), "1.0"],
                transport=transport, landing=landing)
        if paths:
            say(f"delta on the {kind}")
            try:
                delta = delta_on_device(device, config, changed, repeats)
            except Exception as exc:  # noqa: BLE001 - recorded, like a failed path
                failed.append({"name": f"delta find+encode on the {kind}", "kind": "rlsync", "error": str(exc)})
            transport, landing = paths[0]
            add(f"{transport}/{landing} delta {changed:.0%}", "rlsync",
                ["trainer", device, json.dumps(config), transport, landing, str(versions), str(changed)],
                transport=transport, landing=landing)
    except BenchStopped as exc:  # SIGTERM (a caller's time limit): report what was measured so far
        stopped = str(exc)
    per_tensor = limit["per_tensor"]
    bucket = next((r["seconds"] for r in rows if r["kind"] == "baseline"), None)
    for row in rows:
        row["x_per_tensor_copy"] = per_tensor / row["seconds"]
        row["x_bucketed"] = None if bucket is None else bucket / row["seconds"]
    return {"device": device, "device_name": _device_name(device), "bytes": total, "tensors": len(_shapes(config)),
            "limits": {"one_copy_seconds": limit["one_copy"], "one_copy_gbps": total / limit["one_copy"] / 1e9,
                       "per_tensor_seconds": per_tensor, "per_tensor_gbps": total / per_tensor / 1e9},
            "results": rows, "failed": failed, "delta": delta, **({"stopped": stopped} if stopped else {})}


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return str(_torch().cuda.get_device_name(_torch().device(device)))
    import platform

    return platform.processor() or platform.machine()


def run(*, device: str, size: str | None, transports: str | None, repeats: int, json_output: bool,
        path_timeout: float = PATH_TIMEOUT, tensors: int | None = None, model: str | None = None,
        scale: str = "1/256") -> None:
    from rich.console import Console
    from rich.table import Table

    from rlsync.bench._progress import progress

    torch = _torch()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (torch.cuda.is_available() is False); use --device cpu")
    if model is not None and size is not None:
        raise ConfigError("--model takes its tensors and their sizes from the preset (and --scale): leave out --size")
    asked = parse_size(size or ("8GiB" if device.startswith("cuda") else "256MiB"))
    if model is None and not device.startswith("cuda"):  # before a tensor list of that size is built
        check_fits(asked, 6, f"rlsync bench --device {device} --size {size}")
    config = device_config(asked, tensors, model, scale)
    nbytes = _nbytes(config)
    if not device.startswith("cuda"):  # trainer and engine copies, staging and the bucketed recipe, in host memory
        if model is None:
            check_fits(nbytes, 6, f"rlsync bench --device {device} --size {size}")
        else:
            check_fits(nbytes, 6, f"rlsync bench --device {device} --model {model} --scale {scale}", "a smaller --scale")
    names = [t for t in transports.split(",") if t] if transports else None
    _stop_on_sigterm()
    with progress(None, f"weight sync on {device}") as advance:
        report = measure(device, nbytes, names, repeats, progress=advance, path_timeout=path_timeout, config=config)
    if json_output:
        print(json.dumps(report))
        return
    lim = report["limits"]
    table = Table(title=f"{report['bytes'] / 2**30:.2f} GiB bf16 ({report['tensors']} tensors), {report['device_name']}: "
                        f"one copy {lim['one_copy_gbps']:.0f} GB/s, per tensor {lim['per_tensor_gbps']:.0f} GB/s")
    for col in ("path", "lands in", "seconds to live", "GB/s", "x per-tensor copy", "x bucketed recipe", "exact"):
        table.add_column(col, overflow="fold")
    for r in report["results"]:
        bucketed = "-" if r["x_bucketed"] is None else f"{r['x_bucketed']:.2f}"
        table.add_row(r["name"], r.get("memory", "-"), f"{r['seconds']:.4f}", f"{r['gbps']:.1f}",
                      f"{r['x_per_tensor_copy']:.2f}", bucketed, "yes" if r["exact"] else "NO")
    for r in report["failed"]:
        table.add_row(r["name"], "-", "failed", "-", "-", "-", "-")
    Console().print(table)
    for r in report["failed"]:
        Console(stderr=True).print(f"[red]{r['name']} failed:[/red] {r['error']}")
    d = report["delta"]
    if d:
        for label, figures in ((f"delta at {d['changed']:.0%} changed", d), ("  compressed (zstd, as over tcp)", d["zstd"])):
            Console().print(f"{label}: find + encode {figures['find_encode_seconds'] * 1e3:.1f} ms "
                            f"({figures['find_encode_gbps']:.1f} GB/s of model bytes), apply "
                            f"{figures['apply_seconds'] * 1e3:.1f} ms, {figures['delta_bytes'] / figures['full_bytes']:.1%} "
                            f"of the bytes: pays on links slower than {figures['pays_below_gbps']:.1f} GB/s")

def main() -> None:
    """A worker process: ``python -c 'from rlsync.bench._device import main; main()' ROLE ARGS...``."""
    role, rest = sys.argv[1], sys.argv[2:]
    if role == "engine":
        engine(rest[0], json.loads(rest[1]), rest[2], rest[3])
    elif role == "bucket-engine":
        bucket_engine(rest[0], json.loads(rest[1]), rest[2])
    elif role == "trainer":
        trainer(rest[0], json.loads(rest[1]), rest[2], rest[3], int(rest[4]), float(rest[5]))
    elif role == "bucket-trainer":
        bucket_trainer(rest[0], json.loads(rest[1]), rest[2], int(rest[3]))
    else:
        raise SystemExit(f"unknown role {role}")
