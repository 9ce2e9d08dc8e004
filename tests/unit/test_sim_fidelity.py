"""Held-out fidelity (nemo_rl_spec.sim.fidelity) and the speculative micro-benchmark comparison (spec_bench):
hand-worked numbers and synthetic runs with a known truth. No timing, no vLLM."""

import json

import pytest

from nemo_rl_spec.cli import run_sim
from nemo_rl_spec.sim.calibrate import predict
from nemo_rl_spec.sim.config import CONFIG_DIR, load_scenario
from nemo_rl_spec.sim.fidelity import (
    apply_ratios,
    compare,
    conditional_acceptance,
    fidelity,
    phase_ratios,
    scenario_from_recipe,
    split_fit_holdout,
    step_inputs,
    timed_steps,
)
from nemo_rl_spec.sim.formulas import tokens_per_pass_per_position
from nemo_rl_spec.sim.interfaces import PhaseTimes
from nemo_rl_spec.sim.spec_bench import bench_scenario, compare_bench

CPU = CONFIG_DIR / "cpu_smollm2_default.yaml"
TRUTH_RATIOS = {"generation": 2.0, "logprob": 1.5, "training": 0.8}
TRUTH_REFIT_OVERHEAD = 4.0  # seconds per refit on top of the bytes term


def truth_of(scn):
    """The prior profile with TRUTH_RATIOS and a fixed refit cost of TRUTH_REFIT_OVERHEAD s."""
    scaled = apply_ratios(scn, TRUTH_RATIOS)
    return scaled.model_copy(update={"efficiency": {**scaled.efficiency, "refit_overhead_s": TRUTH_REFIT_OVERHEAD}})


def record(step, phases, extra):
    return {
        "step": step,
        "timing/train/generation": phases.generation,
        "timing/train/policy_and_reference_logprobs": phases.logprob,
        "timing/train/policy_training": phases.training,
        "timing/train/weight_sync": phases.refit,
        "timing/train/total_step_time": phases.total,
        **extra,
    }


def synthetic_run(scn, lengths, speculative=False, extra=None, other=0.5):
    """Steps 1.. of a run whose truth is :func:`truth_of` ``scn``; step 1 is a warm-up at 3x the cost."""
    truth = truth_of(scn)
    rows = []
    for i, length in enumerate(lengths, start=1):
        inputs = {"train/mean_response_length": length, **(extra or {})}
        ph = predict(step_inputs(truth, inputs), speculative).model_copy(update={"other": other})
        if i == 1:
            ph = ph.model_copy(update={k: 3 * v for k, v in ph.model_dump().items()})
        rows.append(record(i, ph, inputs))
    return rows


def test_split_fit_holdout_by_hand():
    steps = [{"step": s} for s in range(1, 7)]
    fit, held = split_fit_holdout(steps, warmup=1)
    assert [r["step"] for r in fit] == [2, 3] and [r["step"] for r in held] == [4, 5, 6]
    fit, held = split_fit_holdout(steps, warmup=2, n_fit=1)
    assert [r["step"] for r in fit] == [3] and [r["step"] for r in held] == [4, 5, 6]
    with pytest.raises(ValueError):
        split_fit_holdout(steps[:2], warmup=1)
    with pytest.raises(ValueError):
        split_fit_holdout(steps, warmup=1, n_fit=5)


def test_timed_steps_drops_validation_only_records_and_sorts():
    rows = [
        {"step": 3, "timing/train/total_step_time": 1.0},
        {"step": 0, "validation/accuracy": 0.1},
        {"step": 2, "timing/train/total_step_time": 2.0},
    ]
    assert [r["step"] for r in timed_steps(rows)] == [2, 3]


