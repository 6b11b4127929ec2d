"""``rlsync bench --buffer``: put+get throughput of each rollout-buffer backend against the plain
alternative a user would write instead, in the same run: ``queue.Queue`` (memory),
``ray.util.queue.Queue`` (ray), a bare ``XADD`` / ``XREADGROUP`` loop (redis). Samples carry 1k
tokens; both sides move them in batches of 64. The ``+routes`` rows carry MoE routing on every generated token too
(48 layers x top-8 expert ids, as a large MoE records them: 192 KiB per sample).

Episodes (``rlsync.Episode``): the cost of recording a model turn of 512 tokens (versions, log-probs) per
backend, against appending the same msgpack bytes the plain way (a Python list; a Ray actor call, ``Queue.put``; ``RPUSH``), and of a resume:
claiming an episode of 16 recorded turns whose lease ran out and replaying them."""

from __future__ import annotations

import contextlib
import json
import queue
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from rlsync import RolloutBuffer, Sample, decode_sample, encode_sample

BATCH = 64
ROUTES = (48, 8)  # MoE layers x experts per token, of 256 experts


def make_samples(n: int, routes: bool = False) -> list[Sample]:
    tokens = np.arange(1024, dtype=np.int32)
    routed = np.random.default_rng(0).integers(0, 256, (512, *ROUTES)).astype(np.uint8) if routes else None
    return [Sample(f"p{i}", tokens, 512, np.zeros(512, np.float32), np.zeros(512, np.int32), routes=routed)
            for i in range(n)]


def _rate(n: int, put: Callable[[list[Sample]], None], get: Callable[[], int], repeats: int, routes: bool = False) -> float:
    """Best samples/s over ``repeats`` rounds of ``n`` fresh samples (fresh ids: Redis deduplicates)."""
    best = 0.0
    for _ in range(repeats):
        samples = make_samples(n, routes)
        started = time.perf_counter()
        moved = 0
        for at in range(0, len(samples), BATCH):
            put(samples[at : at + BATCH])
            moved += get()
        best = max(best, moved / (time.perf_counter() - started))
    return best


def bench_memory(repeats: int, routes: bool = False) -> tuple[float, float]:
    n = BATCH * 300
    buf = RolloutBuffer(batch_size=BATCH, max_staleness=1 << 30, on_stale="drop")
    ours = _rate(n, buf.put, lambda: len(buf.get()), repeats, routes)  # type: ignore[arg-type]
    q: queue.Queue[Sample] = queue.Queue()

    def put(batch: list[Sample]) -> None:
        for s in batch:
            q.put(s)

    def get() -> int:
        return len([q.get() for _ in range(BATCH)])

    return ours, _rate(n, put, get, repeats, routes)


@contextlib.contextmanager
def _ray_running() -> Iterator[None]:
    """Ray, started here for the measurement unless it runs already (then left running)."""
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        if started_here:
            ray.shutdown()


def bench_ray(repeats: int, routes: bool = False) -> tuple[float, float]:
    from ray.util.queue import Queue

    from rlsync.plugins import RayRolloutBuffer

    with _ray_running():
        n = BATCH * (8 if routes else 30)  # routed samples are 192 KiB each: fewer of them
        buf = RayRolloutBuffer(batch_size=BATCH, max_staleness=1 << 30, on_stale="drop")
        ours = _rate(n, buf.put, lambda: len(buf.get()), repeats, routes)  # type: ignore[arg-type]
        buf.close()
        q = Queue(actor_options={"num_cpus": 0})
        base = _rate(n, q.put_nowait_batch, lambda: len(q.get_nowait_batch(BATCH)), repeats, routes)
        q.shutdown()
        return ours, base


