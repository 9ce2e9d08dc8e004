"""scripts/test_times.py: the time table and the CI summary from a hand-written JUnit XML and phase sources."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("test_times_script", ROOT / "scripts" / "test_times.py")
tt = sys.modules.setdefault("test_times_script", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(tt)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" time="31.5"
 timestamp="2026-12-04T03:00:00" hostname="vm">
<testcase classname="tests.unit.test_a" name="test_fast" time="0.5"><properties>
 <property name="tier" value="unit"/></properties></testcase>
<testcase classname="tests.functional.test_b" name="test_loop[x.y-1]" time="20.0"><properties>
 <property name="tier" value="functional"/></properties></testcase>
<testcase classname="tests.functional.test_slurm" name="test_job" time="10.0"><failure message="boom"/></testcase>
<testcase classname="tests.functional.test_b" name="test_skip" time="1.0"><skipped message="no"/></testcase>
<testcase classname="tests.unit.test_a.TestGroup" name="test_m" time="0.25"/>
</testsuite></testsuites>
"""
DURATIONS = """============================== slowest durations ===============================
12.00s setup    tests/functional/test_b.py::test_loop[x.y-1]
7.50s call     tests/functional/test_b.py::test_loop[x.y-1]
0.50s teardown tests/functional/test_b.py::test_loop[x.y-1]
10.00s call     tests/functional/test_slurm.py::test_job
0.20s call     tests/unit/test_a.py::TestGroup::test_m
(3 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "j.xml").write_text(JUNIT)
    (tmp_path / "run.log").write_text(DURATIONS)
    return tmp_path / "j.xml", tmp_path / "run.log"


def test_junit_ids_tiers_outcomes_and_durations_log_phases(run):
    junit, log = run
    tests = tt.read_junit(junit)
    assert [t.nodeid for t in tests] == [
        "tests/unit/test_a.py::test_fast",
        "tests/functional/test_b.py::test_loop[x.y-1]",
        "tests/functional/test_slurm.py::test_job",
        "tests/functional/test_b.py::test_skip",
        "tests/unit/test_a.py::TestGroup::test_m",
    ]
    # the property decides when present; the path when not (test_slurm.py -> slurm)
    assert [t.tier for t in tests] == ["unit", "functional", "slurm", "functional", "unit"]
    assert [t.outcome for t in tests] == ["passed", "passed", "failed", "skipped", "passed"]
    tt.attach_phases(tests, tt.read_durations_log(log))
    assert tests[1].phases == {"setup": 12.0, "call": 7.5, "teardown": 0.5}
    assert tests[0].phases == {"setup": 0.0, "call": 0.0, "teardown": 0.0}  # hidden by pytest: counted as 0
    assert tests[4].phases == {"setup": 0.0, "call": 0.2, "teardown": 0.0}  # a test in a class
    totals = tt.tier_totals(tests)
    assert totals == {
        "unit": {"tests": 2, "seconds": 0.75, "setup": 0.0, "call": 0.2, "teardown": 0.0},
        "functional": {"tests": 2, "seconds": 21.0, "setup": 12.0, "call": 7.5, "teardown": 0.5},
        "slurm": {"tests": 1, "seconds": 10.0, "setup": 0.0, "call": 10.0, "teardown": 0.0},
    }


def test_table_files_and_summary(run, tmp_path, capsys):
    junit, _ = run
    phases = tmp_path / "phases.json"  # the form tests/conftest.py writes
    phases.write_text(json.dumps({"tests/functional/test_b.py::test_loop[x.y-1]": {"setup": 1.0, "call": 18.0}}))
    assert tt.main(["table", "--junit", str(junit), "--phases", str(phases), "--out", str(tmp_path / "t")]) == 0
    table = json.loads((tmp_path / "t.json").read_text())
    assert [t["total"] for t in table["tests"]] == [20.0, 10.0, 1.0, 0.5, 0.25]  # slowest first
    assert table["tests"][0]["phases"] == {"setup": 1.0, "call": 18.0, "teardown": 0.0}
    md = (tmp_path / "t.md").read_text()
    assert "| functional | 2 | 21.0 (0m21s) | 1.0 | 18.0 | 0.0 |" in md
    assert "| all | 5 | 31.8 (0m32s) | | | |" in md
    assert "started 2026-12-04T03:00:00 on vm, pytest's own total 32 s" in md
    assert tt.main(["summary", "--junit", str(junit), "--top", "2", "--wall", "125"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "test phase wall time: 125 s (2m05s)" in out
    slowest = [line.split()[1] for line in out if line.startswith("    ")]
    assert slowest == ["tests/functional/test_b.py::test_loop[x.y-1]", "tests/functional/test_slurm.py::test_job"]


def test_missing_junit_is_an_error_not_an_empty_table(tmp_path, capsys):
    assert tt.main(["summary", "--junit", str(tmp_path / "none.xml")]) == 1
    assert "run `make test` first" in capsys.readouterr().err
