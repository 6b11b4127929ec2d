"""verl loads rlsync as its checkpoint-engine backend ``rlsync``, and verl's own ``CheckpointEngineManager`` syncs
a trainer group of 2 ranks (FSDP2 on CPU) into 2 of verl's own ``CheckpointEngineWorker``s through it, on a
local CPU Ray. ``verl_workers.py`` names the two stand-ins (verl's trainer worker and server adapter need GPUs)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")
torch = pytest.importorskip("torch")

from rlsync import record_timeline  # noqa: E402
from rlsync.core import keyed  # noqa: E402
from rlsync.timeline import read_timeline  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
pytestmark = [pytest.mark.ray, pytest.mark.filterwarnings("ignore")]


def test_import_verl_alone_registers_the_backend() -> None:
    """The ``verl.plugins`` entry point: a fresh interpreter, nothing but ``import verl``."""
    code = "import verl\nfrom verl.checkpoint_engine import CheckpointEngineRegistry as R\nprint(R.get('rlsync').__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("rlsync.adapters.verl._engine")


def test_custom_backend_module_registers_it_too() -> None:
    """verl's explicit fallback (``checkpoint_engine.custom_backend_module``), with entry points switched off."""
    code = ("from verl.utils.import_utils import import_external_libs\n"
            "from verl.checkpoint_engine import CheckpointEngineRegistry as R\n"
            "assert 'rlsync' not in R._registry\n"
            "import_external_libs('rlsync.adapters.verl')\nprint(R.get('rlsync').__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "RlsyncCheckpointEngine"


def test_doctor_lists_the_backend_as_registered() -> None:
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "doctor"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "COLUMNS": "300"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "verl checkpoint-engine backend 'rlsync': registered" in out.stdout


def _tiny_qwen2(where: Path, peaked: bool = False) -> Path:
    """A tiny Qwen2 in bf16 (vocab 8192 x hidden 128: the embedding, 2 MiB, is larger than the 1 MiB bucket verl is
    given). ``peaked``: larger weights, so that its next-token distributions are peaked as a trained LM's (a default
    init predicts nearly uniform tokens, which any weights reproduce: no canary could tell them apart)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    if peaked:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.1)  # fp32 against bf16: about 0.01-0.03 nats a token; the fault below: 0.6
    model.to(torch.bfloat16).save_pretrained(where)
    return where


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="module")
def peaked_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny_qwen2(tmp_path_factory.mktemp("peaked-qwen2"), peaked=True)


class Cluster:
    def __init__(self, model_dir: Path, engine_kwargs: dict[str, Any], vllm: tuple[str, str] | None = None,
                 lora: str | None = None, rollout_dtype: str = "bfloat16", engine: str | None = None) -> None:
        """``vllm``: (server URL, address) of a vLLM server rollout worker 0 forwards what it receives into;
        ``engine``: the URL of a vLLM server at tensor parallelism 2 whose workers receive their own slices (the engine
        route: one replica of two rollout workers)."""
        import verl_workers
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

        served = vllm[0] if vllm is not None else engine
        if served is None:  # no engine to check a canary on; and the trainer's mixed-dtype model runs no forward
            engine_kwargs = {"canary": False, **engine_kwargs}
        self.config = CheckpointEngineConfig(backend="rlsync", update_weights_bucket_megabytes=1,
                                             engine_kwargs={"rlsync": engine_kwargs})
        rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=1 if engine is None else 2, data_parallel_size=1,
                                       pipeline_model_parallel_size=1, checkpoint_engine=self.config)
        model_config = HFModelConfig(path=str(model_dir), load_tokenizer=False)
        self.pools = [RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1) for _ in range(2)]
        self.trainer = RayWorkerGroup(
            resource_pool=self.pools[0],
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(verl_workers.FsdpTrainer),
                                                   checkpoint_engine_config=self.config, model_dir=str(model_dir), lora=lora,
                                                   fp32=served is not None, rollout_dtype=rollout_dtype,
                                                   store=str(Path(tempfile.mkdtemp(prefix="rlsync-verl-")) / "store")),
            device_name="cpu")
        self.rollout = RayWorkerGroup(
            resource_pool=self.pools[1],
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(verl_workers.RecordingRollout),
                                                   rollout_config=rollout_config, model_config=model_config, vllm=vllm,
                                                   engine=engine),
            device_name="cpu")
        replicas = [verl_workers.Replica(replica_rank=r, config=rollout_config, model_config=model_config)
                    for r in range(2 if engine is None else 1)]
        for r in replicas:
            asyncio.run(r.init_hybrid(self.rollout))
        if served is not None:  # replica 0's worker forwards into that vLLM server: its server actor asks it too
            replicas[0]._server_handle = ray.remote(verl_workers.FakeVllmServer).remote(served, str(model_dir))
        self.manager = CheckpointEngineManager(config=self.config, actor_wg=self.trainer, replicas=replicas)
        # what crosses: a bf16 rollout takes each trainer rank's own shards in bf16; other dtypes, gathered as they are
        self.shards = lora is None and rollout_dtype == "bfloat16"

    def expected(self) -> dict[str, torch.Tensor]:
        """The trainer's tensors as the rollout should hold them (in bf16 where its own shards cross)."""
        state = self.trainer.full_state()[0]
        return {n: t.to(torch.bfloat16) if self.shards and t.is_floating_point() else t for n, t in state.items()}

    def received(self) -> list[tuple[dict[str, Any], list[Any]]]:
        return self.rollout.received()

    def close(self) -> None:
        for worker in [*self.trainer.workers, *self.rollout.workers]:
            ray.kill(worker)
        for pool in self.pools:  # their CPUs go back to the module's Ray (16): a test can make any number of clusters
            for pg in pool.pgs or ():
                ray.util.remove_placement_group(pg)


@pytest.fixture
def clusters() -> Iterator[list[Cluster]]:
    """Clusters a test made, torn down after it (their actors would hold Ray's CPUs)."""
    made: list[Cluster] = []
    yield made
    for cluster in made:
        cluster.close()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}})
    yield
    ray.shutdown()


