"""ClippedPGLossFn: hand-computed losses, gradients and metrics for every branch; micro-batch additivity."""

import math

import pytest
import torch

from nemo_rl_spec.algorithms.loss import ClippedPGLossFn, LossFunction, aggregate_microbatch_metrics

pytestmark = pytest.mark.numerics  # docs/design/numerical_tolerances.md

BASE_CFG = dict(
    ratio_clip_min=0.2,
    ratio_clip_max=0.28,
    token_level_loss=True,
    reference_policy_kl_penalty=0.0,
    reference_policy_kl_type="k3",
    use_importance_sampling_correction=False,
    truncated_importance_sampling_ratio=None,
)


def _cfg(**kw):
    return {**BASE_CFG, **kw}


EPS32 = torch.finfo(torch.float32).eps
LN2 = math.log(2)


def hand_tol(abs_sum: float, n_terms: int, per_term: int = 3) -> float:
    """Bound on |fp32 loss - hand value| (docs/design/numerical_tolerances.md): n_terms terms, each within
    ``per_term`` roundings (the fp32 input curr = prev + log r, the exp, the fp32 clip constant; k3 adds its two
    subtractions), the sum n_terms - 1 more and the normaliser 1, each at most eps times ``abs_sum``, the sum of the
    terms' absolute values (and of their parts) over the normaliser. The terms have both signs, so a relative
    tolerance on the (partly cancelling) result would not do."""
    return (n_terms - 1 + per_term + 1) * EPS32 * abs_sum


CLIP_ABS = 1.28 + 0.5 + 1.1 + 1.6 + 3.0  # sum of |term| of _clip_batch (docstring)
# The gradients have no sum over tokens: each element is -A r w / N (or the k3 one) within <= 5 roundings of itself,
# <= 5 eps |g| = 3.6e-7 for |g| <= 0.6 (k3: 4e-8 for |g| <= 0.067): hence atol 1e-6 (k3: 1e-7). Counts (clamped
# fractions) and maxima are exact up to the one rounding of the division.


def _clip_batch():
    """B=2, S=4, clip range [0.8, 1.28].

    row 0, A=+1, valid tokens 1..3, ratios 1.5 (clipped -> -1.28), 0.5 (pessimistic unclipped -> -0.5), 1.1 (-1.1)
    row 1, A=-2, valid tokens 2..3, ratios 0.5 (clipped: -min(-1.0, -1.6) = 1.6), 1.5 (unclipped: 3.0)
    """
    ratios = torch.tensor([[1.0, 1.5, 0.5, 1.1], [1.0, 1.0, 0.5, 1.5]], dtype=torch.float64)
    prev = torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, -0.7, -1.2, -3.0]])
    curr = (prev.double() + ratios.log()).float().requires_grad_(True)
    data = dict(
        prev_logprobs=prev,
        token_mask=torch.tensor([[0.0, 1, 1, 1], [0, 0, 1, 1]]),
        sample_mask=torch.ones(2),
        advantages=torch.tensor([1.0, -2.0]),
    )
    return curr, data


def test_protocol_is_satisfied():
    assert isinstance(ClippedPGLossFn(BASE_CFG), LossFunction)


def test_token_level_clipping_both_sides_loss_grad_metrics():
    curr, data = _clip_batch()
    loss, metrics = ClippedPGLossFn(_cfg())(curr, data, torch.tensor(5.0), torch.tensor(2.0))
    # (-1.28 - 0.5 - 1.1 + 1.6 + 3.0) / 5
    assert float(loss) == pytest.approx(1.72 / 5, abs=hand_tol(CLIP_ABS / 5, 5))
    loss.backward()
    # d/dcurr = -A * ratio / 5 where the unclipped term is active, 0 where the clipped one is (and off-mask)
    expected_grad = torch.tensor([[0.0, 0.0, -0.5 / 5, -1.1 / 5], [0.0, 0.0, 0.0, 2 * 1.5 / 5]])
    torch.testing.assert_close(curr.grad, expected_grad, rtol=0, atol=1e-6)
    assert metrics["probs_ratio"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.5 + 1.5) / 5, abs=hand_tol(5.1 / 5, 5))
    assert metrics["probs_ratio_clamped"] == pytest.approx(4 / 5, abs=1e-7)
    assert metrics["num_valid_tokens"] == 5.0 and metrics["num_valid_seqs"] == 2.0
    assert metrics["kl_penalty"] == 0.0
    assert metrics["is_weight"] == pytest.approx(1.0) and metrics["is_weight_max"] == 1.0
    assert metrics["loss"] == pytest.approx(float(loss))


