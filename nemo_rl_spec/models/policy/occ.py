"""OCC: the per-step coefficient of the MTP gradient that reaches the shared trunk (docs/methods.md section 3).

Derivation (docs/occ.md). With the trunk updated by ``theta' = theta + eta * (g_RL + lambda * g_MTP)`` and the RL
objective J L-smooth, the guaranteed improvement is

    J(theta') - J(theta) >= eta <g_RL, g> - (L eta^2 / 2) ||g||^2,        g = g_RL + lambda * g_MTP

whose lambda-dependent part ``lambda * eta * (1 - L eta) * c - lambda^2 * (L eta^2 / 2) * v2`` (c = <g_RL, g_MTP>,
v2 = ||g_MTP||^2) is maximised by

    lambda* = (1 - L eta) / (L eta) * c / v2          (0 when c <= 0: an opposed MTP gradient never helps).

OCC sets ``lambda_t = lambda_plus * max(c_hat, 0) / (v2_hat + eps)``, optionally clamped to ``lambda_max``;
``lambda_plus`` absorbs the unknown ``(1 - L eta) / (L eta)``.

Proxies (this project's choice, docs/occ.md section 3). Parameter-space gradients of the two losses would need
a second backward pass through the trunk. Both heads read the same trunk output h (decoder output after its
final norm), so the worker takes the gradients of the two losses with respect to h at every valid
(non-padding) position, which the one backward pass computes anyway:

    c_hat  = sum_p <dL_RL/dh_p, dL_MTP/dh_p>         v2_hat = sum_p ||dL_MTP/dh_p||^2

They equal c and v2 exactly when the trunk Jacobians of different positions are orthonormal
(J_p^T J_q = delta_pq I), e.g. a linear trunk fed near-orthogonal inputs, and are first-order log-prob proxies
in general: ``-<dL_RL/dh, Delta h>`` is the advantage-weighted change of the main head's log-probs (the first-order
``delta = log pi_theta - log pi_old``, weighted as the PG loss weights it) that a hidden-state step Delta h
causes, so c_hat is that change under the MTP step Delta h = -dL_MTP/dh and v2_hat the step's squared size.

Zero delta. In the sync driver every ``train`` call is one optimizer step on freshly computed ``prev_logprobs``,
so the observed ``delta = curr - prev`` is exactly 0 on every (first, on-policy) minibatch. The proxies never
divide by delta: at delta = 0 the PG loss has ratio 1 and no clipping, dL_RL/dh is the on-policy gradient and
lambda_t is finite; lambda_t = 0 exactly when c_hat <= 0 (e.g. all advantages 0, or v2_hat = 0 with c_hat = 0).

The paper's own proxy, from observed log-prob changes (``policy.megatron_cfg.mtp_occ_proxy: logprob_delta``), is
:func:`logprob_delta_lambda`; it is 0 on the first mini-batch of a step and needs several optimizer mini-batches
per GRPO step (``policy.train_global_batch_size`` below the step's rows) to be anything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("detach", "ce", "policy", "occ")
PROXIES = ("hidden_grad", "logprob_delta")  # ``policy.megatron_cfg.mtp_occ_proxy`` (docs/occ.md section 3a)


def occ_proxies(
    rl_hidden_grad: torch.Tensor, mtp_hidden_grad: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alignment and magnitude proxies from hidden-state gradients over valid positions.

    ``c_hat = sum_{p valid} <rl_hidden_grad[p], mtp_hidden_grad[p]>``, ``v2_hat = sum_{p valid} ||mtp_hidden_grad[p]||^2``
    (float64 accumulation).

    Shape: rl_hidden_grad, mtp_hidden_grad [..., H] (the same leading shape, e.g. [S, B, H]); valid [...] (1 on
    positions to count, 0 on padding) -> two scalars (float64), in units of loss^2 / hidden^2.

    Raises:
        ValueError: shapes disagree.
    """
    if rl_hidden_grad.shape != mtp_hidden_grad.shape or rl_hidden_grad.shape[:-1] != valid.shape:
        raise ValueError(
            f"shapes {tuple(rl_hidden_grad.shape)}, {tuple(mtp_hidden_grad.shape)}, valid {tuple(valid.shape)} disagree"
        )
    weight = valid.to(torch.float64).unsqueeze(-1)
    rl, mtp = rl_hidden_grad.to(torch.float64) * weight, mtp_hidden_grad.to(torch.float64) * weight
    return (rl * mtp).sum(), (mtp * mtp).sum()