def test_conditional_acceptance_from_vllm_rates():
    rec = {
        "vllm/spec_acceptance_rate_pos0": 0.6,
        "vllm/spec_acceptance_rate_pos1": 0.3,
        "vllm/spec_acceptance_rate_pos2": 0.15,
    }
    alphas = conditional_acceptance(rec, 3)
    assert alphas == pytest.approx([0.6, 0.5, 0.5])
    # tokens per pass = 1 + sum of the unconditional rates = 2.05
    assert tokens_per_pass_per_position(alphas) == pytest.approx(2.05)
    assert conditional_acceptance(rec, 4) is None  # position 3 missing
    assert conditional_acceptance(
        {
            "vllm/spec_acceptance_rate_pos0": 0.5,
            "vllm/spec_acceptance_rate_pos1": 0.0,
            "vllm/spec_acceptance_rate_pos2": 0.0,
        },
        3,
    ) == [0.5, 0.0, 0.0]


def test_compare_by_hand():
    meas = [
        PhaseTimes(generation=10, logprob=4, training=20, refit=1, other=0.5),
        PhaseTimes(generation=20, logprob=6, training=20, refit=1, other=0.5),
    ]
    pred = [
        PhaseTimes(generation=12, logprob=5, training=18, refit=2, other=0.5),
        PhaseTimes(generation=18, logprob=5, training=18, refit=2, other=0.5),
    ]
    out = compare(pred, meas, [4, 5])["phases"]
    assert out["generation"]["measured_s"] == 15 and out["generation"]["predicted_s"] == 15
    assert out["generation"]["error"] == 0 and out["generation"]["per_step_error"] == pytest.approx([0.2, -0.1])
    assert out["logprob"]["error"] == 0
    assert out["training"]["error"] == pytest.approx(-0.1)
    assert out["refit"]["error"] == pytest.approx(1.0)
    # totals 35.5 and 47.5 measured, 37.5 and 43.5 predicted: means 41.5 vs 40.5
    assert out["total"]["error"] == pytest.approx(40.5 / 41.5 - 1)
    with pytest.raises(ValueError):
        compare(pred[:1], meas, [4, 5])


def test_apply_ratios_scales_each_phase_exactly():
    scn = load_scenario(CPU)
    base = predict(step_inputs(scn, {"train/mean_response_length": 100.0}), False)
    scaled = predict(
        step_inputs(apply_ratios(scn, {**TRUTH_RATIOS, "refit": 3.0}), {"train/mean_response_length": 100.0}), False
    )
    for ph, r in {**TRUTH_RATIOS, "refit": 3.0}.items():
        assert getattr(scaled, ph) == pytest.approx(r * getattr(base, ph), rel=1e-9), ph


def test_refit_fixed_cost_is_additive():
    """The fitted refit cost is a fixed overhead: a speculative step adds only the draft's bytes / bandwidth
    (538 MB of SmolLM2 in 0.4 s -> the 33.4M-parameter fp32 draft adds 133.6 MB / 1.345 GB/s = 0.0993 s)."""
    scn = load_scenario(CPU)
    rows = synthetic_run(scn, [100, 70, 90, 130])
    rep = fidelity(scn, rows, warmup=1)
    assert rep["fit"]["refit_overhead_s"] == pytest.approx(TRUTH_REFIT_OVERHEAD, rel=1e-9)
    fitted = scn.model_copy(update={"efficiency": rep["fit"]["efficiency"]})
    ar, sp = predict(fitted, False).refit, predict(fitted, True).refit
    draft_bytes = 4.0 * 33.4e6
    assert sp - ar == pytest.approx(draft_bytes / (10e9 * 0.1345), rel=2e-3)
    assert ar == pytest.approx(TRUTH_REFIT_OVERHEAD + 0.40, rel=0.01)


def test_step_inputs_use_each_steps_length():
    scn = load_scenario(CPU)
    short = predict(step_inputs(scn, {"train/mean_response_length": 60.0}), False)
    long = predict(step_inputs(scn, {"train/mean_response_length": 120.0}), False)
    assert long.generation > short.generation and long.training > 1.5 * short.training


