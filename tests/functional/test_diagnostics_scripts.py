"""The engine-starting diagnostic in examples/diagnostics/, run as the command a user types: three speculative vLLM
engines in one process, each engine's acceptance counters its own (``check_spec_counters_per_engine.py``; the
logger's logic without engines is tests/unit/test_spec_counters_per_engine.py). About 25 s on 2 cores, so it runs in
the slow tier: CI checks per-engine counters through Ray in tests/functional/test_vllm_generation_dp.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm")

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_check_spec_counters_per_engine_passes():
    res = subprocess.run(
        [sys.executable, "examples/diagnostics/check_spec_counters_per_engine.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    # the script's checks: each speculative engine's second run counts what its first did, draft tokens = k x
    # drafts, drafts + accepted within the tokens generated, and the autoregressive engine counts no drafts
    assert "OK: each engine's counters are its own" in res.stdout, out[-4000:]
