"""Micro-batch plans (nemo_rl_spec/models/policy/dynamic_batching.py) and the ``policy.dynamic_batching`` /
``policy.sequence_packing`` config keys, by hand."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_spec.models.policy.dynamic_batching import (
    MicroBatch,
    fixed_size_plan,
    padded_length,
    select_rows,
    token_budget_plan,
)
from nemo_rl_spec.utils.config import ConfigError, load_config


def _rows(plan):
    return [mb.rows.tolist() for mb in plan], [mb.seq_len for mb in plan]


def test_docstring_example_by_hand():
    lengths = torch.tensor([5, 30, 12, 28, 7])
    assert _rows(token_budget_plan(lengths, 64, 8, 32)) == ([[1, 3], [2, 4, 0]], [32, 16])
    assert _rows(fixed_size_plan(lengths, 2)) == ([[0, 1], [2, 3], [4]], [30, 28, 7])
    assert sum(mb.num_tokens for mb in token_budget_plan(lengths, 64, 8, 32)) == 112
    assert sum(mb.num_tokens for mb in fixed_size_plan(lengths, 2)) == 123


def test_token_budget_plan_properties():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 200, (37,), generator=gen)
    plan = token_budget_plan(lengths, 512, 16, 200)
    rows = torch.cat([mb.rows for mb in plan])
    assert sorted(rows.tolist()) == list(range(37))  # every row exactly once
    for mb in plan:
        longest = int(lengths[mb.rows].max())
        assert mb.seq_len == min(-(-longest // 16) * 16, 200) >= longest
        assert mb.num_tokens <= 512
    # greedy: the first row of the next micro-batch would not have fitted
    for mb, nxt in zip(plan, plan[1:]):
        assert (mb.rows.numel() + 1) * mb.seq_len > 512 and int(lengths[nxt.rows[0]]) <= int(lengths[mb.rows].min())


def test_ties_keep_order_long_rows_alone_and_empty():
    assert _rows(token_budget_plan(torch.tensor([4, 4, 4]), 8, 1, 10)) == ([[0, 1], [2]], [4, 4])
    assert _rows(token_budget_plan(torch.tensor([50, 3]), 20, 1, 50)) == ([[0], [1]], [50, 3])
    assert token_budget_plan(torch.tensor([], dtype=torch.long), 8, 1, 10) == []
    assert fixed_size_plan(torch.tensor([], dtype=torch.long), 2) == []
    assert padded_length(0, 8, 10) == 8
    assert padded_length(37, 16, 100) == 48 and padded_length(37, 64, 50) == 50 and padded_length(0, 1, 5) == 1
    with pytest.raises(ValueError):
        token_budget_plan(torch.tensor([3]), 0, 1, 10)
    with pytest.raises(ValueError):
        fixed_size_plan(torch.tensor([3]), 0)


def test_select_rows():
    data = {
        "input_ids": torch.arange(12).view(3, 4),
        "input_lengths": torch.tensor([4, 2, 3]),
        "flag": "x",
        "scalar": torch.tensor(2.0),
    }
    out = select_rows(data, MicroBatch(torch.tensor([2, 0]), 3))
    assert out["input_ids"].tolist() == [[8, 9, 10], [0, 1, 2]] and out["input_lengths"].tolist() == [3, 4]
    assert out["flag"] == "x" and float(out["scalar"]) == 2.0


def _load(*overrides):
    return load_config("configs/grpo_math_tiny.yaml", list(overrides))


def test_config_keys():
    cfg = _load("policy.dynamic_batching.enabled=true")
    dyn = cfg.policy.dynamic_batching
    assert (dyn.enabled, dyn.train_mb_tokens, dyn.logprob_mb_tokens, dyn.sequence_length_round) == (True, 768, 1536, 1)
    assert _load().policy.dynamic_batching.enabled is False and _load().policy.sequence_packing.enabled is False
    with pytest.raises(ConfigError, match="policy.dynamic_batching.train_mb_tokens=100"):
        _load("policy.dynamic_batching.enabled=true", "policy.dynamic_batching.train_mb_tokens=100")
    assert (
        _load("policy.dynamic_batching.train_mb_tokens=100").policy.dynamic_batching.enabled is False
    )  # off: unchecked
    pack = _load("policy.sequence_packing.enabled=true").policy.sequence_packing
    assert (pack.enabled, pack.train_mb_tokens, pack.logprob_mb_tokens, pack.sequence_length_round) == (
        True,
        768,
        1536,
        1,
    )
    assert pack.algorithm == "modified_first_fit_decreasing"
