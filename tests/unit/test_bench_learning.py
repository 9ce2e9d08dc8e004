"""The learning benchmark's arithmetic (examples/bench_learning.py, nemo_rl_spec/utils/bench_runs.py), without a
model: per-seed start/final/gain from metrics records, reward thirds, and the bootstrap interval against the exact
resampling distribution."""
import itertools
import statistics

import pytest
from examples_loader import load_example

from nemo_rl_spec.utils.bench_runs import bootstrap_interval


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
    bench = load_example("bench_learning")
    assert bench.third_means([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]) == (2.0, 6.0)  # ceil(7/3) = 3 each end
    records = [{"step": 0, "validation/accuracy": 0.25},
               *({"step": k, "train/reward": r, "timing/train/total_step_time": 10.0 * k}
                 for k, r in zip(range(1, 7), [0.1, 0.3, 0.2, 0.4, 0.5, 0.7])),
               {"step": 3, "validation/accuracy": 0.3},
               {"step": 6, "validation/accuracy": 0.5}]
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
    """docs/training_curves.json (the README's numbers) re-summarises to its own mean gain and plots."""
    import json
    from pathlib import Path

    bench = load_example("bench_learning")
    saved = json.loads((Path(__file__).resolve().parents[2] / "docs" / "training_curves.json").read_text())
    seeds = {s: {k: v for k, v in r.items() if k not in ("returncode", "wall_s")} for s, r in saved["seeds"].items()}
    assert bench.summarize(seeds)["mean_gain"] == pytest.approx(saved["mean_gain"], abs=1e-12)
    for s in seeds.values():
        assert s["gain"] == pytest.approx(s["final_accuracy"] - s["start_accuracy"], abs=1e-12)
    bench.plot(seeds, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000
