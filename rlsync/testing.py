"""For plugin authors: an in-memory transport and the conformance checks every built-in passes.

    from rlsync.testing import check_storage, check_transport
    check_transport(MyTransport)            # raises AssertionError naming what broke the contract
    check_storage(lambda: MyStorage(...))   # a fresh, empty storage per call

``MemoryTransport`` moves bytes between a writer and a reader of one process (threads), with no
copies beyond the write itself: use it to test code that drives ``WeightsWriter``/``WeightsReader``.
With ``transport_options={"device": "cpu"}`` (or ``"cuda"``) its regions are torch tensors on that device
and it reports device memory: the path a GPU landing takes (torch views, device checksums, deltas applied
on the device, sources handed over as tensors), runnable on a CPU.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import msgspec
import numpy as np
import torch

from rlsync import (
    BatchedCopies,
    Episode,
    EpisodeLog,
    Landing,
    LeaseLostError,
    Link,
    Run,
    Sample,
    Storage,
    SyncOptions,
    Transport,
    TransportError,
    Turn,
    WeightsReader,
    WeightsWriter,
)
from rlsync.layouts import from_state_dict

__all__ = ["MemoryTransport", "check_episode_log", "check_storage", "check_transport"]

_landings: dict[int, MemoryLanding] = {}
_ids = itertools.count()
_lock = threading.Lock()


class MemoryLanding(Landing):
    """Regions in this process's memory, found by a key in the process-wide table: numpy arrays, or torch tensors
    on ``options["device"]`` (then ``memory`` is ``"device"``)."""

    name = "memory"
    same_host_only = True

    def __init__(self, nbytes: int, slots: int, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(nbytes, slots, options)
        device = self.options.get("device")
        self._regions: list[Any]
        if device is None:
            self._regions = [np.zeros(nbytes, np.uint8) for _ in range(slots)]  # zeros: pages touched
        else:
            self.memory = "device"
            self._regions = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(slots)]
        with _lock:
            self.key = next(_ids)
            _landings[self.key] = self

    @classmethod
    def over(cls, regions: Sequence[Any], options: Mapping[str, Any] | None = None) -> MemoryLanding:
        """In place: the caller's tensors are the regions (one per buffer)."""
        landing = cls(0, 0, options)
        landing._regions = [torch.as_tensor(r) for r in regions]
        landing.memory = "device"  # torch tensors, checked with the device checksum wherever they are
        return landing

    @property
    def regions(self) -> Sequence[Any]:
        return self._regions

    def describe(self) -> dict[str, Any]:
        return {"key": self.key}

    def close(self) -> None:
        with _lock:
            _landings.pop(self.key, None)


class MemoryLink(Link):
    """Into host regions: each write copied at once. Into device regions (torch tensors, on any device): gathered and
    copied at ``flush`` in batches, prepared versions included (``rlsync.BatchedCopies``, as ``cuda_ipc`` does), so
    that the CPU tests run the lines a GPU link runs."""

    def __init__(self, landing: MemoryLanding) -> None:
        self.landing = landing
        self._copies = BatchedCopies(landing.regions) if landing.memory == "device" else None

    def write(self, source: Any, runs: Sequence[Run]) -> None:
        if self._copies is not None:
            self._copies.add(source, runs)
            return
        regions = self.landing.regions
        if isinstance(source, torch.Tensor):
            source = source.cpu().numpy()
        for src, slot, dst, n in runs:
            regions[slot][dst : dst + n] = source[src : src + n]

    def prepare(self, parts: Sequence[tuple[Any, Sequence[Run]]]) -> Any:
        return super().prepare(parts) if self._copies is None else self._copies.prepare(parts)

    def write_prepared(self, prepared: Any) -> None:
        if self._copies is None:
            super().write_prepared(prepared)
        else:
            self._copies.add_prepared(prepared)

    def flush(self) -> None:
        if self._copies is not None:
            BatchedCopies.copy(self._copies.take())


class MemoryTransport(Transport):
    """``SyncOptions(transport=MemoryTransport)``: reader and writer in one process."""

    name: ClassVar[str] = "memory"
    landing: ClassVar[type[Landing]] = MemoryLanding
    device_sources: ClassVar[bool] = True

    @classmethod
    def open(cls, description: dict[str, Any], options: Mapping[str, Any] | None = None) -> Link:
        with _lock:
            landing = _landings.get(int(description["key"]))
        if landing is None:
            raise TransportError(f"no memory landing {description['key']} in this process: it was closed, or the "
                                 f"reader lives in another process (MemoryTransport reaches this process only)")
        return MemoryLink(landing)


