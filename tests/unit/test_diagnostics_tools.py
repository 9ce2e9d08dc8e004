"""The diagnostic tools in examples/diagnostics/ that read files or parse arguments, run as the commands a user types
(subprocesses: tests import the package, never examples/). ``draft_drift_table.py`` against hand-computed windows;
``lossless_bf16.py --help`` (the study itself starts engines: it is a diagnostic run by hand, not a unit test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DIAGNOSTICS = ROOT / "examples" / "diagnostics"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(DIAGNOSTICS / script), *args],
        cwd=ROOT,
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
