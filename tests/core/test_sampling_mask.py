"""The sampling mask reapplied in the trainer (``rlsync.sampling_mask``, ``masked_logprobs``): top-k, top-p and a
recorded kept-set size, on hand-checked cases."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from rlsync import head_logprobs, kept_sizes, masked_logprobs, sampling_mask


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert sampling_mask(logits, top_k=2).tolist() == [[False, True, True, False]]
    assert sampling_mask(logits, top_k=None).all()


def test_top_p_keeps_a_token_while_the_mass_ranked_above_it_is_below_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert sampling_mask(logits, top_p=0.7).tolist() == [[True, True, False, False]]  # above: 0, 0.5, 0.8
    assert sampling_mask(logits, top_p=0.5).tolist() == [[True, False, False, False]]  # 0.5 is not below 0.5
    assert sampling_mask(logits, top_p=1e-9).tolist() == [[True, False, False, False]]  # the top token always stays
    # top-k first, then top-p on what is left (renormalized): of {0.5, 0.3} the mass above 0.3 is 0.625
    assert sampling_mask(logits, top_k=2, top_p=0.6).tolist() == [[True, False, False, False]]


def test_min_p_drops_tokens_less_likely_than_min_p_times_the_top_one_before_top_k_and_top_p() -> None:
    """vLLM's order (``MinPLogitsProcessor`` after the temperature, before top-k/top-p): min-p on the full softmax,
    then top-k and top-p on what it left, renormalized."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert sampling_mask(logits, min_p=0.3).tolist() == [[True, True, True, False]]  # 0.15 >= 0.3 * 0.5 > 0.05
    assert sampling_mask(logits, min_p=0.61).tolist() == [[True, False, False, False]]
    assert sampling_mask(logits, min_p=0.0).all() and sampling_mask(logits, min_p=None).all()
    # after min-p left {0.5, 0.3, 0.15}, top-p 0.8 sees them renormalized (0.526, 0.316, 0.158): the mass above the
    # third is 0.842, so it goes; without min-p the mass above it is 0.8, not below 0.8: it goes as well
    assert sampling_mask(logits, min_p=0.3, top_p=0.8).tolist() == [[True, True, False, False]]
    assert sampling_mask(logits, min_p=0.3, top_p=0.85).tolist() == [[True, True, True, False]]
    assert sampling_mask(logits, top_p=0.85).tolist() == [[True, True, True, False]]
    assert sampling_mask(logits, min_p=0.3, top_p=0.9).tolist() == [[True, True, True, False]]
    assert sampling_mask(logits, top_p=0.99).tolist() == [[True, True, True, True]]  # min-p is what dropped 0.05
    assert sampling_mask(logits, min_p=0.5, top_k=3).tolist() == [[True, True, False, False]]
    got = masked_logprobs(logits, torch.tensor([2]), min_p=0.3)
    assert math.isclose(float(got), math.log(0.15 / 0.95), rel_tol=1e-5)
    from rlsync import logits_logprobs

    chosen, entropy = logits_logprobs(logits, torch.tensor([2]), min_p=0.3, entropy=True)
    assert math.isclose(float(chosen), math.log(0.15 / 0.95), rel_tol=1e-5)
    kept = torch.tensor([0.5, 0.3, 0.15]) / 0.95
    assert math.isclose(float(entropy), float(-(kept * kept.log()).sum()), rel_tol=1e-5)
    from rlsync import masked_entropy

    assert math.isclose(float(masked_entropy(logits, min_p=0.3)), float(-(kept * kept.log()).sum()), rel_tol=1e-5)


def test_a_recorded_kept_size_rebuilds_the_mask_from_the_trainers_logits() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.1, 0.2, 0.3]])
    assert sampling_mask(logits, kept=torch.tensor([1, 3])).tolist() == [[False, True, False, False], [False, True, True, True]]
    engine = torch.tensor([[-0.1, float("-inf"), -2.5], [float("-inf")] * 3])
    assert kept_sizes(engine).tolist() == [2, 0]


def test_masked_logprobs_renormalize_over_the_kept_set() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    got = masked_logprobs(logits, torch.tensor([1]), top_p=0.7)
    assert math.isclose(float(got), math.log(0.3 / 0.8), rel_tol=1e-5)
    assert float(masked_logprobs(logits, torch.tensor([3]), top_p=0.7)) == float("-inf")  # could not be sampled
    halved = masked_logprobs(logits, torch.tensor([0]), temperature=2.0)
    assert math.isclose(float(halved), math.log(math.sqrt(0.5) / sum(math.sqrt(p) for p in (0.5, 0.3, 0.15, 0.05))), rel_tol=1e-5)