# -- conformance: transports ----------------------------------------------------------------------


def check_transport(transport: type[Transport], *, options: Mapping[str, Any] | None = None) -> None:
    """Check ``transport`` against the contract in ``rlsync.Transport``'s module: raises ``AssertionError``.

    Runs in this process: the reader's side and the writer's side each in their own objects, as two
    processes would hold them. Checks the capability flags, region shapes, that a description survives
    msgpack (no pickle on the control plane), that written runs land exactly where they say and nowhere
    else, and that a writer and a reader built on it deliver three versions byte for byte.
    """
    name = getattr(transport, "name", None)
    assert isinstance(name, str) and name, f"{transport.__name__}.name must be a non-empty string"
    assert transport.landing.name == name, f"{transport.__name__}.landing.name is {transport.landing.name!r}, not {name!r}"
    available = transport.available()
    assert isinstance(available, bool), f"{name}: available() must return a bool, not {available!r}"
    assert available, f"{name}: available() says it cannot run here; install what it needs before checking it"

    nbytes, slots = 4096 + 64, 2
    landing = transport.landing(nbytes, slots, options)
    memory = landing.memory
    assert memory in ("host", "device"), f"{name}: Landing.memory must be 'host' or 'device', not {memory!r}"
    try:
        regions = landing.regions
        assert len(regions) == slots, f"{name}: {len(regions)} regions for {slots} slots"
        for region in regions:
            kind, dtype, shape = (type(region).__name__, region.dtype, tuple(region.shape))
            if memory == "host":
                assert isinstance(region, np.ndarray) and dtype == np.uint8 and shape == (nbytes,), \
                    f"{name}: a host region must be a 1-D uint8 numpy array of {nbytes} bytes, not {kind} {dtype} {shape}"
            else:
                assert isinstance(region, torch.Tensor) and dtype == torch.uint8 and shape == (nbytes,), \
                    f"{name}: a device region must be a 1-D uint8 torch tensor of {nbytes} bytes, not {kind} {dtype} {shape}"
            region[:] = 0xAB  # writable, and a pattern that shows what a write touched
        description = landing.describe()
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(description))
        assert wire == description, f"{name}: describe() must be plain data that survives msgpack, got {description!r}"

        rng = np.random.default_rng(0)
        source = rng.integers(0, 255, 8192, dtype=np.uint8)
        runs: list[Run] = [(0, 0, 0, 1000), (1000, 1, 64, 3000), (5000, 0, 2048, 1), (6000, 1, 4096, 64)]
        # a transport that takes device sources gets the last runs from a tensor on the device the check runs on
        device = _device(transport, options, landing)
        writes: list[tuple[Any, list[Run]]] = [(source, runs)]
        if transport.device_sources:
            writes = [(source, runs[:2]), (torch.from_numpy(source).to(device), runs[2:])]
        for prepared in (False, True):  # write() part by part; then a version prepared once and written after a step
            for region in regions:
                region[:] = 0xAB
            _check_writes(transport, wire, options, landing, writes, prepared, name)
            expected = [np.full(nbytes, 0xAB, np.uint8) for _ in range(slots)]
            for src, slot, dst, n in runs:
                expected[slot][dst : dst + n] = source[src : src + n]
            for slot in range(slots):
                landing.progress()
                differs = np.flatnonzero(_host(regions[slot]) != expected[slot])
                assert differs.size == 0, f"{name}: slot {slot} differs from what was written at byte {differs[0]} " \
                                          f"({differs.size} bytes differ{', prepared' if prepared else ''})"
    finally:
        landing.close()
    _check_versions(transport, options, device)



