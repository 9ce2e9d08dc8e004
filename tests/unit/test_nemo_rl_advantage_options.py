"""NeMo-RL's advantage and reward options against hand-worked values: ``grpo.reward_scaling``, ``grpo.reward_shaping``
(DAPO overlong penalty, stop-properly penalty), ``grpo.adv_estimator`` (grpo / reinforce_plus_plus) and
``grpo.advantage_clip_low/high``; their schema rules; and their order in the training step (scaling -> shaping ->
estimator -> clip, after overlong filtering), which the sync and the async loop share (``train_on_selection``).

Definitions matched: NeMo-RL 7ea279ab nemo_rl/algorithms/grpo.py (``scale_rewards``, ``_clip_grpo_advantages``),
nemo_rl/algorithms/reward_functions.py (``apply_reward_shaping``), nemo_rl/algorithms/advantage_estimator.py
(``GRPOAdvantageEstimator``, ``ReinforcePlusPlusAdvantageEstimator``).
"""

from __future__ import annotations

import math
import warnings
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from nemo_rl_spec.algorithms.advantages import (
    clip_advantages,
    compute_reinforce_plus_plus_advantages,
    estimate_advantages,
)
from nemo_rl_spec.algorithms.grpo import train_on_selection
from nemo_rl_spec.algorithms.reward_shaping import scale_rewards, shape_rewards
from nemo_rl_spec.utils.config import ConfigError, load_config
from nemo_rl_spec.utils.config_schema import GRPOConfig
from nemo_rl_spec.utils.feature_configs import RewardScalingConfig, RewardShapingConfig

TINY = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_tiny.yaml"


def _grpo(**kw) -> GRPOConfig:
    base = dict(
        num_prompts_per_step=1,
        num_generations_per_prompt=4,
        max_num_steps=1,
        val_period=0,
        val_at_start=False,
        normalize_rewards=True,
        use_leave_one_out_baseline=False,
        seed=0,
    )
    return GRPOConfig(**{**base, **kw})


def _close(got: torch.Tensor, expected: list[float], atol: float = 1e-5) -> None:
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


# --- grpo.advantage_clip_low / advantage_clip_high ---------------------------------------------------------------


def test_advantage_clip_clamps_each_side():
    adv = torch.tensor([-3.0, -0.5, 0.4, 2.5])
    _close(clip_advantages(adv, -1.0, 2.0), [-1.0, -0.5, 0.4, 2.0])
    _close(clip_advantages(adv, -1.0, None), [-1.0, -0.5, 0.4, 2.5])
    _close(clip_advantages(adv, None, 2.0), [-3.0, -0.5, 0.4, 2.0])
    _close(clip_advantages(adv, None, None), [-3.0, -0.5, 0.4, 2.5])


def test_advantage_clip_applies_after_the_grpo_estimator():
    # rewards [1, 0, 0, 0]: mean 0.25, Bessel std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5 -> A = [1.5, -0.5, -0.5, -0.5]
    rewards, groups, tokens = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long), torch.ones(4)
    _close(estimate_advantages(_grpo(), rewards, groups, tokens), [1.5, -0.5, -0.5, -0.5])
    clipped = estimate_advantages(_grpo(advantage_clip_low=-0.4, advantage_clip_high=1.0), rewards, groups, tokens)
    _close(clipped, [1.0, -0.4, -0.4, -0.4])


# --- grpo.reward_scaling ----------------------------------------------------------------------------------------


def test_reward_scaling_clamps_then_maps_the_source_range_onto_the_target_range():
    cfg = RewardScalingConfig(enabled=True, source_min=0.0, source_max=1.0, target_min=-1.0, target_max=1.0)
    # clamp to [0, 1]: [0, 1, 0.25, 1, 0]; -1 + r * 2
    _close(scale_rewards(torch.tensor([0.0, 1.0, 0.25, 1.5, -0.5]), cfg), [-1.0, 1.0, -0.5, 1.0, -1.0])
    cfg = RewardScalingConfig(enabled=True, source_min=2.0, source_max=6.0, target_min=0.0, target_max=1.0)
    # (r - 2) / 4
    _close(scale_rewards(torch.tensor([4.0, 3.0, 6.0, 8.0]), cfg), [0.5, 0.25, 1.0, 1.0])
    off = RewardScalingConfig(enabled=False, target_min=-1.0)
    _close(scale_rewards(torch.tensor([0.0, 1.5]), off), [0.0, 1.5])


