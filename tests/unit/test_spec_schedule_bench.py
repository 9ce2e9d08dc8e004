"""The long-tail benchmark's summary (nemo_rl_spec.bench.spec_schedule.summarize), on hand-worked numbers."""

import math

import pytest

from nemo_rl_spec.bench.spec_schedule import _order, amdahl_bound, format_tables, summarize


def _roll(ar_s, spec_s, var_s, by_batch):
    return {
        "ar": {"seconds": ar_s, "tokens": 100, "seconds_by_batch": by_batch},
        "spec": {"seconds": spec_s, "tokens": 100, "acceptance_length": 2.0},
        "variant": {"seconds": var_s, "tokens": 100, "acceptance_length": 1.5},
        "order": ["ar", "spec", "variant"],
    }


def _point(k, ar, spec, var):
    def eng(x):
        return {"speedup": x, "speedup_runs": [x], "tokens_per_s": ar * x, "acceptance_length": 2.0}

    return {"k": k, "ar_tokens_per_s": ar, "spec": eng(spec), "variant": eng(var)}


def _result():
    return {
        "schedule": [[1, 1, 3], [2, 4, 2], [5, 64, 0]],
        "rollouts": [
            _roll(10.0, 8.0, 10.0, {32: 6.0, 4: 1.0, 1: 3.0}),  # 4 s of 10 at b <= 4
            _roll(12.0, 10.0, 12.5, {16: 12.0}),  # never at a drafting batch
        ],
        "sweep": {1: _point(3, 10.0, 1.5, 1.2), 8: _point(0, 50.0, 0.97, 1.01)},
    }


def test_summary_hand_worked():
    s = summarize(_result())
    assert s["ar_share_at_drafting_batches"] == [0.4, 0.0]
    assert math.isclose(s["spec"]["rollout_phase_speedup"], 22.0 / 18.0, rel_tol=1e-12)  # total over total
    assert s["spec"]["rollout_speedups"] == [1.25, 1.2]
    assert s["spec"]["sweep_min_speedup"] == 0.97 and s["spec"]["sweep_min_batch"] == 8
    assert math.isclose(s["variant"]["rollout_phase_speedup"], 22.0 / 22.5, rel_tol=1e-12)
    assert s["variant"]["sweep_min_speedup"] == 1.01 and s["variant"]["sweep_min_batch"] == 8


def test_amdahl_bound_hand_worked():
    # group 0: 10 s, 40% at drafting batches, L = 2 -> 10 * (0.6 + 0.2) = 8 s; group 1 never drafts: 12 s
    assert math.isclose(summarize(_result())["spec"]["amdahl_bound"], 22.0 / 20.0, rel_tol=1e-12)
    assert math.isclose(summarize(_result())["variant"]["amdahl_bound"], 22.0 / (10 * (0.6 + 0.4 / 1.5) + 12))
    # free speculation everywhere with L = 3 gives 3x; a group that never drafted (None / NaN) counts at 1
    assert math.isclose(amdahl_bound([5.0, 5.0], [1.0, 1.0], [3.0, 3.0]), 3.0)
    assert math.isclose(amdahl_bound([4.0, 4.0], [1.0, 0.5], [None, float("nan")]), 1.0)
    with pytest.raises(ValueError, match="one entry per group"):
        amdahl_bound([1.0], [0.5, 0.5], [2.0])
    with pytest.raises(ValueError, match="acceptance length 0.5"):
        amdahl_bound([1.0], [0.5], [0.5])


def test_order_rotates_and_tables_render():
    assert [_order(["ar", "spec", "v"], i) for i in range(4)] == [
        ["ar", "spec", "v"],
        ["spec", "v", "ar"],
        ["v", "ar", "spec"],
        ["ar", "spec", "v"],
    ]
    res = _result()
    res["summary"] = summarize(res)
    text = format_tables(res)
    assert "rollout phase, spec: 1.222x" in text and "sweep minimum, spec: 0.970x at b = 8" in text
    assert "bound, spec: 1.100x if drafting and verification were free" in text
    assert "rollout phase, variant: 0.978x" in text


