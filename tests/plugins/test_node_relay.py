"""``NodeRelay``: the trainer's writer sends a host's distinct bytes once, over tcp, to the host's relay, which forwards
each engine rank its part over shared memory; every rank bit-exact, and a rank that is gone when a version is
forwarded leaves every rank of the host on the previous version."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest

from _support.faulty_transports import writes_one_by_one
from rlsync import NodeRelay, SyncOptions, WeightsReader, build_plan

pytestmark = pytest.mark.multiproc

LOCAL = SyncOptions(transport="shm", timeout=10)


def _reports(child: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in child.stdout_text.splitlines() if line.startswith("{")]


def test_the_host_takes_its_distinct_bytes_once_and_every_engine_rank_lands_them(sync: Any) -> None:
    src, whole = sync.layouts("plain")
    _, tp2 = sync.layouts("boxes_tp2")  # two ranks: row and column halves, the norm on both, layer5 on rank 1 only
    tp_ranks = [WeightsReader(None, tp2, r, options=LOCAL) for r in (0, 1)]
    replica = WeightsReader(None, whole, 0, options=LOCAL)  # a second engine on the host, holding the whole model
    relay = NodeRelay([[r.address for r in tp_ranks], [replica.address]], options=SyncOptions(transport="tcp"), local=LOCAL)
    try:
        writer = sync.writer("plain", "tcp", {0: relay.address}, [1, 2], extra=("--replicas", "1"))  # dst=None: asks
        assert writer.returncode == 0, writer.stderr_text
        distinct = sum(t.nbytes for t in whole.tensors)
        per_rank = sum(build_plan(src, engine).stats.bytes_sent for engine in (tp2, whole))
        assert per_rank > 1.9 * distinct  # what a writer sending to each rank moves
        sent = [r["bytes"] for r in _reports(writer) if "completed" in r]
        assert sent == [distinct, distinct]  # each byte the host needs crossed its link once
        assert relay.version == 2 and relay.last_forward_seconds > 0
        for rank in tp_ranks:
            assert rank.version == 2
            sync.assert_landed("boxes_tp2", rank, 2)
        assert replica.version == 2
        sync.assert_landed("plain", replica, 2)
    finally:
        relay.close()
        for reader in (*tp_ranks, replica):
            reader.close()


@pytest.mark.parametrize("when", ["between versions", "mid-forward"])
def test_a_rank_gone_when_a_version_is_forwarded_leaves_every_rank_on_the_previous_version(sync: Any, when: str) -> None:
    _, fanout = sync.layouts("fanout")  # one engine of two ranks, each holding the whole model
    here = WeightsReader(None, fanout, 0, options=LOCAL)
    child, address = sync.reader("fanout", "shm", 1, timeout=120)
    relay = NodeRelay([[here.address, address]], options=SyncOptions(transport="tcp"), local=LOCAL)
    try:
        first = sync.writer("fanout", "tcp", {0: relay.address}, [1], extra=("--replicas", "1"))
        assert first.returncode == 0, first.stderr_text
        assert here.version == 1 and relay.version == 1
        if when == "between versions":  # rank 1's engine dies; its shared memory stays writable to the relay
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
        else:  # it dies as the relay starts writing its bytes of version 2 (the writes still succeed)
            link = relay._writers[0]._links[1]
            write = link.write

            def die_then_write(source: Any, runs: Any) -> None:
                if child.poll() is None:
                    os.kill(child.pid, signal.SIGKILL)
                    child.wait(timeout=10)
                write(source, runs)

            link.write = die_then_write
            writes_one_by_one(link)
        second = sync.writer("fanout", "tcp", {0: relay.address}, [2], extra=("--replicas", "1"))
        assert second.returncode != 0
        assert "reader rank 1" in second.stderr_text and "every rank stays on version 1" in second.stderr_text
        assert here.version == 1 and relay.version == 1  # rank 0 heard nothing of version 2
        sync.assert_landed("fanout", here, 1)
    finally:
        relay.close()
        here.close()


def test_engines_that_disagree_on_a_tensor_are_refused_by_name(sync: Any) -> None:
    from rlsync import ConfigError, TensorMeta
    from rlsync.layouts import from_state_dict

    _, whole = sync.layouts("plain")
    other = from_state_dict([TensorMeta(t.name, "float32", t.shape) for t in whole.tensors])
    a, b = WeightsReader(None, whole, 0, options=LOCAL), WeightsReader(None, other, 0, options=LOCAL)
    try:
        with pytest.raises(ConfigError, match="layer0.weight"):
            NodeRelay([[a.address], [b.address]], local=LOCAL)
    finally:
        a.close()
        b.close()


def test_replica_engines_learn_their_layout_through_the_relay_from_the_trainers_writer(sync: Any) -> None:
    """Engines whose readers hold a whole copy of what their writer sends (``replicas=1``) know no layout before a
    writer comes: the relay learns it from the trainer's writer, and teaches them at the first version."""
    replicas = [WeightsReader(None, None, 0, replicas=1, options=LOCAL) for _ in range(3)]
    relay = NodeRelay([[r.address] for r in replicas], options=SyncOptions(transport="tcp"), local=LOCAL)
    try:
        writer = sync.writer("plain", "tcp", {0: relay.address}, [1, 2], extra=("--replicas", "1"))
        assert writer.returncode == 0, writer.stderr_text
        _, whole = sync.layouts("plain")
        assert [r["bytes"] for r in _reports(writer) if "completed" in r] == [sum(t.nbytes for t in whole.tensors)] * 2
        for replica in replicas:
            assert replica.version == 2
            sync.assert_landed("plain", replica, 2)
    finally:
        relay.close()
        for replica in replicas:
            replica.close()


