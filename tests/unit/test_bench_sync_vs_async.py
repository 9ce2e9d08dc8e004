"""The sync-vs-async benchmark's bookkeeping without a model: merging re-run modes, the speedup and overlap-bound
columns, the interleaved run order and the mean over repeats."""

import json
import math

import pytest

from nemo_rl_spec.bench import sync_vs_async as bench_sync_vs_async


def _doc(modes: dict) -> dict:
    return {"modes": modes, "settings": {"steps": 6}}


def test_merge_later_file_wins_and_speedups_by_hand(tmp_path):
    bench = bench_sync_vs_async
    first = tmp_path / "a.json"
    first.write_text(
        json.dumps(
            _doc(
                {
                    "sync/autoregressive": {"step_time_s": 80.0},
                    "async_age1/autoregressive": {"step_time_s": 100.0},
                    "sync/speculative": {"step_time_s": 90.0},
                }
            )
        )
    )
    rerun = tmp_path / "b.json"
    rerun.write_text(
        json.dumps(
            _doc(
                {
                    "async_age1/autoregressive": {"step_time_s": 50.0},
                    "async_age1/speculative": {"step_time_s": 60.0},
                    "async_age2/speculative": {"error": "Traceback\nboom"},
                }
            )
        )
    )
    out = tmp_path / "merged.json"
    table = bench.merge([str(first), str(rerun)], out)
    modes = json.loads(out.read_text())["modes"]
    assert modes["async_age1/autoregressive"]["step_time_s"] == 50.0  # the re-run replaced the first value
    assert modes["async_age1/autoregressive"]["speedup_vs_sync"] == pytest.approx(80.0 / 50.0)
    assert modes["async_age1/speculative"]["speedup_vs_sync"] == pytest.approx(90.0 / 60.0)
    assert modes["sync/speculative"]["speedup_vs_sync"] == 1.0
    assert "speedup_vs_sync" not in modes["async_age2/speculative"]
    assert "| async_age2/speculative | error: boom |" in table
    assert out.with_suffix(".png").is_file() and out.with_suffix(".md").read_text().strip() == table
    sources = json.loads(out.read_text())["settings"]["sources"]
    assert [s["file"] for s in sources] == [str(first), str(rerun)]


def test_overlap_bound_on_async_rows_by_hand():
    bench = bench_sync_vs_async
    results = {
        "sync/autoregressive": {"step_time_s": 74.3, "exposed_generation_s": 19.3},
        "async_age1/autoregressive": {"step_time_s": 57.8},
        "async_age2/autoregressive": {"error": "x"},
    }
    bench.add_speedups(results)
    assert results["async_age1/autoregressive"]["overlap_bound"] == pytest.approx(74.3 / 55.0)
    assert results["async_age1/autoregressive"]["speedup_vs_sync"] == pytest.approx(74.3 / 57.8)
    assert "overlap_bound" not in results["sync/autoregressive"]
    assert "overlap_bound" not in results["async_age2/autoregressive"]


def test_interleaved_schedule_and_mean_over_repeats():
    bench = bench_sync_vs_async
    assert bench.schedule(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert bench.schedule(["a"], 1) == [(0, "a")]
    with pytest.raises(ValueError, match="repeats"):
        bench.schedule(["a"], 0)
    runs = [
        {"step_time_s": 70.0, "exposed_generation_s": 20.0, "buffer_starvation_s": None, "steps": 4},
        {"error": "Traceback\nboom"},
        {"step_time_s": 80.0, "exposed_generation_s": 10.0, "buffer_starvation_s": None, "steps": 4},
    ]
    combined = bench.combine_repeats(runs)
    assert combined["step_time_s"] == 75.0 and combined["exposed_generation_s"] == 15.0
    assert combined["steps"] == 4.0 and "buffer_starvation_s" not in combined and combined["repeats"] == runs
    failed = bench.combine_repeats([{"error": "e1"}, {"error": "e2"}])
    assert failed["error"] == "e2"


def test_repeats_below_one_is_refused_before_any_run():
    bench = bench_sync_vs_async
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", "x.json", "--repeats", "0"])


def test_rollout_acceptance_sums_the_training_steps_counts_only():
    """The per-step counts of a 5-step run of the default spec recipe (measured): 33 drafts, 34
    accepted in the training rollouts -> 1 + 34 / 33; the final validation's drafts are not in the history."""
    counts = [(0, 0), (0, 0), (4, 3), (29, 31), (0, 0)]
    history = [{"vllm/spec_num_drafts": d, "vllm/spec_num_accepted_tokens": a} for d, a in counts]
    history.append({"train/reward": 0.5})  # a step logged without speculative counts
    out = bench_sync_vs_async.rollout_acceptance(history)
    assert out == {"acceptance_length": pytest.approx(1 + 34 / 33, rel=1e-12), "spec_num_drafts": 33}
    assert math.isnan(bench_sync_vs_async.rollout_acceptance([{"vllm/spec_num_drafts": 0.0}])["acceptance_length"])
