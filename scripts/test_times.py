#!/usr/bin/env python3
"""Per-test time table of a pytest run, from its JUnit XML (and, when given, per-phase durations).

  test_times.py table   --junit J.xml [--phases P.json | --durations-log run.log]
                        --out docs/results/ci_test_times/test_times [--title T]
      writes <out>.md (per-tier totals, then every test sorted by total time, setup/call/teardown) and <out>.json
  test_times.py summary --junit J.xml [--phases P.json | --durations-log run.log] [--top 25] [--wall SECONDS]
      prints the per-tier totals and the TOP slowest tests (what .ci/run shows at the end of the test phase)

Sources: the JUnit XML (``pytest --junitxml``) lists every test with its outcome and its total seconds
(setup + call + teardown). The phases come from ``$TEST_PHASES_JSON`` written by tests/conftest.py
({nodeid: {"setup": s, "call": s, "teardown": s}}) or from the text of ``pytest --durations=0`` (lines like
``12.34s call     tests/x.py::test_y``; pytest hides phases under 0.005 s, counted as 0 here). Without either, the
phase columns are empty. The tier is the ``tier`` property tests/conftest.py records in the XML (unit, functional,
slurm, or slow for a test marked slow); for an XML
without it (runs before the tiers existed), the directory (tests/unit, tests/functional) and test_slurm.py decide.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

PHASES = ("setup", "call", "teardown")
DURATION_LINE = re.compile(r"^\s*([0-9.]+)s\s+(setup|call|teardown)\s+(\S.*?)\s*$")


@dataclass
class TimedTest:
    """One test of the run: seconds per phase (None when unknown) and the JUnit total (seconds)."""

    nodeid: str
    tier: str
    outcome: str
    total: float
    phases: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(PHASES))


def _nodeid(classname: str, name: str) -> str:
    """pytest's node id from JUnit's classname and name: tests.unit.test_a.TestB + t -> tests/unit/test_a.py::TestB::t
    (the module is the last dotted part named test_*; the parts after it are classes)."""
    parts = classname.split(".")
    modules = [i for i, part in enumerate(parts) if part.startswith("test_")]
    split = modules[-1] + 1 if modules else len(parts)
    return "::".join(["/".join(parts[:split]) + ".py", *parts[split:], name])


def _fallback_tier(nodeid: str) -> str:
    """Tier of a test from its path alone (for XML written before tests/conftest.py recorded it)."""
    if nodeid.startswith("tests/unit/"):
        return "unit"
    return "slurm" if "/test_slurm.py::" in nodeid else "functional"


def _outcome(case: ET.Element) -> str:
    for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        if case.find(tag) is not None:
            return name
    return "passed"


def read_junit(path: Path) -> list[TimedTest]:
    """The tests of a JUnit XML written by pytest, in file order. Raises FileNotFoundError, ET.ParseError."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        nodeid = _nodeid(case.get("classname", ""), case.get("name", ""))
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        tests.append(
            TimedTest(
                nodeid=nodeid,
                tier=props.get("tier") or _fallback_tier(nodeid),
                outcome=_outcome(case),
                total=float(case.get("time", 0.0)),
            )
        )
    return tests


def junit_run_info(path: Path) -> str:
    """'started <timestamp> on <host>, pytest's own total <s> s' from the XML's first testsuite ('' when absent)."""
    suite = next(ET.parse(path).getroot().iter("testsuite"), None)
    if suite is None:
        return ""
    return (
        f"started {suite.get('timestamp', '?')} on {suite.get('hostname', '?')}, "
        f"pytest's own total {float(suite.get('time', 0.0)):.0f} s"
    )


def read_phases_json(path: Path) -> dict[str, dict[str, float]]:
    """{nodeid: {phase: seconds}} as written by tests/conftest.py ($TEST_PHASES_JSON)."""
    return json.loads(path.read_text())


def read_durations_log(path: Path) -> dict[str, dict[str, float]]:
    """{nodeid: {phase: seconds}} from the `slowest durations` lines of pytest's terminal output."""
    phases: dict[str, dict[str, float]] = {}
    for line in path.read_text(errors="replace").splitlines():
        match = DURATION_LINE.match(line)
        if match:
            seconds, phase, nodeid = match.groups()
            phases.setdefault(nodeid, {})[phase] = float(seconds)
    return phases


def attach_phases(tests: list[TimedTest], phases: dict[str, dict[str, float]]) -> None:
    """Fill each test's phase seconds from `phases` (phases a --durations log hid count as 0.0)."""
    for test in tests:
        found = phases.get(test.nodeid, {})
        test.phases = {phase: float(found.get(phase, 0.0)) for phase in PHASES}


