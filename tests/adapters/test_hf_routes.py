"""Routing replay in transformers MoE models (``rlsync.adapters.hf.replay_routes``), for Qwen3-MoE, OLMoE and
Mixtral built here (tiny, random). The routes a "generator" forward took are recorded; the weights then move one
optimizer step (on other data). Without replay the moved model routes some tokens elsewhere (counted); with replay
it takes the recorded experts for every token, and its routers still get gradients. Replaying a model's own routes
changes nothing, bit for bit. (The log-prob gap to the generator is printed, not asserted: on these tiny models
the tokens routed elsewhere sit at near-ties and replay moves the gap by under 1 %.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _support.moe_routes import own_routes, token_logprobs, with_and_without_replay

import rlsync
from rlsync.adapters.hf import HeldReplay, replay_routes, routes_of

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8,
                                                    moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
                                                    num_key_value_heads=2, num_experts=8,
                                                    num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                                    mlp_only_layers=[]),
    "olmoe": lambda: transformers.OlmoeConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
                                              num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                              num_experts_per_tok=2),
    "mixtral": lambda: transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16,
                                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                                  num_local_experts=8, num_experts_per_tok=2),
}
BATCH, SEQ, LAYERS, TOP_K = 3, 12, 3, 2


def _model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate" in name and p.ndim == 2 and p.shape[0] == 8:
                p.normal_(0, 0.5)  # routers with opinions, as a trained model's are
    return model.eval()


def _record(model: torch.nn.Module, ids: torch.Tensor) -> np.ndarray:
    return own_routes(model, ids, LAYERS, TOP_K)


def _step(model: torch.nn.Module) -> None:
    """One AdamW step on a batch of other tokens."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    other = torch.randint(0, 64, (8, SEQ), generator=torch.Generator().manual_seed(2))
    (-token_logprobs(model, other).mean()).backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_replay_takes_the_recorded_experts_after_the_weights_moved(arch: str) -> None:
    model = _model(arch)
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = token_logprobs(model, ids)
        recorded = _record(model, ids)
        with replay_routes(model, recorded):  # its own routes: nothing changes
            assert torch.equal(token_logprobs(model, ids), before)
    _step(model)  # the trainer's weights move a step past the generator's

    moved = _record(model, ids)
    differing = int((np.sort(moved, -1) != np.sort(recorded, -1)).any(-1).sum())
    assert differing > 0, "the step moved no token to other experts: the test shows nothing"
    without, with_replay, log, used = with_and_without_replay(model, ids, recorded)
    assert len(used) == LAYERS
    for layer, given in enumerate(used):  # the forward ran the recorded experts, token by token
        assert torch.equal(given.view(BATCH, SEQ, TOP_K), torch.from_numpy(recorded[:, :, layer]))
    assert not torch.equal(with_replay, without)
    gap_without = (without - before).abs().mean().item()
    gap_with = (with_replay - before).abs().mean().item()
    assert log.replayed == BATCH * SEQ * LAYERS and log.differing > 0
    # what the first router would have picked itself is logged (later layers see the replayed layers' outputs)
    assert torch.equal(log.picked[0].view(BATCH, SEQ, TOP_K), torch.from_numpy(moved[:, :, 0]))  # type: ignore[union-attr]
    print(f"\n{arch}: {differing} of {BATCH * SEQ * LAYERS} token-layers routed elsewhere after one step; "
          f"log-prob gap to the generator {gap_without:.4f} without replay, {gap_with:.4f} with")

    model.zero_grad()
    with replay_routes(model, recorded):
        (-token_logprobs(model, ids).mean()).backward()
    router_grads = [p.grad for n, p in model.named_parameters() if "gate" in n and p.ndim == 2 and p.shape[0] == 8]
    assert router_grads and all(g is not None and g.abs().sum() > 0 for g in router_grads)