def test_sequence_level_normalisation():
    curr, data = _clip_batch()
    loss, _ = ClippedPGLossFn(_cfg(token_level_loss=False))(curr, data, torch.tensor(5.0), torch.tensor(2.0))
    # row means: (-1.28 - 0.5 - 1.1) / 3 = -0.96, (1.6 + 3.0) / 2 = 2.3; (-0.96 + 2.3) / 2 seqs
    assert float(loss) == pytest.approx(0.67, abs=hand_tol((2.88 / 3 + 4.6 / 2) / 2, 5))
    loss.backward()
    expected_grad = torch.tensor([[0.0, 0.0, -0.5 / 3 / 2, -1.1 / 3 / 2], [0.0, 0.0, 0.0, 3.0 / 2 / 2]])
    torch.testing.assert_close(curr.grad, expected_grad, rtol=0, atol=1e-6)


def test_sample_mask_drops_a_sequence():
    curr, data = _clip_batch()
    data["sample_mask"] = torch.tensor([1.0, 0.0])
    loss, metrics = ClippedPGLossFn(_cfg())(curr, data, torch.tensor(3.0), torch.tensor(1.0))
    assert float(loss) == pytest.approx(-2.88 / 3, abs=hand_tol(2.88 / 3, 3))
    assert metrics["num_valid_tokens"] == 3.0
    loss_seq, _ = ClippedPGLossFn(_cfg(token_level_loss=False))(curr, data, torch.tensor(3.0), torch.tensor(1.0))
    assert float(loss_seq) == pytest.approx(-0.96, abs=hand_tol(2.88 / 3, 3))


def test_k3_kl_penalty_value_and_gradient():
    # ref - curr = [ln 2, -ln 2, 0]: k3 = (2 - ln2 - 1) + (0.5 + ln2 - 1) + 0 = 0.5 exactly; A = 0 isolates KL.
    curr = torch.tensor([[0.0, -1.0, -2.0, -0.5]], requires_grad=True)
    ref = curr.detach() + torch.tensor([[0.0, math.log(2), -math.log(2), 0.0]])
    data = dict(
        prev_logprobs=curr.detach().clone(),
        reference_policy_logprobs=ref,
        token_mask=torch.tensor([[0.0, 1, 1, 1]]),
        sample_mask=torch.ones(1),
        advantages=torch.zeros(1),
    )
    loss, metrics = ClippedPGLossFn(_cfg(reference_policy_kl_penalty=0.1))(
        curr, data, torch.tensor(3.0), torch.tensor(1.0)
    )
    kl_abs = 0.1 * ((2 + LN2 + 1) + (0.5 + LN2 + 1)) / 3  # beta (e^d + |d| + 1) over the 3 tokens
    assert float(loss) == pytest.approx(0.1 * 0.5 / 3, abs=hand_tol(kl_abs, 3, per_term=5))
    assert metrics["kl_penalty"] == pytest.approx(0.1 * 0.5 / 3, abs=hand_tol(kl_abs, 3, per_term=5))
    loss.backward()
    # NeMo-RL's KL gradient (its weight exp(curr - sg(curr)) = 1 keeps the score-function term, d = ref - curr):
    # d/dcurr beta * w * (e^d - d - 1) = beta * ((1 - e^d) + k3) / 3:  d = ln 2 -> -beta ln2 / 3, d = -ln 2 -> +
    expected_grad = torch.tensor([[0.0, -0.1 * LN2 / 3, 0.1 * LN2 / 3, 0.0]])
    torch.testing.assert_close(curr.grad, expected_grad, rtol=0, atol=1e-7)


