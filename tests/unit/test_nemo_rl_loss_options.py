"""NeMo-RL's loss options by hand (``ClippedPGLossFn`` of NVIDIA-NeMo/RL 7ea279ab; docs/guides/grpo.md, loss
options): the k1 / k2 / k3 KL estimators and their input / output clamps, tis / icepop / seq-mask-tis truncated
importance sampling, CISPO, ``disable_ppo_ratio``, ``force_on_policy_ratio``, the positive-example NLL, each with
its value and gradient written out on tiny tensors; and the combinations the config refuses, named by key."""

from __future__ import annotations

import math
import os

import pytest
import torch

from nemo_rl_spec.algorithms.loss import ClippedPGLossFn
from nemo_rl_spec.utils.config import ConfigError, load_config

pytestmark = pytest.mark.numerics

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs")
BASE = dict(
    ratio_clip_min=0.2,
    ratio_clip_max=0.28,
    token_level_loss=True,
    reference_policy_kl_penalty=0.0,
    reference_policy_kl_type="k3",
    use_importance_sampling_correction=False,
    truncated_importance_sampling_ratio=None,
)
# fp32 inputs and a handful of elementwise roundings per term: every value below is O(1), so rel 1e-6 (~8 eps) with
# a 1e-7 floor for zeros is tight (a broken variant moves the values by >= 1e-2)
REL, ABS = 1e-6, 1e-7


def _fn(**kw) -> ClippedPGLossFn:
    return ClippedPGLossFn({**BASE, **kw})


def _grad(loss: torch.Tensor, curr: torch.Tensor) -> list[list[float]]:
    (g,) = torch.autograd.grad(loss, curr)
    return g.tolist()


def _approx(values):
    return pytest.approx(values, rel=REL, abs=ABS)


# ---- KL estimators and clamps ---------------------------------------------------------------------------------------
D = [0.0, 1.0, -2.0, 0.5]  # d = ref - curr; token 0 masked
BETA = 0.5


def _kl_batch():
    """One row, tokens 1..3 valid, A = 0 (the KL term alone), curr a leaf; ref = curr + D."""
    curr = torch.tensor([[-0.3, -1.0, -2.0, -0.7]], requires_grad=True)
    data = dict(
        prev_logprobs=curr.detach().clone(),
        reference_policy_logprobs=curr.detach() + torch.tensor([D]),
        generation_logprobs=curr.detach().clone(),
        token_mask=torch.tensor([[0.0, 1, 1, 1]]),
        sample_mask=torch.ones(1),
        advantages=torch.zeros(1),
    )
    return curr, data


# per valid token (d = 1, -2, 0.5): the estimate k(d) and the gradient of w * k w.r.t. curr, w = exp(curr - sg(curr))
# = 1 (NeMo-RL's weight: d/dcurr (w k) = k - dk/dd). k1 = -d: grad 1 - d; k2 = d^2/2: grad d^2/2 - d;
# k3 = e^d - d - 1: grad (e^d - d - 1) - (e^d - 1) = -d.
E = math.e
KL_CASES = {
    "k1": ([-1.0, 2.0, -0.5], [0.0, 3.0, 0.5]),
    "k2": ([0.5, 2.0, 0.125], [-0.5, 4.0, -0.375]),
    "k3": ([E - 2, E**-2 + 1, E**0.5 - 1.5], [-1.0, 2.0, -0.5]),
}


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_kl_estimators_by_hand(kl_type):
    k, g = KL_CASES[kl_type]
    curr, data = _kl_batch()
    fn = _fn(
        reference_policy_kl_penalty=BETA,
        reference_policy_kl_type=kl_type,
        kl_input_clamp_value=None,
        kl_output_clamp_value=None,
    )
    loss, metrics = fn(curr, data, torch.tensor(3.0), torch.tensor(1.0))
    assert float(loss) == _approx(BETA * sum(k) / 3)
    assert metrics["kl_penalty"] == _approx(BETA * sum(k) / 3)
    assert _grad(loss, curr) == [_approx([0.0] + [BETA * x / 3 for x in g])]


