"""OCC, the per-step coefficient of the MTP heads' policy loss (docs/design/methods.md section 3, docs/guides/occ.md).

Derivation. With the trunk updated by ``theta' = theta + eta * (g_RL + lambda * g_MTP)`` and the RL objective J
L-smooth, the guaranteed improvement is

    J(theta') - J(theta) >= eta <g_RL, g> - (L eta^2 / 2) ||g||^2,        g = g_RL + lambda * g_MTP

whose lambda-dependent part ``lambda * eta * (1 - L eta) * c - lambda^2 * (L eta^2 / 2) * v2`` (c = <g_RL, g_MTP>,
v2 = ||g_MTP||^2) is maximised by ``lambda* = (1 - L eta) / (L eta) * c / v2``: OCC sets
``lambda_t = lambda_plus * c / v2`` with ``lambda_plus`` (``mtp_loss_scaling_factor``) absorbing the unknown
constant. :func:`occ_lambda` is that rule on exact c and v2 (the full-gradient reference of
:class:`~nemo_rl_spec.models.policy.occ_reference.OCCReference`). The proxy OCC trains with
(:func:`logprob_delta_lambda`) is the paper's reference implementation (RL-MTP): c and v2 are estimated per token
from observed log-prob changes, so no second backward pass is needed. Like the reference it is signed and
unclamped by default: a negative lambda flips the sign of the MTP head's advantages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("detach", "ce", "policy", "occ")
# ``policy.megatron_cfg.mtp_occ_proxy`` (docs/guides/occ.md section 3): the reference's mean of per-token ratios, or
# the ratio of the token means (a least-squares slope of d on d_mtp; an ablation, not in the paper)
PROXIES = ("logprob_delta", "logprob_delta_ratio")


def _clamp(lam: float, lambda_max: float | None) -> float:
    return lam if lambda_max is None else max(-lambda_max, min(lam, lambda_max))


def occ_lambda(c: float, v2: float, lambda_plus: float, eps: float, lambda_max: float | None = None) -> float:
    """``lambda = lambda_plus * c / (v2 + eps)`` (signed), clamped to ``[-lambda_max, lambda_max]`` when given.

    Units: c in loss^2 / param^2 summed over parameters, v2 likewise; lambda dimensionless.

    Raises:
        ValueError: lambda_plus < 0, eps <= 0, v2 < 0 or lambda_max < 0.
    """
    if lambda_plus < 0 or eps <= 0 or v2 < 0 or (lambda_max is not None and lambda_max < 0):
        raise ValueError(
            f"need lambda_plus >= 0, eps > 0, v2 >= 0, lambda_max >= 0; got {lambda_plus}, {eps}, {v2}, {lambda_max}"
        )
    return _clamp(lambda_plus * float(c) / (float(v2) + eps), lambda_max)


def logprob_delta_lambda(
    mtp_logprobs: torch.Tensor,
    logprobs: torch.Tensor,
    prev_logprobs: torch.Tensor,
    valid: torch.Tensor,
    lambda_plus: float,
    num_heads: int,
    eps: float,
    lambda_max: float | None = None,
    ratio_of_means: bool = False,
) -> float:
    """OCC's coefficient lambda_k for MTP head k from observed log-prob changes (the RL-MTP reference's proxy).

    With ``d_mtp = mtp_logprobs - prev_logprobs`` and ``d = logprobs - prev_logprobs`` (log-probs of the same target
    token ``input_ids[b, s]``; ``prev_logprobs`` the main head's at the start of the GRPO step, which the reference
    subtracts from both heads):

        m_k      = sum_{valid} d * d_mtp / (d_mtp^2 + eps) / sum(valid)        (0 without valid tokens)
        lambda_k = clamp(lambda_plus * m_k / num_heads, -lambda_max, lambda_max)      (no clamp: lambda_max None)

    With ``ratio_of_means`` (``mtp_occ_proxy: logprob_delta_ratio``) the means are taken before the division:

        m_k      = (sum_{valid} d * d_mtp / sum(valid)) / (sum_{valid} d_mtp^2 / sum(valid) + eps)

    which is the least-squares slope of d on d_mtp: tokens where the MTP head agrees with the old main head
    (|d_mtp| small) no longer contribute the large ratios of either sign that decide the per-token mean.

    Per token, ``d * d_mtp`` estimates c (the main head moved toward what the MTP head predicts) and ``d_mtp^2`` v2.
    The reference averages over every slot of its [B, R] response block, padding included (whose terms are 0);
    here the mean is over the head's valid targets, which removes a dilution by the micro-batch's padding.
    ``lambda_k`` multiplies head k's advantages in its clipped PG loss. On the first (on-policy) optimizer
    mini-batch of a step ``d = 0`` and lambda_k = 0 (up to the ~1e-7 recomputation noise of ``logprobs``).

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
    if ratio_of_means:
        cov, var = float((weight * d_mtp * d).sum()) / count, float((weight * d_mtp * d_mtp).sum()) / count
        mean = cov / (var + eps)
    else:
        mean = float((weight * d_mtp * d / (d_mtp * d_mtp + eps)).sum()) / count
    return _clamp(lambda_plus * mean / num_heads, lambda_max)


@dataclass
class MTPCoefficient:
    """The coefficients lambda_k of the MTP heads' losses, per ``mtp_loss_mode`` (K heads):

    detach -> 1/K each (the heads' mean CE; the trunk never sees it); ce / policy -> ``scaling_factor / K``;
    occ -> :func:`logprob_delta_lambda` per head (``lambda_plus = scaling_factor``). The coefficient scales the
    whole head loss, so the MTP head and the trunk see the same lambda (as in the reference).

    Raises:
        ValueError: an unknown mode or proxy.
    """

    mode: str
    scaling_factor: float
    eps: float = 1e-8
    lambda_max: float | None = None
    proxy: str = "logprob_delta"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mtp_loss_mode={self.mode!r}; expected one of {MODES}")
        if self.proxy not in PROXIES:
            raise ValueError(f"mtp_occ_proxy={self.proxy!r}; expected one of {PROXIES}")

    def fixed(self, num_heads: int) -> list[float]:
        """Per-head coefficients of the modes with a fixed coefficient (occ: see :meth:`occ`)."""
        base = 1.0 if self.mode == "detach" else self.scaling_factor
        return [base / num_heads] * num_heads

    def occ(self, head_logprobs: list[tuple[torch.Tensor, torch.Tensor]], logprobs, prev_logprobs) -> list[float]:
        """OCC's lambda_k of every head from ``(mtp_logprobs, valid)`` pairs [B, S] and the main head's ``logprobs``
        / ``prev_logprobs`` [B, S] (:func:`logprob_delta_lambda`; its ValueError for shapes that disagree)."""
        k, ratio = len(head_logprobs), self.proxy == "logprob_delta_ratio"
        lam_plus, eps, lam_max = self.scaling_factor, self.eps, self.lambda_max
        return [
            logprob_delta_lambda(lp, logprobs, prev_logprobs, valid, lam_plus, k, eps, lam_max, ratio_of_means=ratio)
            for lp, valid in head_logprobs
        ]