def _check_writes(transport: type[Transport], wire: dict[str, Any], options: Any, landing: Landing,
                  writes: list[tuple[Any, list[Run]]], prepared: bool, name: str) -> None:
    """Write ``writes`` through a link of ``transport``, from another thread as another process would; ``prepared``:
    through ``prepare`` once, then a step that changes every source in place, then ``write_prepared`` (a prepared
    version must read its sources' bytes as they are when it is written, not when it was prepared)."""
    errors: list[BaseException] = []

    def write() -> None:
        try:
            link = transport.open(wire, options)
            try:
                if prepared:
                    ready = link.prepare(writes)
                    for src, _ in writes:
                        src[:] = src + 1  # an optimizer step, in place (numpy arrays and tensors alike)
                    link.write_prepared(ready)
                else:
                    for src, part in writes:
                        link.write(src, part)
                link.flush()
            finally:
                link.close()
        except BaseException as exc:  # noqa: BLE001 - reported below, in the checking thread
            errors.append(exc)

    writer = threading.Thread(target=write, name=f"rlsync-check-{name}")
    writer.start()
    while writer.is_alive():  # the reader's service thread: transports whose target must progress do it here
        landing.progress()
        writer.join(0.001)
    if errors:
        raise AssertionError(f"{name}: writing runs{' (prepared)' if prepared else ''} failed: {errors[0]!r}") from errors[0]


def _host(region: Any) -> np.ndarray:
    return region.cpu().numpy() if isinstance(region, torch.Tensor) else np.asarray(region)


def _device(transport: type[Transport], options: Mapping[str, Any] | None, landing: Landing) -> torch.device:
    """Where the check's sources live: the option's device, else the landing's, for a transport that reads
    device sources; the host otherwise."""
    if not transport.device_sources:
        return torch.device("cpu")
    if options and options.get("device"):
        return torch.device(options["device"])
    regions = landing.regions
    return regions[0].device if regions and isinstance(regions[0], torch.Tensor) else torch.device("cpu")


def _check_versions(transport: type[Transport], options: Mapping[str, Any] | None, device: torch.device) -> None:
    """Three versions through a real writer and reader on ``transport``, each landing byte for byte (with
    ``verify`` on: the reader checks the writer's checksums of the landing memory's kind)."""
    state = {"a.weight": torch.zeros(64, 32, dtype=torch.bfloat16, device=device),
             "b.bias": torch.zeros(17, dtype=torch.float32, device=device)}
    layout = from_state_dict(state)
    sync = SyncOptions(transport=transport, timeout=30.0, verify=True, transport_options=options)
    for landing in ("direct", "staged"):
        loaded: list[int] = []
        with WeightsReader(layout, layout, 0, options=sync, landing=landing,
                           on_version=lambda v, _: loaded.append(v)) as reader:
            with WeightsWriter(layout, layout, 0, [reader.address], options=sync) as writer:
                for version in (1, 2, 3):
                    for tensor in state.values():
                        tensor.copy_(torch.randn(tensor.shape))  # (moved to the tensor's device by copy_)
                    writer.multi_put(state)
                    writer.complete(version)
                    assert reader.version == version, f"{transport.name}: version {version} not live ({landing} landing)"
                    live = reader.buffers()
                    for tname, tensor in state.items():
                        sent = tensor.reshape(-1).view(torch.uint8).cpu().numpy()
                        assert np.array_equal(_host(live[tname]), sent), \
                            f"{transport.name}: tensor {tname!r} of version {version} landed wrong ({landing} landing)"
        assert loaded == [1, 2, 3], f"{transport.name}: on_version saw {loaded} ({landing} landing)"


# -- conformance: storages ------------------------------------------------------------------------