# --- grpo.reward_shaping ----------------------------------------------------------------------------------------


def _no_truncation() -> torch.Tensor:
    raise AssertionError("the DAPO penalty does not look at truncation")


def test_dapo_overlong_penalty_ramps_over_the_buffer_and_is_not_capped_beyond_it():
    # max_response_length 20, buffer 8 -> penalty starts after 12 tokens; excess [-2, 0, 4, 8, 12] -> -excess / 8
    cfg = RewardShapingConfig(
        enabled=True, overlong_buffer_length=8, overlong_buffer_penalty=1.0, max_response_length=20
    )
    rewards, lengths = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0]), torch.tensor([10, 12, 16, 20, 24])
    _close(shape_rewards(rewards, cfg, lengths, _no_truncation), [1.0, 1.0, 0.5, -1.0, -0.5])
    cfg = cfg.model_copy(update={"overlong_buffer_penalty": 0.5})  # the penalty scales the whole ramp
    _close(shape_rewards(rewards, cfg, lengths, _no_truncation), [1.0, 1.0, 0.75, -0.5, 0.25])
    off = cfg.model_copy(update={"enabled": False})
    _close(shape_rewards(rewards, off, lengths, _no_truncation), [1.0, 1.0, 1.0, 0.0, 1.0])


def test_stop_properly_penalty_scales_truncated_rewards_and_replaces_the_dapo_penalty():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the DAPO lengths are ignored (NeMo-RL warns too)
        cfg = RewardShapingConfig(
            enabled=True,
            stop_properly_penalty_coef=0.3,
            overlong_buffer_length=1,
            overlong_buffer_penalty=1.0,
            max_response_length=2,
        )
    rewards, lengths = torch.tensor([1.0, 1.0, 0.0, 0.5]), torch.tensor([9, 9, 9, 9])
    truncated = torch.tensor([False, True, True, True])
    _close(shape_rewards(rewards, cfg, lengths, lambda: truncated), [1.0, 0.3, 0.0, 0.15])


# --- grpo.adv_estimator -----------------------------------------------------------------------------------------


def test_reinforce_plus_plus_whitens_the_group_centred_reward_over_the_batch_tokens():
    # groups A = [1, 0, 0, 1] (mean 0.5) and B = [1, 1, 1, 1] (mean 1): a = [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0];
    # tokens [3, 1, 1, 3, 4, 4, 4, 4] (24): mu = (1.5 - 0.5 - 0.5 + 1.5) / 24 = 1/12,
    # var = (6 (5/12)^2 + 2 (7/12)^2 + 16 (1/12)^2) / 24 = 11/144 -> A = (a - 1/12) * 12 / sqrt(11)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    tokens = torch.tensor([3.0, 1.0, 1.0, 3.0, 4.0, 4.0, 4.0, 4.0])
    s = math.sqrt(11)
    got = compute_reinforce_plus_plus_advantages(rewards, groups, tokens, minus_baseline=True)
    _close(got, [5 / s, -7 / s, -7 / s, 5 / s, -1 / s, -1 / s, -1 / s, -1 / s])
    # minus_baseline false: a = r; mu = 22/24 = 11/12, var = 11/144 -> A = (r - 11/12) * 12 / sqrt(11)
    got = compute_reinforce_plus_plus_advantages(rewards, groups, tokens, minus_baseline=False)
    _close(got, [1 / s, -11 / s, -11 / s, 1 / s, 1 / s, 1 / s, 1 / s, 1 / s])
    # unequal groups (Pilot-Commit, masked rows): [1, 0] (mean 0.5) and [1, 0, 0, 0] (mean 0.25), one token each:
    # a = [0.5, -0.5, 0.75, -0.25, -0.25, -0.25], mu = 0, var = (0.5 + 0.5625 + 0.1875) / 6 = 5/24 -> a * sqrt(24/5)
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0]), torch.tensor([7, 7, 3, 3, 3, 3])
    k = math.sqrt(24 / 5)
    got = compute_reinforce_plus_plus_advantages(rewards, groups, torch.ones(6), minus_baseline=True)
    _close(got, [0.5 * k, -0.5 * k, 0.75 * k, -0.25 * k, -0.25 * k, -0.25 * k])


