"""Non-finite reward guard, applied where rewards are produced (right after ``env.step``).

A NaN or inf reward poisons its whole GRPO group: the group mean and std become NaN, so every advantage of the
group, the clipped-PG loss and its gradients are NaN, and the optimizer step writes NaN into the weights.
``grpo.non_finite_reward`` chooses what happens instead:

* ``error`` (default): :class:`NonFiniteRewardError` naming each offending (prompt, response) pair.
* ``mask``: the reward is replaced by 0.0 and the row is marked invalid; invalid rows get advantage 0, are
  left out of their group's baseline and std, and get ``sample_mask = 0`` so the loss ignores them.
  ``train/non_finite_rewards`` counts them per step. (With Pilot-Commit the masked 0.0 also enters the
  pilot's success estimate, as a failure.) In validation a masked reward counts as a wrong answer and
  ``validation/non_finite_rewards`` counts them (:func:`nemo_rl_spec.algorithms.validation.validate`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch

NON_FINITE_REWARD_POLICIES = ("error", "mask")


class NonFiniteRewardError(ValueError):
    """An environment returned NaN or inf for at least one response (``grpo.non_finite_reward=error``)."""


def check_rewards(
    rewards: torch.Tensor, group_size: int, policy: str, prompt_ids: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the rewards of one generation call for NaN / inf.

    Rows are prompt-major: row ``i`` is response ``i % group_size`` of prompt ``prompt_ids[i // group_size]``.

    Shape: rewards [N], N = len(prompt_ids) * group_size -> (rewards [N] float32, finite everywhere;
    valid [N] bool, False where the reward was NaN or inf).

    Args:
        group_size: responses per prompt in this call (vLLM's ``n``).
        policy: ``"error"`` or ``"mask"`` (``grpo.non_finite_reward``).
        prompt_ids: the prompts' ids used in the error message (their training-pool index); default 0, 1, ...

    Raises:
        NonFiniteRewardError: policy ``"error"`` and some reward is not finite; the message lists
            ``prompt <id> response <j>: <value>`` for each such row.
        ValueError: unknown policy, or N is not a multiple of ``group_size``.
    """
    import torch  # lazy: this module imports without torch

    if policy not in NON_FINITE_REWARD_POLICIES:
        raise ValueError(f"grpo.non_finite_reward must be one of {NON_FINITE_REWARD_POLICIES}, got {policy!r}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of {group_size}")
    rewards = rewards.float()
    valid = torch.isfinite(rewards)
    if bool(valid.all()):
        return rewards, valid
    if policy == "error":
        ids = list(prompt_ids) if prompt_ids is not None else list(range(rewards.numel() // group_size))
        bad = [
            f"prompt {ids[i // group_size]} response {i % group_size}: {float(rewards[i])}"
            for i in torch.nonzero(~valid).flatten().tolist()
        ]
        raise NonFiniteRewardError(
            f"{len(bad)} non-finite reward(s) from the environment ({'; '.join(bad)}); fix the reward function "
            "or set grpo.non_finite_reward=mask to drop these responses from the update"
        )
    return torch.where(valid, rewards, torch.zeros_like(rewards)), valid
