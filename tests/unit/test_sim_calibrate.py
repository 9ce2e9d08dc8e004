"""Calibration from metrics.jsonl (synthetic runs with a known truth) and the docs/results/cpu_step_costs.md CPU profile fit."""

import json

import numpy as np
import pytest

from nemo_rl_spec.cli import run_sim
from nemo_rl_spec.sim import model_math as mm
from nemo_rl_spec.sim.calibrate import (
    calibrate,
    fit_mean_length_scale,
    measured_phases,
    predict,
    read_jsonl,
    summarize,
)
from nemo_rl_spec.sim.config import CONFIG_DIR, load_scenario
from nemo_rl_spec.sim.cpu_profile import cpu_efficiency_from_design, design_fit_errors
from nemo_rl_spec.sim.lengths import sample_lengths
from nemo_rl_spec.sim.presets import CPU_EFFICIENCY, MODELS

CPU = CONFIG_DIR / "cpu_smollm2_default.yaml"


def record(step, phases, extra):
    total = phases.total
    return {
        "step": step,
        "timing/train/generation": phases.generation,
        "timing/train/policy_and_reference_logprobs": phases.logprob,
        "timing/train/policy_training": phases.training,
        "timing/train/weight_sync": phases.refit,
        "timing/train/total_step_time": total,
        **extra,
    }


def write_run(path, phases, extra, steps=4):
    """A warm-up step at twice the cost, then identical steps (the median must ignore the warm-up)."""
    warm = phases.model_copy(update={k: 2 * v for k, v in phases.model_dump().items()})
    rows = [record(1, warm, extra)] + [record(s, phases, extra) for s in range(2, steps + 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_summarize_median_after_warmup_and_other():
    rows = [
        {"step": 1, "timing/train/total_step_time": 100.0, "timing/train/generation": 90.0},
        {"step": 2, "timing/train/total_step_time": 10.0, "timing/train/generation": 4.0},
        {"step": 3, "timing/train/total_step_time": 12.0, "timing/train/generation": 6.0},
        {"step": 4, "validation/accuracy": 0.5},
    ]
    s = summarize(rows, skip=1)
    assert s["timing/train/total_step_time"] == 11.0 and s["timing/train/generation"] == 5.0
    assert measured_phases(s).other == pytest.approx(6.0)
    with pytest.raises(ValueError):
        summarize(rows, skip=3)


def test_mean_length_fit():
    scn = load_scenario(CPU)
    scale = fit_mean_length_scale(scn, 120.0)
    lengths = sample_lengths(scn.workload.response, 16, scn.workload.seed, scale)
    assert lengths.mean() == pytest.approx(120.0, abs=1.0 / 16 + 1e-9)  # integer lengths of 16 rollouts


def test_calibration_recovers_a_known_truth(tmp_path):
    """Truth: the prior CPU profile with decode 1.3x slower, training MFU x0.8, log-prob MFU x1.1, refit 1.5x
    slower. Fitting on the AR run must reproduce it exactly and predict the speculative run exactly."""
    prior = load_scenario(CPU)
    e = CPU_EFFICIENCY
    truth_eff = {
        **e.model_dump(),
        "decode_flops_eff": e.decode_flops_eff / 1.3,
        "mem_bw_eff": e.mem_bw_eff / 1.3,
        "prefill_mfu": e.prefill_mfu / 1.3,
        "forward_overhead_s": e.forward_overhead_s * 1.3,
        "train_mfu": e.train_mfu * 0.8,
        "logprob_mfu": e.logprob_mfu * 1.1,
        "refit_bw_eff": e.refit_bw_eff / 1.5,
    }
    extra_ar = {"train/mean_response_length": 120.0}
    extra_sp = {"train/mean_response_length": 120.0, "vllm/spec_acceptance_length": 1.8}
    from nemo_rl_spec.sim.calibrate import with_measured_inputs

    truth = prior.model_copy(update={"efficiency": truth_eff})
    ar_truth = predict(with_measured_inputs(truth, extra_ar), False).model_copy(update={"other": 2.0})
    sp_truth = predict(with_measured_inputs(truth, extra_sp), True).model_copy(update={"other": 2.0})
    ar_file = write_run(tmp_path / "ar.jsonl", ar_truth, extra_ar)
    sp_file = write_run(tmp_path / "sp.jsonl", sp_truth, extra_sp)
    fitted, rep = calibrate(prior, read_jsonl(ar_file), read_jsonl(sp_file))
    assert all(abs(v) < 1e-9 for v in rep["in_sample_ar_residuals"].values()), rep["in_sample_ar_residuals"]
    assert all(abs(v) < 1e-9 for v in rep["spec_errors"].values()), rep["spec_errors"]
    assert rep["prior_ar_errors"]["generation"] == pytest.approx(1 / 1.3 - 1, abs=1e-9)
    assert fitted.efficiency["train_mfu"] == pytest.approx(truth_eff["train_mfu"], rel=1e-9)


def test_cli_calibrate_writes_a_loadable_scenario(tmp_path, capsys):
    main = run_sim_main()
    ar = predict(load_scenario(CPU), False)
    ar_file = write_run(tmp_path / "ar.jsonl", ar, {"train/mean_response_length": 90.0})
    out = tmp_path / "fitted.yaml"
    assert main(["calibrate", "--metrics", str(ar_file), "--out", str(out)]) == 0
    fitted = load_scenario(out)
    assert fitted.name == "cpu_smollm2_default_fitted"
    assert "in_sample_ar_residuals" in capsys.readouterr().out


def test_cpu_profile_preset_is_the_design_fit():
    fit = cpu_efficiency_from_design().model_dump()
    for key, value in CPU_EFFICIENCY.model_dump().items():
        assert value == pytest.approx(fit[key], rel=2e-3, abs=1e-6), key
    assert np.all(np.abs(design_fit_errors()) < 0.20)  # every docs/results/cpu_step_costs.md step cost within 20%
    assert np.sqrt(np.mean(design_fit_errors() ** 2)) < 0.10


def test_cpu_training_mfu_by_hand():
    # Megatron fwd+bwd of 8 x 256 tokens in 23 s on 1 thread: 3 x (2 P 2048 + 2 L H d 8 256^2) FLOPs
    flops = 3 * (2 * mm.matmul_params_per_token(MODELS["smollm2-135m"]) * 2048 + 2 * 30 * 9 * 64 * 8 * 256**2)
    assert cpu_efficiency_from_design().train_mfu == pytest.approx(flops / (23.0 * 2.94e11), rel=1e-12)


def run_sim_main():
    """``examples/run_sim.py``'s main."""
    return run_sim.main
