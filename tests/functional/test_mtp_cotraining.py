"""MTP co-training on the Megatron policy worker (megatron-core MTP block, tiny random Qwen3, CPU fp32).

Covers: detach leaves the trunk bitwise equal to a worker without MTP while the MTP weights move; every mode moves
the MTP weights and reports its coefficient; with a fixed lambda every gradient (trunk and MTP head alike) equals an
independent single-backward gradient of ``L_RL + lambda * L_MTP``; the step-level full-gradient reference equals
<G_RL, G_MTP> over the step's micro-batches and agrees with finite differences of the losses.
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


def _ref_model(worker):
    """An unwrapped copy of the worker's current weights (no DDP, no detached branches)."""
    ref, _ = mm.build_from_hf(worker.model_path, mtp_num_layers=1, seed=3)
    mm.load_megatron_state(ref, {k: v.detach().clone() for k, v in mm.megatron_param_state(worker.module).items()})
    return ref


def _losses(ref, data, mode):
    """(L_RL, unscaled L_MTP) of the whole batch on model ``ref``, normalised by the batch's own counts."""
    ids, loss_fn = data["input_ids"], _loss_fn()
    trunk = mm.gpt_trunk_forward(ref, ids)
    curr = token_logprobs(mm.output_logits(ref, trunk.hidden), ids, data["input_lengths"], 1.0)
    n_tok = (data["token_mask"] * data["sample_mask"].unsqueeze(1)).sum()
    rl_loss, _ = loss_fn(curr, data, n_tok, data["sample_mask"].sum())
    hidden = mm.mtp_hidden_states(ref, ids, trunk, trunk.hidden, ref.embedding)[0]
    lp = ml.mtp_token_logprobs(mm.output_logits(ref, hidden), ids, 0)
    valid = ml.mtp_valid_mask(data, 0)
    if mode in ("ce", "detach"):
        return rl_loss, ml.mtp_ce_loss(lp, valid, valid.sum())
    return rl_loss, loss_fn(lp, {**data, "token_mask": valid}, valid.sum(), data["sample_mask"].sum())[0]


def _independent_gradients(worker, data, mode):
    """On a copy of the worker's current weights, one ordinary forward of the whole batch with the MTP block
    reading the live trunk: ``(named params, dL_RL/dparams, dL_MTP/dparams)``."""
    ref = _ref_model(worker)
    rl_loss, mtp_loss = _losses(ref, data, mode)
    params = dict(ref.named_parameters())
    g_rl = torch.autograd.grad(rl_loss, list(params.values()), retain_graph=True, allow_unused=True)
    g_mtp = torch.autograd.grad(mtp_loss, list(params.values()), allow_unused=True)
    return params, g_rl, g_mtp


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
    assert metrics["mtp/lambda"] == 0.0 and metrics["mtp/grad_norm"] > 0.0


@pytest.mark.parametrize("mode", ["ce", "policy", "occ"])
def test_every_mode_moves_mtp_and_trunk_and_reports(model_dir, mode):
    worker = _worker(model_dir, mode=mode, factor=0.5, micro=2)
    trunk0, mtp0 = _split(worker)
    data = fm.on_policy(worker, fm.train_batch())
    m = worker.train(data)
    trunk1, mtp1 = _split(worker)
    assert any(not torch.equal(trunk0[n], trunk1[n]) for n in trunk0)
    for key in ("mtp/lambda", "mtp/loss_0", "mtp/ce_0", "mtp/acceptance_0", "mtp/acceptance", "mtp/delta_abs_mean"):
        assert key in m and m[key] == m[key], key
    assert m["mtp/delta_abs_mean"] < 1e-5  # first on-policy minibatch: delta = 0
    assert 0.0 <= m["mtp/acceptance"] <= 1.0 and m["mtp/ce_0"] > 0.0
    if mode == "occ":  # the first mini-batch: no observed change, lambda = 0 (up to recomputation noise)
        assert abs(m["mtp/lambda"]) < 1e-5
    else:
        assert m["mtp/lambda"] == pytest.approx(0.5, abs=0)
        assert all(not torch.equal(mtp0[n], mtp1[n]) for n in mtp0)


@pytest.mark.parametrize("mode", ["ce", "policy"])
def test_every_gradient_is_rl_plus_lambda_mtp(model_dir, mode):
    """Two micro-batches, no clipping: every gradient of the worker (trunk ``main_grad`` and the MTP head's
    ``grad``) equals the gradient of ``L_RL + lambda * L_MTP`` from one ordinary backward over the whole batch on a
    copy of the same weights. A head that got the unscaled MTP gradient (the earlier behaviour) fails here."""
    worker = _worker(model_dir, mode=mode, factor=0.7, micro=2, clip=1e9)
    data = fm.on_policy(worker, fm.train_batch())
    params, g_rl, g_mtp = _independent_gradients(worker, data, mode)
    m = worker.train(data)
    assert m["mtp/lambda"] == 0.7
    worker_params = dict(worker.module.named_parameters())
    for (name, p), gr, gm in zip(params.items(), g_rl, g_mtp):
        zero = torch.zeros_like(p)
        expected = (zero if gr is None else gr) + 0.7 * (zero if gm is None else gm)
        got = worker_params[name].grad if name.startswith(mm.MTP_PREFIX) else worker_params[name].main_grad
        scale = expected.abs().max().clamp(min=1e-8)
        assert (got - expected).abs().max() / scale < 1e-4, name


