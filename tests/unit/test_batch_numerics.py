"""Greedy-divergence statistics and the rule that holds speculation to the AR batch-shape baseline
(nemo_rl_spec/testing/batch_numerics.py). Expected values worked by hand."""

from __future__ import annotations

import math

import pytest

from nemo_rl_spec.testing.batch_numerics import (
    Divergence,
    binomial_margin,
    divergence,
    first_divergence_index,
    hold_to_baseline,
)


def test_first_divergence_index():
    assert first_divergence_index([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence_index([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence_index([7, 2, 3], [1, 2, 3]) == 0
    assert first_divergence_index([1, 2], [1, 2, 3]) == 2  # a prefix differs at the shorter length
    assert first_divergence_index([], []) is None


def test_divergence_counts_rate_and_positions():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [0, 0, 0, 0]]
    other = [[1, 2, 3, 4], [5, 6, 0, 8], [1, 9, 9, 9], [0, 0, 0, 0]]
    d = divergence(ref, other)
    assert d.first_divergence == [None, 2, 0, None]
    assert (d.num_sequences, d.num_differ) == (4, 2)
    assert d.mismatch_rate == 0.5
    assert d.mean_first_divergence == 1.0  # (2 + 0) / 2
    assert d.mean_matched_prefix == 2.5  # (4 + 2 + 0 + 4) / 4


def test_divergence_identical_and_errors():
    d = divergence([[1, 2]], [[1, 2]])
    assert (d.mismatch_rate, d.mean_first_divergence, d.mean_matched_prefix) == (0.0, None, 2.0)
    with pytest.raises(ValueError):
        divergence([[1]], [[1], [2]])
    with pytest.raises(ValueError):
        divergence([], [])


def test_binomial_margin_hand_values():
    # zero baseline over 32 sequences: p floored at 1/32 -> 2 * sqrt(2 * (1/32) * (31/32) / 32)
    assert binomial_margin(0.0, 32) == pytest.approx(2 * math.sqrt(2 * 31 / 32**3))
    assert binomial_margin(0.0, 32) == pytest.approx(0.0869964, abs=1e-7)
    # baseline 0.25 over 32: 2 * sqrt(2 * 0.25 * 0.75 / 32) = 2 * sqrt(0.01171875) = 0.2165064
    assert binomial_margin(0.25, 32) == pytest.approx(0.2165064, abs=1e-7)
    # p is capped at 1/2
    assert binomial_margin(0.9, 32) == binomial_margin(0.5, 32) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        binomial_margin(0.1, 0)


def _div(n: int, differ_at: list[int], length: int = 64) -> Divergence:
    """n sequences of ``length`` tokens; the first len(differ_at) diverge at the given indices."""
    ref = [[0] * length for _ in range(n)]
    other = [[0] * length for _ in range(n)]
    for i, pos in enumerate(differ_at):
        other[i][pos] = 1
    return divergence(ref, other)


def test_bf16_rule_rate_bound():
    # baseline 0 of 32 -> bound 0.087: 2 of 32 (0.0625) passes, 3 of 32 (0.09375) fails
    base = [_div(32, []), _div(32, [])]
    assert hold_to_baseline(base, [_div(32, [60, 60])], 64, exact=False).passed
    v = hold_to_baseline(base, [_div(32, [60, 60, 60])], 64, exact=False)
    assert not v.passed and v.rate_bound == pytest.approx(0.0869964, abs=1e-7)
    assert "mismatch rate 0.094" in v.reasons[0]


def test_bf16_rule_uses_worst_baseline_and_worst_spec_comparison():
    # baseline max rate 8/32 = 0.25 -> bound 0.25 + 0.2165 = 0.4665: 14/32 = 0.4375 passes, 15/32 = 0.46875 fails
    base = [_div(32, []), _div(32, [63] * 8)]
    ok = hold_to_baseline(base, [_div(32, []), _div(32, [63] * 14)], 64, exact=False)
    assert ok.passed and ok.baseline_rate == 0.25 and ok.worst_spec_rate == 0.4375
    assert not hold_to_baseline(base, [_div(32, []), _div(32, [63] * 15)], 64, exact=False).passed


def test_bf16_rule_position_bound():
    # baseline: 8 of 32 diverge at token 32 -> mean prefix (24 * 64 + 8 * 32) / 32 = 56; margin 0.2165 -> prefix
    # bound 56 - 0.2165 * 64 = 42.14. Speculation: 8 of 32 (same rate) diverging at token 0 -> prefix 48: passes;
    # 12 of 32 (0.375 <= 0.4665) diverging at 0 -> prefix (20 * 64) / 32 = 40 < 42.14: fails on position only
    base = [_div(32, [32] * 8)]
    assert base[0].mean_matched_prefix == 56.0
    assert hold_to_baseline(base, [_div(32, [0] * 8)], 64, exact=False).passed
    v = hold_to_baseline(base, [_div(32, [0] * 12)], 64, exact=False)
    assert not v.passed and v.prefix_bound == pytest.approx(56 - 0.2165064 * 64, abs=1e-5)
    assert len(v.reasons) == 1 and "mean matched prefix 40.0" in v.reasons[0]


def test_fp32_rule_is_exact_equality():
    base = [_div(32, [10] * 8)]  # even a noisy AR baseline allows nothing in fp32
    assert hold_to_baseline(base, [_div(32, [])], 64, exact=True).passed
    v = hold_to_baseline(base, [_div(32, []), _div(32, [63])], 64, exact=True)
    assert not v.passed and v.rate_bound == 0.0 and v.worst_spec_rate == 1 / 32


def test_rule_rejects_mixed_sizes_and_empty():
    with pytest.raises(ValueError):
        hold_to_baseline([_div(32, [])], [_div(16, [])], 64, exact=False)
    with pytest.raises(ValueError):
        hold_to_baseline([], [_div(16, [])], 64, exact=False)
