"""Advantages: NeMo-RL's ``grpo.adv_estimator`` (``grpo``: per-prompt-group baselines and optional std normalisation;
``reinforce_plus_plus``: :func:`compute_reinforce_plus_plus_advantages`, or per token with ``loss_fn.use_kl_in_reward``:
:func:`compute_reinforce_plus_plus_token_advantages` and :func:`reward_kl_penalty`) and the advantage clip
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

from nemo_rl_spec.algorithms.loss.clipped_pg import reference_kl

#: the clamps of the reward's KL estimate (NeMo-RL's ``calculate_kl`` defaults; its REINFORCE++ estimator passes no
#: others, so ``loss_fn.kl_input_clamp_value`` / ``kl_output_clamp_value`` act on the loss's KL term only)
REWARD_KL_INPUT_CLAMP = 20.0
REWARD_KL_OUTPUT_CLAMP = 10.0


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


def reward_kl_penalty(
    prev_logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    kl_coef: float,
    kl_type: str,
) -> torch.Tensor:
    """``loss_fn.use_kl_in_reward``: the per-token KL penalty that REINFORCE++ subtracts from the reward (NeMo-RL's
    ``ReinforcePlusPlusAdvantageEstimator``), beta * kl_t with beta = ``reference_policy_kl_penalty`` and kl_t the
    estimator ``reference_policy_kl_type`` of KL(pi_old || pi_ref) at the sampled token::

        d    = clamp(log pi_ref - log pi_old, -20, 20)
        k1 = -d      k2 = d^2 / 2      k3 = e^d - d - 1
        kl_t = clamp(k(d), -10, 10)

    pi_old is the trainer's policy before the update (``prev_logprobs``), as in NeMo-RL; the clamps are NeMo-RL's
    fixed ones (:data:`REWARD_KL_INPUT_CLAMP`, :data:`REWARD_KL_OUTPUT_CLAMP`). No gradient flows (the advantages are
    constants of the loss).

    Shapes: prev_logprobs, reference_logprobs [N, S] -> [N, S] float64 (every position; the caller's mask decides
    which count).
    """
    if prev_logprobs.shape != reference_logprobs.shape or prev_logprobs.dim() != 2:
        raise ValueError(
            f"prev_logprobs {tuple(prev_logprobs.shape)} and reference_logprobs {tuple(reference_logprobs.shape)} "
            "must be the same [N, S]"
        )
    prev = prev_logprobs.detach().to(torch.float64)
    ref = reference_logprobs.detach().to(torch.float64)
    kl = reference_kl(ref - prev, torch.ones_like(prev), kl_type, REWARD_KL_INPUT_CLAMP, REWARD_KL_OUTPUT_CLAMP)
    return kl_coef * kl


def compute_reinforce_plus_plus_token_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    mask: torch.Tensor,
    token_penalty: torch.Tensor,
    minus_baseline: bool = True,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++ with the KL in the reward (``loss_fn.use_kl_in_reward``; NeMo-RL's ``reinforce_plus_plus``
    estimator with ``logprobs_policy`` / ``logprobs_reference``). Per response i (group g) and token t::

        a_i    = r_i - mean_g(r)   if minus_baseline   else   a_i = r_i
        A_it   = a_i - p_it                                   p = token_penalty = beta * kl (:func:`reward_kl_penalty`)
        mu     = sum_{m_it=1} A_it / sum m,    var = sum_{m_it=1} (A_it - mu)^2 / sum m
        A_it  <- (A_it - mu) / sqrt(max(var, 1e-8))           on m_it = 1;  0 where m_it = 0

    The penalty of each token is subtracted from the sequence reward at that token only: no return-to-go sum and no
    discount, as NeMo-RL computes it. With p = 0 it is :func:`compute_reinforce_plus_plus_advantages` on every
    token of the row (token counts = row sums of m).

    Shapes: rewards [N], group_ids [N], mask [N, S] (token_mask x sample_mask: the tokens in the loss),
    token_penalty [N, S], valid [N] bool or None (False rows leave their group's mean) -> [N, S], dtype of
    ``rewards``. No token in the loss: every advantage is 0.
    """
    if mask.dim() != 2 or mask.shape != token_penalty.shape or mask.shape[0] != rewards.numel():
        raise ValueError(
            f"mask {tuple(mask.shape)} and token_penalty {tuple(token_penalty.shape)} must be [N, S] with "
            f"N = len(rewards) = {rewards.numel()}"
        )
    r = rewards.detach().to(torch.float64)
    a = r - _group_mean(r, group_ids, valid) if minus_baseline else r
    m = mask > 0
    n = m.sum()
    if n == 0:
        return torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    adv = a.unsqueeze(-1) - token_penalty.detach().to(torch.float64)
    zero = torch.zeros_like(adv)
    mu = torch.where(m, adv, zero).sum() / n
    var = torch.where(m, (adv - mu) ** 2, zero).sum() / n
    return torch.where(m, (adv - mu) * var.clamp(min=1e-8).rsqrt(), zero).to(rewards.dtype)


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
    token_penalty: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``grpo.adv_estimator`` then the advantage clip, as NeMo-RL's loop applies them to the (scaled, shaped) rewards.

    Args:
        grpo_cfg: the ``grpo`` section (:class:`~nemo_rl_spec.utils.config_schema.GRPOConfig`).
        rewards: [N] rewards after ``grpo.reward_scaling`` / ``grpo.reward_shaping``.
        group_ids: [N] prompt-group id per response.
        token_counts: [N] response tokens in the loss (token_mask row sums x sample_mask); reinforce_plus_plus only.
        valid: [N] bool or None; False rows (masked non-finite rewards) leave their group's statistics.
        token_penalty: [N, S] or None: ``loss_fn.use_kl_in_reward``'s beta * kl (:func:`reward_kl_penalty`);
            reinforce_plus_plus only, per token (:func:`compute_reinforce_plus_plus_token_advantages`).
        mask: [N, S] tokens in the loss (token_mask x sample_mask), with ``token_penalty`` (it then replaces
            ``token_counts``).

    Returns:
        [N] advantages, or [N, S] with ``token_penalty``; dtype of ``rewards``.

    Raises:
        ValueError: ``token_penalty`` with the grpo estimator or without ``mask``.
    """
    est = grpo_cfg.adv_estimator
    if token_penalty is not None:
        if est.name != "reinforce_plus_plus" or mask is None:
            raise ValueError(
                "a per-token reward penalty (loss_fn.use_kl_in_reward) needs grpo.adv_estimator.name="
                f"reinforce_plus_plus (got {est.name!r}) and the loss mask"
            )
        adv = compute_reinforce_plus_plus_token_advantages(
            rewards, group_ids, mask, token_penalty, est.minus_baseline, valid
        )
    elif est.name == "reinforce_plus_plus":
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
