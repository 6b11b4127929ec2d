"""The backend's node relays (``rlsync.adapters.verl._relays``): rollout workers that share a host take the trainer's
bytes once, through one ``NodeRelay`` run by the lowest of them, and every one of them lands every version bit-exact.
In one process, as ``test_verl_topology.py`` drives verl's contract (prepare, build_topology, init_process_group,
send and receive concurrently); where the hosts are is given by the workers' metadata."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("verl")
torch = pytest.importorskip("torch")

from rlsync import ConfigError  # noqa: E402
from rlsync.adapters.verl._relays import place, relay_mode  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _meta(host: str, rank: int, relay: Any = "auto") -> dict[str, Any]:
    return {"address": f"tcp://{host}:{100 + rank}", "host": host, "relay_address": f"tcp://{host}:{200 + rank}",
            "relay": relay}


def test_hosts_of_several_rollout_workers_and_no_trainer_get_one_relay_each() -> None:
    rollout = [_meta("a", 0), _meta("b", 1), _meta("a", 2), _meta("c", 3), _meta("b", 4), _meta("b", 5)]
    placed = place(["t", "t"], rollout)
    assert placed.entries == ["tcp://a:200", "tcp://b:201", "tcp://c:103"]  # a relay each for a and b; c alone
    assert placed.reader == [(0, 1), (0, 1), (0, 1), (2, 3), (0, 1), (0, 1)]
    assert placed.behind == [True, True, True, False, True, True]
    assert placed.relay[0] == {"address": "tcp://a:200", "rank": 0, "replicas": 3, "local": ["tcp://a:100", "tcp://a:102"]}
    assert placed.relay[1] == {"address": "tcp://b:201", "rank": 1, "replicas": 3,
                               "local": ["tcp://b:101", "tcp://b:104", "tcp://b:105"]}
    assert [r is None for r in placed.relay] == [False, False, True, True, True, True]


def test_auto_leaves_a_host_the_trainer_shares_and_false_relays_nothing() -> None:
    rollout = [_meta("t", 0), _meta("t", 1), _meta("b", 2), _meta("b", 3)]
    auto = place(["t"], rollout)
    assert auto.entries == ["tcp://t:100", "tcp://t:101", "tcp://b:202"]
    assert auto.reader == [(0, 3), (1, 3), (0, 1), (0, 1)] and auto.behind == [False, False, True, True]
    forced = place(["t"], [_meta("t", r, relay=True) for r in range(2)])
    assert forced.entries == ["tcp://t:200"]
    off = place(["t"], [_meta("b", r, relay=False) for r in range(2)])
    assert off.entries == ["tcp://b:100", "tcp://b:101"] and off.relay == [None, None]


def test_the_option_accepts_auto_true_false_and_names_itself_otherwise() -> None:
    assert relay_mode("auto") == "auto" and relay_mode(True) is True and relay_mode("false") is False
    with pytest.raises(ConfigError, match=r"checkpoint_engine\.engine_kwargs\.rlsync\.relay='sometimes'"):
        relay_mode("sometimes")


@pytest.mark.parametrize("wire", ["full", "delta"])
def test_three_rollout_workers_on_one_host_take_one_copy_through_the_relay(wire: str) -> None:
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import rlsync.adapters.verl  # noqa: F401  (registers the backend, as the entry point does)
    from rlsync.core import rank_address, split_address

    cls = CheckpointEngineRegistry.get("rlsync")
    # tcp to the host, as across machines; the relay forwards over shared memory (its workers' readers take that)
    actors = [cls(bucket_size=1 << 20, is_master=r == 0, wire=wire, transport="tcp") for r in range(2)]
    rollouts = [cls(bucket_size=1 << 20, timeout=30, relay=True, wire=wire, transport="tcp") for _ in range(3)]
    metadata = [e.prepare() for e in (*actors, *rollouts)]
    actor_kwargs, rollout_kwargs = cls.build_topology(2, 3, metadata)
    # the trainer sees one reader: the relay; each actor rank with its own credential, not the relay's key
    relay_base, relay_key = split_address(metadata[2]["relay_address"])
    for rank in (0, 1):
        [address] = actor_kwargs["readers"][rank]
        assert split_address(address)[0] == relay_base and address == rank_address(metadata[2]["relay_address"], rank)
        assert relay_key is not None and relay_key not in address
    for rank, engine in enumerate(actors):
        engine.init_process_group(**{k: v[rank] for k, v in actor_kwargs.items()})
    for rank, engine in enumerate(rollouts):
        engine.init_process_group(**{k: v[rank] for k, v in rollout_kwargs.items()})
    assert rollouts[0]._relay is not None and all(e._relay is None for e in rollouts[1:])

    gen = torch.Generator().manual_seed(0)
    weights = {"embed.weight": torch.randn(64, 48, generator=gen).to(torch.bfloat16),
               "norm.weight": torch.randn(48, generator=gen)}
    total = sum(t.numel() * t.element_size() for t in weights.values())

    async def sync(steps: int) -> tuple[list[dict[str, Any]], list[dict[str, torch.Tensor]]]:
        received: list[dict[str, torch.Tensor]] = [{} for _ in rollouts]

        async def consume(engine: Any, into: dict[str, torch.Tensor]) -> None:
            async for name, tensor in engine.receive_weights(global_steps=steps):
                into[name] = tensor.clone()

        results = await asyncio.gather(*(e.send_weights(iter(weights.items()), global_steps=steps) for e in actors),
                                       *(consume(e, got) for e, got in zip(rollouts, received)))
        return list(results[:2]), received

    try:
        for steps in (1, 2, 3):
            metrics, received = asyncio.run(sync(steps))
            for got in received:  # every worker of the host, bit for bit
                assert got.keys() == weights.keys() and all(torch.equal(got[n], t) for n, t in weights.items())
            sent = sum(m["rlsync/rank_wire_bytes"] for m in metrics)
            if steps == 1 or wire == "full":
                assert sent == total  # one copy for the host's three workers, not three
            else:
                assert 0 < sent < total / 4
            assert rollouts[0]._relay.version == metrics[0]["rlsync/sync_version"]  # live on the whole host
            with torch.no_grad():  # a step's change: a few values move
                for t in weights.values():
                    t.view(-1)[steps::17] += 1
    finally:
        for engine in rollouts:
            engine._close_rollout()
        for engine in actors:
            engine._close_writers()