def check_storage(make: Callable[[], Storage]) -> None:
    """Check a ``Storage`` implementation (``make()`` returns a fresh, empty one): raises ``AssertionError``.

    Checks oldest-version-first and first-in-first-out order, that ``ack`` removes for good, ``__len__``,
    the state round trip, and that a ``RolloutBuffer`` on it hands out batches in that order.
    """
    from rlsync import RolloutBuffer

    def sample(prompt: str, version: int) -> Sample:
        return Sample(prompt, np.array([1, 2, 3, 4]), 2, np.zeros(2, np.float32), np.full(2, version, np.int64))

    storage = make()
    try:
        assert isinstance(storage, Storage), f"{type(storage).__name__} lacks a method of rlsync.Storage"
        assert len(storage) == 0, "a fresh storage must be empty"
        batch = [sample("late-v2", 2), sample("first-v1", 1), sample("second-v1", 1), sample("v0", 0)]
        storage.append(batch)
        assert len(storage) == 4, f"after appending 4 samples len() is {len(storage)}"
        taken = storage.take(3)
        got = [s.prompt_id for s in taken]
        assert got == ["v0", "first-v1", "second-v1"], f"take() must hand out oldest version first, FIFO within one: {got}"
        assert len(storage) == 1, f"taken samples are no longer waiting: len() is {len(storage)}"
        storage.ack([s.sample_id for s in taken])
        rest = storage.take(10)
        assert [s.prompt_id for s in rest] == ["late-v2"], f"after ack the rest is the v2 sample, got {rest}"
        storage.ack([s.sample_id for s in rest])
        assert storage.take(1) == [] and len(storage) == 0, "acknowledged samples must never come back"
        storage.save_state({"version": 7, "consumed": 3})
        state = storage.load_state()
        assert {k: state[k] for k in ("version", "consumed")} == {"version": 7, "consumed": 3}, f"state round trip: {state}"
    finally:
        storage.close()

    buffer = RolloutBuffer(batch_size=2, max_staleness=10, storage=make())
    try:
        buffer.publish(2)
        buffer.put([sample("b", 2), sample("a", 1)])
        got_batch = buffer.get(timeout=5)
        assert got_batch is not None and [s.prompt_id for s in got_batch.samples] == ["a", "b"], \
            f"a RolloutBuffer on this storage handed out {got_batch}"
    finally:
        buffer.close()



def check_episode_log(make: Callable[[], tuple[EpisodeLog, Callable[[], list[Sample]]]]) -> None:
    """Check an ``EpisodeLog`` implementation: raises ``AssertionError``. ``make()`` returns a fresh, empty log and a
    function that returns the samples its ``finish`` delivered since the last call (``storage.take``).

    Checks adding once, claiming new episodes in order and resumable ones (a lease ran out) with their steps under a
    new epoch, recording (retries of a step are no-ops, gaps refused), fencing (a stale epoch records and finishes
    nothing), finishing exactly once, an ``Episode`` that replays a dead generator's turn and tool result
    without calling the tool again, and claims by id (leased: None; finished: done) with a finish that delivers
    no sample and keeps the steps for a replay.
    """
    log, delivered = make()
    try:
        assert isinstance(log, EpisodeLog), f"{type(log).__name__} lacks a method of rlsync.EpisodeLog"
        _check_claims_and_records(log, delivered)
        _check_a_replayed_episode(log, delivered)
        _check_claims_by_id(log, delivered)
    finally:
        log.close()


def _episode_sample(prompt: str) -> Sample:
    return Sample(prompt, np.array([1, 2, 3, 4]), 2, np.zeros(2, np.float32), np.zeros(2, np.int64))


def _check_claims_and_records(log: EpisodeLog, delivered: Callable[[], list[Sample]]) -> None:
    """Adding once, claims in order and after a lease ran out (a new epoch), records (retries no-ops, gaps refused),
    fencing, and finishing once."""
    import time

    sample = _episode_sample
    assert log.add("e1", b"p1") and log.add("e2", b"p2"), "add() of a new id must say True"
    assert not log.add("e1", b"other"), "add() of a known id must say False and change nothing"
    assert log.unfinished() == 2, f"two episodes added, unfinished() says {log.unfinished()}"
    first = log.claim("g1", 0.3)
    assert first is not None and (first.episode_id, first.prompt, first.steps) == ("e1", b"p1", []), \
        f"the first claim must hand out the first episode added, with no steps: {first}"
    log.record("e1", first.epoch, 0, b"step-0", 0.3)
    log.record("e1", first.epoch, 0, b"step-0", 0.3)  # a retry after a lost reply: a no-op
    for bad_step, entry in ((0, b"another"), (5, b"gap")):
        try:
            log.record("e1", first.epoch, bad_step, entry, 0.3)
        except ValueError:
            pass
        else:
            raise AssertionError(f"record() of step {bad_step} ({entry!r}) after one step must raise ValueError")
    second = log.claim("g2", 30)
    assert second is not None and second.episode_id == "e2", f"a leased episode is not claimed again: {second}"
    assert log.claim("g3", 30) is None, "with every episode leased, claim() must say None"
    time.sleep(0.5)  # e1's lease runs out: its generator is presumed dead
    resumed = log.claim("g3", 30)
    assert resumed is not None and resumed.episode_id == "e1" and resumed.steps == [b"step-0"], \
        f"an episode whose lease ran out is claimed again with its steps: {resumed}"
    assert resumed.epoch != first.epoch, "a new claim must come with a new epoch"
    for stale in (lambda: log.record("e1", first.epoch, 1, b"late", 30), lambda: log.finish("e1", first.epoch, sample("e1"))):
        try:
            stale()
        except LeaseLostError:
            pass
        else:
            raise AssertionError("a record or finish under an epoch older than the last claim must raise LeaseLostError")
    assert log.finish("e1", resumed.epoch, sample("e1")), "finish() under the current epoch must say True"
    assert not log.finish("e1", resumed.epoch, sample("e1")), "a second finish() must say False"
    got = delivered()
    assert [(s.prompt_id, s.sample_id) for s in got] == [("e1", "e1")], \
        f"finish() must deliver its sample once, under the episode's id: {[(s.prompt_id, s.sample_id) for s in got]}"
    assert log.unfinished() == 1, f"one episode finished of two, unfinished() says {log.unfinished()}"
    try:
        log.record("e1", resumed.epoch, 1, b"after", 30)
    except LeaseLostError:
        pass
    else:
        raise AssertionError("a finished episode records nothing more (LeaseLostError)")


