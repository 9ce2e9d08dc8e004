"""The learning benchmark's arithmetic (examples/bench_learning.py, nemo_rl_spec/utils/bench_runs.py), without a
model: per-seed start/final/gain from metrics records, reward thirds, and the bootstrap interval against the exact
resampling distribution."""

import itertools
import statistics

import pytest

from nemo_rl_spec.bench import learning as bench_learning
from nemo_rl_spec.utils.bench_runs import bootstrap_interval, result_paths


def test_bootstrap_interval_matches_the_exact_resampling_distribution():
    values = [0.0, 0.3, 1.0]
    # all 27 equally likely resamples of 3 seeds: the exact 5% / 95% quantiles of their means
    means = sorted(statistics.fmean(t) for t in itertools.product(values, repeat=3))
    exact = (means[int(0.05 * 27)], means[int(0.95 * 27)])
    assert exact == pytest.approx((0.1, 2.3 / 3))
    assert bootstrap_interval(values) == pytest.approx(exact, abs=1e-12)
    assert bootstrap_interval([0.2, 0.2, 0.2]) == pytest.approx((0.2, 0.2))
    assert bootstrap_interval([0.5]) is None
    with pytest.raises(ValueError, match="level"):
        bootstrap_interval(values, level=1.0)


def test_seed_summary_and_mean_gain_by_hand():
    bench = bench_learning
    assert bench.third_means([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == (2.0, 6.0)  # ceil(7/3) = 3 each end
    records = [
        {"step": 0, "validation/accuracy": 0.25},
        *(
            {"step": k, "train/reward": r, "timing/train/total_step_time": 10.0 * k}
            for k, r in zip(range(1, 7), [0.1, 0.3, 0.2, 0.4, 0.5, 0.7])
        ),
        {"step": 3, "validation/accuracy": 0.3},
        {"step": 6, "validation/accuracy": 0.5},
    ]
    s = bench.seed_summary(records)
    assert (s["start_accuracy"], s["final_accuracy"]) == (0.25, 0.5)
    assert s["gain"] == pytest.approx(0.25)
    assert s["reward_first_third"] == pytest.approx((0.1 + 0.3) / 2)
    assert s["reward_last_third"] == pytest.approx((0.5 + 0.7) / 2)
    assert s["mean_step_time_s"] == pytest.approx(35.0)
    no_final = bench.seed_summary([{"step": 0, "validation/accuracy": 0.25}])
    assert no_final["gain"] is None and no_final["reward_first_third"] is None
    result = bench.summarize({"0": s, "1": {**s, "gain": 0.05}, "2": no_final})
    assert result["mean_gain"] == pytest.approx(0.15)  # seeds without a final validation are left out
    assert result["mean_reward_trend"] == pytest.approx(0.6 - 0.2)


def test_plots_the_committed_result(tmp_path):
    """docs/results/grpo_learning/training_curves.json (its results page's numbers) re-summarises to its own mean
    gain and plots."""
    import json
    from pathlib import Path

    bench = bench_learning
    path = Path(__file__).resolve().parents[2] / "docs" / "results" / "grpo_learning" / "training_curves.json"
    saved = json.loads(path.read_text())
    seeds = {s: {k: v for k, v in r.items() if k not in ("returncode", "wall_s")} for s, r in saved["seeds"].items()}
    assert bench.summarize(seeds)["mean_gain"] == pytest.approx(saved["mean_gain"], abs=1e-12)
    for s in seeds.values():
        assert s["gain"] == pytest.approx(s["final_accuracy"] - s["start_accuracy"], abs=1e-12)
    bench.plot(seeds, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_token_mult_prob_error_per_step_and_mean_by_hand():
    bench = bench_learning
    records = [
        {"step": 0, "validation/accuracy": 0.5},
        {"step": 1, "train/reward": 0.1, "train/token_mult_prob_error": 1.01},
        {"step": 2, "train/reward": 0.2, "train/token_mult_prob_error": 1.03},
        {"step": 2, "validation/accuracy": 0.75},
    ]
    s = bench.seed_summary(records)
    assert s["token_mult_prob_error"] == [1.01, 1.03]
    assert s["mean_token_mult_prob_error"] == pytest.approx(1.02)
    old = bench.seed_summary([{"step": 1, "train/reward": 0.1}])  # a run that did not log it
    assert old["token_mult_prob_error"] == [] and old["mean_token_mult_prob_error"] is None
    result = bench.summarize({"0": s, "1": {**s, "mean_token_mult_prob_error": 1.04}, "2": old})
    assert result["mean_token_mult_prob_error"] == pytest.approx(1.03)  # (1.02 + 1.04) / 2; seed 2 left out
    assert "1.0100 1.0300" in bench.table({**result, "meta": {}})


def test_compare_pairs_final_accuracy_by_seed_by_hand():
    bench = bench_learning
    seed = lambda start, final: {
        "start_accuracy": start,
        "final_accuracy": final,  # noqa: E731
        "gain": None if final is None else final - start,
    }
    run = {
        "seeds": {
            "42": seed(0.3, 0.8),
            "1": seed(0.3, 0.7),
            "2": seed(0.3, 0.6),
            "3": seed(0.3, None),
            "9": seed(0.3, 0.9),
        }
    }
    base = {"seeds": {"42": seed(0.3, 0.75), "1": seed(0.3, 0.75), "2": seed(0.2, 0.7), "3": seed(0.3, 0.7)}}
    c = bench.compare(run, base)
    assert list(c["seeds"]) == ["42", "1", "2"]  # seed 3: no final here; seed 9: not in the baseline
    assert [c["seeds"][s]["final_diff"] for s in ("42", "1", "2")] == pytest.approx([0.05, -0.05, -0.1])
    assert c["seeds"]["2"]["gain_diff"] == pytest.approx(0.3 - 0.5)
    assert c["mean_final_diff"] == pytest.approx(-0.1 / 3)
    assert c["mean_gain_diff"] == pytest.approx((0.05 - 0.05 + 0.3 - 0.5) / 3)
    assert c["final_diff_interval_90"] == pytest.approx(bootstrap_interval([0.05, -0.05, -0.1]))
    # the 27 resamples of {0.05, -0.05, -0.1}: 5% quantile is the 2nd smallest mean (-0.25 / 3), 95% the 26th (0.05 / 3)
    assert c["final_diff_interval_90"] == pytest.approx((-0.25 / 3, 0.05 / 3), abs=1e-12)
    text = bench.table(
        {
            "seeds": {},
            "gain_interval_90": None,
            "mean_gain": None,
            "mean_reward_trend": None,
            "comparison": c,
            "meta": {"baseline": "fp32.json"},
        }
    )
    assert "vs baseline fp32.json" in text and "-0.033" in text and "[-0.083, 0.017]" in text


def test_result_paths_default_and_given_work_dir(tmp_path):
    out, work = result_paths(str(tmp_path / "new" / "res.json"), None)
    assert out == tmp_path / "new" / "res.json" and out.parent.is_dir() and not out.exists()
    assert work == tmp_path / "new" / "res_runs" and not work.exists()
    assert result_paths(str(out), str(tmp_path / "w"))[1] == tmp_path / "w"
