"""Checkpoint layout and crash safety: a run killed while writing leaves the previous checkpoint intact."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from nemo_rl_spec.utils.checkpoint import CheckpointManager


def _write(mgr, step, payload=b"x"):
    tmp = mgr.begin(step)
    (tmp / "policy.bin").write_bytes(payload)
    return mgr.finalize(tmp, step, {"train/reward": 0.5}, "grpo: {}\n")


def test_layout_and_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_top_k=2)
    assert mgr.latest() is None
    for step in (1, 2, 3):
        _write(mgr, step)
    assert mgr.steps() == [2, 3]  # step_1 pruned after step_3 was complete
    latest = mgr.latest()
    assert latest.name == "step_3"
    assert json.loads((latest / "training_info.json").read_text()) == {"step": 3, "train/reward": 0.5}
    assert (latest / "config.yaml").read_text() == "grpo: {}\n"


def test_failure_while_writing_keeps_previous(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_top_k=1)
    _write(mgr, 1, b"good")
    tmp = mgr.begin(2)
    (tmp / "policy.bin").write_bytes(b"half")
    # the writer dies here: no finalize
    assert mgr.latest().name == "step_1"
    assert (mgr.latest() / "policy.bin").read_bytes() == b"good"
    # the next run cleans the leftover and can write step 2
    _write(mgr, 2, b"new")
    assert not list(tmp_path.glob("tmp_step_*"))
    assert mgr.steps() == [2]


def test_refuses_to_overwrite(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_top_k=3)
    _write(mgr, 1)
    with pytest.raises(FileExistsError, match="step_1 already exists"):
        _write(mgr, 1)


def test_sigkill_during_write_leaves_previous_intact(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_top_k=3)
    _write(mgr, 1, b"good")
    script = textwrap.dedent(f"""
        from nemo_rl_spec.utils.checkpoint import CheckpointManager
        mgr = CheckpointManager({str(tmp_path)!r}, keep_top_k=3)
        tmp = mgr.begin(2)
        with open(tmp / "policy.bin", "wb") as fh:
            print("writing", flush=True)
            while True:
                fh.write(b"0" * 1024)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"writing"
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (tmp_path / "tmp_step_2").exists()
    assert mgr.latest().name == "step_1"
    assert (mgr.latest() / "policy.bin").read_bytes() == b"good"
