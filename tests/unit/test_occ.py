"""OCC coefficient: the rule on exact c and v2 (signed, optional clamp), the per-mode head coefficients, the MTP
log-probs / acceptance on a hand example, and the benchmark's proxy validation and summaries (docs/guides/occ.md)."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_spec.algorithms.loss import mtp_loss as ml
from nemo_rl_spec.algorithms.occ import MTPCoefficient, occ_lambda
from nemo_rl_spec.bench import occ as bench_occ


def test_occ_lambda_hand_values_sign_and_clamp():
    assert occ_lambda(2.0, 4.0, 1.0, 1e-8) == pytest.approx(0.5, rel=1e-7)
    assert occ_lambda(2.0, 4.0, 3.0, 1.0) == pytest.approx(1.2, rel=1e-12)  # 3 * 2 / 5
    assert occ_lambda(-1.0, 4.0, 1.0, 1e-8) == pytest.approx(-0.25, rel=1e-7)  # opposed: signed
    assert occ_lambda(0.0, 0.0, 1.0, 1e-8) == 0.0  # no signal (e.g. all advantages 0): 0 / eps
    assert occ_lambda(5.0, 1.0, 1.0, 1e-8, lambda_max=2.0) == 2.0
    assert occ_lambda(-5.0, 1.0, 1.0, 1e-8, lambda_max=2.0) == -2.0  # the clamp bounds |lambda|
    with pytest.raises(ValueError):
        occ_lambda(1.0, -1.0, 1.0, 1e-8)
    with pytest.raises(ValueError):
        occ_lambda(1.0, 1.0, 1.0, 0.0)


def test_coefficient_per_mode():
    assert MTPCoefficient("detach", 0.3).fixed(2) == [0.5, 0.5]  # the heads' mean CE, head-only
    assert MTPCoefficient("ce", 0.3).fixed(1) == [0.3]
    assert MTPCoefficient("policy", 0.3).fixed(3) == pytest.approx([0.1, 0.1, 0.1])
    # occ: per head from the log-prob changes; d = (0.5, 0, -0.5), d_mtp = (-2, 1, -1) -> mean 0.25 / 3, / K heads
    prev = torch.tensor([[0.0, -1.0, -2.0, -1.0]])
    curr = torch.tensor([[0.0, -0.5, -2.0, -1.5]])
    mtp = torch.tensor([[0.0, -3.0, -1.0, -2.0]])
    valid = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    lams = MTPCoefficient("occ", 0.3, eps=1e-12).occ([(mtp, valid), (mtp, valid)], curr, prev)
    assert lams == pytest.approx([0.3 * 0.25 / 3 / 2] * 2, rel=1e-9)
    with pytest.raises(ValueError):
        MTPCoefficient("mse", 0.3)


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


def test_bench_occ_mode_syntax():
    bench = bench_occ
    assert bench.mode_overrides("occ") == ["policy.megatron_cfg.mtp_loss_mode=occ"]
    assert bench.mode_overrides("policy@1+ref") == [
        "policy.megatron_cfg.mtp_loss_mode=policy",
        "policy.megatron_cfg.mtp_loss_scaling_factor=1.0",
        "+policy.megatron_cfg.mtp_occ_reference=true",
    ]
    assert bench.mode_overrides("occ+ref+ratio")[-1] == "+policy.megatron_cfg.mtp_occ_proxy=logprob_delta_ratio"
    assert bench.parse_mode("occ@0.1") == ("occ", 0.1, False)
    for bad in ("occ+lpd", "policy@x", "policy@-1"):
        with pytest.raises(ValueError):
            bench.parse_mode(bad)


def test_bench_occ_proxy_validation_per_optimizer_step():
    """Points are the optimizer steps after each GRPO step's first; by hand: 4 points (lambda, lambda_ref, c) =
    (1, 2, 4), (-1, 3, 3), (0.5, 0.5, -1), (2, 1, 0.5); |c| median 2 -> top half c = 4, 3: signs agree on 1 of 2;
    ratios |lambda| / |lambda_ref| there 0.5, 1/3 -> median 5/12."""
    seeds = {
        "0": {
            "minibatch_series": {
                "lambda": [[0.0, 1.0, -1.0]],
                "lambda_ref": [[9.0, 2.0, 3.0]],
                "c_ref": [[9.0, 4.0, 3.0]],
            }
        },
        "1": {
            "minibatch_series": {
                "lambda": [[0.0, 0.5], [0.0, 2.0]],
                "lambda_ref": [[7.0, 0.5], [7.0, 1.0]],
                "c_ref": [[7.0, -1.0], [7.0, 0.5]],
            }
        },
    }
    out = bench_occ.proxy_validation(seeds)
    assert out["n"] == 4 and out["n_top_half"] == 2
    assert out["sign_agreement"] == 0.5  # (1, c 4) and (2, c 0.5) agree; (-1, c 3) and (0.5, c -1) do not
    assert out["sign_agreement_top_half_c"] == 0.5
    assert out["scale_ratio_median"] == pytest.approx(5 / 12)
    assert out["spearman_lambda"] == pytest.approx(
        float(torch.corrcoef(torch.tensor([[2.0, 0.0, 1.0, 3.0], [2.0, 3.0, 0.0, 1.0]]))[0, 1])
    )


def test_bench_occ_summary_peak_accuracy_skips_step_zero():
    bench = bench_occ
    rows = (
        [{"step": 0, "validation/accuracy": 0.9}]
        + [{"step": k, "timing/train/total_step_time": 2.0, "timing/train/policy_training": 1.0} for k in (1, 2, 3)]
        + [{"step": 2, "validation/accuracy": 0.6}, {"step": 3, "validation/accuracy": 0.5}]
    )
    s = bench.summarise(rows)
    assert s["peak_accuracy"] == 0.6 and s["final_accuracy"] == 0.5
    assert s["max_drawdown"] == pytest.approx(0.1)  # 0.6 -> 0.5 (step 0 is not a trained validation)
    assert bench.max_drawdown([0.5, 0.8, 0.7, 0.9, 0.85]) == pytest.approx(0.1)
    assert bench.max_drawdown([0.1, 0.2]) == 0.0 and bench.max_drawdown([]) == 0.0
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