def test_kl_input_clamp_clamps_d_and_detaches_the_weight():
    # clamp 1.5: d = -2 -> -1.5, k3 = e^-1.5 + 0.5; that token's gradient is 0 (clamped d, detached weight)
    curr, data = _kl_batch()
    fn = _fn(reference_policy_kl_penalty=BETA, kl_input_clamp_value=1.5, kl_output_clamp_value=None)
    loss, _ = fn(curr, data, torch.tensor(3.0), torch.tensor(1.0))
    k = [E - 2, E**-1.5 + 0.5, E**0.5 - 1.5]
    assert float(loss) == _approx(BETA * sum(k) / 3)
    assert _grad(loss, curr) == [_approx([0.0, -BETA / 3, 0.0, -0.5 * BETA / 3])]


def test_kl_input_clamp_detaches_the_on_policy_weight_too():
    # use_on_policy_kl_approximation: w = exp(curr - gen) = [e^0.2, e^-0.1, e^0.3] carries d/dcurr w = w; on the
    # clamped token (d = -2 -> -1.5) it is detached: gradient 0 there, w * (k - dk/dd) = w * (-d) elsewhere (k3)
    curr, data = _kl_batch()
    data["generation_logprobs"] = curr.detach() - torch.tensor([[0.0, 0.2, -0.1, 0.3]])
    w = [E**0.2, E**-0.1, E**0.3]
    fn = _fn(reference_policy_kl_penalty=BETA, use_on_policy_kl_approximation=True, kl_input_clamp_value=1.5)
    loss, _ = fn(curr, data, torch.tensor(3.0), torch.tensor(1.0))
    k = [E - 2, E**-1.5 + 0.5, E**0.5 - 1.5]
    assert float(loss) == _approx(BETA * sum(wi * ki for wi, ki in zip(w, k)) / 3)
    assert _grad(loss, curr) == [_approx([0.0, -BETA * w[0] / 3, 0.0, -0.5 * BETA * w[2] / 3])]


def test_kl_output_clamp_acts_on_the_weighted_estimate_before_the_penalty():
    # clamp 1.0: k3(-2) = 1.135 -> 1.0 (gradient 0); beta * k3 = 0.57 < 1 would not be clamped: the clamp is on
    # w * k, before beta
    curr, data = _kl_batch()
    fn = _fn(reference_policy_kl_penalty=BETA, kl_input_clamp_value=None, kl_output_clamp_value=1.0)
    loss, _ = fn(curr, data, torch.tensor(3.0), torch.tensor(1.0))
    assert float(loss) == _approx(BETA * (E - 2 + 1.0 + E**0.5 - 1.5) / 3)
    assert _grad(loss, curr) == [_approx([0.0, -BETA / 3, 0.0, -0.5 * BETA / 3])]


def test_nemo_rl_default_clamps_leave_moderate_values_alone():
    curr, data = _kl_batch()
    loss, _ = _fn(reference_policy_kl_penalty=BETA)(curr, data, torch.tensor(3.0), torch.tensor(1.0))
    assert float(loss) == _approx(BETA * sum(KL_CASES["k3"][0]) / 3)


# ---- truncated importance sampling ----------------------------------------------------------------------------------
# u = exp(prev - gen) per valid token (3 rows; row 2 has 2 valid tokens; the padding has u = e^50):
U = [[0.25, 1.0, 4.0], [0.5, 2.0, 8.0], [4.0, 4.0]]
N_TOK = 8
# geometric means 1, 2, 4 (arithmetic 1.75, 3.5, 4); bounds [lo, hi] = [0.5, 3]; ratio 1 and A = 1: pg = -1, so
# loss = -sum(w) / 8 and d loss / d curr = -w / 8
TIS_CASES = {
    # type: (w per valid token, is_oob_ratio: of the 8 tokens, or of the 3 sequences for seq-mask-tis)
    "tis": ([[0.5, 1, 3], [0.5, 2, 3], [3, 3]], 5 / 8),
    "icepop": ([[0, 1, 0], [0.5, 2, 0], [0, 0]], 5 / 8),
    "seq-mask-tis": ([U[0], U[1], [0, 0]], 1 / 3),  # row 2 (geo mean 4 > 3) dropped, others keep raw u
}


def _padded(rows: list[list[float]], pad: float) -> list[list[float]]:
    return [row + [pad] * (4 - len(row)) for row in rows]


