"""Position-keyed seeded sampling (nemo_rl_spec.models.generation.position_keyed_seeds): the keyed uniform, and the
verification rule on hand-built target distributions (one-hot rows, so every F^-1(u) is known by hand)."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl_spec.models.generation import position_keyed_seeds as pks
from nemo_rl_spec.utils.config import ConfigError, check_runtime_support, load_config


def test_position_uniform_is_keyed_deterministic_and_uniform():
    us = [pks.position_uniform(1234, t) for t in range(4000)]
    assert us == [pks.position_uniform(1234, t) for t in range(4000)]  # a pure function of (seed, position)
    assert len(set(us)) == len(us) and all(0.0 <= u < 1.0 for u in us)
    assert pks.position_uniform(1235, 0) != us[0]
    # mean of 4000 U(0,1): sd 1/sqrt(12 * 4000) = 0.0046; 4 sd
    assert abs(sum(us) / len(us) - 0.5) < 4 / math.sqrt(12 * 4000)
    with pytest.raises(ValueError):
        pks.position_uniform(-1, 0)


def _one_hot_logits(tokens: list[int], vocab: int = 5) -> torch.Tensor:
    logits = torch.full((len(tokens), vocab), float("-inf"))
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return logits


def _verify(num_drafts, drafts, targets, bonus, rows):
    """Run the wrapped rejection_sample with a stand-in original that marks every slot 99 (vLLM's result)."""

    def original(draft_token_ids, num_draft_tokens, max_spec_len, *args, **kwargs):
        return torch.full((len(num_draft_tokens), max_spec_len + 1), 99, dtype=torch.int32)

    wrapped = pks._rejection_keyed(original)
    pks._state.rows = rows
    try:
        cu = torch.tensor(num_drafts).cumsum(0)
        return wrapped(torch.tensor(drafts), num_drafts, max(num_drafts), cu, None, _one_hot_logits(targets),
                       torch.tensor(bonus).view(-1, 1), None).tolist()  # fmt: skip
    finally:
        pks._state.rows = None


def test_verification_emits_the_targets_samples_until_the_first_mismatch():
    # row 0 (seeded): targets 1, 2, 3 against drafts 1, 0, 3 -> 1 accepted, then the target's 2, then placeholders
    # row 1 (seeded): drafts 4, 4 match the targets 4, 4 -> both, then the bonus 0
    # row 2 (not seeded): vLLM's result (99) kept
    out = _verify([3, 2, 1], [1, 0, 3, 4, 4, 2], [1, 2, 3, 4, 4, 2], [7, 0, 5], {0: (11, 5, 3), 1: (12, 0, 2)})
    assert out == [[1, 2, -1, -1], [4, 4, 0, -1], [99, 99, 99, 99]]


def test_a_row_without_drafts_takes_its_bonus_token():
    out = _verify([0, 2], [3, 1], [3, 1], [6, 2], {0: (1, 9, 0), 1: (2, 4, 2)})
    assert out == [[6, -1, -1], [3, 1, 2]]


def test_recorded_positions_follow_the_emitted_tokens():
    pks.recording, pks.emitted_positions[:] = True, []
    try:
        _verify([3, 2], [1, 0, 3, 4, 4], [1, 2, 3, 4, 4], [7, 0], {0: (11, 5, 3), 1: (12, 0, 2)})
        assert pks.emitted_positions == [(11, 5), (11, 6), (12, 0), (12, 1), (12, 2)]
    finally:
        pks.recording, pks.emitted_positions[:] = False, []


def test_config_key_and_gpu_refusal():
    cfg = load_config("configs/grpo_math_tiny.yaml", ["policy.generation.seeded_sampling=position"])
    assert cfg.policy.generation.seeded_sampling == "position"
    check_runtime_support(cfg)  # CPU: runs
    with pytest.raises(ConfigError, match="seeded_sampling"):
        load_config("configs/grpo_math_tiny.yaml", ["policy.generation.seeded_sampling=counter"])
    gpu = load_config("configs/grpo_math_tiny.yaml", ["policy.generation.seeded_sampling=position"])
    gpu.cluster.gpus_per_node = 1
    with pytest.raises(ConfigError, match="seeded_sampling=position"):
        check_runtime_support(gpu)
