"""The paper's OCC proxy (``mtp_occ_proxy: logprob_delta``, RL-MTP): hand-worked values, clamps, zero cases, and
the config rules that select it (docs/occ.md section 3a)."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from nemo_rl_spec.algorithms.occ import logprob_delta_lambda
from nemo_rl_spec.bench import occ as bench_occ
from nemo_rl_spec.utils.config import ConfigError, load_config

RECIPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs", "grpo_math_tiny_mtp.yaml")


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
    # clamp bounds num_heads * lambda_k: min(2 * 0.25 / 3, 0.1) / 2
    assert logprob_delta_lambda(mtp, curr, prev, valid, 2.0, 2, 1e-12, lambda_max=0.1) == pytest.approx(0.05)
    # eps = 1: terms (-1 / 5, 0 / 2, 0.5 / 2) -> mean 0.05 / 3
    assert logprob_delta_lambda(mtp, curr, prev, valid, 1.0, 1, 1.0) == pytest.approx(0.05 / 3, rel=1e-9)


def test_zero_cases():
    mtp, curr, prev, valid = _hand_case()
    # first (on-policy) mini-batch: curr == prev, so every term is 0
    assert logprob_delta_lambda(mtp, prev, prev, valid, 1.0, 1, 1e-8) == 0.0
    # opposed: the mirrored main-head change gives mean -0.25 / 3 -> max(., 0) = 0
    assert logprob_delta_lambda(mtp, 2 * prev - curr, prev, valid, 1.0, 1, 1e-8) == 0.0
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
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(
            RECIPE, ["+policy.megatron_cfg.mtp_occ_proxy=logprob_delta", "policy.train_global_batch_size=4"]
        )
    assert cfg.policy.megatron_cfg.mtp_occ_proxy == "logprob_delta"
    assert load_config(RECIPE).policy.megatron_cfg.mtp_occ_proxy == "hidden_grad"
    for mode in ("detach", "ce", "policy"):
        with pytest.raises(ConfigError, match="mtp_occ_proxy"):
            load_config(
                RECIPE,
                ["+policy.megatron_cfg.mtp_occ_proxy=logprob_delta", f"policy.megatron_cfg.mtp_loss_mode={mode}"],
            )
    with pytest.raises(ConfigError, match="mtp_occ_proxy"):
        load_config(
            RECIPE, ["+policy.megatron_cfg.mtp_occ_proxy=logprob_delta", "policy.megatron_cfg.mtp_num_layers=0"]
        )
    # one optimizer mini-batch per step (8 rows, train_global_batch_size 8): lambda is 0 on every step -> warned
    with pytest.warns(UserWarning, match="train_global_batch_size=8"):
        load_config(RECIPE, ["+policy.megatron_cfg.mtp_occ_proxy=logprob_delta"])


def test_bench_occ_paper_proxy_flag():
    bench = bench_occ
    overrides = bench.mode_overrides("occ+lpd+ref")
    assert overrides == [
        "policy.megatron_cfg.mtp_loss_mode=occ",
        "+policy.megatron_cfg.mtp_occ_reference=true",
        "+policy.megatron_cfg.mtp_occ_proxy=logprob_delta",
    ]
    assert bench.parse_mode("occ+lpd") == ("occ", False, "logprob_delta")
    assert bench.parse_mode("occ+ref") == ("occ", True, "hidden_grad")
    cfg = load_config(RECIPE, [*overrides, "policy.train_global_batch_size=4"])  # the bench's overrides validate
    assert cfg.policy.megatron_cfg.mtp_occ_proxy == "logprob_delta" and cfg.policy.megatron_cfg.mtp_occ_reference
    with pytest.raises(ValueError, match="unknown flag"):
        bench.parse_mode("occ+paper")
