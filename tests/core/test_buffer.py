"""The rollout buffer: staleness bound under concurrency, restart capacity, partial-rollout
policies, token batching, gates, importance weights, the version clock."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from rlsync import (
    MemoryStorage,
    PolicyVersionClock,
    RolloutBuffer,
    RolloutBufferError,
    Sample,
    VersionError,
    decode_sample,
    encode_sample,
)
from rlsync.core import freshest_per_group, importance_weights


def sample(prompt: str, versions: list[int], prompt_len: int = 2, group: str | None = None) -> Sample:
    n = len(versions)
    return Sample(prompt, np.arange(prompt_len + n, dtype=np.int32), prompt_len, np.full(n, -1.0, np.float32),
                  np.array(versions, np.int32), group=group)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lag_bound_holds_under_random_concurrent_load(seed: int) -> None:
    rng = random.Random(seed)
    bound, batch = 2, 4
    buf = RolloutBuffer(batch_size=batch, max_staleness=bound, on_stale="wait")
    clock = PolicyVersionClock(0)
    stop = threading.Event()
    lags: list[int] = []

    def generator(k: int) -> None:
        local = random.Random(seed * 10 + k)
        while not stop.is_set():
            ticket = buf.admit(timeout=0.2)
            if ticket is None:
                continue
            versions = []
            for _ in range(local.randint(1, 6)):  # each token is one step; a publish may land between steps
                with clock.step() as v:
                    versions.append(v)
                time.sleep(local.random() * 0.002)
            buf.put(sample(f"p{k}", versions), ticket)

    threads = [threading.Thread(target=generator, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        for step in range(1, 26):
            got = buf.get(timeout=20)
            assert got is not None and len(got) == batch
            lags.extend(int(x) for lag in got.version_lags() for x in lag)
            time.sleep(rng.random() * 0.003)
            clock.advance(step, apply=lambda s=step: buf.publish(s))
    finally:
        stop.set()
        buf.close()
        for t in threads:
            t.join()
    assert max(lags) <= bound
    assert buf.telemetry.dropped == 0
    assert max(lags) > 0  # the workload really was off-policy


def test_drop_mode_drops_what_is_too_old() -> None:
    buf = RolloutBuffer(batch_size=2, max_staleness=1, on_stale="drop")
    buf.put([sample("a", [0, 0]), sample("b", [0])])
    buf.publish(1)
    buf.publish(2)
    buf.put([sample("c", [2]), sample("d", [1, 2])])
    got = buf.get(timeout=1)
    assert got is not None and [s.prompt_id for s in got.samples] == ["d", "c"]  # oldest policy first
    assert buf.telemetry.dropped == 2


def test_capacity_is_right_after_a_restart_from_saved_state() -> None:
    storage = MemoryStorage()  # stands for durable storage (Redis) that outlives the process
    buf = RolloutBuffer(batch_size=4, max_staleness=1, storage=storage)
    tickets = [buf.admit() for _ in range(8)]
    assert buf.capacity() == 0 and buf.admit(timeout=0.01) is None
    for t in tickets[:6]:
        assert t is not None
        buf.put(sample("p", [0]), t)
    assert buf.get() is not None
    buf.publish(1)
    # 4 consumed, 2 waiting, 2 in flight: limit (1 + 1 + 1) * 4 = 12 -> 4 free
    assert buf.capacity() == 4
    restarted = RolloutBuffer(batch_size=4, max_staleness=1, storage=storage)
    # the 2 in-flight rollouts died with the old process; consumed and waiting come back
    assert (restarted.version, restarted.consumed, restarted.waiting, restarted.in_flight) == (1, 4, 2, 0)
    assert restarted.capacity() == 6


def test_partial_rollout_policies() -> None:
    cont = RolloutBuffer(batch_size=1, max_staleness=3, partial="continue")
    t = cont.admit(prompt_id="q")
    cont.publish(1)
    assert t is not None and cont.put(sample("q", [0, 1]), t)  # a rollout spanning the update keeps both versions
    assert cont.get(timeout=1).samples[0].versions.tolist() == [0, 1]  # type: ignore[union-attr]

    abort = RolloutBuffer(batch_size=1, max_staleness=3, partial="abort")
    t = abort.admit(prompt_id="q")
    abort.publish(1)
    assert t is not None and not abort.put(sample("q", [0]), t)
    assert abort.next_prompt() == "q" and abort.waiting == 0 and abort.telemetry.aborted == 1

    drain = RolloutBuffer(batch_size=1, max_staleness=3, partial="drain")
    t = drain.admit()
    drain.publish(1)
    assert drain.admit(timeout=0.05) is None  # nothing new while a rollout is in flight
    assert t is not None and drain.put(sample("q", [0]), t)
    assert drain.admit(timeout=1) is not None


def test_batches_by_token_count() -> None:
    buf = RolloutBuffer(batch_size=100, max_staleness=5)
    buf.put([sample(f"p{i}", [0] * 8) for i in range(5)])  # 10 tokens each
    got = buf.get(max_tokens=35, timeout=1)
    assert got is not None and len(got) == 3 and got.num_tokens == 30
    with pytest.raises(RolloutBufferError, match="does not fit max_tokens=5"):
        buf.get(max_tokens=5, timeout=1)


def test_groups_are_delivered_whole_and_freshest() -> None:
    buf = RolloutBuffer(batch_size=2, max_staleness=5, group_size=2)
    buf.publish(1)
    buf.put([sample("a", [0], group="g1"), sample("x", [0], group="g2")])
    assert buf.get(timeout=0.1) is None  # no group complete yet
    buf.put(sample("b", [1], group="g1"))
    got = buf.get(timeout=1)
    assert got is not None and [s.prompt_id for s in got.samples] == ["a", "b"]
    many = [sample(f"s{v}", [v]) for v in (0, 3, 1, 3)]
    assert [s.prompt_id for s in freshest_per_group(many, 2)] == ["s3", "s3"]


def test_a_group_taken_apart_by_version_is_gated_again_when_it_is_handed_out() -> None:
    """Partial rollouts give one group members whose first tokens are of different versions; the storage hands them
    out oldest version first, so a group can complete in one get and wait for the next, across a publish: it must
    be gated again under the version it trains at. (Seen in the async example: one token two versions behind at
    max_staleness=1.)"""
    buf = RolloutBuffer(batch_size=2, max_staleness=1, on_stale="drop", group_size=2)
    buf.publish(1)
    buf.put([sample("a", [0, 1], group="A"), sample("a", [1], group="A")])
    buf.put([sample("b", [0], group="B"), sample("b", [0, 1], group="B")])
    first = buf.get(timeout=1)
    assert first is not None and {s.group for s in first.samples} == {"B"}
    buf.publish(2)
    assert buf.get(timeout=0.2) is None  # A's first member is now two versions old: dropped, A cannot complete
    assert buf.telemetry.dropped == 1
    buf.put(sample("a", [2], group="A"))  # a fresh member completes it
    second = buf.get(timeout=1)
    assert second is not None and [list(s.versions) for s in second.samples] == [[1], [2]]
    assert all(second.trainer_version - s.oldest_version <= 1 for s in second.samples)


def test_importance_weights_match_a_hand_computation() -> None:
    trainer = np.array([-1.0, -0.5, -2.0], np.float32)
    behaviour = np.array([-1.0, -1.5, -0.1], np.float32)
    expected = [1.0, min(np.e, 2.0), np.exp(-1.9)]
    np.testing.assert_allclose(importance_weights(trainer, behaviour, cap=2.0), expected, rtol=1e-6)
    buf = RolloutBuffer(batch_size=1, max_staleness=5)
    s = Sample("p", np.arange(5, dtype=np.int32), 2, behaviour, np.zeros(3, np.int32))
    buf.put(s)
    got = buf.get(timeout=1)
    assert got is not None
    np.testing.assert_allclose(got.importance_weights([trainer], cap=2.0)[0], expected, rtol=1e-6)


def test_bad_samples_and_versions_are_refused() -> None:
    with pytest.raises(RolloutBufferError, match="3 generated tokens but 2 log-probs"):
        Sample("p", np.arange(5, dtype=np.int32), 2, np.zeros(2, np.float32), np.zeros(3, np.int32))
    buf = RolloutBuffer(batch_size=1)
    with pytest.raises(VersionError, match="newer than published 0"):
        buf.put(sample("p", [1]))
    buf.publish(1)
    with pytest.raises(VersionError):
        buf.publish(1)


def test_clock_fences_stamping_against_publishing() -> None:
    clock = PolicyVersionClock(0)
    order: list[str] = []
    inside = threading.Event()

    def long_step() -> None:
        with clock.step() as v:
            inside.set()
            time.sleep(0.1)
            order.append(f"step-end v{v}")

    t = threading.Thread(target=long_step)
    t.start()
    inside.wait()
    clock.advance(1, apply=lambda: order.append("apply"))
    t.join()
    assert order == ["step-end v0", "apply"]  # the weights changed only after the running step ended
    with clock.step() as v:
        assert v == 1


def test_wire_round_trip_keeps_every_field() -> None:
    s = sample("p", [3, 4], group="g")
    s.reward = 0.5
    back = decode_sample(encode_sample(s))
    assert (back.sample_id, back.prompt_id, back.group, back.reward, back.prompt_len) == (s.sample_id, "p", "g", 0.5, 2)
    assert back.versions.tolist() == [3, 4] and back.tokens.tolist() == s.tokens.tolist()


def test_telemetry_counts_token_lags_and_reaches_report_hooks() -> None:
    import rlsync

    seen: list[dict[str, object]] = []

    class Reporter:
        @rlsync.hookimpl
        def rlsync_report(self, kind: str, stats: dict[str, object]) -> None:
            seen.append({"kind": kind, **stats})

    pm = rlsync.make_plugin_manager(autoload=False)
    pm.register(Reporter())
    buf = RolloutBuffer(batch_size=2, max_staleness=3, plugins=pm)
    buf.publish(1)
    buf.publish(2)
    buf.put([sample("a", [0, 1, 2]), sample("b", [2, 2])])
    assert buf.get(timeout=1) is not None
    line = buf.report()
    assert seen[0]["kind"] == "buffer" and seen[0]["token_lag_histogram"] == [3, 1, 1, 0, 0, 0, 0, 0]
    assert "token lag 0:3 1:1 2:1" in line


def test_max_staleness_judges_a_sample_or_a_batch_of_oldest_versions_alike() -> None:
    """``MaxStaleness.keeps`` takes an int, a numpy array or a torch tensor (a trainer's batch where it lives): the
    same verdicts as the gate on samples, the lag of exactly ``max_staleness`` kept."""
    import torch

    from rlsync import Decision, MaxStaleness

    gate = MaxStaleness(2)
    oldest = [7, 8, 5, 10, 6]
    verdicts = [gate(Sample("p", np.arange(4, dtype=np.int32), 2, np.zeros(2, np.float32), np.full(2, v, np.int64)), 10)
                is Decision.TRAIN for v in oldest]
    assert verdicts == [False, True, False, True, False]
    assert [bool(gate.keeps(v, 10)) for v in oldest] == verdicts
    assert gate.keeps(np.array(oldest), 10).tolist() == verdicts
    assert gate.keeps(torch.tensor(oldest), 10).tolist() == verdicts


@pytest.mark.parametrize("options", [{"max_staleness": -1}, {"batch_size": 0}, {"batch_size": 2.5}, {"group_size": -3},
                                     {"max_staleness": True}])
def test_a_number_that_would_hang_or_mean_nothing_is_refused_naming_it(options: dict) -> None:
    """#58: max_staleness=-1 was accepted and admit() then blocked forever."""
    from rlsync import ConfigError, make_buffer

    name = next(iter(options))
    with pytest.raises(ConfigError, match=f"{name}="):
        make_buffer("memory", **{"batch_size": 2, **options})
