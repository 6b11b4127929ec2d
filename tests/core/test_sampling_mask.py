"""The sampling mask reapplied in the trainer (``rlsync.sampling_mask``, ``masked_logprobs``): top-k, top-p and a
recorded kept-set size, on hand-checked cases."""

from __future__ import annotations

import math

import torch

from rlsync import kept_sizes, masked_logprobs, sampling_mask


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
