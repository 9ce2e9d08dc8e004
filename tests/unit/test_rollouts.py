"""Batch assembly helpers, against hand-worked values."""

import math

import pytest
import torch

from nemo_rl_spec.algorithms.rollouts import logprob_agreement_metrics, masked_mean_abs_diff, response_mask


def test_response_mask_matches_worked_example():
    # the worked example of distributed/interfaces.py
    mask = response_mask(torch.tensor([3, 2]), torch.tensor([5, 5]), width=6)
    assert mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 0]]


@pytest.mark.numerics
def test_masked_mean_abs_diff():
    a = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 9.0]])
    b = torch.tensor([[0.0, -1.5, -1.0], [0.0, -0.25, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    assert math.isclose(masked_mean_abs_diff(a, b, mask), (0.5 + 1.0 + 0.25) / 3, rel_tol=1e-6)  # fp32
    assert masked_mean_abs_diff(a, b, torch.zeros_like(mask)) == 0.0


@pytest.mark.numerics
def test_logprob_agreement_metrics():
    prev = torch.tensor([[0.0, -1.0, -2.0]])
    gen = torch.tensor([[5.0, -1.1, -1.8]])  # position 0 is masked out
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    m = logprob_agreement_metrics(prev, gen, mask)
    assert math.isclose(m["train/token_mult_prob_error"], (math.exp(0.1) + math.exp(0.2)) / 2, rel_tol=1e-6)
    assert math.isclose(m["train/importance_ratio_max_abs_dev"], 1 - math.exp(-0.2), rel_tol=1e-5)
