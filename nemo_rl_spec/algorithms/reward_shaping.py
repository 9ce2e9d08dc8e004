"""NeMo-RL's reward transforms before the advantages: ``grpo.reward_scaling`` (linear, clamped) then
``grpo.reward_shaping`` (DAPO's overlong penalty, or the stop-properly penalty), on the rewards of the trained
responses. Formulas: :class:`~nemo_rl_spec.utils.feature_configs.RewardScalingConfig` and
:class:`~nemo_rl_spec.utils.feature_configs.RewardShapingConfig`.

They change the rewards the advantages see, not the task reward: ``train/reward`` stays the mean task reward, and the
rollout allocators (DAPO dynamic sampling, Pilot-Commit) judge groups by it, as NeMo-RL's dynamic sampling filters on
the unshaped reward.
"""

from __future__ import annotations

from typing import Callable

import torch

from nemo_rl_spec.utils.feature_configs import RewardScalingConfig, RewardShapingConfig


def scale_rewards(rewards: torch.Tensor, cfg: RewardScalingConfig) -> torch.Tensor:
    """r' = target_min + (clamp(r, source_min, source_max) - source_min) / (source_max - source_min)
    * (target_max - target_min) when ``cfg.enabled``, else r. Shape: [N] -> [N]."""
    if not cfg.enabled:
        return rewards
    r = rewards.clamp(min=cfg.source_min, max=cfg.source_max)
    return cfg.target_min + (r - cfg.source_min) / (cfg.source_max - cfg.source_min) * (cfg.target_max - cfg.target_min)


def overlong_penalty(response_lengths: torch.Tensor, cfg: RewardShapingConfig) -> torch.Tensor:
    """DAPO's overlong penalty, added to the reward: min(0, -(L - (max_response_length - overlong_buffer_length)) /
    overlong_buffer_length * overlong_buffer_penalty). Shape: response_lengths [N] (tokens) -> [N] float32 (<= 0)."""
    expected = cfg.max_response_length - cfg.overlong_buffer_length
    excess = response_lengths.to(torch.float32) - expected
    return (-excess / cfg.overlong_buffer_length * cfg.overlong_buffer_penalty).clamp(max=0.0)


def shape_rewards(
    rewards: torch.Tensor,
    cfg: RewardShapingConfig,
    response_lengths: torch.Tensor,
    truncated: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """``grpo.reward_shaping`` on the rewards (after scaling): with ``stop_properly_penalty_coef`` c set,
    r' = c * r on truncated responses (the DAPO penalty is then skipped, as in NeMo-RL); else r' = r +
    :func:`overlong_penalty`. Off: r.

    Args:
        rewards: [N] rewards.
        response_lengths: [N] response tokens per row.
        truncated: called only for the stop-properly penalty; returns [N] bool, True for a response cut off by a
            length limit (:func:`~nemo_rl_spec.algorithms.overlong.truncated_rows`).

    Returns:
        [N] shaped rewards, dtype of ``rewards``.
    """
    if not cfg.enabled:
        return rewards
    if cfg.stop_properly_penalty_coef is not None:
        return torch.where(truncated(), rewards * cfg.stop_properly_penalty_coef, rewards)
    return rewards + overlong_penalty(response_lengths, cfg).to(rewards.dtype)
