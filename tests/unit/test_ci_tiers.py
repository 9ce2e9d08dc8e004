"""tests/conftest.py on a miniature suite: tiers by location, unit tier first, tier property in the JUnit XML,
per-phase durations in $TEST_PHASES_JSON, --strict-markers with the markers pyproject.toml registers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FILES = {
    "tests/functional/test_f.py": "import time\n\ndef test_f_one():\n    time.sleep(0.05)\n\ndef test_f_two():\n    pass\n",
    "tests/functional/test_s.py": (
        "import pytest\n\n@pytest.fixture\ndef slurm_nodes():\n    return ['n1']\n\n"
        "def test_needs_slurm(slurm_nodes):\n    pass\n\n"
        "def test_stub_without_slurm():\n    pass\n\n"
        "@pytest.mark.slow\ndef test_long():\n    pass\n"
    ),
    "tests/unit/test_u.py": "def test_u_one():\n    pass\n",
}


def _suite(tmp_path: Path) -> Path:
    """A copy of tests/conftest.py and the pytest settings of pyproject.toml over the three files above."""
    for rel, text in FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    markers = "".join(f"\n    {m}" for m in ini["markers"])
    (tmp_path / "pytest.ini").write_text(f"[pytest]\naddopts = {ini['addopts']}\nmarkers ={markers}\n")
    return tmp_path


def _pytest(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def _collected(cwd: Path, *args: str) -> list[str]:
    proc = _pytest(cwd, "--collect-only", "-q", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_unit_tier_first_and_tiers_by_location(tmp_path):
    suite = _suite(tmp_path)
    # functional given first, as `pytest tests` collects it: the unit tier still runs first, the rest keep their order
    assert _collected(suite, "tests/functional", "tests/unit") == [
        "tests/unit/test_u.py::test_u_one",
        "tests/functional/test_f.py::test_f_one",
        "tests/functional/test_f.py::test_f_two",
        "tests/functional/test_s.py::test_stub_without_slurm",
        "tests/functional/test_s.py::test_long",
        "tests/functional/test_s.py::test_needs_slurm",
    ]
    assert _collected(suite, "tests", "-m", "unit") == ["tests/unit/test_u.py::test_u_one"]
    assert _collected(suite, "tests", "-m", "slurm") == ["tests/functional/test_s.py::test_needs_slurm"]
    assert _collected(suite, "tests", "-m", "functional and not slow") == [
        "tests/functional/test_f.py::test_f_one",
        "tests/functional/test_f.py::test_f_two",
        "tests/functional/test_s.py::test_stub_without_slurm",
    ]


def test_junit_tier_property_and_phase_durations(tmp_path):
    suite = _suite(tmp_path)
    phases = tmp_path / "out" / "phases.json"
    proc = _pytest(suite, "tests", "-q", f"--junitxml={tmp_path / 'j.xml'}", env={"TEST_PHASES_JSON": str(phases)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tiers = {
        case.get("name"): case.find("properties/property").get("value")
        for case in ET.parse(tmp_path / "j.xml").getroot().iter("testcase")
    }
    assert tiers == {
        "test_u_one": "unit",
        "test_f_one": "functional",
        "test_f_two": "functional",
        "test_stub_without_slurm": "functional",
        "test_needs_slurm": "slurm",
        "test_long": "slow",
    }
    recorded = json.loads(phases.read_text())
    assert set(recorded) == {
        f"{rel}::{name}"
        for rel, name in [
            ("tests/unit/test_u.py", "test_u_one"),
            ("tests/functional/test_f.py", "test_f_one"),
            ("tests/functional/test_f.py", "test_f_two"),
            ("tests/functional/test_s.py", "test_needs_slurm"),
            ("tests/functional/test_s.py", "test_stub_without_slurm"),
            ("tests/functional/test_s.py", "test_long"),
        ]
    }
    one = recorded["tests/functional/test_f.py::test_f_one"]
    assert set(one) == {"setup", "call", "teardown"} and one["call"] >= 0.05, one  # the call sleeps 0.05 s


def test_a_misspelt_marker_is_a_collection_error(tmp_path):
    suite = _suite(tmp_path)
    (suite / "tests" / "unit" / "test_typo.py").write_text(
        "import pytest\n\n@pytest.mark.slwo\ndef test_t():\n    pass\n"
    )
    proc = _pytest(suite, "tests", "--collect-only", "-q")
    assert proc.returncode != 0 and "'slwo' not found in `markers`" in proc.stdout, proc.stdout