def _sync_bit_exact(cluster: Cluster, step: int, *train: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Train ``step``, sync it through verl's manager, check every rollout worker holds the trainer's tensors bit for
    bit; the step's metrics and the trainer's tensors."""
    cluster.trainer.train_step(step, *train)
    metrics = cluster.manager.update_weights(global_steps=step)
    expected = cluster.expected()
    for weights, steps in cluster.received():
        assert steps[-1] == step
        for name, tensor in expected.items():
            assert torch.equal(weights[name], tensor), (step, name)
    return metrics, expected


def test_each_trainer_rank_sends_its_own_shard_in_bf16_and_gathers_nothing(model_dir: Path, ray_cluster: None,
                                                                           clusters: list[Cluster], tmp_path: Path) -> None:
    """Issue #67, the trainer's side: through verl's own manager, each FSDP2 rank sends its own local shard (verl's
    ``get_per_tensor_param_shard``) in the rollout's bf16 (the trainer's model holds an fp32 tensor too), every byte
    once into each rollout worker, and makes no all-gather (nor any other collective) during the sync. With
    ``engine_kwargs.rlsync.timeline`` (#69) every process records: each rank's syncs and the driver's, and the
    driver's generations and train steps (verl's own ``AgentLoopManager.generate_sequences`` and
    ``RayPPOTrainer._update_actor``, as its ``fit`` runs them after each sync, over stand-ins: ``verl_driver.py``).
    Then a trainer rank killed mid-sync leaves every rollout worker on the previous step, whole."""
    import verl_driver  # verl's driver classes are imported before its first sync, as in verl's driver

    timeline = tmp_path / "timeline"
    cluster = Cluster(model_dir, {"verify": True, "timeout": 120, "timeline": str(timeline)})
    clusters.append(cluster)
    totals = {}
    with record_timeline(timeline):  # this process is verl's driver: recording in the block only (the option's file)
        for step in (1, 2, 3):
            metrics, expected = _sync_bit_exact(cluster, step)
            trainer, manager = verl_driver.driver(step)
            assert len(manager.generate_sequences(verl_driver.prompts(4))) == 4
            trainer._update_actor(verl_driver.trained_batch(4))
            assert len(trainer.actor_rollout_wg.batches) == 1  # verl's own _update_actor ran
            assert all(t.dtype == torch.bfloat16 for t in expected.values() if t.is_floating_point())
            assert metrics["rlsync/gathered"] == 0
            assert metrics["rlsync/bytes"] == 2 * sum(t.numel() * t.element_size() for t in expected.values())  # bf16
            assert metrics["rlsync/rank_wire_bytes"] == metrics["rlsync/rank_plan_bytes"] > 0  # as the plan says
            assert metrics["rlsync/senders"] == 2
            totals[metrics["rlsync/sync_version"]] = metrics["rlsync/bytes"]  # rlsync's version number (the step's is verl's)
    assert cluster.trainer.collectives()[0] == [{}] * 3  # rank 0's three syncs: no collective at all
    assert cluster.trainer.collectives()[1] == [{}] * 3
    events = read_timeline(timeline)
    assert len({e["pid"] for e in events if e["kind"] == "process"}) == 5  # the driver, 2 trainer ranks, 2 rollout workers
    driver = [e for e in events if e["kind"] == "sync" and e.get("route") == "verl"]
    assert [(e["step"], e["version"], e["bytes"]) for e in driver] == [(s, v, totals[v]) for s, v in zip((1, 2, 3), totals)]
    ranks = [e for e in events if e["kind"] == "sync" and "rank" in e]
    assert sorted((e["version"], e["rank"]) for e in ranks) == [(v, r) for v in totals for r in (0, 1)]
    for version, total in totals.items():  # each rank's bytes: its share of the version, within the driver's span
        assert sum(e["bytes"] for e in ranks if e["version"] == version) == total
        (outer,) = [e for e in driver if e["version"] == version]
        assert all(outer["start"] <= e["start"] <= e["end"] <= outer["end"] for e in ranks if e["version"] == version)
    # the driver's generation and train step of each step, after its sync
    timed = [(e["kind"], e.get("step")) for e in events if e["kind"] in ("request", "train") or e in driver]
    assert timed == [x for s in (1, 2, 3) for x in (("sync", s), ("request", None), ("train", s))], timed
    requests = [e for e in events if e["kind"] == "request"]
    assert all(e["sequences"] == 4 and e["tokens"] == 4 * verl_driver.RESPONSE and e["engine"] == "verl" for e in requests)
    assert all(e["end"] - e["start"] >= verl_driver.SECONDS for e in requests)
    # rank 1 killed in the middle of the next sync (after rank 0 finished its part): the sync raises, and each rollout
    # worker keeps step 3 whole, having given step 4 up as its connection closed (not at the 120 s timeout)
    cluster.trainer.train_step(4)
    cluster.trainer.die_in_next_sync(1, 5)
    with pytest.raises(Exception) as failure:
        cluster.manager.update_weights(global_steps=4)
    failed = time.monotonic()
    assert "died" in str(failure.value).lower() or "ActorDiedError" in repr(failure.value), failure.value
    for weights, steps in cluster.received():
        assert steps == [1, 2, 3]
        assert all(torch.equal(weights[name], tensor) for name, tensor in expected.items())
    assert time.monotonic() - failed < 60


def test_three_syncs_through_verls_manager_land_bit_exact_with_metrics(model_dir: Path, ray_cluster: None,
                                                                      clusters: list[Cluster]) -> None:
    """Today's route (each rank gathers every tensor and sends its row chunk), where a rollout serves another dtype
    than verl's bf16 shards: mixed dtypes land as the trainer holds them."""
    cluster = Cluster(model_dir, {"verify": True, "timeout": 120}, rollout_dtype="float32")
    clusters.append(cluster)
    for step in (1, 2, 3):
        cluster.trainer.train_step(step)
        metrics = cluster.manager.update_weights(global_steps=step)
        expected = cluster.trainer.full_state()[0]
        for weights, steps in cluster.received():  # each rollout worker holds a whole, bit-exact copy
            assert steps[-1] == step
            assert weights.keys() == expected.keys()
            for name, tensor in expected.items():
                assert weights[name].dtype == tensor.dtype and torch.equal(weights[name], tensor), (step, name)
        assert metrics["rlsync/version"] == step
        total = sum(t.numel() * t.element_size() for t in expected.values())
        assert metrics["rlsync/bytes"] == 2 * total  # every byte once into each of the 2 rollout workers
        assert metrics["rlsync/senders"] == 2  # both trainer ranks send, not rank 0 alone
        assert metrics["rlsync/max_bytes_per_sender"] < 0.6 * metrics["rlsync/bytes"]  # about half each
        assert metrics["rlsync/seconds"] > 0 and metrics["rlsync/gbps"] > 0
    metrics = cluster.manager.update_weights(global_steps=None)  # before validation, say: no step number
    assert metrics["rlsync/version"] == -1 and metrics["rlsync/gathered"] == 1
    assert [steps for _, steps in cluster.received()] == [[1, 2, 3, None]] * 2
    assert all(c.get("full_tensor", 0) > 0 for c in cluster.trainer.collectives()[0])  # this route gathers, counted


