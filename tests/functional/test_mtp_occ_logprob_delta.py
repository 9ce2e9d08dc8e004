"""OCC with the paper's proxy (``mtp_occ_proxy: logprob_delta``) on the Megatron worker, tiny random Qwen3, CPU fp32.

Four GRPO steps of 4 rows, each split into 2 optimizer mini-batches of 2 rows by the controller's own splitter
(:func:`~nemo_rl_spec.models.policy.lm_policy.train_minibatches`, ``train_global_batch_size`` = half the rows):
lambda is 0 on each step's first (on-policy) mini-batch and, on the second, equal to the published formula
recomputed independently from the model's log-probs just before that mini-batch, signed: +0.61 in step 1 and
-0.077 in step 4 for these batches (on this random model the sign varies with the batch, so the batches are fixed).
With two MTP heads whose lambdas differ, every gradient (MTP block and trunk) equals that of
``L_RL + sum_k L_k(A * lambda_k)`` from one ordinary backward on a copy of the weights.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fixtures_models as fm  # noqa: E402

from nemo_rl_spec.algorithms.loss import ClippedPGLossFn  # noqa: E402
from nemo_rl_spec.algorithms.loss import mtp_loss as ml  # noqa: E402
from nemo_rl_spec.models.policy import megatron_model as mm  # noqa: E402
from nemo_rl_spec.models.policy.lm_policy import train_minibatches  # noqa: E402
from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker, token_logprobs  # noqa: E402
from nemo_rl_spec.utils.config_schema import PolicyConfig  # noqa: E402

torch.set_num_threads(1)
LAMBDA_PLUS, EPS = 1.0, 1e-8


def _loss_fn():
    return ClippedPGLossFn(fm.base_recipe_section("loss_fn"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    fm.save_tiny_model(path, "qwen3", True)
    return str(path)


def _worker(model_dir, heads: int) -> MegatronPolicyWorker:
    cfg = fm.base_recipe_section("policy")
    cfg.update(train_global_batch_size=2, train_micro_batch_size=2, logprob_batch_size=4)
    cfg["megatron_cfg"]["optimizer"].update(lr=1e-2, clip_grad=1e9)
    cfg["megatron_cfg"].update(
        mtp_num_layers=heads,
        mtp_loss_mode="occ",
        mtp_loss_scaling_factor=LAMBDA_PLUS,
        mtp_occ_eps=EPS,
    )
    return MegatronPolicyWorker(PolicyConfig.model_validate(cfg), _loss_fn(), model_dir, seed=3)


def _forward(model, data):
    """Live-graph forward on an unwrapped GPTModel: main-head log-probs [B, S] and each MTP head's [B, S]."""
    ids = data["input_ids"]
    trunk = mm.gpt_trunk_forward(model, ids)
    curr = token_logprobs(mm.output_logits(model, trunk.hidden), ids, data["input_lengths"], 1.0)
    hidden = mm.mtp_hidden_states(model, ids, trunk, trunk.hidden, model.embedding)
    return curr, [ml.mtp_token_logprobs(mm.output_logits(model, hk), ids, k) for k, hk in enumerate(hidden)]


def _expected_lambdas(model, data) -> list[float]:
    """The published per-head rule, written out here (not the library function) in float64."""
    with torch.no_grad():
        curr, heads = _forward(model, data)
    old, out = data["prev_logprobs"].double(), []
    for k, lp in enumerate(heads):
        valid = ml.mtp_valid_mask(data, k).double()
        d_mtp, d = lp.double() - old, curr.double() - old
        mean = float((valid * d_mtp * d / (d_mtp**2 + EPS)).sum() / valid.sum())
        out.append(LAMBDA_PLUS / len(heads) * mean)  # signed, unclamped, as in the reference
    return out


def test_lambda_zero_then_equal_to_independent_recomputation(model_dir):
    worker, seen = _worker(model_dir, heads=1), []

    def step(rows):
        expected = sum(_expected_lambdas(worker.module, rows))
        metrics = worker.train(rows)
        seen.append((expected, metrics))
        return metrics

    for grpo_step in range(4):
        data = fm.on_policy(worker, fm.train_batch(seed=10 + grpo_step))
        assert len(train_minibatches(step, data, worker.cfg.train_global_batch_size)) == 2
    for i, (expected, m) in enumerate(seen):
        if i % 2 == 0:  # first mini-batch of a step: on-policy, delta = 0 up to recomputation noise
            assert m["mtp/delta_abs_mean"] < 1e-5 and abs(m["mtp/lambda"]) < 1e-5 and abs(expected) < 1e-5
        else:
            assert m["mtp/delta_abs_mean"] > 1e-3
            assert m["mtp/lambda"] == pytest.approx(expected, rel=1e-4, abs=1e-12)
    assert seen[1][1]["mtp/lambda"] > 0.1  # step 1: positive (0.61)
    assert seen[7][1]["mtp/lambda"] < -0.05  # step 4: a negative mean stays negative (-0.077; no max(., 0))


def test_two_heads_trunk_gradient_is_rl_plus_weighted_heads(model_dir):
    worker = _worker(model_dir, heads=2)
    data = fm.on_policy(worker, fm.train_batch(seed=20))  # mean terms on the second mini-batch: 0.70, 0.22
    first, second = (
        {k: v[a:b] if isinstance(v, torch.Tensor) else v for k, v in data.items()} for a, b in ((0, 2), (2, 4))
    )
    worker.train(first)  # moves the weights: the second mini-batch sees delta != 0
    lams = _expected_lambdas(worker.module, second)
    assert all(lam > 0 for lam in lams) and lams[0] != pytest.approx(lams[1], rel=1e-3), lams

    ref, _ = mm.build_from_hf(worker.model_path, mtp_num_layers=2, seed=3)
    mm.load_megatron_state(ref, {k: v.detach().clone() for k, v in mm.megatron_param_state(worker.module).items()})
    loss_fn, seqs = _loss_fn(), second["sample_mask"].sum()
    curr, heads = _forward(ref, second)
    rl_loss, _ = loss_fn(curr, second, (second["token_mask"] * second["sample_mask"].unsqueeze(1)).sum(), seqs)
    head_losses = []  # the reference's form: head k's PG loss with advantages * lambda_k
    for k, (lp, lam) in enumerate(zip(heads, lams)):
        valid = ml.mtp_valid_mask(second, k)
        rows = {**second, "token_mask": valid, "advantages": second["advantages"] * lam}
        head_losses.append(loss_fn(lp, rows, valid.sum(), seqs)[0])
    params = dict(ref.named_parameters())
    grads = torch.autograd.grad(rl_loss + sum(head_losses), list(params.values()), allow_unused=True)

    m = worker.train(second)
    assert m["mtp/lambda"] == pytest.approx(sum(lams), rel=1e-4)
    worker_params = dict(worker.module.named_parameters())
    for (name, p), g in zip(params.items(), grads):  # MTP head and trunk alike
        expected = torch.zeros_like(p) if g is None else g
        got = worker_params[name].grad if name.startswith(mm.MTP_PREFIX) else worker_params[name].main_grad
        scale = expected.abs().max().clamp(min=1e-8)
        assert (got - expected).abs().max() / scale < 1e-4, name