def _check_a_replayed_episode(log: EpisodeLog, delivered: Callable[[], list[Sample]]) -> None:
    """An ``Episode`` that replays a dead generator's turn and tool result without calling the tool again."""
    import time

    calls: list[str] = []

    def count(key: str) -> int:  # a tool with a side effect: it remembers every call
        calls.append(key)
        return len(calls)

    log.add("agent", b"p")
    dying = Episode.next(log, "g4", lease_seconds=0.3)
    assert dying is not None and dying.episode_id == "agent" and not dying.resumed
    dying.turn(lambda: Turn([5, 6], [1, 1], [-0.5, -0.25]))
    assert dying.tool("count", count, {"n": 1}) == 1
    time.sleep(0.5)  # the generator "dies" here: it never records again
    again = Episode.next(log, "g5", lease_seconds=30)
    assert again is not None and again.episode_id == "agent" and again.resumed
    assert again.turn(lambda: Turn([9], [2], [0.0])).tokens == [5, 6], "a recorded turn is replayed, not generated"
    assert again.tool("count", count, {"n": 1}) == 1 and calls == ["agent/1"], \
        f"a recorded tool result is replayed, the tool not called again: calls {calls}"
    assert again.finish(_episode_sample("agent")) and [s.sample_id for s in delivered()] == ["agent"]


def _check_claims_by_id(log: EpisodeLog, delivered: Callable[[], list[Sample]]) -> None:
    """Episodes a framework hands its generators by id (verl's agent loop): one claim at a time, no sample."""
    import time

    # episodes a framework hands its generators by id (verl's agent loop): one claim at a time, no sample
    assert log.claim("g6", 30, "never-added") is None, "a claim of an unknown id must say None"
    log.add("by-id", b"q")
    mine = log.claim("g6", 0.3, "by-id")
    assert mine is not None and (mine.episode_id, mine.prompt, mine.steps, mine.done) == ("by-id", b"q", [], False), \
        f"a claim by id hands out that episode: {mine}"
    assert log.claim("g7", 30, "by-id") is None, "a claim by id of a leased episode must say None"
    log.record("by-id", mine.epoch, 0, b"s0", 0.3)
    time.sleep(0.5)
    taken = log.claim("g7", 30, "by-id")
    assert taken is not None and taken.steps == [b"s0"] and taken.epoch != mine.epoch and not taken.done, \
        f"a claim by id after the lease ran out resumes it, with its steps, under a new epoch: {taken}"
    assert log.finish("by-id", taken.epoch, None) and delivered() == [], "finish(None) ends it and delivers nothing"
    ended = log.claim("g8", 30, "by-id")
    assert ended is not None and ended.done and ended.steps == [b"s0"], \
        f"a claim by id of one finished without a sample says done, with its steps (for a replay): {ended}"
    try:
        log.record("by-id", ended.epoch, 1, b"more", 30)
    except LeaseLostError:
        pass
    else:
        raise AssertionError("a finished episode records nothing more (LeaseLostError)")
    assert log.claim("g8", 30) is None and log.unfinished() == 1, "only e2 (leased) is left unfinished"