def test_the_estimator_is_chosen_by_name_and_reads_the_section_copies():
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long)
    tokens = torch.tensor([1.0, 1.0, 1.0, 1.0])
    # grpo without normalisation: r - mean = [0.75, -0.25, -0.25, -0.25]; leave-one-out: r - mean(others)
    _close(estimate_advantages(_grpo(normalize_rewards=False), rewards, groups, tokens), [0.75, -0.25, -0.25, -0.25])
    loo = _grpo(normalize_rewards=False, use_leave_one_out_baseline=True)
    _close(estimate_advantages(loo, rewards, groups, tokens), [1.0, -1 / 3, -1 / 3, -1 / 3])
    # reinforce_plus_plus, equal tokens: a = [0.75, -0.25, -0.25, -0.25], mu 0, var 0.1875 -> a / sqrt(0.1875)
    rpp = _grpo(adv_estimator={"name": "reinforce_plus_plus"})
    k = 1 / math.sqrt(0.1875)
    _close(estimate_advantages(rpp, rewards, groups, tokens), [0.75 * k, -0.25 * k, -0.25 * k, -0.25 * k])


def test_adv_estimator_copies_are_derived_from_the_grpo_keys_or_must_agree():
    # null copies: the estimator reads grpo.normalize_rewards / use_leave_one_out_baseline (see the test above);
    # set copies equal to them load, and give the same advantages
    cfg = _grpo(normalize_rewards=False, use_leave_one_out_baseline=True)
    assert (cfg.adv_estimator.normalize_rewards, cfg.adv_estimator.use_leave_one_out_baseline) == (None, None)
    agree = _grpo(
        normalize_rewards=False,
        use_leave_one_out_baseline=True,
        adv_estimator={"normalize_rewards": False, "use_leave_one_out_baseline": True},
    )
    rewards, groups, tokens = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long), torch.ones(4)
    _close(estimate_advantages(agree, rewards, groups, tokens), [1.0, -1 / 3, -1 / 3, -1 / 3])
    with pytest.raises(ValidationError, match="adv_estimator.normalize_rewards=False differs from grpo.normalize"):
        _grpo(adv_estimator={"normalize_rewards": False})
    with pytest.raises(ValidationError, match="reinforce_plus_plus"):
        _grpo(adv_estimator={"name": "gdpo"})
    # one generation per prompt: refused for grpo's std, fine for reinforce_plus_plus (which does not use it)
    with pytest.raises(ValidationError, match="group std of one"):
        _grpo(num_generations_per_prompt=1)
    assert _grpo(num_generations_per_prompt=1, adv_estimator={"name": "reinforce_plus_plus"})


def test_schema_rules_of_the_reward_and_clip_options():
    with pytest.raises(ValidationError, match="needs stop_properly_penalty_coef or all of"):
        RewardShapingConfig(enabled=True, overlong_buffer_length=8, max_response_length=20)
    with pytest.warns(UserWarning, match="overlong_buffer_length, max_response_length"):
        RewardShapingConfig(
            enabled=True, stop_properly_penalty_coef=0.5, overlong_buffer_length=8, max_response_length=20
        )
    with pytest.raises(ValidationError):
        RewardShapingConfig(enabled=True, stop_properly_penalty_coef=1.5)
    with pytest.raises(ValidationError, match="source_max=0.0 must exceed source_min=0.0"):
        RewardScalingConfig(enabled=True, source_min=0.0, source_max=0.0)
    with pytest.raises(ValidationError, match="advantage_clip_low=1.0 exceeds"):
        _grpo(advantage_clip_low=1.0, advantage_clip_high=-1.0)
    assert RewardShapingConfig().enabled is False  # NeMo-RL's defaults: off, lengths unset


def test_the_base_recipe_writes_nemo_rl_defaults_and_overrides_load():
    cfg = load_config(TINY, []).grpo
    assert (cfg.advantage_clip_low, cfg.advantage_clip_high, cfg.adv_estimator.name) == (None, None, "grpo")
    assert not cfg.reward_shaping.enabled and not cfg.reward_scaling.enabled
    assert cfg.adv_estimator.use_leave_one_out_baseline is None and cfg.use_leave_one_out_baseline is False
    both = ["grpo.use_leave_one_out_baseline=true", "grpo.adv_estimator.use_leave_one_out_baseline=true"]
    cfg = load_config(TINY, [*both, "grpo.adv_estimator.minus_baseline=false"]).grpo
    assert cfg.adv_estimator.use_leave_one_out_baseline is True and cfg.adv_estimator.minus_baseline is False
    with pytest.raises(ConfigError, match="differs from grpo.use_leave_one_out_baseline"):
        load_config(TINY, ["grpo.adv_estimator.use_leave_one_out_baseline=true"])


