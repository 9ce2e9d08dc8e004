"""Checks shared by the GRPO loop tests: the run really trained (owned with test_grpo_loop.py).

The loop tests select the scripted reward (``env.reward=char_fraction``, environments/char_fraction_env.py) with
:data:`TRAINS`: on the random tiny model the math reward is 0 everywhere, advantages and gradients vanish and the
weights never move, so refit / resume / importance-ratio checks could not fail.
"""

from __future__ import annotations

from pathlib import Path

import torch

TRAINS = ("env.reward=char_fraction",)
"""Overrides that make a tiny-recipe run train (reward spread in every group)."""


def policy_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """The policy's model tensors saved in a checkpoint directory ``.../step_<n>`` (TP rank 0)."""
    return torch.load(step_dir / "policy" / "megatron_policy_tp0.pt", weights_only=False)["model"]


def assert_trained(records: list[dict], ckpt_dir: Path, steps: list[int]) -> None:
    """Every listed step had reward spread in every group, a non-zero loss and gradient, and moved the weights
    (checkpoint ``step_<n>`` differs from ``step_<n-1>``; needs save_period=1)."""
    by_step = {r["step"]: r for r in records}
    for step in steps:
        m = by_step[step]
        assert m["rollout_alloc/zero_adv_group_frac"] == 0.0 and m["rollout_alloc/mean_group_reward_var"] > 0, m
        assert m["train/grad_norm"] > 1e-6 and m["train/loss"] != 0.0, m
    for prev, step in zip(steps, steps[1:]):
        before, after = policy_weights(ckpt_dir / f"step_{prev}"), policy_weights(ckpt_dir / f"step_{step}")
        moved = max(float((after[k].float() - before[k].float()).abs().max()) for k in after)
        assert moved > 1e-5, f"weights did not move from step {prev} to {step} (max |change| {moved})"