def test_head_logprobs_equal_the_masked_logprobs_of_the_logits_with_their_gradients_chunk_by_chunk(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """From hidden states and an LM head, a few rows at a time (here 7): the log-probs and entropies of the masked
    distribution and the same gradients as the whole computation at once; a sampled token the mask would drop (the two
    sides' kernels round differently) still gets a finite log-prob, under the kept set with it added."""
    from rlsync.core.rollouts import _sampling_mask

    monkeypatch.setattr(_sampling_mask, "_CHUNK_ELEMENTS", 40 * 7)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=gen, requires_grad=True)
    weight = torch.randn(40, 16, generator=gen, requires_grad=True)
    bias = torch.randn(40, generator=gen, requires_grad=True)
    tokens = torch.randint(0, 40, (50,), generator=gen)
    got, entropy = head_logprobs(hidden, weight, bias, tokens, temperature=0.8, top_k=20, top_p=0.7, logit_scale=1.5,
                                 softcap=30.0, entropy=True)
    (got.sum() + entropy.sum()).backward()
    grads = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    z = 30.0 * torch.tanh((hidden @ weight.T + bias) * 1.5 / 30.0) / 0.8
    expected = masked_logprobs(z * 0.8, tokens, temperature=0.8, top_k=20, top_p=0.7)
    inside = torch.isfinite(expected)
    assert 0 < inside.sum() < 50 and torch.isfinite(got).all()
    assert torch.allclose(got[inside], expected[inside], atol=1e-5)
    keep = sampling_mask(z.detach(), top_k=20, top_p=0.7).scatter(-1, tokens.unsqueeze(-1), True)
    logp = z.masked_fill(~keep, float("-inf")).log_softmax(-1)
    kept = logp.masked_fill(~keep, 0.0)
    assert torch.allclose(entropy, -(kept.exp() * kept).sum(-1), atol=1e-5)
    (logp.gather(-1, tokens.unsqueeze(-1)).sum() - (kept.exp() * kept).sum()).backward()
    for mine, theirs in zip(grads, (hidden.grad, weight.grad, bias.grad)):
        assert torch.allclose(mine, theirs, atol=1e-4)


def test_top_p_after_top_k_over_the_k_values_alone_equals_it_over_the_whole_vocabulary() -> None:
    """With top-k, top-p sorts only the k kept values (the vocabulary's sort is most of the mask's cost): the same
    kept sets as top-p over the whole renormalized vocabulary. Ties at the k-th value (more than k kept) take the
    whole sort: all of them stay, as vLLM keeps them."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(300, 1000, generator=gen) * 3
    for top_k, top_p in ((20, 0.7), (50, 0.95), (5, 0.3), (999, 0.9)):
        by_k = sampling_mask(logits, top_k=top_k)
        whole = by_k & sampling_mask(logits.masked_fill(~by_k, float("-inf")), top_p=top_p)
        got = sampling_mask(logits, top_k=top_k, top_p=top_p)
        assert torch.equal(got, whole), (top_k, top_p)
        assert 0 < got.sum(-1).min() and got.sum(-1).max() <= top_k
    tied = logits[:1].clone()
    tied[0, :40] = tied[0].sort(descending=True).values[10]  # the 11th largest, 40 times: the 20th is one of them
    assert sampling_mask(tied, top_k=20).sum() == 50 and sampling_mask(tied, top_k=20, top_p=0.9999).sum() == 50


def test_logits_logprobs_score_a_batch_chunk_by_chunk_with_the_gradients_of_the_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer that holds its logits ``[batch, seq, vocab]`` (OpenRLHF's actor): the masked log-probs and entropies,
    their gradients as autograd gives them over the whole at once, a few rows at a time (here 7); a sampled token the
    mask would drop still gets a finite log-prob."""
    from rlsync import logits_logprobs
    from rlsync.core.rollouts import _sampling_mask

    monkeypatch.setattr(_sampling_mask, "_CHUNK_ELEMENTS", 40 * 7)
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 17, 40, generator=gen) * 2).requires_grad_()
    tokens = torch.randint(0, 40, (3, 17), generator=gen)
    got, entropy = logits_logprobs(logits, tokens, top_k=25, top_p=0.8, entropy=True)
    assert got.shape == entropy.shape == (3, 17) and torch.isfinite(got).all()
    (got.sum() + 0.5 * entropy.sum()).backward()
    grad = logits.grad.clone()
    logits.grad = None
    expected = masked_logprobs(logits, tokens, top_k=25, top_p=0.8)
    inside = torch.isfinite(expected)
    assert 0 < inside.sum() < inside.numel() and torch.allclose(got[inside], expected[inside], atol=1e-5)
    keep = sampling_mask(logits.detach(), top_k=25, top_p=0.8).scatter(-1, tokens.unsqueeze(-1), True)
    logp = logits.masked_fill(~keep, float("-inf")).log_softmax(-1)
    kept = logp.masked_fill(~keep, 0.0)
    assert torch.allclose(entropy, -(kept.exp() * kept).sum(-1), atol=1e-5)
    (logp.gather(-1, tokens.unsqueeze(-1)).sum() - 0.5 * (kept.exp() * kept).sum()).backward()
    assert torch.allclose(grad, logits.grad, atol=1e-5)


def test_top_p_alone_decides_from_the_most_likely_tokens_where_its_set_ends_among_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Top-p without top-k looks at the ``_TOP_P_PREFIX`` most likely tokens first (here 16) and sorts a whole row only
    where the set reaches past them: the same kept sets as the whole sort, for peaked rows (decided by the prefix) and
    flat ones (sorted) in one batch."""
    from rlsync.core.rollouts import _sampling_mask

    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(64, 1000, generator=gen)
    logits[::2] *= 8  # peaked rows: top-p 0.9 keeps a few tokens
    whole = {p: _sampling_mask._top_p_mask(logits.softmax(-1), p) for p in (0.5, 0.9, 0.99)}
    monkeypatch.setattr(_sampling_mask, "_TOP_P_PREFIX", 16)
    sorted_rows: list[int] = []
    sort = torch.Tensor.sort

    def counting_sort(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sorted_rows.append(self.shape[0])
        return sort(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "sort", counting_sort)
    for top_p, expected in whole.items():
        sorted_rows.clear()
        assert torch.equal(sampling_mask(logits, top_p=top_p), expected), top_p
        assert 0 < sum(sorted_rows) < 64 or top_p == 0.99, (top_p, sorted_rows)
