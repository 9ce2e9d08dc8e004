"""Suite-wide pytest hooks: test tiers by location, unit tier first, per-phase durations for the time table.

Tiers (markers registered in pyproject.toml, ``--strict-markers``):

- ``unit``: everything under tests/unit (no Ray, no engines; about a minute in all).
- ``functional``: everything under tests/functional that is not ``slurm``.
- ``slurm``: tests that take the ``slurm_nodes`` fixture (tests/functional/test_slurm.py): they submit jobs to a
  running Slurm, which the install step starts (``make slurm``, run by ``.ci/run``).
- ``slow``: set explicitly by the tests themselves (statistical checks, tens of minutes); CI runs ``-m "not slow"``.

Collected items are reordered so that the unit tier runs first whatever paths were given (``pytest tests`` would
otherwise collect tests/functional first), keeping the order within each tier (module-scoped fixtures stay shared).

With ``TEST_PHASES_JSON=<path>`` set, the session writes ``{nodeid: {"setup": s, "call": s, "teardown": s}}``
(seconds) there at its end; ``scripts/test_times.py`` joins it with the JUnit XML into the time table.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
TIER_ORDER = ("unit", "functional", "slurm")
_PHASES: dict[str, dict[str, float]] = {}


def tier_of(item: pytest.Item) -> str | None:
    """The tier of a collected test: "unit", "functional", "slurm", or None outside tests/unit and tests/functional."""
    try:
        parts = Path(item.path).resolve().relative_to(TESTS_DIR).parts
    except ValueError:
        return None
    if parts[0] == "unit":
        return "unit"
    if parts[0] == "functional":
        return "slurm" if "slurm_nodes" in getattr(item, "fixturenames", ()) else "functional"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each item with its tier and move the unit tier to the front (stable: module order is kept)."""
    for item in items:
        tier = tier_of(item)
        if tier is not None:
            item.add_marker(tier)
            # the tier column of the time table (scripts/test_times.py); slow-marked tests are counted apart
            item.user_properties.append(("tier", "slow" if item.get_closest_marker("slow") else tier))
    rank = {tier: i for i, tier in enumerate(TIER_ORDER)}
    items.sort(key=lambda item: rank.get(tier_of(item), len(rank)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Record the duration of each phase (setup, call, teardown) of each test, in seconds."""
    _PHASES.setdefault(report.nodeid, {})[report.when] = round(report.duration, 3)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Write the recorded phase durations to $TEST_PHASES_JSON, when set."""
    path = os.environ.get("TEST_PHASES_JSON")
    if path and _PHASES and not hasattr(session.config, "workerinput"):  # pytest-xdist: the controller writes
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(_PHASES, indent=0, sort_keys=True))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole test session, for tests that do not need a Ray of their own.

    Starts ``ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)`` unless Ray is already
    initialised (then the running one is used and left running); yields the ``ray`` module; shuts down at the end
    of the session only the Ray it started. Tests that call ``ray.shutdown()`` themselves must not take it.
    Not yet taken by any test (modules adopt it one by one; see docs/guides/testing.md).
    """
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started and ray.is_initialized():
        ray.shutdown()
