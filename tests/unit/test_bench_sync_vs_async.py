"""The sync-vs-async benchmark's bookkeeping without a model: merging re-run modes and the speedup column."""
import json

import pytest
from examples_loader import load_example


def _doc(modes: dict) -> dict:
    return {"modes": modes, "settings": {"steps": 6}}


def test_merge_later_file_wins_and_speedups_by_hand(tmp_path):
    bench = load_example("bench_sync_vs_async")
    first = tmp_path / "a.json"
    first.write_text(json.dumps(_doc({"sync/autoregressive": {"step_time_s": 80.0},
                                      "async_age1/autoregressive": {"step_time_s": 100.0},
                                      "sync/speculative": {"step_time_s": 90.0}})))
    rerun = tmp_path / "b.json"
    rerun.write_text(json.dumps(_doc({"async_age1/autoregressive": {"step_time_s": 50.0},
                                      "async_age1/speculative": {"step_time_s": 60.0},
                                      "async_age2/speculative": {"error": "Traceback\nboom"}})))
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