def _tis_batch():
    prev = torch.tensor([[-1.0, -2.0, -0.5, -1.0], [-0.2, -3.0, -1.5, -2.0], [-1.0, -1.0, -1.0, -1.0]])
    log_u = torch.tensor(_padded([[math.log(x) for x in row] for row in U], 50.0))
    curr = prev.clone().requires_grad_(True)
    data = dict(
        prev_logprobs=prev,
        generation_logprobs=prev - log_u,
        token_mask=torch.tensor(_padded([[1.0] * len(row) for row in U], 0.0)),
        sample_mask=torch.ones(3),
        advantages=torch.ones(3),
    )
    return curr, data


def _tis_fn(kind, lo=0.5):
    return _fn(
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type=kind,
        truncated_importance_sampling_ratio=3.0,
        truncated_importance_sampling_ratio_min=lo,
    )


ROWS = (slice(0, 2), slice(2, 3))
TOKS, SEQS = torch.tensor(float(N_TOK)), torch.tensor(3.0)


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
def test_truncated_importance_sampling_types_by_hand(kind):
    w, oob = TIS_CASES[kind]
    curr, data = _tis_batch()
    fn = _tis_fn(kind)
    loss, metrics = fn(curr, data, TOKS, SEQS)
    assert float(loss) == _approx(-sum(map(sum, w)) / N_TOK)
    assert metrics["is_oob_ratio"] == _approx(oob)
    assert _grad(loss, curr) == [_approx([-x / N_TOK for x in row]) for row in _padded(w, 0.0)]
    # micro-batches (rows 0-1, row 2) with the global counts sum to the full batch, is_oob_ratio included
    parts = [fn(curr[r], {k: v[r] for k, v in data.items()}, TOKS, SEQS) for r in ROWS]
    assert sum(float(p[0]) for p in parts) == _approx(float(loss))
    assert sum(p[1]["is_oob_ratio"] for p in parts) == _approx(oob)


def test_tis_without_lower_bound_and_a_ratio_without_type():
    # tis's lower bound defaults to 0: w = clamp(u, max=3); a ratio with type null is tis too (this project's
    # truncated_importance_sampling_ratio alone; NeMo-RL requires the type)
    w = [[0.25, 1, 3], [0.5, 2, 3], [3, 3]]
    for kind in ("tis", None):
        curr, data = _tis_batch()
        loss, metrics = _tis_fn(kind, lo=None)(curr, data, TOKS, SEQS)
        assert float(loss) == _approx(-sum(map(sum, w)) / N_TOK)
        assert metrics["is_oob_ratio"] == _approx(4 / N_TOK)  # u > 3: 4, 8, 4, 4
    loss, metrics = _fn(use_importance_sampling_correction=True)(curr, data, TOKS, SEQS)
    assert float(loss) == _approx(-sum(map(sum, U)) / N_TOK) and "is_oob_ratio" not in metrics


# ---- CISPO, disable_ppo_ratio, force_on_policy_ratio -----------------------------------------------------------------
def _ratio_batch(ratios: list[float], advantage: float):
    """One row of valid tokens with curr = [-1, -2, -0.5] and prev = curr - ln r."""
    curr = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    prev = curr.detach() - torch.tensor([[math.log(r) for r in ratios]])
    data = dict(
        prev_logprobs=prev,
        generation_logprobs=prev.clone(),
        token_mask=torch.ones(1, 3),
        sample_mask=torch.ones(1),
        advantages=torch.tensor([advantage]),
    )
    return curr, data


def test_cispo_by_hand():
    # r = [1.5, 1, 0.5], clip to [0.8, 1.28] -> [1.28, 1, 0.8]; A = 2: pg = -A sg(clip r) curr = [2.56, 4, 0.8];
    # gradient -A clip(r) / 3 (the clipped weight is a constant: no d r / d curr term, clipped or not)
    curr, data = _ratio_batch([1.5, 1.0, 0.5], 2.0)
    loss, metrics = _fn(use_cispo=True)(curr, data, torch.tensor(3.0), torch.tensor(1.0))
    assert float(loss) == _approx((2.56 + 4.0 + 0.8) / 3)
    assert metrics["probs_ratio_clamped"] == _approx(2 / 3)
    assert _grad(loss, curr) == [_approx([-2 * 1.28 / 3, -2 / 3, -2 * 0.8 / 3])]