def tier_totals(tests: list[TimedTest]) -> dict[str, dict[str, float]]:
    """{tier: {"tests": count, "seconds": sum of totals, "setup"/"call"/"teardown": sums}}, tiers in run order."""
    totals: dict[str, dict[str, float]] = {}
    for test in tests:
        row = totals.setdefault(test.tier, {"tests": 0, "seconds": 0.0, **dict.fromkeys(PHASES, 0.0)})
        row["tests"] += 1
        row["seconds"] += test.total
        for phase in PHASES:
            row[phase] += test.phases[phase] or 0.0
    return {tier: {k: round(v, 2) for k, v in row.items()} for tier, row in totals.items()}


def _fmt(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds:.2f}"


def _hms(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s"


def render_markdown(tests: list[TimedTest], title: str, source: str) -> str:
    """The time table as Markdown: per-tier totals, then every test, slowest first."""
    totals = tier_totals(tests)
    lines = [
        f"# {title}",
        "",
        f"Source: {source}. Seconds; total = setup + call + teardown (JUnit). "
        "Refresh: `make test-times` after `make test` (docs/guides/testing.md).",
        "",
        "| tier | tests | total | setup | call | teardown |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for tier, row in totals.items():
        lines.append(
            f"| {tier} | {int(row['tests'])} | {row['seconds']:.1f} ({_hms(row['seconds'])}) | "
            f"{row['setup']:.1f} | {row['call']:.1f} | {row['teardown']:.1f} |"
        )
    everything = sum(row["seconds"] for row in totals.values())
    lines += [
        f"| all | {len(tests)} | {everything:.1f} ({_hms(everything)}) | | | |",
        "",
        "| # | test | tier | outcome | total | setup | call | teardown |",
        "|---:|---|---|---|---:|---:|---:|---:|",
    ]
    for rank, test in enumerate(sorted(tests, key=lambda t: -t.total), 1):
        # plain text, not a code span: tests/unit/test_docs_overrides.py reads code spans in docs/ as commands
        lines.append(
            f"| {rank} | {test.nodeid.replace('|', '&#124;')} | {test.tier} | {test.outcome} | {test.total:.2f} | "
            + " | ".join(_fmt(test.phases[p]) for p in PHASES)
            + " |"
        )
    return "\n".join(lines) + "\n"


def render_summary(tests: list[TimedTest], top: int, wall: float | None) -> str:
    """Plain-text summary for the end of a CI log: wall time, per-tier totals, the `top` slowest tests."""
    lines = ["==== test phase summary ===="]
    if wall is not None:
        lines.append(f"test phase wall time: {wall:.0f} s ({_hms(wall)})")
    for tier, row in tier_totals(tests).items():
        lines.append(f"  {tier:<11} {int(row['tests']):4d} tests {row['seconds']:8.1f} s ({_hms(row['seconds'])})")
    lines.append(f"{top} slowest tests (total = setup + call + teardown, seconds):")
    for test in sorted(tests, key=lambda t: -t.total)[:top]:
        phases = " ".join(f"{p}={_fmt(test.phases[p])}" for p in PHASES if test.phases[p] is not None)
        lines.append(f"  {test.total:8.2f}  {test.nodeid}  [{test.tier}, {test.outcome}] {phases}")
    return "\n".join(lines)


def load(args: argparse.Namespace) -> list[TimedTest]:
    """The tests of the run named by --junit, with phases from --phases or --durations-log when given."""
    tests = read_junit(Path(args.junit))
    if args.phases and Path(args.phases).is_file():
        attach_phases(tests, read_phases_json(Path(args.phases)))
    elif args.durations_log:
        attach_phases(tests, read_durations_log(Path(args.durations_log)))
    return tests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("table", "summary"))
    parser.add_argument("--junit", required=True, help="pytest --junitxml output")
    parser.add_argument("--phases", help="per-phase JSON written by tests/conftest.py ($TEST_PHASES_JSON)")
    parser.add_argument("--durations-log", help="pytest output with --durations=0 (alternative to --phases)")
    parser.add_argument("--out", help="table: output path without extension (.md and .json are written)")
    parser.add_argument("--title", default="Per-test times of the CI test phase")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--wall", type=float, help="summary: the test phase's wall time, seconds")
    args = parser.parse_args(argv)
    if not Path(args.junit).is_file():
        print(f"test_times: no JUnit XML at {args.junit} (run `make test` first)", file=sys.stderr)
        return 1
    tests = load(args)
    if args.command == "summary":
        print(render_summary(tests, args.top, args.wall))
        return 0
    if not args.out:
        parser.error("table needs --out")
    source = f"{args.junit}" + (f" + {args.phases or args.durations_log}" if args.phases or args.durations_log else "")
    source += f" ({junit_run_info(Path(args.junit))})"
    out = Path(args.out)
    out.with_suffix(".md").write_text(render_markdown(tests, args.title, source))
    out.with_suffix(".json").write_text(
        json.dumps(
            {
                "source": source,
                "tiers": tier_totals(tests),
                "tests": [asdict(t) for t in sorted(tests, key=lambda t: -t.total)],
            },
            indent=1,
        )
        + "\n"
    )
    print(f"test_times: {len(tests)} tests -> {out.with_suffix('.md')}, {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
