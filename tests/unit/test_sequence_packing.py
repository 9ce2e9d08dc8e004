"""Sequence packing plans and pack / mask / unpack helpers (nemo_rl_spec/models/policy/sequence_packing.py), and the
``policy.sequence_packing`` keys, against hand-worked values. The packed forward itself is compared with the padded
worker in tests/functional/test_dynamic_batching.py."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_spec.models.policy.sequence_packing import (
    ALGORITHMS,
    pack_bins,
    pack_rows,
    packed_plan,
    row_index,
    unpack_logprobs,
    unpack_rows,
)
from nemo_rl_spec.utils.config import ConfigError, load_config

SIZES = [5, 30, 12, 28, 7]


@pytest.mark.parametrize(
    "algorithm, expected",
    [
        ("concatenative", [[0, 1], [2, 3], [4]]),  # 5+30, then 12 does not fit; 12+28; 7
        ("first_fit_decreasing", [[1, 4], [3, 2], [0]]),  # 30, 28 | 12 -> bin 2 | 7 -> bin 1 | 5 -> new
    ],
)
def test_pack_bins_by_hand(algorithm, expected):
    assert pack_bins(SIZES, 40, algorithm) == expected


def test_modified_first_fit_decreasing_by_hand():
    """Capacity 60: large > 30 (36, 35), medium 20-30 (25), small 10-20 (15, 12, 11), tiny (8, 3).
    Phase 1: bins {36} room 24, {35} room 25. Phase 2: 25 fits only {35}. Phase 3 (backward, bins without a medium):
    {36} takes the smallest small (11, room 13) and the largest small still fitting (12). Phase 4: nothing fits the
    rooms 1 and 0. Phase 5: 15, 8, 3 by FFD in one bin. Plain FFD puts 36 with 15 and 8 instead."""
    sizes = [36, 25, 15, 35, 12, 11, 8, 3]
    assert pack_bins(sizes, 60, "modified_first_fit_decreasing") == [[0, 5, 4], [3, 1], [2, 6, 7]]
    assert pack_bins(sizes, 60, "first_fit_decreasing") == [[0, 2, 6], [3, 1], [4, 5, 7]]


def test_modified_first_fit_decreasing_phase_4_fills_large_bins():
    """Capacity 60, no medium or small items: 40 and 31 open bins, then the tiny items go largest first into the
    bins in turn (phase 4, largest first): {40} takes 10 and 9 (room 1), {31} takes 8, 7, 5 and 2 (room 7)."""
    sizes = [40, 10, 2, 31, 9, 8, 7, 5]
    assert pack_bins(sizes, 60, "modified_first_fit_decreasing") == [[0, 1, 4], [3, 5, 6, 7, 2]]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_covers_each_row_once_within_capacity(algorithm):
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        sizes = torch.randint(1, 90, (int(torch.randint(1, 40, (), generator=gen)),), generator=gen).tolist()
        bins = pack_bins(sizes, 64, algorithm, seed=trial)
        assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
        assert all(b and (sum(sizes[i] for i in b) <= 64 or len(b) == 1) for b in bins)  # > 64: alone


def test_first_fit_shuffle_depends_on_the_seed_only():
    sizes = list(range(1, 30))
    assert pack_bins(sizes, 50, "first_fit_shuffle", seed=1) == pack_bins(sizes, 50, "first_fit_shuffle", seed=1)
    assert pack_bins(sizes, 50, "first_fit_shuffle", seed=1) != pack_bins(sizes, 50, "first_fit_shuffle", seed=2)


def test_pack_bins_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown sequence packing algorithm 'best_fit'"):
        pack_bins(SIZES, 40, "best_fit")
    with pytest.raises(ValueError, match="capacity=0 must be >= 1"):
        pack_bins(SIZES, 0, "concatenative")


def test_packed_plan_by_hand():
    lengths = torch.tensor(SIZES)
    plan = packed_plan(lengths, 40, 1, 32, "first_fit_decreasing")
    assert [(mb.rows.tolist(), mb.row_tokens, mb.seq_len, mb.num_tokens) for mb in plan] == [
        ([1, 4], (30, 7), 30, 37),
        ([3, 2], (28, 12), 28, 40),
        ([0], (5,), 5, 5),
    ]
    # rounded to 8 and capped at the width 32: sizes 8, 32, 16, 32, 8
    plan = packed_plan(lengths, 40, 8, 32, "first_fit_decreasing")
    assert [(mb.rows.tolist(), mb.row_tokens, mb.seq_len) for mb in plan] == [
        ([1, 0], (32, 8), 32),
        ([3, 4], (32, 8), 32),
        ([2], (16,), 16),
    ]
    with pytest.raises(ValueError, match="round_to=0"):
        packed_plan(lengths, 40, 0, 32, "concatenative")


def test_pack_and_unpack_by_hand():
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]])
    assert pack_rows(ids, (3, 2)).tolist() == [[1, 2, 3, 4, 5]]
    assert row_index((3, 2), 4).tolist() == [[0, 1, 2, 5], [3, 4, 5, 5]]  # 5 = T: the padding slot
    values = torch.arange(10.0).view(1, 5, 2)
    assert unpack_rows(values, (3, 2), 4).tolist() == [
        [[0, 1], [2, 3], [4, 5], [0, 0]],
        [[6, 7], [8, 9], [0, 0], [0, 0]],
    ]
    with pytest.raises(ValueError, match="row_tokens .* must give 1..4 tokens for each of the 2 rows"):
        pack_rows(ids, (3, 5))


def test_unpack_logprobs_zeroes_row_starts_and_padding():
    """Pack of rows with 3 real tokens (+1 rounding token) and 2: the values at the second row's first token (scored
    from the first row's last logits) and at the rounding token are not log-probs of the rows and become 0."""
    packed = torch.tensor([[0.0, -1.0, -2.0, -3.0, -4.0, -5.0]])  # tokens: row 0 (3 + 1 rounding), row 1 (2)
    got = unpack_logprobs(packed, (4, 2), torch.tensor([3, 2]), 5)
    assert got.tolist() == [[0.0, -1.0, -2.0, 0.0, 0.0], [0.0, -5.0, 0.0, 0.0, 0.0]]


def _load(*overrides):
    return load_config("configs/grpo_math_tiny.yaml", list(overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["policy.dynamic_batching.enabled=true"], "cannot be combined with policy.dynamic_batching.enabled=true"),
        (["policy.megatron_cfg.mtp_num_layers=1"], "cannot be combined with policy.megatron_cfg.mtp_num_layers"),
        (["policy.sequence_packing.train_mb_tokens=100"], "policy.sequence_packing.train_mb_tokens=100 is below"),
        (["policy.sequence_packing.algorithm=best_fit"], "policy.sequence_packing.algorithm"),
    ],
)
def test_refused_combinations_name_their_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _load("policy.sequence_packing.enabled=true", *overrides)