def test_disable_ppo_ratio_is_reinforce_on_log_probs():
    # pg = -A curr whatever prev is (rows A = 1, -0.5): loss = -(1*(-1) + 1*(-2) + (-0.5)(-0.5) + (-0.5)(-3)) / 4
    # = 0.3125; gradient -A / 4
    curr = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    data = dict(
        prev_logprobs=torch.tensor([[-4.0, 0.0], [-0.1, -9.0]]),
        token_mask=torch.ones(2, 2),
        sample_mask=torch.ones(2),
        advantages=torch.tensor([1.0, -0.5]),
    )
    loss, metrics = _fn(disable_ppo_ratio=True)(curr, data, torch.tensor(4.0), torch.tensor(2.0))
    assert float(loss) == _approx(0.3125)
    assert metrics["probs_ratio_clamped"] == 0.0
    assert _grad(loss, curr) == [_approx([-0.25, -0.25]), _approx([0.125, 0.125])]


def test_force_on_policy_ratio_ignores_prev():
    # prev far off (ratios e^4 and e^-2 would be clipped) is replaced by sg(curr): r = 1, pg = -A = -1.5 per token,
    # gradient -A / 2; with IS correction the weight is exp(curr - gen) = 2 (prev := curr there too)
    curr, data = _ratio_batch([math.exp(-4.0), math.exp(2.0), 1.0], 1.5)
    loss, metrics = _fn(force_on_policy_ratio=True)(curr, data, torch.tensor(3.0), torch.tensor(1.0))
    assert float(loss) == _approx(-1.5)
    assert (metrics["probs_ratio"], metrics["probs_ratio_clamped"]) == (_approx(1.0), 0.0)
    assert _grad(loss, curr) == [_approx([-0.5, -0.5, -0.5])]
    data["generation_logprobs"] = curr.detach() - math.log(2.0)
    fn = _fn(force_on_policy_ratio=True, use_importance_sampling_correction=True)
    loss, _ = fn(curr, data, torch.tensor(3.0), torch.tensor(1.0))
    assert float(loss) == _approx(-3.0)
    assert _grad(loss, curr) == [_approx([-1.0, -1.0, -1.0])]


# ---- positive-example NLL --------------------------------------------------------------------------------------------
def test_positive_example_nll_by_hand():
    # rewards [1, 0, 0.5, 2]: rows 0 and 2 count (row 3 is sample-masked); their valid tokens -1, -2, -0.5, -1.5:
    # NLL = 5 / 4 = 1.25, a mean over this micro-batch's 4 such tokens whatever global_valid_toks is (NeMo-RL);
    # A = 0, so loss = 0.1 * 1.25 and the gradient is -0.1 / 4 on those tokens
    curr = torch.tensor(
        [[-1.0, -2.0, -7.0], [-3.0, -4.0, -5.0], [-0.5, -1.5, -2.5], [-0.1, -0.2, -0.3]], requires_grad=True
    )
    data = dict(
        prev_logprobs=curr.detach().clone(),
        token_mask=torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]]),
        sample_mask=torch.tensor([1.0, 1, 1, 0]),
        advantages=torch.zeros(4),
        rewards=torch.tensor([1.0, 0.0, 0.5, 2.0]),
    )
    loss, metrics = _fn(positive_example_nll_weight=0.1)(curr, data, torch.tensor(9.0), torch.tensor(3.0))
    assert float(loss) == _approx(0.125)
    assert metrics["positive_nll_loss"] == _approx(1.25)
    g = -0.1 / 4
    assert _grad(loss, curr) == [_approx([g, g, 0]), _approx([0, 0, 0]), _approx([g, g, 0]), _approx([0, 0, 0])]
    data["rewards"] = torch.zeros(4)  # no positive example: the term is 0
    assert float(_fn(positive_example_nll_weight=0.1)(curr, data, torch.tensor(9.0), torch.tensor(3.0))[0]) == 0.0
    assert "positive_nll_loss" not in _fn()(curr, data, torch.tensor(9.0), torch.tensor(3.0))[1]