def _redis_server(workdir: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir,
                             "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            break
        except OSError:
            time.sleep(0.02)
    return proc, f"redis://127.0.0.1:{port}/0"


def bench_redis(repeats: int, routes: bool = False) -> tuple[float, float]:
    import redis

    from rlsync.plugins import RedisStorage

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _redis_server(tmp)
        try:
            n = BATCH * (8 if routes else 80)  # routed samples are 192 KiB each: fewer of them
            buf = RolloutBuffer(batch_size=BATCH, max_staleness=1 << 30, on_stale="drop", storage=RedisStorage(url, name="bench"))
            ours = _rate(n, buf.put, lambda: len(buf.get()), repeats, routes)  # type: ignore[arg-type]
            r = redis.Redis.from_url(url)
            r.xgroup_create("plain", "g", id="0", mkstream=True)

            def put(batch: list[Sample]) -> None:
                pipe = r.pipeline(transaction=False)
                for s in batch:
                    pipe.xadd("plain", {"d": encode_sample(s)})
                pipe.execute()

            def get() -> int:
                read: Any = r.xreadgroup("g", "c", {"plain": ">"}, count=BATCH)
                entries = read[0][1]
                got = [decode_sample(fields[b"d"]) for _, fields in entries]
                r.xack("plain", "g", *[i for i, _ in entries])
                return len(got)

            return ours, _rate(n, put, get, repeats, routes)
        finally:
            proc.kill()
            proc.wait()


TURN_TOKENS, RESUMED_TURNS = 512, 16


def _episode_costs(log: Any, plain_append: Callable[[bytes], object], repeats: int) -> dict[str, float]:
    """Seconds per recorded turn (rlsync and plain) and per resume of a RESUMED_TURNS-turn episode, best of ``repeats``."""
    import msgspec

    from rlsync import Episode, Turn

    turn = Turn(list(range(TURN_TOKENS)), [3] * TURN_TOKENS, [-0.5] * TURN_TOKENS)
    best = {"turn_s": float("inf"), "plain_turn_s": float("inf"), "resume_s": float("inf")}
    for r in range(repeats):
        log.add(f"bench-{r}", b"")
        episode = Episode.next(log, "bench", lease_seconds=0)  # the lease runs out at once: a resume can follow
        assert episode is not None
        started = time.perf_counter()
        for _ in range(RESUMED_TURNS):
            episode.turn(lambda: turn)
        best["turn_s"] = min(best["turn_s"], (time.perf_counter() - started) / RESUMED_TURNS)
        started = time.perf_counter()
        for _ in range(RESUMED_TURNS):
            plain_append(msgspec.msgpack.encode(turn))
        best["plain_turn_s"] = min(best["plain_turn_s"], (time.perf_counter() - started) / RESUMED_TURNS)
        started = time.perf_counter()
        resumed = Episode.next(log, "other", lease_seconds=60)
        assert resumed is not None and resumed.recorded == RESUMED_TURNS
        for _ in range(RESUMED_TURNS):
            resumed.turn(lambda: turn)  # replayed from the record
        best["resume_s"] = min(best["resume_s"], time.perf_counter() - started)
    return best


def episodes_memory(repeats: int) -> dict[str, float]:
    from rlsync import MemoryEpisodes

    plain: list[bytes] = []
    return _episode_costs(MemoryEpisodes(lambda samples: None), plain.append, repeats)


def episodes_ray(repeats: int) -> dict[str, float]:
    """The buffer actor's episode log (one actor call per turn) against the plain Ray way: one actor call that
    appends the same bytes (``ray.util.queue.Queue.put``)."""
    from ray.util.queue import Queue

    from rlsync.plugins import RayRolloutBuffer

    with _ray_running():
        buf = RayRolloutBuffer(batch_size=BATCH, max_staleness=1 << 30, on_stale="drop")
        plain = Queue(actor_options={"num_cpus": 0})
        try:
            return _episode_costs(buf.episodes, plain.put, repeats)
        finally:
            buf.close()
            plain.shutdown()


def episodes_redis(repeats: int) -> dict[str, float]:
    import redis

    from rlsync.plugins import RedisEpisodes

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _redis_server(tmp)
        try:
            r = redis.Redis.from_url(url)
            return _episode_costs(RedisEpisodes(url, name="bench"), lambda entry: r.rpush("plain-turns", entry), repeats)
        finally:
            proc.kill()
            proc.wait()


def backends() -> tuple[list[tuple[str, Callable[[int], tuple[float, float]]]], list[dict[str, str]]]:
    """The backends that run here, and the ones skipped with why (Ray and Redis are extras, redis-server a program)."""
    import importlib.util

    runs: list[tuple[str, Callable[[int], tuple[float, float]]]] = [
        ("memory", bench_memory), ("memory+routes", lambda r: bench_memory(r, routes=True))]
    skipped = []
    if importlib.util.find_spec("ray"):
        runs += [("ray", bench_ray), ("ray+routes", lambda r: bench_ray(r, routes=True))]
    else:
        skipped.append({"name": "ray", "why": "Ray is not installed (pip install 'rlsync[ray]' to measure it)"})
    if not importlib.util.find_spec("redis"):
        skipped.append({"name": "redis", "why": "redis-py is not installed (pip install 'rlsync[redis]' to measure it)"})
    elif not shutil.which("redis-server"):
        skipped.append({"name": "redis", "why": "no redis-server on PATH (e.g. apt install redis-server)"})
    else:
        runs += [("redis", bench_redis), ("redis+routes", lambda r: bench_redis(r, routes=True))]
    return runs, skipped


def measure(repeats: int, progress: Any = None, chosen: Any = None) -> dict[str, Any]:
    """Every backend of ``chosen`` (``backends()``'s answer; by default asked here) beside its plain alternative."""
    runs, skipped = chosen or backends()
    say = progress or (lambda _step: None)
    results = []
    for name, fn in runs:
        ours, base = fn(repeats)
        results.append({"name": name, "kind": "backend", "samples_per_s": ours})
        results.append({"name": f"{name}-baseline", "kind": "baseline", "samples_per_s": base})
        say(name)
    episodes = [{"name": name, **fn(max(repeats, 3))} for name, fn in
                (("memory", episodes_memory), ("ray", episodes_ray), ("redis", episodes_redis))
                if any(n == name for n, _ in runs)]
    return {"sample_tokens": 1024, "batch": BATCH, "routes": list(ROUTES), "results": results, "skipped": skipped,
            "episodes": episodes, "turn_tokens": TURN_TOKENS, "resumed_turns": RESUMED_TURNS}


def run(*, json_output: bool, repeats: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from rlsync.bench._progress import progress, say_skipped

    chosen = backends()
    say_skipped(chosen[1])
    with progress(len(chosen[0]), "rollout buffer") as advance:
        report = measure(repeats, advance, chosen)
    if json_output:
        print(json.dumps(report))
        return
    table = Table(title="rollout buffer: put+get of 1k-token samples, batches of 64")
    for col in ("backend", "samples/s", "plain alternative", "samples/s", "ratio"):
        table.add_column(col, overflow="fold")
    rows = {r["name"]: r for r in report["results"]}
    for r in report["results"]:
        if r["kind"] == "backend":
            b = rows[f"{r['name']}-baseline"]
            table.add_row(r["name"], f"{r['samples_per_s']:,.0f}", {"memory": "queue.Queue", "ray": "ray.util.queue.Queue",
                          "redis": "XADD/XREADGROUP"}[r["name"].split("+")[0]], f"{b['samples_per_s']:,.0f}",
                          f"{r['samples_per_s'] / b['samples_per_s']:.2f}x")
    Console().print(table)
    turns = Table(title=f"episodes: recording a {TURN_TOKENS}-token turn; resuming an episode of {RESUMED_TURNS} turns")
    for col in ("backend", "ms per turn", "plain append", "ms per turn", "ratio", "ms per resume"):
        turns.add_column(col, overflow="fold")
    for e in report["episodes"]:
        turns.add_row(e["name"], f"{e['turn_s'] * 1e3:.3f}", {"memory": "list.append", "ray": "Queue.put", "redis": "RPUSH"}[e["name"]],
                      f"{e['plain_turn_s'] * 1e3:.3f}", f"{e['plain_turn_s'] / e['turn_s']:.2f}x", f"{e['resume_s'] * 1e3:.2f}")
    Console().print(turns)