def test_kl_adds_to_policy_gradient_term():
    curr, data = _clip_batch()
    # ref = curr + ln 2 on every valid token: k3 = 2 - ln 2 - 1 per token
    data["reference_policy_logprobs"] = curr.detach() + math.log(2)
    loss, metrics = ClippedPGLossFn(_cfg(reference_policy_kl_penalty=0.5))(
        curr, data, torch.tensor(5.0), torch.tensor(2.0)
    )
    k3 = 1 - math.log(2)
    kl_abs = 0.5 * (2 + LN2 + 1)  # per token: beta (e^d + |d| + 1), d = ln 2
    assert float(loss) == pytest.approx(1.72 / 5 + 0.5 * k3, abs=hand_tol(CLIP_ABS / 5 + kl_abs, 5, per_term=5))
    assert metrics["kl_penalty"] == pytest.approx(0.5 * k3, abs=hand_tol(kl_abs, 5, per_term=5))


@pytest.mark.parametrize("trunc,w0,expected_loss", [(2.0, 2.0, -3.5 / 3), (None, 3.0, -4.5 / 3)])
def test_importance_sampling_weight_truncation(trunc, w0, expected_loss):
    # prev - gen = [ln 3, ln 0.5, 0] -> w = [3 (or 2 truncated), 0.5, 1]; ratio 1, A = 1 -> pg = -1 per token
    prev = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    gen = prev - torch.tensor([[0.0, math.log(3), math.log(0.5), 0.0]])
    gen.requires_grad_(True)
    curr = prev.clone().requires_grad_(True)
    data = dict(
        prev_logprobs=prev,
        generation_logprobs=gen,
        token_mask=torch.tensor([[0.0, 1, 1, 1]]),
        sample_mask=torch.ones(1),
        advantages=torch.ones(1),
    )
    fn = ClippedPGLossFn(_cfg(use_importance_sampling_correction=True, truncated_importance_sampling_ratio=trunc))
    loss, metrics = fn(curr, data, torch.tensor(3.0), torch.tensor(1.0))
    assert float(loss) == pytest.approx(expected_loss, abs=hand_tol((w0 + 0.5 + 1.0) / 3, 3))
    assert metrics["is_weight"] == pytest.approx((w0 + 0.5 + 1.0) / 3, abs=hand_tol((w0 + 0.5 + 1.0) / 3, 3))
    assert metrics["is_weight_max"] == pytest.approx(w0, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(curr.grad, torch.tensor([[0.0, -w0 / 3, -0.5 / 3, -1 / 3]]), rtol=0, atol=1e-6)
    assert gen.grad is None  # the weight is detached


def test_importance_sampling_off_ignores_generation_logprobs():
    curr, data = _clip_batch()
    data["generation_logprobs"] = torch.full_like(data["prev_logprobs"], -50.0)
    loss, metrics = ClippedPGLossFn(_cfg())(curr, data, torch.tensor(5.0), torch.tensor(2.0))
    assert float(loss) == pytest.approx(1.72 / 5, abs=hand_tol(CLIP_ABS / 5, 5))
    assert metrics["is_weight_max"] == 1.0


def test_padding_garbage_cannot_produce_nan():
    curr, data = _clip_batch()
    with torch.no_grad():
        data["prev_logprobs"][1, 0] = -1e4  # masked position: exp(curr - prev) would overflow
    data["reference_policy_logprobs"] = curr.detach().clone()
    data["reference_policy_logprobs"][0, 0] = 1e4
    loss, _ = ClippedPGLossFn(_cfg(reference_policy_kl_penalty=0.1))(curr, data, torch.tensor(5.0), torch.tensor(2.0))
    assert float(loss) == pytest.approx(1.72 / 5, abs=hand_tol(CLIP_ABS / 5, 5))


@pytest.mark.parametrize("token_level", [True, False])
def test_microbatches_with_global_normalisers_sum_to_full_batch(token_level):
    g = torch.Generator().manual_seed(123)
    B, S = 6, 7
    prev = -torch.rand(B, S, generator=g) * 3
    curr_full = (prev + 0.4 * torch.randn(B, S, generator=g)).requires_grad_(True)
    token_mask = (torch.rand(B, S, generator=g) > 0.3).float()
    token_mask[:, 0] = 0
    data = dict(
        prev_logprobs=prev,
        generation_logprobs=prev + 0.3 * torch.randn(B, S, generator=g),
        reference_policy_logprobs=prev + 0.2 * torch.randn(B, S, generator=g),
        token_mask=token_mask,
        sample_mask=torch.tensor([1.0, 1, 0, 1, 1, 1]),
        advantages=torch.randn(B, generator=g),
    )
    fn = ClippedPGLossFn(
        _cfg(
            token_level_loss=token_level,
            reference_policy_kl_penalty=0.05,
            use_importance_sampling_correction=True,
            truncated_importance_sampling_ratio=1.5,
        )
    )
    toks = (token_mask * data["sample_mask"][:, None]).sum()
    seqs = data["sample_mask"].sum()
    full_loss, full_metrics = fn(curr_full, data, toks, seqs)
    full_loss.backward()

    curr_mb = curr_full.detach().clone().requires_grad_(True)
    parts, metrics = [], []
    for rows in (slice(0, 2), slice(2, 6)):
        loss, m = fn(curr_mb[rows], {k: v[rows] for k, v in data.items()}, toks, seqs)
        loss.backward()
        parts.append(loss.detach())
        metrics.append(m)
    # Bound (docs/design/numerical_tolerances.md; eps = float32 eps). The loss is one sum of the n valid
    # per-token terms (w * pg + kl, over the normaliser) on the whole batch and two partial sums added on the
    # micro-batches: two summation orders differ by <= 2 n eps sum |terms| (each is within gamma_{n-1} of the exact
    # sum). |term| <= w |A| max(r, clip(r)) + kl (kl >= 0), over the same normaliser. The gradient has no sum over
    # tokens: each element is the same chain of <= 8 elementwise roundings on both sides (sub, exp, products with A
    # and w, the normaliser, the k3 terms), so |d grad| <= 8 eps (|d pg/d curr| + |d kl/d curr|), with
    # |d pg/d curr| <= w |A| r and |d kl/d curr| <= beta (1 + e^(ref - curr)) over the normaliser. The metrics are
    # sums of n terms >= 0 (ratios, weights, k3, counts), or maxima: rel 2 n eps. The control below: a micro-batch
    # divided by its own token or sequence count instead of the global one is caught (~1e-1 here, vs ~1e-5).
    eps = torch.finfo(torch.float32).eps
    with torch.no_grad():
        ratio = (curr_full - prev).exp()
        weight = (prev - data["generation_logprobs"]).exp().clamp(max=1.5)
        ref_minus_curr = data["reference_policy_logprobs"] - curr_full
        k3 = ref_minus_curr.exp() - ref_minus_curr - 1
        adv = data["advantages"].abs()[:, None]
        term = weight * adv * torch.maximum(ratio, ratio.clamp(0.8, 1.28)) + 0.05 * k3
        grad_mag = weight * adv * ratio + 0.05 * (1 + ref_minus_curr.exp())
        mask = token_mask * data["sample_mask"][:, None]
        if token_level:
            per_token_norm = mask / toks
        else:
            per_token_norm = mask / token_mask.sum(-1, keepdim=True).clamp(min=1) / seqs
        n = int(mask.sum())
        loss_tol = 2 * n * eps * float((term * per_token_norm).sum())
        grad_tol = 8 * eps * grad_mag * per_token_norm
    torch.testing.assert_close(parts[0] + parts[1], full_loss.detach(), rtol=0, atol=loss_tol)
    assert ((curr_mb.grad - curr_full.grad).abs() <= grad_tol).all()
    agg = aggregate_microbatch_metrics(metrics)
    for key, value in full_metrics.items():
        assert agg[key] == pytest.approx(value, rel=2 * n * eps, abs=loss_tol if key == "loss" else 0.0), key


def test_config_errors():
    with pytest.raises(KeyError, match="ratio_clip_max"):
        ClippedPGLossFn({k: v for k, v in BASE_CFG.items() if k != "ratio_clip_max"})
    with pytest.raises(ValueError, match="k3"):
        ClippedPGLossFn(_cfg(reference_policy_kl_type="k4"))
    with pytest.raises(ValueError, match="truncated"):
        ClippedPGLossFn(_cfg(truncated_importance_sampling_ratio=0.0))


def test_missing_tensor_for_enabled_branch_raises():
    curr, data = _clip_batch()
    with pytest.raises(KeyError, match="reference_policy_logprobs"):
        ClippedPGLossFn(_cfg(reference_policy_kl_penalty=0.1))(curr, data, torch.tensor(5.0), torch.tensor(2.0))
    with pytest.raises(KeyError, match="generation_logprobs"):
        ClippedPGLossFn(_cfg(use_importance_sampling_correction=True))(curr, data, torch.tensor(5.0), torch.tensor(2.0))
