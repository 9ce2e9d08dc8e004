"""NeMo-RL loss options by hand on small tensors: dual clip (``ratio_clip_c``), GSPO
(``sequence_level_importance_ratios``) against its paper's formula, ``use_on_policy_kl_approximation``; and the
config keys of the loss and the LR scheduler refused with their names before any worker starts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from nemo_rl_spec.algorithms.loss import ClippedPGLossFn
from nemo_rl_spec.utils.config import ConfigError, load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_tiny.yaml"
BASE = dict(
    ratio_clip_min=0.2,
    ratio_clip_max=0.2,
    token_level_loss=True,
    reference_policy_kl_penalty=0.0,
    reference_policy_kl_type="k3",
    use_importance_sampling_correction=False,
    truncated_importance_sampling_ratio=None,
)


EPS32 = torch.finfo(torch.float32).eps


def hand_tol(abs_sum: float, n_terms: int, per_term: int = 3) -> float:
    """|fp32 loss - hand value| bound (docs/design/numerical_tolerances.md): each of n_terms terms within
    ``per_term`` roundings (the fp32 log-ratio input, the exp, the product with A or a clip constant), the sum
    n_terms - 1 more and the normaliser 1, each at most eps times ``abs_sum`` (the sum of |term| and of the parts
    inside a term, over the normaliser). The losses below cancel (+-A terms, e^d - d - 1), so a relative tolerance
    on the result is far below this; the gradients are single terms (relative 1e-6 > 5 eps)."""
    return (n_terms - 1 + per_term + 1) * EPS32 * abs_sum


def _batch(log_ratio: list[list[float]], advantages: list[float], token_mask: list[list[float]] | None = None):
    """prev = 0, curr = log_ratio (a leaf with grad); returns (curr, mb)."""
    curr = torch.tensor(log_ratio, requires_grad=True)
    mask = torch.ones_like(curr) if token_mask is None else torch.tensor(token_mask)
    mb = {
        "prev_logprobs": torch.zeros_like(curr),
        "token_mask": mask,
        "sample_mask": torch.ones(curr.shape[0]),
        "advantages": torch.tensor(advantages),
        "generation_logprobs": torch.zeros_like(curr),
    }
    return curr, mb


@pytest.mark.numerics
def test_dual_clip_by_hand():
    ratios = [[3.5, 0.5, 1.1], [3.5, 0.5, 1.05]]
    curr, mb = _batch([[math.log(r) for r in row] for row in ratios], [-1.0, 2.0])
    loss, metrics = ClippedPGLossFn({**BASE, "ratio_clip_c": 3.0})(curr, mb, torch.tensor(6.0), torch.tensor(2.0))
    # A = -1: max(3.5, 1.2) = 3.5 -> min(3.5, 3) = 3 (dual clip); max(0.5, 0.8) = 0.8; max(1.1, 1.1) = 1.1
    # A = +2: -min(7, 2.4) = -2.4; -min(1, 1.6) = -1; -2.1 (dual clip never acts on positive advantages)
    dual_abs = (3.0 + 0.8 + 1.1 + 2.4 + 1.0 + 2.1) / 6
    assert float(loss) == pytest.approx((3.0 + 0.8 + 1.1 - 2.4 - 1.0 - 2.1) / 6, abs=hand_tol(dual_abs, 6))
    assert metrics["dual_clip_fraction"] == pytest.approx(1 / 6)
    loss.backward()
    assert curr.grad[0, 0] == 0.0  # the dual-clipped token's bound -c * A has no gradient
    assert curr.grad[0, 2] == pytest.approx(1.1 / 6, rel=1e-6)  # d(-A r)/d log r = -A r / N
    plain, _ = ClippedPGLossFn(BASE)(
        *_batch([[math.log(r) for r in row] for row in ratios], [-1.0, 2.0]), torch.tensor(6.0), torch.tensor(2.0)
    )
    plain_abs = (3.5 + 0.8 + 1.1 + 2.4 + 1.0 + 2.1) / 6
    assert float(plain) == pytest.approx((3.5 + 0.8 + 1.1 - 2.4 - 1.0 - 2.1) / 6, abs=hand_tol(plain_abs, 6))


@pytest.mark.numerics
def test_gspo_matches_paper_formula():
    log_ratio = [[0.3, -0.1, 5.0], [0.6, 0.4, 0.5]]
    token_mask = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    advantages = [1.0, -1.0]
    cfg = {**BASE, "token_level_loss": False, "sequence_level_importance_ratios": True}
    curr, mb = _batch(log_ratio, advantages, token_mask)
    loss, metrics = ClippedPGLossFn(cfg)(curr, mb, torch.tensor(5.0), torch.tensor(2.0))
    # GSPO eq. 7: s_i = (pi_theta(y_i) / pi_old(y_i)) ** (1 / |y_i|), the sequence probability ratio from products
    s = [
        math.prod(math.exp(lr) for lr, m in zip(row, mrow) if m) ** (1 / sum(mrow))
        for row, mrow in zip(log_ratio, token_mask)
    ]
    assert s == pytest.approx([math.exp(0.1), math.exp(0.5)], rel=1e-12)
    # J = 1/G sum_i min(s_i A_i, clip(s_i, 0.8, 1.2) A_i); loss = -J
    expected = -sum(min(si * a, min(max(si, 0.8), 1.2) * a) for si, a in zip(s, advantages)) / 2
    # s_i = exp(mean of <= 3 fp32 log-ratios): <= 5 roundings of s_i (inputs, sum, division, exp)
    assert float(loss) == pytest.approx(expected, abs=hand_tol(sum(s) / 2, 2, per_term=5))
    assert metrics["probs_ratio"] == pytest.approx((2 * s[0] + 3 * s[1]) / 5, abs=hand_tol(sum(s) * 3 / 5, 5, 5))
    loss.backward()
    # gradient (GSPO eq. 10): row 0 unclipped, d(-s A / G)/d log pi_t = -A s / (G |y|); masked token 0
    assert curr.grad[0].tolist() == pytest.approx([-s[0] / 4, -s[0] / 4, 0.0], rel=1e-6)
    assert curr.grad[1].tolist() == pytest.approx([s[1] / 6] * 3, rel=1e-6)  # A < 0, s > 1.2: unclipped branch


@pytest.mark.numerics
def test_on_policy_kl_approximation_by_hand():
    curr, mb = _batch([[-1.0, -2.0]], [0.0])
    mb["reference_policy_logprobs"] = torch.tensor([[-1.5, -1.0]])
    mb["generation_logprobs"] = torch.tensor([[-1.2, -2.5]])
    cfg = {**BASE, "reference_policy_kl_penalty": 0.1}
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 1.0)]  # ref - curr
    w = [math.exp(0.2), math.exp(0.5)]  # curr - generation
    plain, _ = ClippedPGLossFn(cfg)(curr, mb, torch.tensor(2.0), torch.tensor(1.0))
    weighted, metrics = ClippedPGLossFn({**cfg, "use_on_policy_kl_approximation": True})(
        curr, mb, torch.tensor(2.0), torch.tensor(1.0)
    )
    parts = [math.exp(d) + abs(d) + 1 for d in (-0.5, 1.0)]  # k3 = e^d - d - 1 cancels: its parts set the bound
    assert float(plain) == pytest.approx(0.1 * sum(k3) / 2, abs=hand_tol(0.1 * sum(parts) / 2, 2, per_term=5))
    weighted_abs = 0.1 * (w[0] * parts[0] + w[1] * parts[1]) / 2
    assert float(weighted) == pytest.approx(
        0.1 * (w[0] * k3[0] + w[1] * k3[1]) / 2, abs=hand_tol(weighted_abs, 2, per_term=7)
    )
    assert metrics["kl_penalty"] == pytest.approx(float(weighted), rel=1e-6)


@pytest.mark.parametrize(
    "override, key",
    [
        ("+loss_fn.ratio_clip_c=1.0", "loss_fn.ratio_clip_c"),
        ("+loss_fn.sequence_level_importance_ratios=true", "loss_fn.sequence_level_importance_ratios"),
        ("+policy.megatron_cfg.scheduler.lr_decay_style=cosine", "policy.megatron_cfg.scheduler.lr_decay_iters"),
        ("+policy.megatron_cfg.scheduler.lr_decay_style=exponential", "policy.megatron_cfg.scheduler.lr_decay_style"),
        ("+policy.megatron_cfg.scheduler.lr_warmup_init=1.0", "policy.megatron_cfg.scheduler.lr_warmup_init"),
        ("+policy.megatron_cfg.optimizer.min_lr=1.0", "policy.megatron_cfg.optimizer.min_lr"),
        (
            "+policy.megatron_cfg.scheduler={lr_warmup_iters: 5, lr_decay_iters: 5}",
            "policy.megatron_cfg.scheduler.lr_decay_iters",
        ),
        ("+policy.megatron_cfg.scheduler.end_weight_decay=0.1", "end_weight_decay"),
    ],
)
def test_bad_parity_keys_name_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override])
    assert key in str(info.value)


def test_parity_keys_load():
    cfg = load_config(
        TINY,
        [
            "+loss_fn.ratio_clip_c=3.0",
            "+policy.megatron_cfg.optimizer.min_lr=1e-7",
            "+policy.megatron_cfg.scheduler={lr_warmup_iters: 2, lr_decay_style: linear, lr_decay_iters: 10}",
        ],
    )
    assert cfg.loss_fn.ratio_clip_c == 3.0 and cfg.policy.megatron_cfg.scheduler.lr_decay_iters == 10
    ClippedPGLossFn(cfg.loss_fn.model_dump())  # the loss takes the validated section
