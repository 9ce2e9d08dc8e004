"""RL-step composition: Pilot-Commit counts, sync/async formulas, refit/log-prob/training by hand, baseline fit."""

import numpy as np
import pytest

from nemo_rl_spec.sim import model_math as mm
from nemo_rl_spec.sim.config import CONFIG_DIR, load_scenario
from nemo_rl_spec.sim.formulas import phase_amdahl_speedup
from nemo_rl_spec.sim.interfaces import LayoutSpec, PilotCommitSpec, ScenarioSpec
from nemo_rl_spec.sim.phases import logprob_seconds, refit_seconds, training_seconds
from nemo_rl_spec.sim.presets import MODELS, resolve_profile
from nemo_rl_spec.sim.simulate import async_step, simulate
from nemo_rl_spec.sim.step import resolve, rollout_counts, scenario_lengths, speculative_overheads, train_side


def zero() -> ScenarioSpec:
    return load_scenario(CONFIG_DIR / "paper_8b_rl_zero.yaml")


def test_pilot_commit_rollout_counts():
    data = zero().model_dump()
    data["workload"]["pilot_commit"] = PilotCommitSpec(
        sampling_prompts=64, n_pilot=4, n_commit=12, selected_fraction=0.25
    ).model_dump()
    # 64 x 4 pilot + 16 selected x 12 commit generated; 16 x (4 + 12) trained
    assert rollout_counts(ScenarioSpec.model_validate(data)) == (448, 256)
    assert rollout_counts(zero()) == (8192, 8192)


def test_refit_by_hand():
    prof = resolve_profile("gb200", {"refit_overhead_s": 1.0, "refit_bw_eff": 0.5})
    lay = LayoutSpec(total_devices=8, gen_devices_per_engine=2)
    # 1e9 params * 2 B / 2 devices = 1e9 B per device over 900 GB/s * 0.5
    assert refit_seconds(10**9, 2.0, prof, lay) == pytest.approx(1.0 + 1e9 / 450e9)


def test_logprob_and_training_from_flops():
    m, prof = MODELS["qwen3-8b"], resolve_profile("gb200", {"logprob_mfu": 0.4, "train_mfu": 0.4})
    seqs = np.array([1000.0, 3000.0])
    flops = mm.forward_flops_sequences(m, seqs)
    assert logprob_seconds(m, prof, 32, seqs) == pytest.approx(flops / (32 * 2.5e15 * 0.4))
    assert logprob_seconds(m, prof, 32, seqs, with_reference=True) == pytest.approx(2 * flops / (32 * 2.5e15 * 0.4))
    assert training_seconds(m, prof, 32, seqs) == pytest.approx(3 * logprob_seconds(m, prof, 32, seqs))


def test_online_draft_training_scales_with_the_ttt_unroll():
    """Online EAGLE-3 training costs ttt_steps x 3 x the draft's forward FLOPs (default ttt_steps = k)."""
    base = load_scenario(CONFIG_DIR / "cpu_smollm2_default.yaml").model_dump()
    base["speculative"].update(k=3, online_draft_training=True)
    lengths = np.array([100.0, 60.0, 160.0])
    extra = {}
    for ttt in (None, 1, 5):
        res = resolve(ScenarioSpec.model_validate({**base, "speculative": {**base["speculative"], "ttt_steps": ttt}}))
        extra[ttt], _ = speculative_overheads(res, lengths, 1)
    seqs = res.scenario.workload.prompt_tokens + lengths
    one = (
        3
        * mm.forward_flops_sequences(res.draft, seqs)
        / (res.profile.hardware.peak_flops * res.profile.efficiency.train_mfu)
    )
    assert extra[1] == pytest.approx(one, rel=1e-12)
    assert extra[None] == pytest.approx(3 * one, rel=1e-12) and extra[5] == pytest.approx(5 * one, rel=1e-12)


def _cpu_spec(online: bool, period: int):
    base = load_scenario(CONFIG_DIR / "cpu_smollm2_default.yaml").model_dump()
    spec = {**base["speculative"], "k": 3, "online_draft_training": online, "draft_train_period": period}
    return resolve(ScenarioSpec.model_validate({**base, "speculative": spec}))


def test_a_draft_trained_every_nth_step_costs_a_nth_of_its_training_and_refit():
    """Both paths: the overheads added to measured phases and the predicted train side (its refit)."""
    lengths = np.array([100.0, 60.0, 160.0])
    (train1, refit1), (train4, refit4) = (speculative_overheads(_cpu_spec(True, p), lengths, 1) for p in (1, 4))
    assert train1 > 0 and refit1 > 0
    assert train4 == pytest.approx(train1 / 4, rel=1e-12) and refit4 == pytest.approx(refit1 / 4, rel=1e-12)
    assert speculative_overheads(_cpu_spec(False, 4), lengths, 1)[0] == 0.0  # the period is an online key
    model_refit = train_side(_cpu_spec(True, 1), lengths, 1, False)[2]
    draft1, draft4 = (train_side(_cpu_spec(True, p), lengths, 1, True)[2] - model_refit for p in (1, 4))
    assert draft1 > 0 and draft4 == pytest.approx(draft1 / 4, rel=1e-9)


def test_baseline_fit_and_sync_composition():
    scn = zero()
    r = simulate(scn)
    assert r.ar.generation == pytest.approx(100.0, rel=1e-3)  # lengths fitted to the measured AR generation
    assert r.ar_step_s == pytest.approx(r.ar.total) and r.spec_step_s == pytest.approx(r.spec.total)
    assert r.spec.other == 51.2
    assert r.e2e_speedup == pytest.approx(r.ar.total / r.spec.total, rel=1e-12)
    # Amdahl over the phase fractions; the only other change is the draft's refit (~1 ms)
    amdahl = phase_amdahl_speedup({"gen": r.ar.generation, "rest": 51.2}, {"gen": r.generation_speedup})
    assert r.e2e_speedup == pytest.approx(amdahl, rel=1e-4)
    assert 0 < r.spec.refit < 0.01


def test_async_step_formula():
    scn = load_scenario(CONFIG_DIR / "qwen3_235b_2048gb200_async.yaml")
    res = resolve(scn)
    step, ph = async_step(res, scenario_lengths(res), False, 1536)
    assert step == pytest.approx(max(ph.generation, ph.logprob + ph.training) + ph.refit)
    # exposed generation at the AR split: generation beyond log-probs + training, AR and speculative
    r = simulate(scn)
    split = int(r.details["ar_gen_devices"])
    lengths = scenario_lengths(res)
    for speculative, key in ((False, "exposed_generation_ar_s"), (True, "exposed_generation_spec_s")):
        _, ph = async_step(res, lengths, speculative, split)
        assert r.details[key] == pytest.approx(max(0.0, ph.generation - ph.logprob - ph.training), rel=1e-12)


def test_async_needs_separate_pools():
    data = load_scenario(CONFIG_DIR / "qwen3_235b_2048gb200_async.yaml").model_dump()
    data["layout"]["colocated"] = True
    with pytest.raises(ValueError, match="non-colocated"):
        simulate(ScenarioSpec.model_validate(data))


def test_unreachable_baseline_is_an_error():
    # 1024 rollouts of at most 8192 tokens cannot keep 32 GB200 busy for 100 s
    scn = load_scenario(
        CONFIG_DIR / "paper_8b_rl_zero.yaml", workload={"num_prompts": 64, "response": {"max_tokens": 8192}}
    )
    with pytest.raises(ValueError, match="resize the workload"):
        simulate(scn)