def test_per_token_advantages_broadcast_like_per_row():
    curr, data = _ratio_batch([1.5, 1.0, 0.5], -1.0)
    per_row, _ = _fn()(curr, data, torch.tensor(3.0), torch.tensor(1.0))
    per_token, _ = _fn()(curr, {**data, "advantages": torch.full((1, 3), -1.0)}, torch.tensor(3.0), torch.tensor(1.0))
    assert float(per_token) == float(per_row)


# ---- refusals --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(use_cispo=True, disable_ppo_ratio=True), "loss_fn.disable_ppo_ratio"),
        (dict(use_cispo=True, force_on_policy_ratio=True), "loss_fn.force_on_policy_ratio"),
        (dict(use_cispo=True, ratio_clip_c=3.0), "loss_fn.ratio_clip_c"),
        (dict(use_cispo=True, token_level_loss=False), "loss_fn.token_level_loss"),
        (dict(force_on_policy_ratio=True, disable_ppo_ratio=True), "loss_fn.force_on_policy_ratio"),
        (dict(truncated_importance_sampling_type="tis", truncated_importance_sampling_ratio=2.0), "use_importance"),
        (dict(use_importance_sampling_correction=True, truncated_importance_sampling_type="tis"), "_ratio (the upper"),
        (
            dict(
                use_importance_sampling_correction=True,
                truncated_importance_sampling_type="icepop",
                truncated_importance_sampling_ratio=2.0,
            ),
            "truncated_importance_sampling_ratio_min",
        ),
        (
            dict(truncated_importance_sampling_ratio=2.0, truncated_importance_sampling_ratio_min=3.0),
            "loss_fn.truncated_importance_sampling_ratio_min=3.0 exceeds",
        ),
        (dict(truncated_importance_sampling_ratio_min=0.5), "loss_fn.truncated_importance_sampling_ratio_min"),
        (
            dict(
                use_importance_sampling_correction=True,
                truncated_importance_sampling_type="seq-mask-tis",
                truncated_importance_sampling_ratio=2.0,
                truncated_importance_sampling_ratio_min=0.5,
                token_level_loss=False,
                sequence_level_importance_ratios=True,
            ),
            "sequence_level_importance_ratios",
        ),
        (dict(reference_policy_kl_type="k4"), "loss_fn.reference_policy_kl_type"),
        (dict(kl_input_clamp_value=0.0), "loss_fn.kl_input_clamp_value"),
        (dict(positive_example_nll_weight=-0.1), "loss_fn.positive_example_nll_weight"),
    ],
)
def test_invalid_loss_options_are_refused_by_key(overrides, key):
    with pytest.raises(ValueError, match="invalid loss_fn") as info:
        _fn(**overrides)
    assert key in str(info.value)


def test_loop_level_refusals_name_the_key():
    tiny, mtp = os.path.join(CONFIGS, "grpo_math_tiny.yaml"), os.path.join(CONFIGS, "grpo_math_tiny_mtp.yaml")
    with pytest.raises(ConfigError, match="loss_fn.force_on_policy_ratio=true needs policy.train_global_batch_size"):
        load_config(tiny, ["loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=4"])
    assert load_config(tiny, ["loss_fn.force_on_policy_ratio=true"]).loss_fn.force_on_policy_ratio  # 2 x 4 = 8
    for key in ("positive_example_nll_weight=0.1", "force_on_policy_ratio=true"):
        for mode in ("policy", "occ"):
            with pytest.raises(ConfigError, match=f"loss_fn.{key.split('=')[0]} is not supported"):
                load_config(mtp, [f"loss_fn.{key}", f"policy.megatron_cfg.mtp_loss_mode={mode}"])
    # the heads' CE modes (and every other loss option) train as usual
    cfg = load_config(mtp, ["loss_fn.positive_example_nll_weight=0.1", "policy.megatron_cfg.mtp_loss_mode=ce"])
    assert cfg.loss_fn.positive_example_nll_weight == 0.1
    assert load_config(mtp, ["loss_fn.use_cispo=true", "loss_fn.disable_ppo_ratio=false"]).loss_fn.use_cispo
