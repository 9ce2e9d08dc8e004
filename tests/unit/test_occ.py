"""OCC coefficient: the rule, its clamps and zero cases, and a toy with known gradients in which the proxy
lambda_t tracks the closed-form L-smooth optimum (docs/occ.md)."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl_spec.algorithms.loss import mtp_loss as ml
from nemo_rl_spec.algorithms.occ import (
    MTPCoefficient,
    closed_form_lambda,
    occ_lambda,
    occ_proxies,
)
from nemo_rl_spec.bench import occ as bench_occ


def test_occ_lambda_hand_values_and_clamps():
    assert occ_lambda(2.0, 4.0, 1.0, 1e-8) == pytest.approx(0.5, rel=1e-7)
    assert occ_lambda(2.0, 4.0, 3.0, 1.0) == pytest.approx(1.2, rel=1e-12)  # 3 * 2 / 5
    assert occ_lambda(-1.0, 4.0, 1.0, 1e-8) == 0.0  # opposed
    assert occ_lambda(0.0, 0.0, 1.0, 1e-8) == 0.0  # no signal (e.g. all advantages 0): 0 / eps
    assert occ_lambda(5.0, 1.0, 1.0, 1e-8, lambda_max=2.0) == 2.0
    with pytest.raises(ValueError):
        occ_lambda(1.0, -1.0, 1.0, 1e-8)
    with pytest.raises(ValueError):
        occ_lambda(1.0, 1.0, 1.0, 0.0)


def test_coefficient_per_mode():
    assert MTPCoefficient("detach", 0.3)(5.0, 1.0) == 0.0
    assert MTPCoefficient("ce", 0.3)(-5.0, 1.0) == 0.3
    assert MTPCoefficient("policy", 0.3)(5.0, 1.0) == 0.3
    assert MTPCoefficient("occ", 0.3)(5.0, 1.0) == pytest.approx(1.5)
    with pytest.raises(ValueError):
        MTPCoefficient("mse", 0.3)


def test_proxies_hand_values_ignore_padding():
    rl = torch.tensor([[1.0, 2.0], [3.0, -1.0], [100.0, 100.0]])
    mtp = torch.tensor([[0.5, 1.0], [1.0, 1.0], [100.0, 100.0]])
    c, v2 = occ_proxies(rl, mtp, torch.tensor([1.0, 1.0, 0.0]))
    assert float(c) == 0.5 + 2.0 + 3.0 - 1.0
    assert float(v2) == 0.25 + 1.0 + 1.0 + 1.0
    with pytest.raises(ValueError):
        occ_proxies(rl, mtp[:2], torch.ones(3))


def _linear_trunk_toy(theta: float, seed: int = 0, n: int = 32, dim_in: int = 1024, hidden: int = 16):
    """Linear trunk h_p = W x_p (x_p random unit vectors, nearly orthogonal), RL loss through a softmax head
    with advantages, MTP loss linear in h with gradient field m_p = cos(theta) g_p + sin(theta) o_p, where g_p =
    dL_RL/dh_p and o_p is a field of the same size orthogonal to g_p at every position.

    Returns (true c, true v2 in parameter space, c_hat, v2_hat from hidden-state gradients)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim_in, generator=gen, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)
    weight = torch.randn(hidden, dim_in, generator=gen, dtype=torch.float64).requires_grad_(True)
    head = torch.randn(50, hidden, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 50, (n,), generator=gen)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    h = x @ weight.t()
    logp = torch.log_softmax(h @ head.t(), -1).gather(1, targets[:, None]).squeeze(1)
    rl_loss = -(adv * logp).sum() / n
    g_h = torch.autograd.grad(rl_loss, h, retain_graph=True)[0]
    rand = torch.randn(n, hidden, generator=gen, dtype=torch.float64)
    orth = rand - (rand * g_h).sum(1, keepdim=True) / (g_h * g_h).sum(1, keepdim=True) * g_h
    orth = orth / orth.norm(dim=1, keepdim=True) * g_h.norm(dim=1, keepdim=True)
    field = math.cos(theta) * g_h + math.sin(theta) * orth
    mtp_loss = (field.detach() * h).sum()
    g_rl = torch.autograd.grad(rl_loss, weight, retain_graph=True)[0]
    g_mtp_h, g_mtp = torch.autograd.grad(mtp_loss, [h, weight])
    c_hat, v2_hat = occ_proxies(g_h, g_mtp_h, torch.ones(n))
    return float((g_rl * g_mtp).sum()), float((g_mtp * g_mtp).sum()), float(c_hat), float(v2_hat)