def test_pooled_k0_geometric_mean_over_k0_points_only():
    res = _result()
    res["sweep"][8]["spec"]["speedup_runs"] = [0.9, 1.0, 1.1]
    res["sweep"][16] = _point(0, 60.0, 1.0, 1.0)
    res["sweep"][16]["spec"]["speedup_runs"] = [0.95, 1.05]
    pooled = summarize(res)["spec"]["sweep_k0_pooled"]
    # k = 3 at b = 1 (1.5x) is left out; the five k = 0 ratios pool, geometric mean by hand
    by_hand = math.exp(sum(math.log(x) for x in (0.9, 1.0, 1.1, 0.95, 1.05)) / 5)
    assert pooled["n"] == 5 and math.isclose(pooled["geomean"], by_hand, rel_tol=1e-12)
    lo, hi = pooled["interval90"]
    assert 0.9 <= lo < by_hand < hi <= 1.1


def test_ar_control_is_compared_like_an_engine_and_renders_without_acceptance():
    res = _result()
    for r in res["rollouts"]:
        r["ar_control"] = {"seconds": r["ar"]["seconds"] * 1.05, "tokens": 100, "acceptance_length": None}
    for p in res["sweep"].values():
        p["ar_control"] = {"speedup": 0.99, "speedup_runs": [0.99], "tokens_per_s": 1.0, "acceptance_length": None}
    res["summary"] = summarize(res)
    assert math.isclose(res["summary"]["ar_control"]["rollout_phase_speedup"], 1 / 1.05, rel_tol=1e-12)
    text = format_tables(res)
    assert "rollout phase, ar_control: 0.952x" in text
    assert "sweep k = 0 pooled, ar_control: 0.990x (geometric mean of 1)" in text


def test_matched_length_phase_is_ar_held_to_each_engines_lengths_over_its_natural_seconds():
    res = _result()  # natural seconds: AR 10 / 12, spec 8 / 10, variant 10 / 12.5
    # the held AR runs' time by running batch: half of group 0 at b = 2 (drafting), none of group 1
    shares = [lambda sec: {32: sec / 2, 2: sec / 2}, lambda sec: {16: sec}]
    for g, (own, at_spec, at_var) in enumerate([(10.5, 9.0, 11.0), (12.0, 11.0, 10.0)]):

        def held(sec, tokens, g=g):
            return {"seconds": sec, "tokens": tokens, "acceptance_length": None, "seconds_by_batch": shares[g](sec)}

        res["rollouts"][g]["matched"] = {"ar": held(own, 100), "spec": held(at_spec, 90), "variant": held(at_var, 110)}
    res["summary"] = s = summarize(res)
    assert math.isclose(s["spec"]["matched_phase_speedup"], 20.0 / 18.0, rel_tol=1e-12)
    assert s["spec"]["matched_speedups"] == [9.0 / 8.0, 11.0 / 10.0]
    assert math.isclose(s["variant"]["matched_phase_speedup"], 21.0 / 22.5, rel_tol=1e-12)
    assert math.isclose(s["ar_held_over_natural"], 22.5 / 22.0, rel_tol=1e-12)
    assert s["spec"]["rollout_phase_speedup"] == 22.0 / 18.0  # the natural-length ratio is unchanged
    # the bound from the held AR runs (spec L = 2, variant L = 1.5 in both groups): 9 * (0.5 + 0.5 / L) + 11 * 1 ...
    assert math.isclose(s["spec"]["matched_amdahl_bound"], 20.0 / (9.0 * 0.75 + 11.0), rel_tol=1e-12)
    assert math.isclose(s["variant"]["matched_amdahl_bound"], 21.0 / (11.0 * (0.5 + 0.5 / 1.5) + 10.0), rel_tol=1e-12)
    text = format_tables(res)
    assert "rollout phase, AR held to spec's row lengths: 1.111x (1.125 1.100)" in text
    assert "check: AR held to its own lengths / AR natural: 1.023" in text


def test_time_matched_rollout_refuses_lengths_that_do_not_fit_the_rows():
    import pytest

    from nemo_rl_spec.bench.engine_steps import time_matched_rollout

    with pytest.raises(ValueError, match="need 4 values >= 1"):
        time_matched_rollout(None, [[1, 2], [3]], 2, 0, 0.7, [5, 5, 5])  # 2 prompts x n = 2 rows
    with pytest.raises(ValueError, match="need 4 values >= 1"):
        time_matched_rollout(None, [[1, 2], [3]], 2, 0, 0.7, [5, 0, 5, 5])
