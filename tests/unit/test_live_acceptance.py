"""Live-acceptance k: the acceptance estimate and the per-step choice of k, against hand-worked numbers."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from nemo_rl_spec.speculative.live_acceptance import (
    AcceptanceEstimate,
    LiveKLookup,
    install_live_acceptance,
    prior_acceptance,
)
from nemo_rl_spec.utils.feature_configs import DynamicSpeculationConfig

# step costs (seconds): AR 10 ms at every batch; k = 1 costs 12 ms, k = 3 costs 15 ms at b = 1 and 30 ms at b = 4
AR = {1: 0.010, 4: 0.010}
SPEC = {1: {1: 0.012, 4: 0.020}, 3: {1: 0.015, 4: 0.030}}
CAP = [0, 3, 3, 3, 1, 0]  # vLLM's dense lookup: index = running batch, index 0 unused


def test_estimate_counts_tried_proposals_and_decays():
    est = AcceptanceEstimate(prior_rate=0.5, prior_trials=2.0, half_life=1.0)
    assert est.rate == 0.5
    est.observe(3, 1)  # accepted 1, rejected the 2nd: tried 2
    est.observe(3, 3)  # all accepted: tried 3
    est.observe(2, 0)  # tried 1
    assert (est.accepted, est.tried) == (4.0, 6.0)
    assert est.rate == pytest.approx((2 * 0.5 + 4) / (2 + 6))  # 0.625
    est.step()  # half-life 1 step: counts halve
    assert (est.accepted, est.tried) == (2.0, 3.0)
    assert est.rate == pytest.approx((1 + 2) / (2 + 3))
    for _ in range(60):
        est.step()
    assert est.rate == pytest.approx(0.5, abs=1e-9)  # back to the prior
    est.observe(0, 0)  # nothing proposed: no evidence
    assert est.tried == pytest.approx(0.0, abs=1e-12)


def test_estimate_without_prior_is_the_mle_and_rejects_bad_counts():
    est = AcceptanceEstimate(prior_rate=0.9, prior_trials=0.0, half_life=8)
    assert est.rate == 0.9  # no evidence: the prior
    est.observe(4, 2)
    assert est.rate == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="accepted 5 outside 0..4"):
        est.observe(4, 5)
    with pytest.raises(ValueError, match="prior_rate"):
        AcceptanceEstimate(1.5)
    with pytest.raises(ValueError, match="half_life"):
        AcceptanceEstimate(0.5, half_life=0)


def test_choose_follows_the_predicted_speedup():
    lookup = LiveKLookup(CAP, AR, SPEC, AcceptanceEstimate(0.6))
    # b = 1: E_1(0.6) = 1.6 -> 1.6 * 10/12 = 1.333; E_3(0.6) = 2.176 -> 2.176 * 10/15 = 1.451: k = 3
    assert lookup.choose(1, 0.6) == 3
    # a = 0.3: E_1 = 1.3 -> 1.083; E_3 = 1.417 -> 0.945: k = 1
    assert lookup.choose(1, 0.3) == 1
    # a = 0.15: E_1 = 1.15 -> 0.958 < 1 (k = 0's): no draft
    assert lookup.choose(1, 0.15) == 0
    # b = 4, cap 1: c_1(4) = 20 ms: E_1(0.9) = 1.9 -> 0.95 < 1: k = 0 even at high acceptance
    assert lookup.choose(4, 0.9) == 0
    # b = 2: costs interpolated (k = 3: 20 ms, k = 1: 14.67 ms); a = 0.9: E_3 = 3.439 -> 1.72, E_1 = 1.9 -> 1.295
    assert lookup.choose(2, 0.9) == 3
    assert lookup.choose(5, 1.0) == 0  # the schedule's k = 0 range: never drafts
    assert lookup.choose(99, 1.0) == 0  # above vLLM's max_num_seqs: the last entry


def test_min_speedup_and_a_measured_k0_cost():
    # k = 0 measured at 11 ms (the drafter pass): k = 0 itself is 10/11 = 0.909 of AR; k = 1 at a = 0.15 gives
    # 0.958, which beats it (drafts) unless min_speedup asks for more
    spec = {**SPEC, 0: {1: 0.011, 4: 0.011}}
    assert LiveKLookup(CAP, AR, spec, AcceptanceEstimate(0.5)).choose(1, 0.15) == 1
    assert LiveKLookup(CAP, AR, spec, AcceptanceEstimate(0.5), min_speedup=1.1).choose(1, 0.15) == 0


def _step(drafts: dict[str, list[int]], sampled: dict[str, list[int]]):
    ids = list(sampled)
    return (
        SimpleNamespace(scheduled_spec_decode_tokens=drafts),
        SimpleNamespace(sampled_token_ids=[sampled[r] for r in ids], req_id_to_index={r: i for i, r in enumerate(ids)}),
    )


def test_lookup_stops_drafting_on_rejections_and_probes_again():
    est = AcceptanceEstimate(prior_rate=0.6, prior_trials=1.0, half_life=4)
    lookup = LiveKLookup(CAP, AR, SPEC, est)
    assert lookup[1] == 3  # the prior: a = 0.6
    for _ in range(3):  # three k = 3 steps, each rejected at the first proposal: one bonus token sampled
        lookup.observe_step(*_step({"r": [7, 8, 9]}, {"r": [5]}))
    assert est.rate == pytest.approx(0.6 / (1 + 3))  # tried 3, accepted 0
    # hand-worked, d = 0.5 ** (1/4) = 0.8409 per lookup: tried 3 d^n, a = 0.6 / (1 + 3 d^n); k = 1 pays from
    # E_1(a) * 10/12 >= 1, i.e. a >= 0.2, i.e. 3 d^n <= 2: n >= 2.34
    # n = 1: a = 0.1703 (E_1 -> 0.975); n = 2: a = 0.1922 (0.993); n = 3: a = 0.2155 (1.013; E_3 -> 0.849)
    assert [lookup[1] for _ in range(3)] == [0, 0, 1]
    for _ in range(40):  # no more evidence: back to the prior
        lookup[1]
    assert est.rate == pytest.approx(0.6 / (1 + 3 * 0.5 ** (43 / 4))) and lookup[1] == 3
    assert {k: lookup.counts[k] for k in ("steps", "capped", "drafted")} == {"steps": 45, "capped": 45, "drafted": 43}


def test_observe_step_counts_accepted_tokens_per_request():
    est = AcceptanceEstimate(prior_rate=0.5, prior_trials=0.0)
    lookup = LiveKLookup(CAP, AR, SPEC, est)
    # r1: 3 proposed, 4 sampled (all accepted + bonus); r2: 3 proposed, 2 sampled (1 accepted); r3: no drafts
    lookup.observe_step(*_step({"r1": [1, 2, 3], "r2": [1, 2, 3]}, {"r1": [1, 2, 3, 4], "r2": [1, 9], "r3": [4]}))
    assert (est.accepted, est.tried) == (4.0, 5.0)
    lookup.observe_step(*_step({"gone": [1, 2]}, {"r3": [4]}))  # a request no longer in the output: skipped
    lookup.observe_step(*_step({"r1": [1, 2]}, {"r1": []}))  # no token sampled (e.g. preempted): skipped
    assert (est.accepted, est.tried) == (4.0, 5.0)


def test_prior_and_config_errors(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(
        json.dumps({"step_costs": {"ar_step_s": AR, "spec_step_s": SPEC, "acceptance_rate": {"1": 0.7, "3": 0.6}}})
    )
    dyn = DynamicSpeculationConfig(step_costs=str(costs), live_acceptance=True)
    assert prior_acceptance(dyn, json.loads(costs.read_text())["step_costs"]) == 0.6  # the largest k's
    assert prior_acceptance(DynamicSpeculationConfig(step_costs=str(costs), acceptance_rate=0.4), {}) == 0.4
    with pytest.raises(ValueError, match="set acceptance_rate"):
        prior_acceptance(dyn, {})
    with pytest.raises(ValueError, match="live_acceptance=true needs step_costs"):
        DynamicSpeculationConfig(num_speculative_tokens_per_batch_size=[[1, 4, 3]], live_acceptance=True)
    with pytest.raises(ValueError, match="no k > 0 step cost"):
        LiveKLookup(CAP, AR, {0: {1: 0.01}}, AcceptanceEstimate(0.5))


def test_install_replaces_the_schedulers_lookup(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"ar_step_s": AR, "spec_step_s": SPEC}))
    seen = []
    scheduler = SimpleNamespace(dynamic_sd_lookup=list(CAP), update_from_output=lambda so, mro: seen.append(so))
    llm = SimpleNamespace(
        llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler)))
    )
    dyn = DynamicSpeculationConfig(step_costs=str(costs), acceptance_rate=0.6, live_acceptance=True)
    lookup = install_live_acceptance(llm, dyn)
    assert scheduler.dynamic_sd_lookup is lookup and lookup.cap == CAP and lookup.estimate.rate == 0.6
    so, mro = _step({"r": [1, 2, 3]}, {"r": [8]})
    scheduler.update_from_output(so, mro)
    assert seen == [so] and lookup.estimate.tried == 1.0  # observed, then vLLM's own update ran
    assert install_live_acceptance(llm, dyn) is lookup  # installed once
    scheduler.dynamic_sd_lookup = None
    with pytest.raises(RuntimeError, match="batch-size schedule"):
        install_live_acceptance(llm, dyn)
