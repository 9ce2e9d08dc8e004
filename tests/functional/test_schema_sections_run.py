"""Every boolean / optional key of the schema, set alone on the tiny recipe, through the real CLI
(``examples/run_grpo.py``, Ray + vLLM + Megatron): it completes one GRPO step, or exits 2 before Ray starts with the
key named (keys enumerated from the schema by tests/schema_sections.py).

One step costs about a minute on 2 cores, so all keys run only with ``-m slow`` (``make test-slow``); CI runs the
keys in :data:`CI_KEYS`. The pre-Ray half (validate or refuse, naming the key) runs for every key in CI:
tests/unit/test_schema_sections.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import schema_sections as ss  # noqa: E402

pytestmark = pytest.mark.timeout(900)

# representative keys for CI (~1 min each): a section turned on with its defaults (a new code path in the step),
# and a loss switch that changes what the trainer computes
CI_KEYS: tuple[str, ...] = ()  # every passing key runs in CI packed (test_packed_switch_groups_complete_one_step)
VARIANTS = ss.recipe_variants()


def run_one_step(tmp: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    """The tiny recipe for one step with ``overrides`` (applied last), in a subprocess as a user runs it."""
    cmd = [
        sys.executable,
        str(ss.ROOT / "examples" / "run_grpo.py"),
        "--config",
        str(ss.TINY),
        "grpo.max_num_steps=1",
        "data.validation.max_samples=2",
        f"logger.log_dir={tmp}/logs",
        f"checkpointing.checkpoint_dir={tmp}/ckpt",
        *overrides,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "NEMO_RL_SPEC_VERBOSE")}
    return subprocess.run(cmd, cwd=ss.ROOT, capture_output=True, text=True, timeout=800, env=env)


@pytest.mark.parametrize(
    "switch, overrides",
    [pytest.param(sw, o, id=sw.path, marks=() if sw.path in CI_KEYS else pytest.mark.slow) for sw, o in VARIANTS],
)
def test_switch_completes_one_step_or_exits_2_before_ray(switch, overrides, tmp_path):
    """One expected outcome per key (ss.REFUSED_BEFORE_RAY): a listed key exits 2 before Ray with its fragment and
    the key named; every other key completes one step."""
    proc = run_one_step(tmp_path, overrides)
    tail = f"{overrides}: rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    fragment = ss.expected_refusal(switch.path)
    if fragment is not None:
        assert proc.returncode == 2, f"expected refused before Ray with {fragment!r}; " + tail
        outcome, message = ss.pre_ray_outcome(["grpo.max_num_steps=1", "data.validation.max_samples=2", *overrides])
        assert outcome == "refused" and fragment in message, tail  # refused by the checks that run before Ray ...
        assert f"error: {message}" in proc.stderr, tail  # ... with their message, which names the key
        assert ss.names_key(message, switch.path) and "Traceback" not in proc.stderr, tail
        return
    assert_one_step(proc, tmp_path, tail)


def assert_one_step(proc: subprocess.CompletedProcess, tmp_path: Path, tail: str) -> None:
    """The run exited 0 and logged step 1 (it may train on nothing: e.g. dynamic sampling keeps no group of the
    random tiny model, whose rewards are all 0, so that step logs no train/loss)."""
    assert proc.returncode == 0, tail
    records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if r["step"] == 1] and '"steps_run": 1' in proc.stdout, tail


def test_packed_switch_groups_complete_one_step(tmp_path):
    """Every expected-to-pass switch, packed greedily (ss.packed_groups: no two switches of a group where one's
    section or enabled flag governs the other's key; the combined overrides pass the pre-Ray checks) into a handful
    of one-step runs. A failing group's message lists its switches; each can then be run alone above (slow tier).
    CI tier: 265 s measured here for all groups, packing included (was 2 keys alone, ~140 s)."""
    groups = ss.packed_groups(VARIANTS)
    for i, group in enumerate(groups):
        overrides = [o for _, os_ in group for o in os_]
        names = ", ".join(sw.path for sw, _ in group)
        proc = run_one_step(tmp_path / f"g{i}", overrides)
        assert_one_step(
            proc,
            tmp_path / f"g{i}",
            f"group {i} [{names}]: rc {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}",
        )
