"""GRPO advantages: hand-computed values for both baselines, normalisation and the zero-spread guard."""

import math

import numpy as np
import pytest
import torch

from nemo_rl_spec.algorithms.advantages import compute_grpo_advantages, compute_grpo_advantages_by_group

pytestmark = pytest.mark.numerics  # docs/design/numerical_tolerances.md

EPS = 1e-6
MODES = [(loo, norm) for loo in (False, True) for norm in (False, True)]


def _t(values):
    return torch.tensor(values, dtype=torch.float32)


def test_group_mean_baseline_without_normalisation():
    adv = compute_grpo_advantages(_t([1, 0, 0, 0, 1, 1, 0, 0]), 4, False, False)
    expected = _t([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)
    assert adv.dtype == torch.float32


def test_group_mean_baseline_with_std_normalisation():
    # group 1: mean 0.25, Bessel std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    # group 2: mean 0.5, std sqrt(4 * 0.25 / 3) = sqrt(1/3)
    adv = compute_grpo_advantages(_t([1, 0, 0, 0, 1, 1, 0, 0]), 4, False, True)
    s2 = math.sqrt(1 / 3)
    expected = _t([0.75 / (0.5 + EPS)] + [-0.25 / (0.5 + EPS)] * 3 + [0.5 / (s2 + EPS)] * 2 + [-0.5 / (s2 + EPS)] * 2)
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=0)


def test_leave_one_out_baseline():
    # [1,0,0,0]: r=1 vs mean(0,0,0)=0 -> 1; r=0 vs mean(1,0,0)=1/3 -> -1/3
    # [1,1,0,0]: r=1 vs mean(1,0,0)=1/3 -> 2/3; r=0 vs mean(1,1,0)=2/3 -> -2/3
    rewards = _t([1, 0, 0, 0, 1, 1, 0, 0])
    adv = compute_grpo_advantages(rewards, 4, True, False)
    torch.testing.assert_close(adv, _t([1, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -2 / 3, -2 / 3]), rtol=0, atol=1e-7)
    adv_norm = compute_grpo_advantages(rewards, 4, True, True)
    s2 = math.sqrt(1 / 3)
    expected = _t([1 / (0.5 + EPS)] + [-1 / 3 / (0.5 + EPS)] * 3 + [2 / 3 / (s2 + EPS)] * 2 + [-2 / 3 / (s2 + EPS)] * 2)
    torch.testing.assert_close(adv_norm, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("loo,norm", MODES)
def test_all_equal_group_is_exactly_zero(loo, norm):
    # 0.35 is not exactly representable and 8 * fl(0.35) / 8 need not round back to fl(0.35): the guard must
    # still give exact zeros.
    adv = compute_grpo_advantages(_t([0.35] * 8 + [0.1] * 8), 8, loo, norm)
    assert torch.equal(adv, torch.zeros(16))


@pytest.mark.parametrize("loo,norm", MODES)
def test_group_of_one_is_zero_without_nan(loo, norm):
    adv = compute_grpo_advantages(_t([0.7, 0.2, 1.0]), 1, loo, norm)
    assert torch.equal(adv, torch.zeros(3))


@pytest.mark.parametrize("loo,norm", MODES)
@pytest.mark.parametrize("eps", [EPS, 0.0])
def test_float32_rounding_spread_is_treated_as_zero(loo, norm, eps):
    base = np.float32(0.35)
    odd = np.nextafter(base, np.float32(1.0))  # 0.35 + 1 ulp (~3e-8)
    assert odd != base
    rewards = torch.tensor([base] * 7 + [odd], dtype=torch.float32)
    adv = compute_grpo_advantages(rewards, 8, loo, norm, eps=eps)
    assert torch.equal(adv, torch.zeros(8))


def test_small_real_spread_is_normalised():
    # One of n=8 differs by delta: deviation of the odd one (n-1)/n * delta, of the others -delta/n,
    # Bessel std = delta / sqrt(n).
    base, odd = np.float32(0.35), np.float32(0.36)
    delta = float(odd) - float(base)
    rewards = torch.tensor([base] * 7 + [odd], dtype=torch.float32)
    adv = compute_grpo_advantages(rewards, 8, False, True)
    std = delta / math.sqrt(8)
    expected = _t([-delta / 8 / (std + EPS)] * 7 + [7 * delta / 8 / (std + EPS)])
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=0)
    assert abs(float(adv[-1])) < 2.48  # bounded by (n-1)/sqrt(n) = 2.4749 for any delta


def test_unequal_groups_by_id_non_contiguous():
    # group 7: [1, 0, 0]; group 3: [1, 0]; group 5: [5] (single)
    ids = torch.tensor([7, 3, 7, 5, 3, 7])
    rewards = _t([1, 1, 0, 5, 0, 0])
    adv = compute_grpo_advantages_by_group(rewards, ids, False, False)
    torch.testing.assert_close(adv, _t([2 / 3, 0.5, -1 / 3, 0, -0.5, -1 / 3]), rtol=0, atol=1e-7)
    adv_norm = compute_grpo_advantages_by_group(rewards, ids, False, True)
    s7, s3 = math.sqrt(1 / 3), math.sqrt(0.5)
    expected = _t(
        [2 / 3 / (s7 + EPS), 0.5 / (s3 + EPS), -1 / 3 / (s7 + EPS), 0, -0.5 / (s3 + EPS), -1 / 3 / (s7 + EPS)]
    )
    torch.testing.assert_close(adv_norm, expected, rtol=1e-6, atol=0)
    adv_loo = compute_grpo_advantages_by_group(rewards, ids, True, False)
    # group 7: 1 - 0 = 1, 0 - 1/2 = -1/2 (x2); group 3: 1 - 0, 0 - 1; single -> 0
    torch.testing.assert_close(adv_loo, _t([1, 1, -0.5, 0, -1, -0.5]), rtol=0, atol=1e-7)


def test_equal_groups_agree_with_group_id_variant():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(24, generator=g)
    ids = torch.arange(24) // 6
    for loo, norm in MODES:
        torch.testing.assert_close(
            compute_grpo_advantages(rewards, 6, loo, norm),
            compute_grpo_advantages_by_group(rewards, ids, loo, norm),
            rtol=0,
            atol=0,
        )


def test_errors():
    with pytest.raises(ValueError, match="multiple"):
        compute_grpo_advantages(_t([1, 0, 1]), 2, False, True)
    with pytest.raises(ValueError, match="group_size"):
        compute_grpo_advantages(_t([1, 0]), 0, False, True)
    with pytest.raises(ValueError, match="1-D"):
        compute_grpo_advantages(torch.zeros(2, 2), 2, False, True)
    with pytest.raises(ValueError, match="len"):
        compute_grpo_advantages_by_group(_t([1, 0]), torch.tensor([0]), False, True)