def test_toy_lambda_tracks_closed_form_optimum_and_vanishes_when_orthogonal_or_opposed():
    smoothness, lr = 4.0, 0.05
    lambda_plus = (1 - smoothness * lr) / (smoothness * lr)  # the constant of the optimum, docs/occ.md eq. (3)
    thetas = torch.linspace(0.0, math.pi, 25).tolist()
    optimum, proxy = [], []
    for seed in range(3):
        for theta in thetas:
            c, v2, c_hat, v2_hat = _linear_trunk_toy(theta, seed)
            optimum.append(closed_form_lambda(c, v2, smoothness, lr))
            proxy.append(occ_lambda(c_hat, v2_hat, lambda_plus, 1e-12))
    optimum, proxy = torch.tensor(optimum), torch.tensor(proxy)
    corr = torch.corrcoef(torch.stack([optimum, proxy]))[0, 1]
    assert corr > 0.9, float(corr)
    assert (proxy - optimum).abs().max() < 0.25 * optimum.max()
    aligned = proxy.view(3, -1)[:, 0]
    assert aligned.min() > 3.0  # about lambda_plus = 4 when the MTP gradient equals the RL one
    orthogonal = proxy.view(3, -1)[:, 12]  # theta = pi / 2
    assert orthogonal.abs().max() < 0.05 * aligned.min()
    opposed = proxy.view(3, -1)[:, 14:]  # theta > pi / 2 + 2 steps
    assert torch.all(opposed == 0.0)


@pytest.mark.numerics
def test_mtp_token_logprobs_and_acceptance_hand_example():
    # vocab 3, one row of 5 tokens; MTP head 0 at position p predicts token p + 2
    ids = torch.tensor([[0, 1, 2, 1, 0]])
    mtp_logits = torch.full((1, 5, 3), -10.0)
    main_logits = torch.full((1, 5, 3), -10.0)
    for p, tok in enumerate([2, 1, 1, 0, 0]):  # MTP top-1 at p
        mtp_logits[0, p, tok] = 10.0
    for p, tok in enumerate([1, 2, 1, 2, 0]):  # main top-1 at p (predicts p + 1)
        main_logits[0, p, tok] = 10.0
    lp = ml.mtp_token_logprobs(mtp_logits, ids, head=0)
    assert lp[0, :2].abs().max() == 0.0
    assert lp[0, 2] == pytest.approx(0.0, abs=1e-6)  # target 2 predicted from p = 0: top-1 2
    assert lp[0, 3] == pytest.approx(0.0, abs=1e-6)  # target 1 from p = 1: top-1 1
    assert lp[0, 4] == pytest.approx(-20.0, abs=1e-6)  # target 0 from p = 2: top-1 1
    data = dict(
        token_mask=torch.tensor([[0.0, 0.0, 1.0, 1.0, 1.0]]), sample_mask=torch.ones(1), input_lengths=torch.tensor([5])
    )
    valid = ml.mtp_valid_mask(data, 0)
    assert valid.tolist() == [[0.0, 0.0, 1.0, 1.0, 1.0]]
    # targets s = 2, 3, 4: MTP top-1 at s-2 = 2, 1, 1; main top-1 at s-1 = 2, 1, 2 -> 2 of 3 agree
    assert ml.mtp_acceptance_counts(mtp_logits, main_logits, valid, 0) == (2.0, 3.0)
    assert float(ml.mtp_ce_loss(lp, valid, 3.0)) == pytest.approx(20.0 / 3, rel=1e-5)
    data["input_lengths"] = torch.tensor([4])  # padding at s = 4 never counts
    assert ml.mtp_valid_mask(data, 0).tolist() == [[0.0, 0.0, 1.0, 1.0, 0.0]]