def test_an_engine_that_refuses_a_version_at_its_load_fails_it_and_the_next_version_lands_everywhere(sync: Any) -> None:
    """An engine's loader refuses version 2 after the relay told every rank: the trainer hears why (the other engine
    took version 2, as a writer's other readers do when one refuses at its load), and version 3 lands on both: no
    answer to version 2 is left unread for the next."""
    _, whole = sync.layouts("plain")

    def refuse_two(version: int, buffers: Any) -> None:
        if version == 2:
            raise RuntimeError("a loader that fails on purpose")

    picky = WeightsReader(None, whole, 0, options=LOCAL, on_version=refuse_two)
    other = WeightsReader(None, whole, 0, options=LOCAL)
    relay = NodeRelay([[picky.address], [other.address]], options=SyncOptions(transport="tcp"), local=LOCAL)
    try:
        writer = sync.writer("plain", "tcp", {0: relay.address}, [1, 2, 3], extra=("--replicas", "1", "--keep-going"))
        assert writer.returncode == 0, writer.stderr_text
        reports = _reports(writer)
        assert [r.get("completed") for r in reports] == [1, None, 3]
        assert "a loader that fails on purpose" in reports[1]["error"]
        assert picky.version == 3 and other.version == 3 and relay.version == 3
        sync.assert_landed("plain", picky, 3)
        sync.assert_landed("plain", other, 3)
    finally:
        relay.close()
        picky.close()
        other.close()


def test_a_relay_can_be_one_of_several_replica_readers_of_the_trainer() -> None:
    """A framework whose writers send to N replica readers (verl: one per rollout worker) puts a relay in place of a
    host's workers: the relay is replica ``rank`` of ``replicas`` to the trainer and forwards to its engines whole; the
    writer sends one copy to the direct reader and one to the relay, and every reader lands every version."""
    import torch

    from rlsync import ConfigError, WeightsWriter
    from rlsync.layouts import from_state_dict

    gen = torch.Generator().manual_seed(0)
    state = {"embed": torch.randn(32, 16, generator=gen).to(torch.bfloat16), "norm": torch.randn(16, generator=gen)}
    total = sum(t.numel() * t.element_size() for t in state.values())
    link = SyncOptions(transport="tcp", timeout=10)
    direct = WeightsReader(None, None, 0, replicas=2, options=link)
    engines = [WeightsReader(None, None, 0, replicas=1, options=LOCAL) for _ in range(2)]
    with pytest.raises(ConfigError, match="rank=2, replicas=2"):
        NodeRelay([[e.address] for e in engines], rank=2, replicas=2)
    relay = NodeRelay([[e.address] for e in engines], options=link, local=LOCAL, rank=1, replicas=2)
    writer = WeightsWriter(from_state_dict(state), None, 0, [direct.address, relay.address], options=link)
    try:
        for version in (1, 2):
            writer.multi_put(state)
            writer.complete(version)
            assert writer.last_bytes == 2 * total  # the direct reader's copy and the host's, once
            for reader in (direct, *engines):
                assert reader.version == version
                got = reader.buffers()
                for name, tensor in state.items():
                    assert bytes(got[name]) == tensor.contiguous().view(torch.uint8).numpy().tobytes(), (version, name)
            state = {name: t + 1 for name, t in state.items()}
    finally:
        writer.close()
        relay.close()
        for reader in (direct, *engines):
            reader.close()