def test_rollout_workers_of_one_host_take_one_copy_through_a_relay_and_deltas_move_a_fraction(
        model_dir: Path, ray_cluster: None, clusters: list[Cluster]) -> None:
    """``engine_kwargs.rlsync.relay=true`` and ``wire=delta`` through verl's manager and Ray: the two rollout workers
    of this host sit behind one ``NodeRelay`` run by the first, the trainer ranks send the host one copy (half of what
    they send without it), and after the first sync, with small steps (2 % of the values), each trainer rank moves a
    fraction of its bytes; each worker holds a bit-exact copy at every step (CRCs checked too)."""
    cluster = Cluster(model_dir, {"verify": True, "timeout": 120, "relay": True, "wire": "delta"})
    clusters.append(cluster)
    sent = []
    for step in (1, 2, 3):
        metrics, expected = _sync_bit_exact(cluster, step, 50)
        if step == 1:  # in full: one copy for the host, not one per rollout worker
            assert metrics["rlsync/bytes"] == sum(t.numel() * t.element_size() for t in expected.values())
        sent.append(metrics["rlsync/rank_wire_bytes"])
    assert sent[0] > 0 and all(0 < n < 0.2 * sent[0] for n in sent[1:]), sent


VLLM_PYTHON = os.environ.get("RLSYNC_TEST_VLLM_PYTHON")
GREEDY = """
import json, os, sys
os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
adapters = sys.argv[3:]  # PEFT adapter directories: the greedy output with each
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", distributed_executor_backend="uni",
          max_model_len=128, seed=0, **({"enable_lora": True, "max_lora_rank": 8} if adapters else {}))
for i, adapter in enumerate(adapters or [None], start=1):
    outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                        SamplingParams(temperature=0.0, max_tokens=8, detokenize=False), use_tqdm=False,
                        lora_request=None if adapter is None else LoRARequest(f"a{i}", i, adapter))
    print("GREEDY", json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""
PROMPTS = [[5, 17, 42, 99, 3], [200, 1, 77]]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(900)
@pytest.mark.skipif(VLLM_PYTHON is None, reason="needs RLSYNC_TEST_VLLM_PYTHON, a Python with vllm-cpu (nox -s verl builds one)")
def test_the_weights_end_in_a_vllm_engine_that_generates_like_a_fresh_one(peaked_model_dir: Path, ray_cluster: None,
                                                                          tmp_path: Path, clusters: list[Cluster]) -> None:
    """Three steps into a real vllm-cpu server, each checked by the canary on the replica that serves from it
    (``rlsync/canary_deviation`` in verl's sync metrics); then a fault after the bytes landed (a tensor the engine
    gets zeroed, which no byte check sees) is refused by the canary with an error naming the deviation."""
    from _support import vllm_server
    from transformers import AutoModelForCausalLM

    from rlsync import CanaryError

    model_dir = peaked_model_dir
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": str(tmp_path), "TMPDIR": str(tmp_path)}
    env.pop("PYTHONPATH", None)
    assert VLLM_PYTHON is not None
    with vllm_server.running(model_dir, tmp_path / "server.log", python=VLLM_PYTHON, env=env) as base:
        before = vllm_server.greedy(base, str(model_dir), PROMPTS, 8)  # the checkpoint's, as a fresh engine serves it
        cluster = Cluster(model_dir, {"timeout": 300}, vllm=(base, keyed(f"tcp://127.0.0.1:{_free_port()}")))
        clusters.append(cluster)
        for step in (1, 2, 3):
            cluster.trainer.train_step(step)
            metrics = cluster.manager.update_weights(global_steps=step)
            assert 0 <= metrics["rlsync/canary_deviation"] < 0.05, metrics  # bf16 trainer, bf16 engine: rounding
            assert "rlsync/_canary" not in metrics
        served = vllm_server.greedy(base, str(model_dir), PROMPTS, 8)
        state = cluster.trainer.full_state()[0]
        cluster.rollout.corrupt("model.layers.1.mlp.down_proj.weight")
        cluster.trainer.train_step(4)
        with pytest.raises(CanaryError, match=r"verl's rollout replica 0's log-probs deviate .* \(version refused\)"):
            cluster.manager.update_weights(global_steps=4)
    # a fresh engine loaded with the trainer's step-3 weights generates the same tokens
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.load_state_dict(state)
    model.save_pretrained(tmp_path / "step3")
    fresh = subprocess.run([VLLM_PYTHON, "-c", GREEDY, str(tmp_path / "step3"), json.dumps(PROMPTS)], capture_output=True,
                           text=True, timeout=600, env=env)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    [line] = [x for x in fresh.stdout.splitlines() if x.startswith("GREEDY ")]
    assert served == json.loads(line.removeprefix("GREEDY "))
    assert served != before  # the steps changed what it generates (the server's own output before the first sync)


@pytest.mark.timeout(900)
@pytest.mark.skipif(VLLM_PYTHON is None, reason="needs RLSYNC_TEST_VLLM_PYTHON, a Python with vllm-cpu (nox -s verl builds one)")
def test_each_trainer_rank_lands_its_shards_straight_in_the_vllm_workers_that_read_them(
        peaked_model_dir: Path, ray_cluster: None, tmp_path: Path, clusters: list[Cluster]) -> None:
    """Issue #67, the engine's side: a real vllm-cpu server at tensor parallelism 2 runs rlsync's weight-transfer
    backend (the engine argument rlsync's patch of verl's ``RolloutConfig`` adds), its replica's leader drives each
    version through verl's ``collective_rpc`` path, and each of the two FSDP2 trainer ranks sends its own bf16 shards
    into the two vLLM workers, each of which receives its own slice only: the bytes on the link are the model's once
    (not once per worker), as the plan says, nothing is gathered, and no rollout worker receives a byte. Greedy output
    then equals a fresh TP=2 engine's loaded with the trainer's weights; a trainer rank killed in the next sync leaves
    the engine serving that version (the sync raises)."""
    from _support import vllm_server
    from transformers import AutoModelForCausalLM
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    # what a user's one flag turns into, on verl's own config: vLLM's engine runs rlsync's weight-transfer backend
    flag = RolloutConfig(name="vllm", checkpoint_engine=CheckpointEngineConfig(backend="rlsync"))
    assert flag.engine_kwargs["vllm"]["weight_transfer_config"] == {"backend": "rlsync"}
    model_dir = peaked_model_dir
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": str(tmp_path), "TMPDIR": str(tmp_path),
           "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    env.pop("PYTHONPATH", None)
    assert VLLM_PYTHON is not None
    tp2 = ["--tensor-parallel-size", "2"]
    with vllm_server.running(model_dir, tmp_path / "server.log", tp2, python=VLLM_PYTHON, env=env) as base:
        before = vllm_server.greedy(base, str(model_dir), PROMPTS, 8)
        cluster = Cluster(model_dir, {"timeout": 60, "verify": True}, engine=base)
        clusters.append(cluster)
        for step in (1, 2):
            cluster.trainer.train_step(step)
            metrics = cluster.manager.update_weights(global_steps=step)
            model_bytes = sum(t.numel() * 2 for t in cluster.trainer.full_state()[0].values())  # bf16, once
            assert metrics["rlsync/engine_route"] == 1 and metrics["rlsync/gathered"] == 0, metrics
            assert 0 <= metrics["rlsync/canary_deviation"] < 0.05, metrics
            assert metrics["rlsync/receivers"] == 2  # the two vLLM workers, not the rollout workers
            # every byte once into the replica (its norms once into each worker), not once into each worker
            assert model_bytes <= metrics["rlsync/bytes"] < 1.02 * model_bytes, (metrics, model_bytes)
            assert metrics["rlsync/max_bytes_per_receiver"] < 0.52 * model_bytes  # each worker its own slice
            ranks = [results[-1] for results in cluster.trainer.sync_results()]
            assert sum(r["rlsync/rank_wire_bytes"] for r in ranks) == metrics["rlsync/bytes"]
            assert all(r["rlsync/rank_wire_bytes"] == r["rlsync/rank_plan_bytes"] > 0 for r in ranks)
        served = vllm_server.greedy(base, str(model_dir), PROMPTS, 8)
        state = cluster.trainer.full_state()[0]
        (leader_calls, steps), (other_calls, _) = cluster.rollout.engine_calls()
        per_version = ["start_weight_update", "update_weights", "update_weights", "finish_weight_update"]
        assert leader_calls == ["init_weight_transfer_engine", *per_version, *per_version] and steps == [1, 2]
        assert other_calls == []  # the leader's collective_rpc reaches the second worker's engine
        assert all(weights == {} for weights, _ in cluster.received())  # no rollout worker landed a byte
        assert cluster.trainer.collectives() == [[{}, {}], [{}, {}]]  # nothing gathered, on either rank
        cluster.trainer.train_step(3)
        cluster.trainer.die_in_next_sync(1, 5)  # rank 1 is killed after 5 of its tensors
        with pytest.raises(Exception) as failure:
            cluster.manager.update_weights(global_steps=3)
        assert "died" in str(failure.value).lower() or "ActorDiedError" in repr(failure.value), failure.value
        assert vllm_server.greedy(base, str(model_dir), PROMPTS, 8) == served  # step 2's weights, whole
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.load_state_dict(state)
    model.save_pretrained(tmp_path / "step2")
    with vllm_server.running(tmp_path / "step2", tmp_path / "fresh.log", tp2, python=VLLM_PYTHON, env=env) as fresh:
        assert served == vllm_server.greedy(fresh, str(tmp_path / "step2"), PROMPTS, 8)
    assert served != before


def test_a_lora_base_model_without_its_adapter_is_refused_naming_the_merge_option() -> None:
    """verl 0.9 with an unmerged LoRA hands a checkpoint engine ``get_per_tensor_param()``'s defaults: the base model
    alone, under PEFT's ``.base_layer`` names (its own ``collect_lora_params`` and ``replace_lora_wrapper``, run here on
    a real PEFT model). Synced silently, the rollout would sample from the initial policy all run (verl #7495)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.utils.fsdp_utils import collect_lora_params, replace_lora_wrapper

    from rlsync import ConfigError
    from rlsync.adapters.verl import RlsyncCheckpointEngine

    config = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(Qwen2ForCausalLM(config), peft_config)
    params = collect_lora_params(module=model, layered_summon=False, base_sync_done=False)
    handed = {replace_lora_wrapper(k, peft_config): v for k, v in params.items()}  # as FSDPEngine.get_per_tensor_param
    assert not any("lora_" in name for name in handed)  # no adapter tensor reaches the checkpoint engine
    engine = RlsyncCheckpointEngine(bucket_size=1 << 20)
    engine.init_process_group("actor", 0, 1, ["tcp://127.0.0.1:9"])
    with pytest.raises(ConfigError, match=r"base weights without its adapter .* actor_rollout_ref\.model\.lora\.merge=True"):
        asyncio.run(engine.send_weights(iter(handed.items()), global_steps=1))


def test_a_merged_lora_reaches_the_rollout_with_its_adapter(model_dir: Path, ray_cluster: None, clusters: list[Cluster]) -> None:
    """``lora.merge=True``: verl's merged weights (its own ``merged_lora_context``) land on every rollout worker and
    carry each step's adapter: equal to base + scale * B @ A of the trainer's current adapter, not the base model."""
    cluster = Cluster(model_dir, {"timeout": 120}, lora="merged")
    clusters.append(cluster)
    try:
        ray.get([w.__ray_ready__.remote() for w in cluster.trainer.workers])
    except ray.exceptions.ActorDiedError:  # seen once in many runs: a trainer process died of SIGSEGV in malloc while
        cluster = Cluster(model_dir, {"timeout": 120}, lora="merged")  # building its model, before any sync; start again
        clusters.append(cluster)
    for step in (1, 2):
        cluster.trainer.train_step(step)  # moves every parameter, the adapter's A and B too
        cluster.manager.update_weights(global_steps=step)
        merged = cluster.trainer.merged_state()[0]
        for weights, _ in cluster.received():
            assert weights.keys() == merged.keys()
            for name, tensor in merged.items():
                torch.testing.assert_close(weights[name].float(), tensor, atol=0.01, rtol=0.01, msg=f"step {step} {name}")
        q = "model.layers.0.self_attn.q_proj.weight"
        base = cluster.trainer.full_state()[0]["base_model.model." + q.replace(".weight", ".base_layer.weight")].float()
        assert (weights[q].float() - base).abs().mean() > 0.05, "the rollout got the base weights without the adapter"


def _adapter_bytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def test_an_unmerged_lora_sends_the_adapter_alone_and_the_server_adapter_gets_its_config(
        model_dir: Path, ray_cluster: None, clusters: list[Cluster]) -> None:
    """``lora.merge=False``: verl's own ``ActorRolloutRefWorker.update_weights`` (rlsync's patch) asks the model engine
    for the adapter (``base_sync_done=True``) and hands it with its PEFT config to the backend; every rollout worker
    gets the adapter's tensors, bit-exact and nothing else, and verl's own ``CheckpointEngineWorker.update_weights``
    (patched too) hands its server adapter ``peft_config`` and ``base_sync_done=True``."""
    cluster = Cluster(model_dir, {"verify": True, "timeout": 120}, lora="adapter")
    clusters.append(cluster)
    for step in (1, 2):
        cluster.trainer.train_step(step)
        metrics = cluster.manager.update_weights(global_steps=step)
        adapter, config = cluster.trainer.adapter_state()[0]
        for (weights, steps), (peft_config, base_sync_done) in zip(cluster.received(), cluster.rollout.received_peft()):
            assert steps[-1] == step and weights.keys() == adapter.keys() and all("lora_" in n for n in weights)
            for name, tensor in adapter.items():
                assert torch.equal(weights[name], tensor), (step, name)
            assert base_sync_done is True and peft_config["r"] == config["r"] == 4
            assert sorted(peft_config["target_modules"]) == ["q_proj", "v_proj"]
        assert metrics["rlsync/adapter_only"] == 1.0
        config_bytes = len(json.dumps(config, default=sorted).encode())
        assert metrics["rlsync/bytes"] == 2 * (_adapter_bytes(adapter) + config_bytes)  # each rollout worker, once


@pytest.mark.timeout(900)
@pytest.mark.skipif(VLLM_PYTHON is None, reason="needs RLSYNC_TEST_VLLM_PYTHON, a Python with vllm-cpu (nox -s verl builds one)")
def test_an_unmerged_lora_is_served_as_a_fresh_engine_serves_its_adapter(model_dir: Path, ray_cluster: None,
                                                                         tmp_path: Path, clusters: list[Cluster]) -> None:
    """The adapter of each step ends in a vLLM engine serving LoRA: its greedy output equals a fresh engine serving
    PEFT's ``save_pretrained`` of the trainer's adapter at that step (and differs from step to step: a rollout that
    kept the initial adapter fails)."""
    from _support import vllm_server
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_RPC_BASE_PATH": str(tmp_path), "TMPDIR": str(tmp_path),
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    env.pop("PYTHONPATH", None)
    assert VLLM_PYTHON is not None
    served, adapters = [], []
    with vllm_server.running(model_dir, tmp_path / "server.log", ["--enable-lora", "--max-lora-rank", "8"],
                             python=VLLM_PYTHON, env=env) as base:
        cluster = Cluster(model_dir, {"timeout": 300}, vllm=(base, keyed(f"tcp://127.0.0.1:{_free_port()}")), lora="adapter")
        clusters.append(cluster)
        for step in (1, 2):
            cluster.trainer.train_step(step)
            cluster.manager.update_weights(global_steps=step)
            served.append(vllm_server.greedy(base, f"policy@{step}", PROMPTS, 8))
            state, _ = cluster.trainer.adapter_state()[0]
            peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16),
                                        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
            set_peft_model_state_dict(peft_model, state)
            peft_model.save_pretrained(tmp_path / f"adapter{step}")
            adapters.append(str(tmp_path / f"adapter{step}"))
    fresh = subprocess.run([VLLM_PYTHON, "-c", GREEDY, str(model_dir), json.dumps(PROMPTS), *adapters], capture_output=True,
                           text=True, timeout=600, env=env)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert served == [json.loads(x.removeprefix("GREEDY ")) for x in fresh.stdout.splitlines() if x.startswith("GREEDY ")]
    assert served[0] != served[1]
