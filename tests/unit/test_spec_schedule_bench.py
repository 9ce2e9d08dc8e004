"""The long-tail benchmark's summary (nemo_rl_spec.bench.spec_schedule.summarize), on hand-worked numbers."""

import math

from nemo_rl_spec.bench.spec_schedule import _order, format_tables, summarize


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
    assert "rollout phase, variant: 0.978x" in text
