"""GRPO advantages: per-prompt-group baselines and optional std normalisation.

GRPO (Shao et al. 2024, "DeepSeekMath", eq. 3 outcome supervision) scores every response against the other
responses to the same prompt::

    A_i = (r_i - b_i) / (std_g + eps)  if normalize_rewards,  else  A_i = r_i - b_i
    b_i = mean_g(r)                                  group-mean baseline
    b_i = (sum_g(r) - r_i) / (n_g - 1)               leave-one-out baseline (RLOO, Ahmadian et al. 2024)
    std_g = sqrt( sum_g (r - mean_g(r))^2 / (n_g - 1) )   Bessel-corrected std of the whole group

Zero-spread rule: a group with ``n_g == 1`` or ``std_g <= zero_spread_atol + zero_spread_rtol * max_g |r|``
(defaults atol 1e-6, rtol 1e-5: about 80 float32 ulps at |r| = 1; rewards assumed O(1)) carries no learning
signal, and dividing rounding noise by a tiny std would blow it up, so every advantage in it is exactly 0.0, with
or without normalisation and for either baseline. Statistics are computed in float64 with a two-pass formula; the
result has the dtype of ``rewards``.
"""

from __future__ import annotations

import torch


def compute_grpo_advantages(
    rewards: torch.Tensor,
    group_size: int,
    use_leave_one_out_baseline: bool,
    normalize_rewards: bool,
    eps: float = 1e-6,
    zero_spread_rtol: float = 1e-5,
    zero_spread_atol: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO advantages for equal, contiguous groups (rows prompt-major).

    Shape: rewards [N] -> advantages [N], N = num_prompts * group_size; rows ``[k*group_size, (k+1)*group_size)``
    are the responses to prompt k.

    Args:
        rewards: [N] float scalar reward per response (unitless).
        group_size: responses per prompt (>= 1).
        use_leave_one_out_baseline: baseline = mean of the *other* responses of the group instead of the
            group mean (a group of one gets advantage 0).
        normalize_rewards: divide by (group std + eps), std Bessel-corrected over the whole group.
        eps: added to the std in the denominator.
        zero_spread_rtol, zero_spread_atol: zero-spread threshold, see the module docstring.
        valid: optional [N] bool; False rows (masked non-finite rewards) are left out of their group's
            statistics and get advantage exactly 0 (each becomes a group of one).

    Returns:
        [N] advantages, dtype of ``rewards``.

    Raises:
        ValueError: rewards is not 1-D, group_size < 1, or N is not a multiple of group_size.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"len(rewards)={rewards.numel()} is not a multiple of group_size={group_size}")
    group_ids = torch.arange(rewards.numel(), device=rewards.device) // group_size
    return compute_grpo_advantages_by_group(
        rewards,
        group_ids,
        use_leave_one_out_baseline=use_leave_one_out_baseline,
        normalize_rewards=normalize_rewards,
        eps=eps,
        zero_spread_rtol=zero_spread_rtol,
        zero_spread_atol=zero_spread_atol,
        valid=valid,
    )


def compute_grpo_advantages_by_group(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    use_leave_one_out_baseline: bool,
    normalize_rewards: bool,
    eps: float = 1e-6,
    zero_spread_rtol: float = 1e-5,
    zero_spread_atol: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO advantages for arbitrary (unequal, non-contiguous) groups given by an id per response.

    Shape: rewards [N], group_ids [N] (any integers; equal id = same prompt), valid [N] bool or None ->
    advantages [N]. Formulas and the zero-spread rule are in the module docstring; ``valid`` as in
    :func:`compute_grpo_advantages` (False rows leave their group and get advantage 0).

    Raises:
        ValueError: rewards or group_ids not 1-D, or their lengths differ.
    """
    if rewards.dim() != 1 or group_ids.dim() != 1:
        raise ValueError(f"rewards and group_ids must be 1-D, got {tuple(rewards.shape)} and {tuple(group_ids.shape)}")
    if rewards.numel() != group_ids.numel():
        raise ValueError(f"len(rewards)={rewards.numel()} != len(group_ids)={group_ids.numel()}")
    if rewards.numel() == 0:
        return rewards.clone()
    if valid is not None:  # each masked row becomes a group of its own, with an id no real group uses
        invalid = ~valid.to(torch.bool)
        group_ids = group_ids.clone()
        group_ids[invalid] = int(group_ids.max()) + 1 + torch.arange(int(invalid.sum()), device=group_ids.device)

    r = rewards.detach().to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=r.device)

    counts = zeros.index_add(0, inverse, torch.ones_like(r))
    sums = zeros.index_add(0, inverse, r)
    mean = (sums / counts)[inverse]
    sq_dev = zeros.index_add(0, inverse, (r - mean) ** 2)
    n = counts[inverse]
    std = (sq_dev[inverse] / (n - 1).clamp(min=1)).sqrt()
    max_abs = zeros.scatter_reduce(0, inverse, r.abs(), reduce="amax", include_self=False)[inverse]
    zero_spread = (n <= 1) | (std <= zero_spread_atol + zero_spread_rtol * max_abs)

    if use_leave_one_out_baseline:
        baseline = (sums[inverse] - r) / (n - 1).clamp(min=1)
    else:
        baseline = mean
    advantages = r - baseline
    if normalize_rewards:
        advantages = advantages / (std + eps)
    advantages = torch.where(zero_spread, torch.zeros_like(advantages), advantages)
    return advantages.to(rewards.dtype)
