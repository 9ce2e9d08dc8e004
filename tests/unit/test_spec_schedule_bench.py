"""The long-tail benchmark's summary (nemo_rl_spec.bench.spec_schedule.summarize), on hand-worked numbers."""

import math

from nemo_rl_spec.bench.spec_schedule import _pair_order, format_tables, summarize


def _roll(ar_s, spec_s, by_batch, acc=2.0):
    return {
        "ar": {"seconds": ar_s, "tokens": 100, "seconds_by_batch": by_batch},
        "spec": {"seconds": spec_s, "tokens": 100, "acceptance_length": acc},
    }


def _result():
    schedule = [[1, 1, 3], [2, 4, 2], [5, 64, 0]]
    rollouts = [
        _roll(10.0, 8.0, {32: 6.0, 4: 1.0, 1: 3.0}),  # 4 s of 10 at b <= 4
        _roll(12.0, 10.0, {16: 12.0}),  # never at a drafting batch
    ]
    sweep = {
        1: {
            "k": 3,
            "speedup": 1.5,
            "speedup_runs": [1.5],
            "ar_tokens_per_s": 10,
            "spec_tokens_per_s": 15,
            "acceptance_length": 2.4,
        },
        8: {
            "k": 0,
            "speedup": 0.97,
            "speedup_runs": [0.97],
            "ar_tokens_per_s": 50,
            "spec_tokens_per_s": 48.5,
            "acceptance_length": float("nan"),
        },
    }
    return {"schedule": schedule, "rollouts": rollouts, "sweep": sweep}


def test_summary_hand_worked():
    s = summarize(_result())
    assert math.isclose(s["rollout_phase_speedup"], 22.0 / 18.0, rel_tol=1e-12)  # total over total, not mean ratio
    assert s["rollout_speedups"] == [1.25, 1.2]
    assert s["ar_share_at_drafting_batches"] == [0.4, 0.0]
    assert s["sweep_min_speedup"] == 0.97 and s["sweep_min_batch"] == 8


def test_pairs_alternate_and_tables_render():
    assert [_pair_order(i) for i in range(3)] == [("ar", "spec"), ("spec", "ar"), ("ar", "spec")]
    res = _result()
    res["summary"] = summarize(res)
    text = format_tables(res)
    assert "rollout phase: 1.222x" in text and "sweep minimum: 0.970x at b = 8" in text
