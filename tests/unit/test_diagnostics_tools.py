"""The diagnostic tools in examples/diagnostics/ that read files or parse arguments, run as the commands a user types
(subprocesses: tests import the package, never examples/). ``draft_drift_table.py`` and ``rollout_phase_bound.py``
against hand-computed numbers; ``--help`` of the studies that load models or start engines (``lossless_bf16.py``,
``online_draft_targets.py``, ``make_standin_draft.py``: diagnostics run by hand, not unit tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIAGNOSTICS = ROOT / "examples" / "diagnostics"


def _run(script: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(DIAGNOSTICS / script), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _row(step, est, ref, drafts, accepted, reward):
    return {
        "step": step,
        "train/draft_est_acceptance_probabilistic": est,
        "train/draft_ref_est_acceptance_probabilistic": ref,
        "train/draft_est_acceptance_greedy": est + 1.0,
        "train/draft_ref_est_acceptance_greedy": ref + 1.0,
        "vllm/spec_num_drafts": drafts,
        "vllm/spec_num_accepted_tokens": accepted,
        "train/reward": reward,
    }


def test_draft_drift_table_windows_by_hand(tmp_path):
    rows = [
        _row(1, 2.0, 1.5, 10, 5, 0.5),
        _row(2, 2.2, 1.5, 10, 15, 0.7),
        {"step": 3, "train/reward": 0.9},  # a step that did not train the draft: no estimate, left out
        _row(4, 2.4, 1.6, 0, 0, 0.2),
        _row(5, 2.6, 1.6, 20, 10, 0.4),
    ]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "table.json"
    res = _run("draft_drift_table.py", str(metrics), "--window", "2", "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| 1-2 | 2.100 | 1.500 |" in res.stdout and "| 4-5 | 2.500 | 1.600 |" in res.stdout

    table = json.loads(out.read_text())[str(metrics)]
    first, second = table["windows"]
    # window 1: steps 1, 2; paired differences 0.5 and 0.7; engine acceptance 1 + (5 + 15) / (10 + 10)
    assert first["steps"] == [1, 2]
    assert first["online"] == pytest.approx(2.1) and first["frozen_start"] == pytest.approx(1.5)
    assert first["difference"] == pytest.approx(0.6)
    assert 0.5 - 1e-9 <= first["interval90"][0] <= first["interval90"][1] <= 0.7 + 1e-9
    assert first["engine_acceptance"] == pytest.approx(2.0) and first["engine_drafts"] == 20
    assert first["reward"] == pytest.approx(0.6)
    # window 2: steps 4, 5 (step 4 drafted nothing); engine acceptance 1 + 10 / 20
    assert second["steps"] == [4, 5] and second["difference"] == pytest.approx(0.9)
    assert second["engine_acceptance"] == pytest.approx(1.5) and second["reward"] == pytest.approx(0.3)
    # the whole run
    whole = table["all"]
    assert whole["steps"] == [1, 2, 4, 5]
    assert whole["online"] == pytest.approx(2.3) and whole["frozen_start"] == pytest.approx(1.55)
    assert whole["engine_acceptance"] == pytest.approx(1.75) and whole["reward"] == pytest.approx(0.45)

    greedy = _run("draft_drift_table.py", str(metrics), "--window", "4", "--method", "greedy")
    assert greedy.returncode == 0, greedy.stdout + greedy.stderr
    assert "| 1-5 | 3.300 | 2.550 | +0.750" in greedy.stdout


def test_draft_drift_table_refuses_a_run_without_estimates(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 1, "train/reward": 0.5}) + "\n")
    res = _run("draft_drift_table.py", str(metrics))
    assert res.returncode != 0
    assert "no train/draft_est_acceptance_* rows" in res.stderr


def test_lossless_bf16_argument_parser():
    res = _run("lossless_bf16.py", "--help")
    assert res.returncode == 0, res.stdout + res.stderr
    for option in ("--dtypes", "--methods", "--batch-sizes", "--head-steps", "--skip-t1", "--out"):
        assert option in res.stdout
    assert "Exits 1 unless every check passes" in res.stdout


def _phase(seconds: float, by_batch: dict[str, float], acceptance_length: float | None = None) -> dict:
    return {"seconds": seconds, "acceptance_length": acceptance_length, "seconds_by_batch": by_batch}


def test_rollout_phase_bound_by_hand(tmp_path):
    # the schedule drafts (k = 2) at running batch 1 only; two groups, AR held to spec's lengths in "matched"
    bench = {
        "schedule": [[1, 1, 2], [2, 64, 0]],
        "sweep": {},
        "rollouts": [
            {
                "ar": _phase(10.0, {"1": 4.0, "4": 6.0}),  # 40% at drafting batches
                "spec": _phase(9.0, {"1": 1.0, "4": 8.0}, acceptance_length=4.0),
                "matched": {"ar": _phase(10.0, {}), "spec": _phase(12.0, {"1": 6.0, "4": 6.0})},  # 50%
            },
            {
                "ar": _phase(20.0, {"1": 2.0, "8": 18.0}),  # 10%
                "spec": _phase(18.0, {"1": 1.0, "8": 17.0}, acceptance_length=2.0),
                "matched": {"ar": _phase(20.0, {}), "spec": _phase(24.0, {"1": 4.8, "8": 19.2})},  # 20%
            },
        ],
    }
    path = tmp_path / "tiny_bench.json"
    path.write_text(json.dumps(bench))
    other = tmp_path / "loop.json"
    other.write_text(json.dumps({"steps": []}))
    out = tmp_path / "bound.json"
    res = _run("rollout_phase_bound.py", str(path), str(other), "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"skipped {other}: not a bench_spec_schedule.py output" in res.stderr

    (row,) = json.loads(out.read_text())
    assert row["file"] == str(path) and row["engine"] == "spec"
    # AR time at drafting batches: (4 + 2) / 30; acceptance weighted by it: (4 * 4 + 2 * 2) / 6
    assert row["share_at_drafting_batches"] == pytest.approx(0.2)
    assert row["acceptance_length"] == pytest.approx(20 / 6)
    # phase: 30 / (9 + 18); bound: 30 / (10 * (0.6 + 0.4 / 4) + 20 * (0.9 + 0.1 / 2)) = 30 / 26
    assert row["rollout_phase_speedup"] == pytest.approx(30 / 27)
    assert row["amdahl_bound"] == pytest.approx(30 / 26)
    # AR held: 36 / 27; bound from the held run: 36 / (12 * (0.5 + 0.5 / 4) + 24 * (0.8 + 0.2 / 2)) = 36 / 29.1
    assert row["matched_phase_speedup"] == pytest.approx(36 / 27)
    assert row["matched_amdahl_bound"] == pytest.approx(36 / 29.1)
    assert "| tiny_bench.json | spec | 20% | 3.33 | 1.111 | 1.154 | 1.333 | 1.237 |" in res.stdout


def test_online_draft_targets_argument_parser(tmp_path):
    res = _run("online_draft_targets.py", "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("usage: online_draft_targets.py")
    for option in ("--draft", "--steps", "--batch-size", "--lr", "--seeds", "--train-rows", "--variants", "--out"):
        assert option in res.stdout
    assert "sharpened" in res.stdout and "writes JSON with every point" in res.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written (no results/)


def test_make_standin_draft_argument_parser(tmp_path):
    # it used to read sys.argv[1] at import: ``--help`` wrote a head into a directory called "--help"
    res = _run("make_standin_draft.py", "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.startswith("usage: make_standin_draft.py [-h] OUT_DIR")
    assert "Writes the head to OUT_DIR" in res.stdout
    assert list(tmp_path.iterdir()) == []
    missing = _run("make_standin_draft.py", cwd=tmp_path)
    assert missing.returncode == 2 and "OUT_DIR" in missing.stderr
    assert list(tmp_path.iterdir()) == []
