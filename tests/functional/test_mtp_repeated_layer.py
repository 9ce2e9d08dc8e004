"""``policy.megatron_cfg.mtp_use_repeated_layer`` (megatron-core's option, NeMo-RL's key): one MTP layer built and
applied at every one of the ``mtp_num_layers`` depths. Tiny random Qwen3, CPU fp32.

Checks: the repeated block holds exactly the parameters of a one-layer block; at depth 2 it computes what a two-layer
block whose second layer is a copy of the first computes (equal losses, and the shared layer's gradient is the sum
of the two copies' gradients); one worker training step updates the shared layer once, with that summed gradient;
the MiMo export writes the layer once per depth (vLLM's drafter loads one layer per ``num_nextn_predict_layers``).
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
from nemo_rl_spec.models.mtp_export import megatron_mtp_to_mimo  # noqa: E402
from nemo_rl_spec.models.policy import megatron_model as mm  # noqa: E402
from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker  # noqa: E402
from nemo_rl_spec.utils.config_schema import PolicyConfig  # noqa: E402

torch.set_num_threads(1)
FACTOR = 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3")
    fm.save_tiny_model(path, "qwen3", True)
    return str(path)


def _mtp(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in mm.megatron_param_state(model).items() if k.startswith(mm.MTP_PREFIX)}


def _copied_two_layer_model(model_dir, repeated) -> torch.nn.Module:
    """A plain two-layer MTP model holding ``repeated``'s weights, its layer 1 a copy of the shared layer 0."""
    two, _ = mm.build_from_hf(model_dir, mtp_num_layers=2, seed=3)
    state = {k: v.detach().clone() for k, v in mm.megatron_param_state(repeated).items()}
    state.update({k.replace("mtp.layers.0.", "mtp.layers.1.", 1): v for k, v in _mtp(repeated).items()})
    mm.load_megatron_state(two, state)
    return two


def _mtp_ce_losses(model, data) -> list[torch.Tensor]:
    """Per-depth MTP cross-entropy (normalised by the batch's valid targets), the trunk detached as in detach mode."""
    ids = data["input_ids"]
    trunk = mm.gpt_trunk_forward(model, ids)
    hidden = mm.mtp_hidden_states(model, ids, trunk, trunk.hidden.detach(), mm.detached_embedding(model))
    weight = mm.output_weight(model).detach()
    losses = []
    for k, hk in enumerate(hidden):
        lp = ml.mtp_token_logprobs(mm.output_logits(model, hk, weight=weight), ids, k)
        valid = ml.mtp_valid_mask(data, k)
        losses.append(ml.mtp_ce_loss(lp, valid, valid.sum()))
    return losses


def _mtp_grads(model, loss) -> dict[str, torch.Tensor]:
    params = {n: p for n, p in model.named_parameters() if n.startswith(mm.MTP_PREFIX)}
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def _summed_over_copies(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gradients of the copied model folded onto the shared layer: layer 0's plus layer 1's."""
    return {n: g + grads[n.replace("mtp.layers.0.", "mtp.layers.1.", 1)] for n, g in grads.items() if ".layers.0." in n}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def test_repeated_layer_is_one_layer_applied_at_every_depth(model_dir):
    repeated, spec = mm.build_from_hf(model_dir, mtp_num_layers=2, mtp_use_repeated_layer=True, seed=3)
    one, _ = mm.build_from_hf(model_dir, mtp_num_layers=1, seed=3)
    assert repeated.config.mtp_num_layers == 2 and len(repeated.mtp.layers) == 1
    # (a) the parameters of ONE layer: the same names and shapes as a one-layer block
    rep_shapes = {k: v.shape for k, v in _mtp(repeated).items()}
    assert rep_shapes == {k: v.shape for k, v in _mtp(one).items()}
    assert sum(v.numel() for v in _mtp(repeated).values()) == sum(v.numel() for v in _mtp(one).values())

    # (b) depth 2 uses the same weights: a two-layer block with copied weights gives the same losses ...
    two = _copied_two_layer_model(model_dir, repeated)
    data = fm.train_batch(seed=5)
    rep_losses, two_losses = _mtp_ce_losses(repeated, data), _mtp_ce_losses(two, data)
    assert len(rep_losses) == 2 and float(rep_losses[1].detach()) != pytest.approx(
        float(rep_losses[0].detach()), rel=1e-3
    )
    for a, b in zip(rep_losses, two_losses):
        a, b = float(a.detach()), float(b.detach())
        assert abs(a - b) <= 1e-6 * abs(b), (a, b)  # measured: bitwise equal
    # ... and the shared layer's gradient is the sum of the two copies' gradients
    rep_grads = _mtp_grads(repeated, sum(rep_losses))
    expected = _summed_over_copies(_mtp_grads(two, sum(two_losses)))
    assert set(rep_grads) == set(expected)
    for name, g in rep_grads.items():
        assert _rel(g, expected[name]) < 1e-5, name

    # the MiMo export serves vLLM one layer per depth, each the shared layer
    mimo = megatron_mtp_to_mimo(mm.megatron_param_state(repeated), spec, depths=2)
    layer0 = {n[len("model.mtp_layers.0.") :]: t for n, t in mimo.items() if n.startswith("model.mtp_layers.0.")}
    layer1 = {n[len("model.mtp_layers.1.") :]: t for n, t in mimo.items() if n.startswith("model.mtp_layers.1.")}
    assert layer0 and set(layer0) == set(layer1) and len(mimo) == 2 * len(layer0)
    assert all(torch.equal(layer0[n], layer1[n]) for n in layer0)


def test_one_train_step_updates_the_shared_layer_once_with_the_summed_gradient(model_dir):
    cfg = fm.base_recipe_section("policy")
    cfg.update(train_micro_batch_size=4, logprob_batch_size=4)
    cfg["megatron_cfg"]["optimizer"].update(lr=1e-2, clip_grad=1e9)
    cfg["megatron_cfg"].update(
        mtp_num_layers=2, mtp_use_repeated_layer=True, mtp_loss_mode="detach", mtp_loss_scaling_factor=FACTOR
    )
    worker = MegatronPolicyWorker(
        PolicyConfig.model_validate(cfg), ClippedPGLossFn(fm.base_recipe_section("loss_fn")), model_dir, seed=3
    )
    assert len(worker.module.mtp.layers) == 1
    data = fm.on_policy(worker, fm.train_batch(seed=6))
    before = _mtp(worker.module)
    two = _copied_two_layer_model(model_dir, worker.module)
    two_losses = _mtp_ce_losses(two, data)
    expected = _summed_over_copies(_mtp_grads(two, FACTOR * sum(two_losses)))

    metrics = worker.train(data)

    after = _mtp(worker.module)
    assert set(after) == set(before) and all(not torch.equal(before[n], after[n]) for n in before)  # all moved
    params = dict(worker.module.named_parameters())
    for name, g in expected.items():  # detach mode: the MTP gradient is lambda * sum over both depths
        assert _rel(params[name].grad, g) < 1e-4, name
    adam = worker.mtp.optimizer.optimizer
    assert len(adam.state) == len(before) and {int(s["step"]) for s in adam.state.values()} == {1}  # one update
    for k, loss in enumerate(two_losses):  # the worker's per-depth CE (before the step) is the copied model's
        assert metrics[f"mtp/ce_{k}"] == pytest.approx(float(loss.detach()), rel=1e-5)