def test_the_trainers_canary_reaches_every_engine_behind_a_relay_and_their_verdict_comes_back() -> None:
    """Each engine checks the canary the trainer sent with the version (it came through the relay, not from the
    trainer): the largest deviation they report reaches the trainer's writer, and an engine whose log-probs deviate
    refuses the version with ``CanaryError``, named at the trainer."""
    import torch

    from rlsync import Canary, CanaryError, WeightsWriter
    from rlsync.layouts import from_state_dict

    state = {"embed": torch.randn(32, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)}
    canary = Canary([[1, 2, 3]], [[-0.5, -0.25]])
    link = SyncOptions(transport="tcp", timeout=10, canary=True)
    local = LOCAL.replace(canary=True)
    engines: list[WeightsReader] = []
    seen: list[tuple[int, Canary | None]] = []

    def checks(engine: int, logprobs: list[list[float]]) -> Any:
        def on_version(version: int, buffers: Any) -> None:
            got = engines[engine].landed_canary
            seen.append((version, got))
            engines[engine].canary_deviation = None if got is None else got.check(logprobs, where=f"engine {engine}")
        return on_version

    engines += [WeightsReader(None, None, 0, replicas=1, options=local, on_version=checks(0, [[-0.5, -0.26]])),
                WeightsReader(None, None, 0, replicas=1, options=local, on_version=checks(1, [[-0.52, -0.25]]))]
    relay = NodeRelay([[e.address] for e in engines], options=link, local=local, replica_engines=True)
    writer = WeightsWriter(from_state_dict(state), None, 0, [relay.address], options=link)
    try:
        writer.multi_put(state)
        writer.complete(1, canary=canary)
        assert sorted(v for v, _ in seen) == [1, 1] and all(c == canary for _, c in seen)
        assert writer.last_canary_deviation == pytest.approx(0.01)  # engine 1's (0.02 + 0) / 2, the larger
        writer.multi_put(state)
        with pytest.raises(CanaryError, match="engine 0's log-probs deviate"):
            writer.complete(2, canary=Canary([[1, 2, 3]], [[-3.0, -3.0]]))
        assert relay.version == 1
    finally:
        writer.close()
        relay.close()
        for engine in engines:
            engine.close()


def test_a_relay_whose_two_copies_do_not_fit_in_host_memory_is_refused_before_it_allocates(
        sync: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlsync import ConfigError
    from rlsync.core.sync import _relay

    _, whole = sync.layouts("plain")
    engine = WeightsReader(None, whole, 0, options=LOCAL)
    needed = 2 * sum(t.nbytes for t in whole.tensors)
    monkeypatch.setattr(_relay, "free_memory", lambda device: needed // 2)  # room for one copy, not two
    try:
        with pytest.raises(ConfigError, match=r"takes .* GiB of host memory \(two copies.* run no relay on this host"):
            NodeRelay([[engine.address]], options=SyncOptions(transport="tcp"), local=LOCAL)
        monkeypatch.setattr(_relay, "free_memory", lambda device: 4 * needed)
        NodeRelay([[engine.address]], options=SyncOptions(transport="tcp"), local=LOCAL).close()
    finally:
        engine.close()