# --- the training step (sync and async share train_on_selection) -----------------------------------------------

EOS = 9


def _selection(rewards: list[float], response_tokens: list[list[int]]):
    """One group; each row is prompt [1, 2] + its response tokens."""
    rows = [[1, 2, *r] for r in response_tokens]
    width = max(map(len, rows))
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    payload = {
        "output_ids": ids,
        "input_lengths": torch.full((len(rows),), 2),
        "sequence_lengths": torch.tensor([len(r) for r in rows]),
        "generation_logprobs": torch.zeros(ids.shape),
    }
    r = torch.tensor(rewards)
    result = SimpleNamespace(payload=payload, rewards=r)
    return SimpleNamespace(results=[result], rewards=r, group_ids=torch.zeros(len(rows), dtype=torch.long))


def _trained_advantages(overrides: list[str], selection) -> torch.Tensor:
    """Run ``train_on_selection`` on fakes (policy, tokenizer) with the tiny recipe + ``overrides``; return the
    advantages the policy was trained with."""
    trained = {}

    def train(data, train_draft=False):
        trained.update(data)
        return {}

    s = SimpleNamespace(
        cfg=load_config(TINY, overrides),
        pad_token_id=0,
        tokenizer=SimpleNamespace(eos_token_id=EOS, decode=lambda ids: ""),
        policy=SimpleNamespace(get_logprobs=lambda data, t: data["generation_logprobs"].clone(), train=train),
        trains_draft=lambda step: False,
    )
    train_on_selection(s, selection, timer=_NoTimer(), step=0)
    return trained["advantages"]


class _NoTimer:
    def time(self, name):
        return nullcontext()


def test_step_order_is_scaling_then_shaping_then_estimator_then_clip():
    # rewards [1, 0, 0, 1] -> scaled to [-1, 1]: [1, -1, -1, 1]; lengths [4, 4, 4, 12], DAPO max 10, buffer 4
    # (penalty after 6 tokens): the last gets -(12 - 6) / 4 = -1.5 -> [1, -1, -1, -0.5]; grpo unnormalised,
    # mean -0.375 -> [1.375, -0.625, -0.625, -0.125]; clip high 1.0 -> [1.0, -0.625, -0.625, -0.125]
    overrides = [
        "grpo.normalize_rewards=false",
        "grpo.reward_scaling.enabled=true",
        "grpo.reward_scaling.target_min=-1.0",
        "grpo.reward_shaping.enabled=true",
        "grpo.reward_shaping.overlong_buffer_length=4",
        "grpo.reward_shaping.overlong_buffer_penalty=1.0",
        "grpo.reward_shaping.max_response_length=10",
        "grpo.advantage_clip_high=1.0",
    ]
    sel = _selection([1.0, 0.0, 0.0, 1.0], [[5, 5, 5, EOS], [5, 5, 5, EOS], [5, 5, 5, EOS], [5] * 11 + [EOS]])
    _close(_trained_advantages(overrides, sel), [1.0, -0.625, -0.625, -0.125])


def test_step_stop_properly_and_reinforce_plus_plus_whiten_over_rows_left_in_the_loss():
    # max_new_tokens 4: row 2 (4 tokens, no EOS) is truncated. stop-properly 0.5: rewards [1, 1, 0, 0] ->
    # [1, 0.5, 0, 0]; group mean 0.375 -> a = [0.625, 0.125, -0.375, -0.375]. overlong filtering drops row 2 from
    # the loss: tokens [3, 0, 2, 3] (8): mu = (1.875 - 0.75 - 1.125) / 8 = 0, var = (3 * 0.625^2 + 5 * 0.375^2) / 8
    # = 15/64 -> A = a * 8 / sqrt(15) = [5, 1, -3, -3] / sqrt(15)
    overrides = [
        "policy.generation.max_new_tokens=4",
        "grpo.overlong_filtering=true",
        "grpo.reward_shaping.enabled=true",
        "grpo.reward_shaping.stop_properly_penalty_coef=0.5",
        "grpo.adv_estimator.name=reinforce_plus_plus",
    ]
    sel = _selection([1.0, 1.0, 0.0, 0.0], [[5, 5, EOS], [5, 5, 5, 5], [5, EOS], [5, 5, EOS]])
    s = math.sqrt(15)
    _close(_trained_advantages(overrides, sel), [5 / s, 1 / s, -3 / s, -3 / s])