def test_bench_occ_reference_mode_overrides_and_proxy_validation():
    bench = bench_occ
    assert bench.mode_overrides("occ") == ["policy.megatron_cfg.mtp_loss_mode=occ"]
    assert bench.mode_overrides("occ+ref") == [
        "policy.megatron_cfg.mtp_loss_mode=occ",
        "+policy.megatron_cfg.mtp_occ_reference=true",
    ]
    # seed 0: c_hat = 2 c_ref + 1 (pearson 1); seed 1 continues the line; one step where the signs differ
    seeds = {
        "0": {
            "series": {
                "c_hat": [1.0, 3.0, 5.0],
                "c_ref": [0.0, 1.0, 2.0],
                "v2_hat": [1.0, 2.0, 3.0],
                "v2_ref": [3.0, 2.0, 1.0],
                "lambda": [0.0, 1.0, 2.0],
                "lambda_ref": [0.0, 1.0, 2.0],
            }
        },
        "1": {
            "series": {
                "c_hat": [7.0],
                "c_ref": [3.0],
                "v2_hat": [4.0],
                "v2_ref": [0.0],
                "lambda": [3.0],
                "lambda_ref": [3.0],
            }
        },
    }
    out = bench.proxy_validation(seeds)
    assert out["pearson_c"] == pytest.approx(1.0, abs=1e-12)
    assert out["pearson_v2"] == pytest.approx(-1.0, abs=1e-12) and out["spearman_v2"] == pytest.approx(-1.0)
    assert out["spearman_c"] == pytest.approx(1.0)
    assert out["pearson_lambda"] == pytest.approx(1.0, abs=1e-12)
    assert out["sign_agreement_c"] == 0.75  # c_hat = 1 > 0 while c_ref = 0 at the first step
    assert out["n"] == 4 and "pearson_c_decoder" not in out  # no decoder-only series given
    seeds["0"]["series"]["c_ref_decoder"] = [-1.0, -3.0, -5.0]
    seeds["1"]["series"]["c_ref_decoder"] = [-7.0]
    out = bench.proxy_validation(seeds)
    assert out["pearson_c_decoder"] == pytest.approx(-1.0, abs=1e-12) and out["sign_agreement_c_decoder"] == 0.0
    # lambda > 0 vs c > 0 (either proxy's coefficient against the reference alignment); NaN steps are dropped
    seeds["1"]["series"]["lambda"] = [float("nan")]
    seeds["0"]["series"]["lambda"] = [0.5, 0.0, 2.0]
    out = bench.proxy_validation(seeds)
    assert out["sign_agreement_lambda_vs_c"] == pytest.approx(1 / 3)  # (0.5, 0) no, (0, 1) no, (2, 2) yes
    assert out["n"] == 4  # c pairs keep every step


def test_bench_occ_summary_peak_accuracy_skips_step_zero():
    bench = bench_occ
    rows = (
        [{"step": 0, "validation/accuracy": 0.9}]
        + [{"step": k, "timing/train/total_step_time": 2.0, "timing/train/policy_training": 1.0} for k in (1, 2, 3)]
        + [{"step": 2, "validation/accuracy": 0.6}, {"step": 3, "validation/accuracy": 0.5}]
    )
    s = bench.summarise(rows)
    assert s["peak_accuracy"] == 0.6 and s["final_accuracy"] == 0.5
    assert s["validation"] == [(0, 0.9), (2, 0.6), (3, 0.5)]


def test_bench_occ_resumes_finished_runs_and_reports_intervals(tmp_path):
    """``--reuse`` on hand-written finished run dirs: no run starts, the JSON has each mode's per-seed final
    accuracy, its mean and a bootstrap interval inside the per-seed range, and the occ / detach step-time ratio."""
    import json

    bench = bench_occ

    def write(mode, seed, acc, step_s):
        d = tmp_path / "runs" / f"{mode}_seed{seed}"
        (d / "logs").mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"returncode": 0, "wall_s": 1.0}))
        rows = [{"step": 0, "validation/accuracy": 0.3}] + [
            {
                "step": i,
                "timing/train/total_step_time": step_s,
                "timing/train/policy_training": step_s / 2,
                "train/reward": 0.5,
                "train/mtp/acceptance": 0.4,
            }
            for i in (1, 2)
        ]
        rows[-1]["validation/accuracy"] = acc
        (d / "logs" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))

    for seed, (a_detach, a_occ) in enumerate([(0.6, 0.7), (0.8, 0.7), (0.7, 0.9)]):
        write("detach", seed, a_detach, 2.0)
        write("occ", seed, a_occ, 2.2)
    out = tmp_path / "occ.json"
    rc = bench.main(
        [
            "--out",
            str(out),
            "--config",
            "configs/grpo_math_testbed_mtp.yaml",
            "--modes",
            "detach",
            "occ",
            "--seeds",
            "0",
            "1",
            "2",
            "--steps",
            "2",
            "--work-dir",
            str(tmp_path / "runs"),
            "--reuse",
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    acc = result["per_mode"]["occ"]["final_accuracy"]
    assert acc["per_seed"] == {"0": 0.7, "1": 0.7, "2": 0.9} and acc["mean"] == pytest.approx(2.3 / 3)
    assert 0.7 - 1e-12 <= acc["interval90"][0] <= acc["mean"] <= acc["interval90"][1] <= 0.9 + 1e-12  # fmean rounding
    assert result["per_mode"]["detach"]["mtp_acceptance"]["mean"] == pytest.approx(0.4)
    assert result["overhead"]["occ_vs_detach_step_time"] == pytest.approx(1.1)
    assert result["failed_runs"] == [] and out.with_suffix(".png").is_file()
    vs = result["vs_detach"]["occ"]["final_accuracy"]  # paired by seed: 0.7-0.6, 0.7-0.8, 0.9-0.7
    assert vs["per_seed"] == pytest.approx({"0": 0.1, "1": -0.1, "2": 0.2})
    assert vs["above"] == 2 and vs["below"] == 1 and vs["mean"] == pytest.approx(0.2 / 3)
    assert "detach" not in result["vs_detach"]