def _shared_dots(params, g_rl, g_mtp):
    c = v2 = c_dec = v2_dec = 0.0
    for (name, _p), gr, gm in zip(params.items(), g_rl, g_mtp):
        if not name.startswith(mm.MTP_PREFIX) and gm is not None:
            dot, sq = (0.0 if gr is None else float((gr.double() * gm.double()).sum())), float(gm.double().pow(2).sum())
            c, v2 = c + dot, v2 + sq
            if name.startswith("decoder."):
                c_dec, v2_dec = c_dec + dot, v2_dec + sq
    return c, v2, c_dec, v2_dec


@pytest.mark.parametrize("mode", ["occ", "detach"])
def test_occ_reference_is_step_level_and_leaves_training_unchanged(model_dir, mode):
    """``mtp_occ_reference``: over two micro-batches of one optimizer step, c_ref and v2_ref equal <G_RL, G_MTP> and
    ||G_MTP||^2 of the whole batch's gradients over the shared parameters (not the sum of per-micro-batch dot
    products, which differs by the cross terms), lambda_ref is the rule on them, and the step itself is bitwise the
    same as without the reference."""
    plain = _worker(model_dir, mode=mode, factor=0.7, micro=2, clip=1e9)
    worker = _worker(model_dir, mode=mode, factor=0.7, micro=2, clip=1e9)
    worker.mtp_occ_reference = True
    data = fm.on_policy(worker, fm.train_batch())
    ref_mode = "occ" if mode == "occ" else "ce"
    c, v2, c_dec, v2_dec = _shared_dots(*_independent_gradients(worker, data, ref_mode))
    halves = [{k: v[a:b] if isinstance(v, torch.Tensor) else v for k, v in data.items()} for a, b in ((0, 2), (2, 4))]
    per_mb = [_shared_dots(*_independent_gradients(worker, h, ref_mode))[0] for h in halves]
    m, m_plain = worker.train(data), plain.train(data)
    assert m["mtp/c_ref"] == pytest.approx(c, rel=1e-4, abs=1e-12)
    assert abs(c - sum(per_mb)) > 1e-3 * abs(c)  # the cross terms matter on this batch: the test can tell
    assert m["mtp/v2_ref"] == pytest.approx(v2, rel=1e-4) and v2 > 0.0
    assert m["mtp/c_ref_decoder"] == pytest.approx(c_dec, rel=1e-4, abs=1e-12)
    assert m["mtp/v2_ref_decoder"] == pytest.approx(v2_dec, rel=1e-4) and 0.0 < v2_dec < v2
    assert m["mtp/lambda_ref"] == pytest.approx(occ_lambda(c, v2, 0.7, 1e-8), rel=1e-3)
    assert "mtp/c_ref" not in m_plain
    for key in ("mtp/lambda", "loss", "grad_norm"):
        assert m[key] == m_plain[key], key
    state, state_plain = _split(worker), _split(plain)
    for part, part_plain in zip(state, state_plain):
        for name in part:
            assert torch.equal(part[name], part_plain[name]), name


def test_occ_reference_agrees_with_finite_differences(model_dir):
    """c = <g_RL, g_MTP> is the derivative of L_RL along g_MTP and ||g_MTP|| that of L_MTP along its unit direction;
    both checked by central differences of the losses (float64 copy of the model, shared parameters only moved)."""
    worker = _worker(model_dir, mode="occ", factor=1.0, micro=4, clip=1e9)
    worker.mtp_occ_reference = True
    data = fm.on_policy(worker, fm.train_batch())
    ref = _ref_model(worker).double()
    rl_loss, mtp_loss = _losses(ref, data, "occ")
    shared = [(n, p) for n, p in ref.named_parameters() if not n.startswith(mm.MTP_PREFIX)]
    g_mtp = torch.autograd.grad(mtp_loss, [p for _, p in shared], allow_unused=True)
    direction = [torch.zeros_like(p) if g is None else g for (_, p), g in zip(shared, g_mtp)]
    norm = float(torch.sqrt(sum((d * d).sum() for d in direction)))

    def slopes(h):  # central differences of (L_RL, L_MTP) along the unit direction g_MTP / ||g_MTP||
        out = []
        for sign in (1.0, -1.0):
            with torch.no_grad():
                for (_, p), d in zip(shared, direction):
                    p.add_(sign * h * d / norm)
                out.append(torch.tensor([float(x) for x in _losses(ref, data, "occ")], dtype=torch.float64))
                for (_, p), d in zip(shared, direction):
                    p.sub_(sign * h * d / norm)
        return (out[0] - out[1]) / (2 * h)

    # Richardson (4 D(h/2) - D(h)) / 3 removes the O(h^2) term; the losses are float32 (the log-probs are), so a
    # rounding of ~1e-7 |L| per evaluation gives (4/3) 1e-7 |L| / (h/2) in a slope: with h = 4e-3, |L_RL| < 1 and
    # ||g_MTP|| ~ 10 that is < 7e-4 of c, and < 1e-4 of v2: bound 2e-3.
    h = 4e-3
    slope_rl, slope_mtp = ((4 * slopes(h / 2) - slopes(h)) / 3).tolist()
    m = worker.train(data)
    assert m["mtp/c_ref"] == pytest.approx(slope_rl * norm, rel=2e-3)
    assert m["mtp/v2_ref"] == pytest.approx(slope_mtp**2, rel=2e-3)
