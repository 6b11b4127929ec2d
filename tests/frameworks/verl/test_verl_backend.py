"""verl loads rlsync as its checkpoint-engine backend ``rlsync``, and verl's own ``CheckpointEngineManager`` syncs
a trainer group of 2 ranks (FSDP2 on CPU) into 2 of verl's own ``CheckpointEngineWorker``s through it, on a
local CPU Ray. ``verl_workers.py`` names the two stand-ins (verl's trainer worker and server adapter need GPUs)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl")
torch = pytest.importorskip("torch")

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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    # vocab 8192 x hidden 128 in bf16: the embedding (2 MiB) is larger than the 1 MiB bucket verl is given
    config = Qwen2Config(vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         tie_word_embeddings=False)
    where = tmp_path_factory.mktemp("tiny-qwen2")
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(where)
    return where


class Cluster:
    def __init__(self, model_dir: Path, engine_kwargs: dict[str, Any]) -> None:
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
        from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig

        import verl_workers

        self.config = CheckpointEngineConfig(backend="rlsync", update_weights_bucket_megabytes=1,
                                             engine_kwargs={"rlsync": engine_kwargs})
        rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=1, data_parallel_size=1,
                                       pipeline_model_parallel_size=1, checkpoint_engine=self.config)
        model_config = HFModelConfig(path=str(model_dir), load_tokenizer=False)
        self.trainer = RayWorkerGroup(
            resource_pool=RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1),
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(verl_workers.FsdpTrainer),
                                                   checkpoint_engine_config=self.config, model_dir=str(model_dir)),
            device_name="cpu")
        self.rollout = RayWorkerGroup(
            resource_pool=RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1),
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(verl_workers.RecordingRollout),
                                                   rollout_config=rollout_config, model_config=model_config),
            device_name="cpu")
        replicas = [verl_workers.Replica(replica_rank=r, config=rollout_config, model_config=model_config)
                    for r in range(2)]
        for r in replicas:
            asyncio.run(r.init_hybrid(self.rollout))
        self.manager = CheckpointEngineManager(config=self.config, actor_wg=self.trainer, replicas=replicas)

    def received(self) -> list[tuple[dict[str, Any], list[Any]]]:
        return self.rollout.received()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}})
    yield
    ray.shutdown()


def test_three_syncs_through_verls_manager_land_bit_exact_with_metrics(model_dir: Path, ray_cluster: None) -> None:
    cluster = Cluster(model_dir, {"verify": True, "timeout": 120})
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
    assert metrics["rlsync/version"] == -1
    assert [steps for _, steps in cluster.received()] == [[1, 2, 3, None]] * 2


def test_a_trainer_rank_killed_mid_sync_leaves_the_rollout_side_on_the_previous_step(model_dir: Path,
                                                                                      ray_cluster: None) -> None:
    cluster = Cluster(model_dir, {"timeout": 20})
    cluster.trainer.train_step(1)
    cluster.manager.update_weights(global_steps=1)
    step1 = cluster.trainer.full_state()[0]
    cluster.trainer.train_step(2)
    cluster.trainer.die_in_next_sync(1, 5)
    with pytest.raises(Exception) as failure:
        cluster.manager.update_weights(global_steps=2)
    assert "died" in str(failure.value).lower() or "ActorDiedError" in repr(failure.value), failure.value
    for weights, steps in cluster.received():
        assert steps == [1]
        assert all(torch.equal(weights[name], tensor) for name, tensor in step1.items())