@pytest.mark.parametrize("arch", ["qwen3_moe"])
def test_a_gradient_checkpointed_backward_under_replay_recomputes_the_replayed_experts(arch: str) -> None:
    """With gradient checkpointing a layer's forward runs again in the backward: while the replay is still open
    there, the gradients are those of the replayed forward (equal to the same backward without checkpointing); once
    it is closed before the backward, the recompute routes itself (torch refuses the backward, or its gradients
    differ): what ``HeldReplay`` keeps the replay open for (TRL's, OpenRLHF's and verl's routing replay)."""
    model = _model(arch)
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    recorded = _record(model, ids)
    _step(model)
    assert (np.sort(_record(model, ids), -1) != np.sort(recorded, -1)).any(), "no token routes elsewhere: nothing shown"

    def grads(checkpointing: bool, close_before_backward: bool) -> list[torch.Tensor]:
        model.train()
        renamed = hasattr(model, "activation_checkpointing_enable")  # transformers 5.2x's name for it
        if checkpointing and renamed:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.activation_checkpointing_disable() if renamed else model.gradient_checkpointing_disable()
        model.zero_grad()
        held = HeldReplay()  # what the framework adapters hold from a forward through its backward
        log = held.open(model, recorded)
        loss = -token_logprobs(model, ids).mean()
        if close_before_backward:
            assert held.close() is log and not held.is_open
        loss.backward()
        if not close_before_backward:
            assert held.is_open and held.close() is log and held.close() is None
        assert log.replayed == BATCH * SEQ * LAYERS * (2 if checkpointing and not close_before_backward else 1)
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    plain = grads(checkpointing=False, close_before_backward=False)
    kept_open = grads(checkpointing=True, close_before_backward=False)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, kept_open))
    try:
        closed = grads(checkpointing=True, close_before_backward=True)
    except torch.utils.checkpoint.CheckpointError:  # torch saw the recompute run other experts (other tensors saved)
        return
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, closed))


def test_routes_of_samples_place_each_record_at_its_positions_and_survive_the_wire() -> None:
    rng = np.random.default_rng(0)
    full = rlsync.Sample("a", np.arange(7), 3, np.zeros(4, np.float32), np.zeros(4, np.int64),
                         routes=rng.integers(0, 8, (6, LAYERS, TOP_K)))  # every position run: all but the last token
    generated = rlsync.Sample("b", np.arange(5), 3, np.zeros(2, np.float32), np.zeros(2, np.int64),
                              routes=rng.integers(0, 8, (2, LAYERS, TOP_K)))  # the steps that sampled tokens 3 and 4
    back = [rlsync.decode_sample(rlsync.encode_sample(s)) for s in (full, generated)]
    batch = routes_of(back, 8)
    assert batch.shape == (2, 8, LAYERS, TOP_K)
    assert np.array_equal(batch[0, :6], full.routes) and (batch[0, 6:] == -1).all()
    assert (batch[1, :2] == -1).all() and np.array_equal(batch[1, 2:4], generated.routes) and (batch[1, 4:] == -1).all()
    with pytest.raises(rlsync.RolloutBufferError, match="or 6 positions run"):
        rlsync.Sample("c", np.arange(7), 3, np.zeros(4, np.float32), np.zeros(4, np.int64),
                      routes=np.zeros((7, LAYERS, TOP_K), np.uint8))


def test_wrong_routes_and_models_without_routers_are_refused_naming_the_shape() -> None:
    model = _model("qwen3_moe")
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(rlsync.ConfigError, match=r"\[batch, seq, 3 MoE layers, top_k 2\]"):
        with replay_routes(model, np.zeros((1, 4, 2, TOP_K))):
            pass
    with pytest.raises(rlsync.ConfigError, match="exactly the forward's input ids"):
        with replay_routes(model, np.zeros((1, 5, LAYERS, TOP_K))):
            model(ids)
    with pytest.raises(rlsync.ConfigError, match="no MoE router"):
        with replay_routes(torch.nn.Linear(2, 2), np.zeros((1, 1, 1, 1))):
            pass
