"""The paper's OCC proxy (``mtp_occ_proxy: logprob_delta``, RL-MTP): hand-worked values, clamps, zero cases, and
the config rules around it (docs/guides/occ.md section 3)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from nemo_rl_spec.algorithms.occ import MTPCoefficient, logprob_delta_lambda
from nemo_rl_spec.utils.config import ConfigError, load_config

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs")
RECIPE = os.path.join(CONFIGS, "grpo_math_tiny_mtp.yaml")
PLAIN_RECIPE = os.path.join(CONFIGS, "grpo_math_tiny.yaml")  # no mtp_* key set


def _hand_case():
    """One row, positions 1-3 valid, position 4 padding with huge values. By hand: d = curr - prev = (0.5, 0, -0.5),
    d_mtp = mtp - prev = (-2, 1, -1); terms d_mtp * d / d_mtp^2 = (-0.25, 0, 0.5), mean 0.25 / 3."""
    prev = torch.tensor([[0.0, -1.0, -2.0, -1.0, 0.0]])
    curr = torch.tensor([[0.0, -0.5, -2.0, -1.5, 50.0]])
    mtp = torch.tensor([[0.0, -3.0, -1.0, -2.0, -90.0]])
    valid = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]])
    return mtp, curr, prev, valid


def test_hand_values_heads_and_clamp():
    mtp, curr, prev, valid = _hand_case()
    assert logprob_delta_lambda(mtp, curr, prev, valid, 1.0, 1, 1e-12) == pytest.approx(0.25 / 3, rel=1e-9)
    assert logprob_delta_lambda(mtp, curr, prev, valid, 2.0, 1, 1e-12) == pytest.approx(0.5 / 3, rel=1e-9)
    assert logprob_delta_lambda(mtp, curr, prev, valid, 2.0, 2, 1e-12) == pytest.approx(0.25 / 3, rel=1e-9)
    # the clamp bounds |lambda_k|: min(2 * 0.25 / 3 / 2, 0.05)
    assert logprob_delta_lambda(mtp, curr, prev, valid, 2.0, 2, 1e-12, lambda_max=0.05) == pytest.approx(0.05)
    assert logprob_delta_lambda(mtp, 2 * prev - curr, prev, valid, 2.0, 2, 1e-12, lambda_max=0.05) == -0.05
    # eps = 1: terms (-1 / 5, 0 / 2, 0.5 / 2) -> mean 0.05 / 3
    assert logprob_delta_lambda(mtp, curr, prev, valid, 1.0, 1, 1.0) == pytest.approx(0.05 / 3, rel=1e-9)


def test_ratio_of_means_hand_values():
    """Ratio of the means on the hand case: mean(d * d_mtp) = (-1 + 0 + 0.5) / 3 = -1/6, mean(d_mtp^2) = 6 / 3 = 2,
    so m = -1/12: the opposite sign of the per-token mean (+1/12), decided there by the token with d_mtp = -1."""
    mtp, curr, prev, valid = _hand_case()
    assert logprob_delta_lambda(mtp, curr, prev, valid, 1.0, 1, 1e-12, ratio_of_means=True) == pytest.approx(
        -1 / 12, rel=1e-9
    )
    # eps = 1 in the denominator of the means: -1/6 / (2 + 1); lambda_plus 2 over 2 heads leaves it unchanged
    assert logprob_delta_lambda(mtp, curr, prev, valid, 2.0, 2, 1.0, ratio_of_means=True) == pytest.approx(
        -1 / 18, rel=1e-9
    )
    assert logprob_delta_lambda(mtp, prev, prev, valid, 1.0, 1, 1e-8, ratio_of_means=True) == 0.0
    coef = MTPCoefficient("occ", 1.0, eps=1e-12, proxy="logprob_delta_ratio")
    assert coef.occ([(mtp, valid)], curr, prev) == [pytest.approx(-1 / 12, rel=1e-9)]
    with pytest.raises(ValueError, match="mtp_occ_proxy"):
        MTPCoefficient("occ", 1.0, proxy="hidden_grad")
    cfg = load_config(RECIPE, ["+policy.megatron_cfg.mtp_occ_proxy=logprob_delta_ratio"])
    assert cfg.policy.megatron_cfg.mtp_occ_proxy == "logprob_delta_ratio"


def test_zero_cases():
    mtp, curr, prev, valid = _hand_case()
    # first (on-policy) mini-batch: curr == prev, so every term is 0
    assert logprob_delta_lambda(mtp, prev, prev, valid, 1.0, 1, 1e-8) == 0.0
    # opposed: the mirrored main-head change gives mean -0.25 / 3, kept signed (as in the reference)
    assert logprob_delta_lambda(mtp, 2 * prev - curr, prev, valid, 1.0, 1, 1e-12) == pytest.approx(-0.25 / 3, rel=1e-9)
    # no valid target
    assert logprob_delta_lambda(mtp, curr, prev, torch.zeros_like(valid), 1.0, 1, 1e-8) == 0.0
    # the MTP head equal to the old main head at a token: 0 / (0 + eps) = 0 there, the mean still over 3 tokens
    mtp_same = mtp.clone()
    mtp_same[0, 1] = prev[0, 1]  # drops the -0.25 term
    assert logprob_delta_lambda(mtp_same, curr, prev, valid, 1.0, 1, 1e-8) == pytest.approx(0.5 / 3, rel=1e-7)


def test_errors():
    mtp, curr, prev, valid = _hand_case()
    with pytest.raises(ValueError):
        logprob_delta_lambda(mtp[:, :4], curr, prev, valid, 1.0, 1, 1e-8)
    for bad in [dict(lambda_plus=-1.0), dict(num_heads=0), dict(eps=0.0), dict(lambda_max=-1.0)]:
        kw = dict(lambda_plus=1.0, num_heads=1, eps=1e-8, lambda_max=None) | bad
        with pytest.raises(ValueError):
            logprob_delta_lambda(mtp, curr, prev, valid, **kw)


def test_config_selects_and_refuses():
    cfg = load_config(RECIPE)
    assert cfg.policy.megatron_cfg.mtp_occ_proxy == "logprob_delta"
    with pytest.raises(ConfigError, match="mtp_occ_proxy"):  # the hidden-state proxy is gone
        load_config(RECIPE, ["+policy.megatron_cfg.mtp_occ_proxy=hidden_grad"])
    # NeMo-RL's mtp_detach_heads: True -> detach, False -> ce; a conflicting explicit mode is refused
    for detach, mode in ((True, "detach"), (False, "ce")):
        overrides = [
            "policy.megatron_cfg.mtp_num_layers=1",
            f"+policy.megatron_cfg.mtp_detach_heads={str(detach).lower()}",
        ]
        cfg = load_config(PLAIN_RECIPE, overrides)
        assert cfg.policy.megatron_cfg.mtp_loss_mode == mode
    with pytest.raises(ConfigError, match="mtp_detach_heads"):
        load_config(RECIPE, ["+policy.megatron_cfg.mtp_detach_heads=true", "policy.megatron_cfg.mtp_loss_mode=occ"])
    # one optimizer mini-batch per step: OCC's lambda is 0 on every step -> warned
    with pytest.warns(UserWarning, match="train_global_batch_size=8"):
        load_config(RECIPE, ["policy.megatron_cfg.mtp_loss_mode=occ", "policy.train_global_batch_size=8"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(RECIPE, ["policy.megatron_cfg.mtp_loss_mode=occ", "policy.train_global_batch_size=4"])


def test_config_refuses_reference_with_checkpointing_and_policy_loss_with_kl():
    with pytest.raises(ConfigError, match="mtp_occ_reference=true needs activation_checkpointing=false"):
        load_config(
            RECIPE,
            ["+policy.megatron_cfg.mtp_occ_reference=true", "policy.megatron_cfg.activation_checkpointing=true"],
        )
    for mode in ("policy", "occ"):
        with pytest.raises(ConfigError, match="reference_policy_kl_penalty=0"):
            load_config(
                RECIPE, [f"policy.megatron_cfg.mtp_loss_mode={mode}", "loss_fn.reference_policy_kl_penalty=0.1"]
            )
    load_config(RECIPE, ["policy.megatron_cfg.mtp_loss_mode=ce", "loss_fn.reference_policy_kl_penalty=0.1"])