def test_held_out_steps_are_predicted_exactly_when_the_truth_is_a_profile():
    """Truth: the prior profile with TRUTH_RATIOS; steps differ in response length. The fit (steps 2-3) must
    recover the ratios and predict steps 4-6 exactly from their own lengths; the prior must miss by the ratios."""
    scn = load_scenario(CPU)
    rows = synthetic_run(scn, [100, 70, 90, 130, 60, 110])
    rep = fidelity(scn, rows, warmup=1)
    assert rep["fit"]["steps"] == [2, 3] and rep["ar_holdout"]["steps"] == [4, 5, 6]
    for ph, r in TRUTH_RATIOS.items():
        assert rep["fit"]["ratios"][ph] == pytest.approx(r, rel=1e-9)
    assert rep["fit"]["other_s"] == pytest.approx(0.5)
    for ph, v in rep["ar_holdout"]["phases"].items():
        assert v["error"] == pytest.approx(0.0, abs=1e-9), ph
    assert rep["fit"]["refit_overhead_s"] == pytest.approx(TRUTH_REFIT_OVERHEAD, rel=1e-9)
    prior = rep["ar_prior"]["phases"]
    assert prior["generation"]["error"] == pytest.approx(1 / 2.0 - 1, abs=1e-9)
    assert prior["training"]["error"] == pytest.approx(1 / 0.8 - 1, abs=1e-9)
    b = prior["refit"]["predicted_s"]  # the bytes term alone
    assert prior["refit"]["error"] == pytest.approx(b / (b + TRUTH_REFIT_OVERHEAD) - 1, abs=1e-9)


def test_fit_never_reads_held_out_timings():
    scn = load_scenario(CPU)
    rows = synthetic_run(scn, [100, 70, 90, 130, 60, 110])
    ratios = phase_ratios(scn, rows[1:3])
    assert set(ratios) == set(TRUTH_RATIOS)
    corrupted = [dict(r) for r in rows]
    for r in corrupted[3:]:
        r["timing/train/generation"] *= 5.0
    rep = fidelity(scn, corrupted, warmup=1)
    assert rep["fit"]["ratios"] == ratios
    assert rep["ar_holdout"]["phases"]["generation"]["error"] == pytest.approx(1 / 5.0 - 1, abs=1e-9)


def test_speculative_run_predicted_from_its_acceptance():
    scn = load_scenario(CPU)
    ar = synthetic_run(scn, [100, 70, 90, 130])
    rates = {
        "vllm/spec_acceptance_rate_pos0": 0.6,
        "vllm/spec_acceptance_rate_pos1": 0.3,
        "vllm/spec_acceptance_rate_pos2": 0.15,
        "vllm/spec_acceptance_length": 2.05,
    }
    sp = synthetic_run(scn, [100, 80, 120], speculative=True, extra=rates)
    rep = fidelity(scn, ar, sp, warmup=1)
    assert rep["spec"]["steps"] == [2, 3]
    for ph, v in rep["spec"]["phases"].items():
        assert v["error"] == pytest.approx(0.0, abs=1e-9), ph
    # the acceptance is an input: the same run without its acceptance metrics (prior acceptance 1.0, i.e. 3x the
    # passes) must be predicted differently.
    no_acc = [{k: v for k, v in r.items() if not k.startswith("vllm/")} for r in sp]
    rep2 = fidelity(scn, ar, no_acc, warmup=1)
    assert abs(rep2["spec"]["phases"]["generation"]["error"]) > 0.05


