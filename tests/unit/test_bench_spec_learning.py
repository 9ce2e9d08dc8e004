"""The arithmetic of examples/bench_spec_learning.py, without a model: run summaries from
metrics records, per-step Welch standard errors by hand, the exact permutation test, and the acceptance goals."""

import math

import pytest

from nemo_rl_spec.bench import spec_learning as bench_spec_learning

bench = bench_spec_learning


def _run(rewards, final, accept=None):
    return {
        "reward": rewards,
        "final_accuracy": final,
        "acceptance_length": accept or [float("nan")] * len(rewards),
        "step_time_s": [1.0] * len(rewards),
    }


def test_run_summary_reads_steps_in_order_and_the_final_validation():
    records = [
        {"step": 0, "validation/accuracy": 0.3},
        {"step": 2, "train/reward": 0.5, "vllm/spec_acceptance_length": 1.5},
        {"step": 1, "train/reward": 0.25, "vllm/spec_acceptance_length": 1.25},
        {"step": 2, "validation/accuracy": 0.6},
    ]
    s = bench.run_summary(records)
    assert s["reward"] == [0.25, 0.5] and s["acceptance_length"] == [1.25, 1.5]
    assert s["final_accuracy"] == 0.6 and s["validation"] == [(0, 0.3), (2, 0.6)]
    assert bench.run_summary([{"step": 0, "validation/accuracy": 0.3}])["final_accuracy"] is None


def test_permutation_p_is_exact():
    # 2 + 2 values: 6 splits; the observed split {3, 4} vs {1, 2} and its mirror are the 2 most extreme
    assert bench.permutation_p([3.0, 4.0], [1.0, 2.0]) == pytest.approx(2 / 6)
    assert bench.permutation_p([1.0, 2.0], [1.0, 2.0]) == pytest.approx(1.0)
    assert bench.permutation_p([5.0, 6.0, 7.0], [1.0, 2.0, 3.0]) == pytest.approx(2 / 20)


def test_compare_per_step_se_and_tests_by_hand():
    ref = {"1": _run([0.0, 0.5], 0.5), "2": _run([0.2, 0.5], 0.7)}
    other = {"1": _run([0.4, 0.6], 0.6), "2": _run([0.6, 0.4], 0.8)}
    c = bench.compare(ref, other)
    # step 1: diff 0.5 - 0.1 = 0.4; var(other) = 0.02, var(ref) = 0.02 -> se = sqrt(0.01 + 0.01)
    assert c["per_step"][0]["diff"] == pytest.approx(0.4)
    assert c["per_step"][0]["se"] == pytest.approx(math.sqrt(0.02))
    assert c["per_step"][0]["within_2se"] is False  # 0.4 > 2 * 0.1414
    assert c["per_step"][1]["diff"] == pytest.approx(0.0) and c["per_step"][1]["within_2se"]
    assert c["steps_outside_2se"] == [1]
    assert c["final_accuracy_diff"] == pytest.approx(0.1)
    from scipy import stats

    assert c["final_accuracy_welch_p"] == pytest.approx(stats.ttest_ind([0.6, 0.8], [0.5, 0.7], equal_var=False).pvalue)


def test_acceptance_summary_goal_and_refit_ratios():
    runs = {
        "1": _run([0.0] * 6, 0.5, [1.0, 2.0, 2.2, 1.5, 2.4, 2.5]),
        "2": _run([0.0] * 6, 0.5, [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]),
    }
    a = bench.acceptance_summary(runs)
    assert a["per_seed"]["1"]["late_mean"] == pytest.approx((2.0 + 2.2 + 1.5 + 2.4 + 2.5) / 5)
    assert a["per_seed"]["1"]["min_refit_ratio"] == pytest.approx(1.5 / 2.2)
    assert a["refits"] == 10 and a["refits_at_or_above_floor"] == pytest.approx(9 / 10)
    assert a["meets_goal"] is True
    assert bench.acceptance_summary({"1": _run([0.0] * 2, 0.5, [1.5, 1.6])})["meets_goal"] is False


def test_paired_comparison_by_hand():
    ref = {"1": _run([0.0, 0.5], 0.5), "2": _run([0.2, 0.5], 0.7), "3": _run([0.4, 0.1], 0.6)}
    other = {"1": _run([0.1, 0.6], 0.6), "2": _run([0.3, 0.4], 0.9), "3": _run([0.5, 0.2], 0.6)}
    q = bench.compare(ref, other)["paired"]
    # step 1: per-seed differences all +0.1 -> se 0 -> z 0 by convention, within 2 SE is False (|0.1| > 0)
    assert q["per_step"][0]["diff"] == pytest.approx(0.1) and q["per_step"][0]["se"] == pytest.approx(0.0)
    # step 2: per-seed differences +0.1, -0.1, +0.1 -> se = sd / sqrt(3)
    import statistics

    d = [0.1, -0.1, 0.1]
    assert q["per_step"][1]["se"] == pytest.approx(statistics.stdev(d) / 3**0.5)
    assert q["steps_outside_2se"] == [1]
    assert q["final_accuracy_diff_per_seed"] == pytest.approx({"1": 0.1, "2": 0.2, "3": 0.0})
    # sign flips of (0.1, 0.2, 0.0): |mean| >= 0.1 for (+,+,*) and (-,-,*): 4 of 8
    assert q["final_accuracy_sign_flip_p"] == pytest.approx(4 / 8)
    assert bench.sign_flip_p([1.0, 2.0, 3.0]) == pytest.approx(2 / 8)
