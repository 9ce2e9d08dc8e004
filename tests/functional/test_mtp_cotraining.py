"""MTP co-training on the Megatron policy worker (megatron-core MTP block, tiny random Qwen3, CPU fp32).

Covers: detach leaves the trunk bitwise equal to a worker without MTP while the MTP weights move; every mode moves
the MTP weights and reports its coefficient; the trunk gradient equals an independent single-backward gradient of
``L_RL + lambda * L_MTP`` (fixed lambda) and, for OCC, lambda equals the rule applied to the reported proxies;
the proxies equal an independent computation from hidden-state gradients.
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
from nemo_rl_spec.algorithms.occ import occ_lambda  # noqa: E402
from nemo_rl_spec.models.policy import megatron_model as mm  # noqa: E402
from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker, token_logprobs  # noqa: E402
from nemo_rl_spec.utils.config_schema import PolicyConfig  # noqa: E402

torch.set_num_threads(1)


def _policy_cfg(mtp_num_layers=1, mode="detach", factor=0.5, micro=2, clip=1.0, lr=1e-2) -> dict:
    cfg = fm.base_recipe_section("policy")
    cfg.update(train_micro_batch_size=micro, logprob_batch_size=4)
    cfg["megatron_cfg"]["optimizer"].update(lr=lr, clip_grad=clip)
    cfg["megatron_cfg"].update(mtp_num_layers=mtp_num_layers, mtp_loss_mode=mode, mtp_loss_scaling_factor=factor)
    return cfg


def _loss_fn():
    return ClippedPGLossFn(fm.base_recipe_section("loss_fn"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    fm.save_tiny_model(path, "qwen3", True)
    return str(path)


def _worker(model_dir, **kw):
    return MegatronPolicyWorker(PolicyConfig.model_validate(_policy_cfg(**kw)), _loss_fn(), model_dir, seed=3)


def _split(worker):
    state = {k: v.detach().clone() for k, v in mm.megatron_param_state(worker.module).items()}
    trunk = {k: v for k, v in state.items() if not k.startswith(mm.MTP_PREFIX)}
    return trunk, {k: v for k, v in state.items() if k.startswith(mm.MTP_PREFIX)}


def _independent_gradients(worker, data, mode):
    """On a copy of the worker's current weights, one ordinary forward with the MTP block reading the live trunk
    (no detached copies): ``(named params, dL_RL/dparams, dL_MTP/dparams + [dL_MTP/dh], dL_RL/dh)``."""
    ref, _ = mm.build_from_hf(worker.model_path, mtp_num_layers=1, seed=3)
    mm.load_megatron_state(ref, {k: v.detach().clone() for k, v in mm.megatron_param_state(worker.module).items()})
    ids, loss_fn = data["input_ids"], _loss_fn()
    trunk = mm.gpt_trunk_forward(ref, ids)
    trunk.hidden.retain_grad()
    main_logits = mm.output_logits(ref, trunk.hidden)
    curr = token_logprobs(main_logits, ids, data["input_lengths"], 1.0)
    n_tok = (data["token_mask"] * data["sample_mask"].unsqueeze(1)).sum()
    rl_loss, _ = loss_fn(curr, data, n_tok, data["sample_mask"].sum())
    hidden = mm.mtp_hidden_states(ref, ids, trunk, trunk.hidden, ref.embedding)[0]
    lp = ml.mtp_token_logprobs(mm.output_logits(ref, hidden), ids, 0)
    valid = ml.mtp_valid_mask(data, 0)
    if mode in ("ce", "detach"):
        mtp_loss = ml.mtp_ce_loss(lp, valid, valid.sum())
    else:
        mtp_loss, _ = loss_fn(lp, {**data, "token_mask": valid}, valid.sum(), data["sample_mask"].sum())
    params = dict(ref.named_parameters())
    g_rl = torch.autograd.grad(rl_loss, list(params.values()), retain_graph=True, allow_unused=True)
    g_mtp = torch.autograd.grad(mtp_loss, list(params.values()) + [trunk.hidden], retain_graph=True, allow_unused=True)
    g_rl_h = torch.autograd.grad(rl_loss, trunk.hidden)[0]
    return params, g_rl, g_mtp, g_rl_h


def test_detach_trunk_bitwise_equal_to_no_mtp_and_mtp_moves(model_dir):
    plain, detach = _worker(model_dir, mtp_num_layers=0), _worker(model_dir, mode="detach")
    for step in range(2):
        data = fm.on_policy(plain, fm.train_batch(seed=step))
        plain.train(data)
        metrics = detach.train(data)
    trunk_plain, _ = _split(plain)
    trunk_detach, mtp_after = _split(detach)
    assert set(trunk_plain) == set(trunk_detach)
    for name in trunk_plain:
        assert torch.equal(trunk_plain[name], trunk_detach[name]), name
    _, mtp_before = _split(_worker(model_dir, mode="detach"))
    moved = [n for n in mtp_before if not torch.equal(mtp_before[n], mtp_after[n])]
    assert set(moved) == set(mtp_before)  # every MTP tensor moved
    assert metrics["mtp/lambda"] == 0.0 and metrics["mtp/v2_hat"] > 0.0


@pytest.mark.parametrize("mode", ["ce", "policy", "occ"])
def test_every_mode_moves_mtp_and_trunk_and_reports(model_dir, mode):
    # occ: one micro-batch of the 4 rows, so mtp/lambda is the rule applied to this call's reported proxies
    worker = _worker(model_dir, mode=mode, factor=0.5, micro=4 if mode == "occ" else 2)
    trunk0, mtp0 = _split(worker)
    data = fm.on_policy(worker, fm.train_batch())
    m = worker.train(data)
    trunk1, mtp1 = _split(worker)
    assert all(not torch.equal(mtp0[n], mtp1[n]) for n in mtp0)
    assert any(not torch.equal(trunk0[n], trunk1[n]) for n in trunk0)
    for key in (
        "mtp/lambda",
        "mtp/c_hat",
        "mtp/v2_hat",
        "mtp/loss_0",
        "mtp/ce_0",
        "mtp/acceptance_0",
        "mtp/acceptance",
        "mtp/delta_abs_mean",
    ):
        assert key in m and m[key] == m[key], key
    assert m["mtp/delta_abs_mean"] < 1e-5  # first on-policy minibatch: delta = 0
    assert 0.0 <= m["mtp/acceptance"] <= 1.0 and m["mtp/ce_0"] > 0.0
    if mode == "occ":  # lambda_plus * max(c_hat, 0) / (v2_hat + eps), eps 1e-8 (the schema default), written out
        assert m["mtp/c_hat"] > 0.0  # so the rule is not trivially 0 = 0 on this batch
        assert m["mtp/lambda"] == pytest.approx(0.5 * m["mtp/c_hat"] / (m["mtp/v2_hat"] + 1e-8), rel=1e-9)
    else:
        assert m["mtp/lambda"] == pytest.approx(0.5, abs=0)


@pytest.mark.parametrize("mode", ["ce", "occ"])
def test_trunk_gradient_is_rl_plus_lambda_mtp(model_dir, mode):
    """One micro-batch, no clipping: the worker's trunk gradient (``main_grad``) equals the gradient of
    ``L_RL + lambda * L_MTP`` computed with one ordinary backward on a copy of the same weights, and its MTP
    gradient equals that of ``L_MTP``; for occ, lambda equals the rule applied to independently computed
    hidden-state gradients."""
    worker = _worker(model_dir, mode=mode, factor=0.7, micro=4, clip=1e9)
    data = fm.on_policy(worker, fm.train_batch())
    params, g_rl, g_mtp, g_rl_h = _independent_gradients(worker, data, mode)
    m = worker.train(data)
    lam, ids = m["mtp/lambda"], data["input_ids"]
    if mode == "occ":
        keep = (torch.arange(ids.shape[1]).unsqueeze(0) < data["input_lengths"].unsqueeze(1)).t().unsqueeze(-1)
        c = float((g_rl_h * g_mtp[-1] * keep).double().sum())
        v2 = float((g_mtp[-1] * keep).double().pow(2).sum())
        assert m["mtp/c_hat"] == pytest.approx(c, rel=1e-4, abs=1e-12)
        assert m["mtp/v2_hat"] == pytest.approx(v2, rel=1e-4)
        assert lam == pytest.approx(occ_lambda(c, v2, 0.7, 1e-8), rel=1e-3)
    else:
        assert lam == 0.7
    worker_params = dict(worker.module.named_parameters())
    for (name, p), gr, gm in zip(params.items(), g_rl, g_mtp[:-1]):
        zero = torch.zeros_like(p)
        if name.startswith(mm.MTP_PREFIX):
            expected, got = gm, worker_params[name].grad
        else:
            expected = (zero if gr is None else gr) + lam * (zero if gm is None else gm)
            got = worker_params[name].main_grad
        scale = expected.abs().max().clamp(min=1e-8)
        assert (got - expected).abs().max() / scale < 1e-4, name


@pytest.mark.parametrize("mode", ["occ", "detach"])
def test_occ_reference_equals_full_gradients_and_leaves_training_unchanged(model_dir, mode):
    """``mtp_occ_reference``: c_ref and v2_ref equal <g_RL, g_MTP> and ||g_MTP||^2 over the shared parameters from an
    independent full-graph backward (one micro-batch), lambda_ref is the OCC rule on them, and the step itself is
    bitwise the same as without the reference (weights and proxies)."""
    plain = _worker(model_dir, mode=mode, factor=0.7, micro=4, clip=1e9)
    worker = _worker(model_dir, mode=mode, factor=0.7, micro=4, clip=1e9)
    worker.mtp_occ_reference = True
    data = fm.on_policy(worker, fm.train_batch())
    params, g_rl, g_mtp, _ = _independent_gradients(worker, data, "occ" if mode == "occ" else "ce")
    c = v2 = c_dec = v2_dec = 0.0
    for (name, _p), gr, gm in zip(params.items(), g_rl, g_mtp[:-1]):
        if not name.startswith(mm.MTP_PREFIX) and gm is not None:
            dot, sq = (0.0 if gr is None else float((gr.double() * gm.double()).sum())), float(gm.double().pow(2).sum())
            c, v2 = c + dot, v2 + sq
            if name.startswith("decoder."):
                c_dec, v2_dec = c_dec + dot, v2_dec + sq
    m, m_plain = worker.train(data), plain.train(data)
    assert m["mtp/c_ref"] == pytest.approx(c, rel=1e-4, abs=1e-12)
    assert m["mtp/v2_ref"] == pytest.approx(v2, rel=1e-4) and v2 > 0.0
    assert m["mtp/c_ref_decoder"] == pytest.approx(c_dec, rel=1e-4, abs=1e-12)
    assert m["mtp/v2_ref_decoder"] == pytest.approx(v2_dec, rel=1e-4) and 0.0 < v2_dec < v2
    assert m["mtp/lambda_ref"] == pytest.approx(occ_lambda(c, v2, 0.7, 1e-8), rel=1e-3)
    assert "mtp/c_ref" not in m_plain
    for key in ("mtp/c_hat", "mtp/v2_hat", "mtp/lambda", "loss", "grad_norm"):
        assert m[key] == m_plain[key], key
    state, state_plain = _split(worker), _split(plain)
    for part, part_plain in zip(state, state_plain):
        for name in part:
            assert torch.equal(part[name], part_plain[name]), name