def test_scenario_from_recipe(tmp_path):
    scn = load_scenario(CPU)
    draft_dir = tmp_path / "head"
    draft_dir.mkdir()
    (draft_dir / "config.json").write_text(json.dumps({"draft_vocab_size": 2048}))
    recipe = {
        "grpo": {"num_prompts_per_step": 8, "num_generations_per_prompt": 2},
        "policy": {
            "generation": {
                "max_new_tokens": 64,
                "vllm_kwargs": {
                    "speculative_config": {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": 5}
                },
            },
            "draft": {"online": True, "ttt_steps": 2, "train_period": 3},
        },
    }
    out = scenario_from_recipe(scn, recipe)
    assert out.speculative.ttt_steps == 2 and out.speculative.draft_train_period == 3
    assert (out.workload.num_prompts, out.workload.generations_per_prompt) == (8, 2)
    assert out.workload.response.max_tokens == 64 and out.workload.response.median_tokens == 64
    assert out.speculative.k == 5 and out.speculative.online_draft_training
    assert out.speculative.draft.vocab == 2048
    plain = scenario_from_recipe(scn, {"grpo": {"num_prompts_per_step": 4}})
    assert plain.speculative == scn.speculative and plain.workload.response == scn.workload.response
    recipe["policy"]["generation"]["vllm_kwargs"]["speculative_config"]["method"] = "mtp"
    with pytest.raises(ValueError):
        scenario_from_recipe(scn, recipe)


def test_cli_fidelity_writes_report(tmp_path, capsys):
    scn = load_scenario(CPU)
    path = tmp_path / "ar.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in synthetic_run(scn, [100, 70, 90, 130, 60])))
    out = tmp_path / "fid.json"
    w = scn.workload  # the recipe of the synthetic run: the scenario's sizes (the default recipe's may differ)
    sizes = [
        f"grpo.num_prompts_per_step={w.num_prompts}",
        f"grpo.num_generations_per_prompt={w.generations_per_prompt}",
        f"policy.generation.max_new_tokens={w.response.max_tokens}",
    ]
    overrides = [arg for size in sizes for arg in ("--override", size)]
    assert run_sim_main()(["fidelity", "--metrics", str(path), "--out", str(out), *overrides]) == 0
    rep = json.loads(out.read_text())
    assert rep["fit"]["steps"] == [2, 3] and rep["ar_holdout"]["steps"] == [4, 5]
    assert abs(rep["ar_holdout"]["phases"]["generation"]["error"]) < 1e-9
    assert "| generation |" in capsys.readouterr().out


def run_sim_main():
    """``examples/run_sim.py``'s main."""
    return run_sim.main


def test_spec_bench_comparison_by_hand():
    rates = [0.6, 0.3, 0.15]
    row = {"batch": 4, "prompt_tokens": 20.4, "max_tokens": 64, "acceptance_length": 2.05, "per_position": rates}
    scn = bench_scenario(
        4, 20.4, 64, 3, conditional_acceptance({f"vllm/spec_acceptance_rate_pos{i}": r for i, r in enumerate(rates)}, 3)
    )
    assert scn.workload.prompt_tokens == 20 and scn.speculative.draft.vocab == 2048
    plain, spec = predict(scn, False).generation, predict(scn, True).generation
    # measured: the machine is 2x slower than the prior at everything -> the plain run fits r = 2 and the
    # speculative prediction is exact; the prior is 50% low on both.
    res = compare_bench({**row, "plain_s": 2 * plain, "spec_s": 2 * spec}, 3)
    assert res["ratio_fitted_on_plain"] == pytest.approx(2.0)
    assert res["spec_fitted_error"] == pytest.approx(0.0, abs=1e-9)
    assert res["plain_prior_error"] == pytest.approx(-0.5) and res["spec_prior_error"] == pytest.approx(-0.5)
    assert res["speedup_measured"] == pytest.approx(res["speedup_predicted"])


def test_cross_run_fit_holds_out_the_whole_other_run():
    """--fit-metrics: fit on run A (steps 2-3 after its warm-up), predict every step of run B after warm-up; run B
    is the truth with training 2x slower, so the fit (training ratio 0.8) predicts B's training 50% low."""
    scn = load_scenario(CPU)
    run_a = synthetic_run(scn, [100, 70, 90])
    run_b = synthetic_run(scn, [120, 60, 100, 80])
    for r in run_b:
        r["timing/train/policy_training"] *= 2.0
    rep = fidelity(scn, run_b, fit_records=run_a, warmup=1)
    assert rep["fit"]["steps"] == [2, 3] and rep["ar_holdout"]["steps"] == [2, 3, 4]
    ph = rep["ar_holdout"]["phases"]
    assert ph["generation"]["error"] == pytest.approx(0.0, abs=1e-9)
    assert ph["training"]["error"] == pytest.approx(-0.5, abs=1e-9)
    with pytest.raises(ValueError):
        fidelity(scn, run_b[:1], fit_records=run_a, warmup=1)