def occ_lambda(c_hat: float, v2_hat: float, lambda_plus: float, eps: float, lambda_max: float | None = None) -> float:
    """``lambda_t = lambda_plus * max(c_hat, 0) / (v2_hat + eps)``, then ``min(., lambda_max)`` when given.

    Raises:
        ValueError: lambda_plus < 0, eps <= 0, v2_hat < 0 or lambda_max < 0.
    """
    if lambda_plus < 0 or eps <= 0 or v2_hat < 0 or (lambda_max is not None and lambda_max < 0):
        raise ValueError(
            f"need lambda_plus >= 0, eps > 0, v2_hat >= 0, lambda_max >= 0; got {lambda_plus}, {eps}, "
            f"{v2_hat}, {lambda_max}"
        )
    lam = lambda_plus * max(float(c_hat), 0.0) / (float(v2_hat) + eps)
    return lam if lambda_max is None else min(lam, lambda_max)


def logprob_delta_lambda(
    mtp_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    valid: torch.Tensor,
    lambda_plus: float,
    num_heads: int,
    eps: float,
    lambda_max: float | None = None,
) -> float:
    """The paper's published OCC proxy for MTP head k (RL-MTP reference implementation; docs/occ.md section 3a).

    With ``d_mtp = mtp_logprobs - prev_logprobs`` and ``d = logprobs - prev_logprobs`` (all log-probs of the same
    target token ``input_ids[b, s]``; ``prev_logprobs`` the main head's at the start of the GRPO step, as in the
    reference, which subtracts the main head's old log-prob from both heads):

        m_k      = sum_{valid} d_mtp * d / (d_mtp^2 + eps) / sum(valid)        (0 without valid tokens)
        lambda_k = min(lambda_plus * max(m_k, 0), lambda_max) / num_heads

    ``lambda_k`` multiplies head k's (un-averaged) MTP loss gradient in the trunk update; the coefficient of the
    head-averaged gradient is ``sum_k lambda_k``. The reference takes ``max(., 0)`` nowhere and clamps nowhere; here
    lambda >= 0 as in OCC's rule (a negative coefficient trains the trunk against the MTP head) and ``lambda_max``
    bounds ``num_heads * lambda_k``. On the first (on-policy) mini-batch of a step ``d = 0`` and lambda_k = 0 (up
    to the ~1e-7 recomputation noise of ``logprobs``).

    Shape: mtp_logprobs, logprobs, prev_logprobs, valid [B, S] (valid 1 on the head's MTP targets, else 0) ->
    float (float64 accumulation), dimensionless.

    Raises:
        ValueError: shapes disagree, lambda_plus < 0, num_heads < 1, eps <= 0 or lambda_max < 0.
    """
    if not mtp_logprobs.shape == logprobs.shape == prev_logprobs.shape == valid.shape:
        raise ValueError(
            f"shapes {tuple(mtp_logprobs.shape)}, {tuple(logprobs.shape)}, {tuple(prev_logprobs.shape)}, "
            f"valid {tuple(valid.shape)} disagree"
        )
    if lambda_plus < 0 or num_heads < 1 or eps <= 0 or (lambda_max is not None and lambda_max < 0):
        raise ValueError(
            f"need lambda_plus >= 0, num_heads >= 1, eps > 0, lambda_max >= 0; got {lambda_plus}, "
            f"{num_heads}, {eps}, {lambda_max}"
        )
    weight = valid.to(torch.float64)
    count = float(weight.sum())
    if count == 0.0:
        return 0.0
    old = prev_logprobs.to(torch.float64)
    d_mtp, d = mtp_logprobs.to(torch.float64) - old, logprobs.to(torch.float64) - old
    mean = float((weight * d_mtp * d / (d_mtp * d_mtp + eps)).sum()) / count
    lam = lambda_plus * max(mean, 0.0)
    return (lam if lambda_max is None else min(lam, lambda_max)) / num_heads


def closed_form_lambda(c: float, v2: float, smoothness: float, lr: float) -> float:
    """The L-smooth optimum ``(1 - L eta) / (L eta) * max(c, 0) / v2`` (0 when v2 == 0); module docstring."""
    if v2 <= 0:
        return 0.0
    return (1.0 - smoothness * lr) / (smoothness * lr) * max(c, 0.0) / v2


@dataclass
class MTPCoefficient:
    """The coefficient of the MTP gradient reaching shared (trunk) parameters, per ``mtp_loss_mode``.

    detach -> 0 (the MTP branch reads detached trunk tensors, nothing is added); ce / policy -> the fixed
    ``scaling_factor``; occ -> :func:`occ_lambda` with ``lambda_plus = scaling_factor``.
    MTP-only parameters always receive the unscaled MTP-loss gradient.
    """

    mode: str
    scaling_factor: float
    eps: float = 1e-8
    lambda_max: float | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mtp_loss_mode={self.mode!r}; expected one of {MODES}")

    def __call__(self, c_hat: float, v2_hat: float) -> float:
        if self.mode == "detach":
            return 0.0
        if self.mode == "occ":
            return occ_lambda(c_hat, v2_hat, self.scaling_factor, self.eps, self.lambda_max)
        return self.scaling_factor
