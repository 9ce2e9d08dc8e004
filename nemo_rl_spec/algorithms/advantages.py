"""Advantages: NeMo-RL's ``grpo.adv_estimator`` (``grpo``: per-prompt-group baselines and optional std normalisation;
``reinforce_plus_plus``: :func:`compute_reinforce_plus_plus_advantages`) and the advantage clip
(:func:`estimate_advantages`).

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


def compute_reinforce_plus_plus_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    token_counts: torch.Tensor,
    minus_baseline: bool = True,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++ advantages (NeMo-RL's ``reinforce_plus_plus`` estimator; ProRLv2's REINFORCE++-baseline).

    Per response i (group g, L_i = token_counts[i] response tokens in the loss)::

        a_i = r_i - mean_g(r)   if minus_baseline   else   a_i = r_i
        mu  = sum_i L_i a_i / sum_i L_i,    var = sum_i L_i (a_i - mu)^2 / sum_i L_i
        A_i = (a_i - mu) / sqrt(max(var, 1e-8))

    i.e. the per-token advantage a_i, whitened over every response token of the batch that is in the loss. A
    group whose rewards are all equal gets a_i = 0 before whitening and -mu / std after it (not 0).

    Shape: rewards [N], group_ids [N], token_counts [N] (response tokens x sample_mask; 0 leaves a row out of mu and
    var), valid [N] bool or None (False rows leave their group's mean) -> [N], dtype of ``rewards``. No token in
    the loss (sum L_i = 0): every advantage is 0.
    """
    r = rewards.detach().to(torch.float64)
    a = r
    if minus_baseline:
        a = r - _group_mean(r, group_ids, valid)
    w = token_counts.to(torch.float64)
    total = w.sum()
    if total <= 0:
        return torch.zeros_like(rewards)
    mu = (w * a).sum() / total
    var = (w * (a - mu) ** 2).sum() / total
    return ((a - mu) * var.clamp(min=1e-8).rsqrt()).to(rewards.dtype)


def _group_mean(r: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Mean of each row's group over its valid rows (a masked row is its own group). Shape: [N] -> [N] float64."""
    w = torch.ones_like(r) if valid is None else valid.to(torch.float64)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    zeros = torch.zeros(int(inverse.max()) + 1 if r.numel() else 0, dtype=torch.float64, device=r.device)
    sums, counts = zeros.index_add(0, inverse, r * w), zeros.index_add(0, inverse, w)
    return torch.where(w > 0, sums[inverse] / counts[inverse].clamp(min=1), r)


def clip_advantages(advantages: torch.Tensor, low: float | None, high: float | None) -> torch.Tensor:
    """``grpo.advantage_clip_low`` / ``advantage_clip_high``: clamp(A, low, high) after the estimator (None: that side
    is not clipped). Shape: any -> same."""
    if low is not None:
        advantages = advantages.clamp(min=low)
    if high is not None:
        advantages = advantages.clamp(max=high)
    return advantages


def estimate_advantages(
    grpo_cfg,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    token_counts: torch.Tensor,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """``grpo.adv_estimator`` then the advantage clip, as NeMo-RL's loop applies them to the (scaled, shaped) rewards.

    Args:
        grpo_cfg: the ``grpo`` section (:class:`~nemo_rl_spec.utils.config_schema.GRPOConfig`).
        rewards: [N] rewards after ``grpo.reward_scaling`` / ``grpo.reward_shaping``.
        group_ids: [N] prompt-group id per response.
        token_counts: [N] response tokens in the loss (token_mask row sums x sample_mask); reinforce_plus_plus only.
        valid: [N] bool or None; False rows (masked non-finite rewards) leave their group's statistics.

    Returns:
        [N] advantages, dtype of ``rewards``.
    """
    est = grpo_cfg.adv_estimator
    if est.name == "reinforce_plus_plus":
        adv = compute_reinforce_plus_plus_advantages(rewards, group_ids, token_counts, est.minus_baseline, valid)
    else:  # the section's copies, or the grpo.* keys where they are null (set, they are equal: GRPOConfig)
        loo = (
            grpo_cfg.use_leave_one_out_baseline
            if est.use_leave_one_out_baseline is None
            else est.use_leave_one_out_baseline
        )
        norm = grpo_cfg.normalize_rewards if est.normalize_rewards is None else est.normalize_rewards
        adv = compute_grpo_advantages_by_group(rewards, group_ids, loo, norm, valid=valid)
    return clip_advantages(adv, grpo_cfg.advantage_clip_low, grpo_cfg.advantage_clip_high)
