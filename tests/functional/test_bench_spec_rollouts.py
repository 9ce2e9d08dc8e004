"""Smoke test of ``examples/bench_spec_rollouts.py --quick`` on the tiny recipe: the JSON has every (k, batch) row
with the expected keys, and its derived quantities agree with an independent recomputation from the raw numbers
(speedup = spec tok/s / AR tok/s, E(a) = acceptance length, bound = E / step_cost_ratio, rollout-phase speedup =
AR seconds / speculative seconds). Several engines start: slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm")

from nemo_rl_spec.testing import checks
from nemo_rl_spec.utils.feature_configs import validate_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]


def test_quick_bench_on_tiny(tmp_path):
    target, prompts, draft = checks.tiny_qwen3_with_trained_head(str(tmp_path / "draft"))
    out = tmp_path / "bench.json"
    res = subprocess.run(
        [
            sys.executable,
            "examples/bench_spec_rollouts.py",
            "--quick",
            "--config",
            "configs/grpo_math_tiny.yaml",
            "--draft",
            draft,
            "--out",
            str(out),
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    print(res.stdout[-3000:])
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert sorted(rows) == ["k1_b1", "k1_b4", "k3_b1", "k3_b4"]
    for row in rows.values():
        k = row["k"]
        for key in ("tokens_per_s", "speedup", "acceptance_length", "step_cost_ratio", "bound"):
            assert row[key] > 0, (key, row)
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / row["ar_tokens_per_s"])
        assert row["step_cost_ratio"] == pytest.approx(row["spec_step_s"] / row["ar_step_s"])
        a = row["a"]
        e = k + 1.0 if a == 1.0 else sum(a**j for j in range(k + 1))  # 1 + a + ... + a^k
        assert e == pytest.approx(min(max(row["acceptance_length"], 1.0), k + 1), rel=1e-6)
        assert row["bound"] == pytest.approx(e / row["step_cost_ratio"], rel=1e-6)
        assert 1.0 <= row["acceptance_length"] <= k + 1
    validate_schedule(data["batch_aware"]["schedule"])
    pairs = data["rollout_phase"]["pairs_s"]
    for name, speedup in data["rollout_phase"]["speedup"].items():
        assert speedup == pytest.approx(sum(p[0] for p in pairs[name]) / sum(p[1] for p in pairs[name]))
    assert set(data["rollout_phase_speedup"]) >= {"with_batch_aware", "without_batch_aware"}
