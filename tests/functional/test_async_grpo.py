"""Async GRPO end to end on the tiny recipe (real Ray + vLLM + Megatron): the age bound exactly at 1, truncated
importance weights within the cap while the policy really moves, a crash mid-run (refit raising) that tears down
every actor and leaves the last checkpoint usable, resume restoring the buffer and versions, and Ctrl-C.

The tiny random model never solves a math problem (reward 0, zero advantages, no gradient), so these tests select
the scripted reward from the recipe (``env.reward=char_fraction``, environments/char_fraction_env.py) that gives
every group a spread: the weights then change each step and one-step-old rollouts are measurably off-policy.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray
import torch

from nemo_rl_spec.algorithms.async_grpo import async_grpo_train
from nemo_rl_spec.algorithms.grpo_setup import setup, teardown
from nemo_rl_spec.utils.config import load_config

ROOT = Path(__file__).resolve().parents[2]
ASYNC = ROOT / "configs" / "grpo_math_tiny_async.yaml"
CAP = 2.0


def _cfg(tmp: Path, *overrides: str):
    return load_config(
        ASYNC,
        [
            f"logger.log_dir={tmp}/logs",
            f"checkpointing.checkpoint_dir={tmp}/ckpt",
            "logger.progress_bar=false",
            "grpo.val_at_start=false",
            "env.reward=char_fraction",
            f"loss_fn.truncated_importance_sampling_ratio={CAP}",
            *overrides,
        ],
    )


def _descendants() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _wait_gone(pids: set[int], timeout: float = 30.0) -> set[int]:
    deadline = time.time() + timeout
    alive = set(pids)
    while alive and time.time() < deadline:
        alive = {p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        time.sleep(0.5)
    return alive


def _run(cfg, crash_at_version: int | None = None):
    """Set up, run async GRPO, tear down; returns (history, pids spawned by setup). With ``crash_at_version`` the
    refit to that version raises, and the refit before it waits until the producer has finished batch
    ``crash_at_version - 1`` (so the checkpoint before the crash holds a non-empty buffer)."""
    s = setup(cfg)
    if crash_at_version is not None:
        refit, allocator_step, done = s.refitter.refit, s.allocator.step, []

        def counted_step(*args, **kwargs):
            out = allocator_step(*args, **kwargs)
            done.append(1)
            return out

        def failing_refit(version):
            if version == crash_at_version:
                raise RuntimeError(f"injected refit failure at version {version}")
            if version == crash_at_version - 1:  # batch `version` may be generated at version - 1 (age bound 1)
                deadline = time.time() + 120
                while len(done) < version + 1 and time.time() < deadline:
                    time.sleep(0.05)
                time.sleep(0.5)  # the producer puts the batch right after its allocator step returns
            return refit(version)

        s.allocator.step, s.refitter.refit = counted_step, failing_refit
    spawned = _descendants()
    try:
        return async_grpo_train(s), spawned
    finally:
        teardown(s)


def test_age_bound_is_correction_crash_and_resume(tmp_path):
    # 1. crash mid-run: the refit to version 3 (end of step index 2) raises; step_2 is the last checkpoint
    cfg = _cfg(tmp_path, "grpo.max_num_steps=4", "checkpointing.save_period=1")
    # children this process had before the run (e.g. multiprocessing's resource tracker, started by an earlier test
    # in the session and alive until pytest exits) are not the run's
    before = _descendants()
    with pytest.raises(RuntimeError, match="injected refit failure"):
        _run(cfg, crash_at_version=3)
    assert not ray.is_initialized()
    leftovers = _wait_gone(_descendants() - before)
    assert not leftovers, f"processes left after teardown: {leftovers}"

    records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in records}
    assert sorted(by_step) == [1, 2]
    assert by_step[1]["async/trajectory_age_max"] == 0  # batch 0 is sampled by the initial weights
    assert by_step[2]["async/trajectory_age_max"] == 1  # batch 1 was sampled during step 0: exactly at the bound
    for step, m in by_step.items():
        assert m["refit/weight_version"] == step
        assert m["async/evicted_groups_total"] == 0
        assert m["train/is_weight_max"] <= CAP + 1e-6
        for key in (
            "timing/train/exposed_generation",
            "timing/train/idle/buffer_starvation",
            "timing/train/idle/refit_bubble",
            "timing/train/total_step_time",
        ):
            assert key in m and m[key] >= 0
    assert by_step[1]["train/grad_norm"] > 0  # the scripted reward moves the weights
    # batch 1 came from version 0 while the trainer held version 1: the recomputed log-probs differ from the
    # behaviour log-probs (off-policy), but the truncated weights stay within the cap
    assert by_step[2]["train/importance_ratio_max_abs_dev"] > 1e-4
    assert by_step[1]["train/importance_ratio_max_abs_dev"] < 1e-3  # on-policy step: ratios ~1

    ckpts = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_"))
    assert ckpts == ["step_1", "step_2"]
    saved = torch.load(tmp_path / "ckpt" / "step_2" / "train_state.pt", weights_only=False)
    state = saved["async_grpo"]
    assert state["policy_version"] == 2
    assert saved["allocator"]["step"] == state["next_index"]  # allocator state of the last buffered batch
    buffered = [
        (b["index"], min(r["policy_version"] for g in b["selection"]["groups"] for r in g["results"]))
        for b in state["batches"]
    ]
    assert [i for i, _ in buffered] == list(range(2, state["next_index"])) and buffered, state["next_index"]
    assert all(2 - v <= 1 for _, v in buffered)

    # 2. resume: the buffered batches train first with their original versions, then generation continues
    history, _ = _run(_cfg(tmp_path, "grpo.max_num_steps=4", "checkpointing.save_period=1"))
    records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in records}
    assert sorted(by_step) == [1, 2, 3, 4] and len(history) == 2
    resumed = by_step[3]
    assert resumed["async/batch_index"] == buffered[0][0]
    assert resumed["async/batch_policy_version"] == buffered[0][1]
    assert resumed["refit/weight_version"] == 3 and by_step[4]["refit/weight_version"] == 4
    assert max(by_step[s]["async/trajectory_age_max"] for s in (3, 4)) <= 1
    assert by_step[4]["train/is_weight_max"] <= CAP + 1e-6
    assert (tmp_path / "ckpt" / "step_4" / "training_info.json").is_file()


def test_ctrl_c_leaves_no_processes_and_a_usable_checkpoint(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "run_grpo.py"),
        "--config",
        str(ASYNC),
        f"logger.log_dir={tmp_path}/logs",
        f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
        "logger.progress_bar=false",
        "grpo.max_num_steps=50",
        "checkpointing.save_period=1",
    ]
    # Ctrl-C as from a terminal: a job started in the background by a non-interactive shell (e.g. CI run with
    # `&`) inherits SIGINT ignored, and Python then never raises KeyboardInterrupt; restore the default for the
    # driver. Its output goes to a file (an unread pipe can fill and block the driver).
    log = tmp_path / "driver.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    deadline = time.time() + 600
    while not (tmp_path / "ckpt" / "step_1" / "training_info.json").is_file():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-4000:]
        time.sleep(1)
    family = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    assert family, "no Ray / vLLM processes found under the driver"
    os.kill(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("driver did not exit within 120 s of Ctrl-C:\n" + log.read_text()[-3000:])
    leftovers = _wait_gone(family)
    assert not leftovers, f"orphan processes after Ctrl-C: {leftovers}"
    latest = max(
        (p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")),
        key=lambda p: int(p.name.split("_")[1]),
    )
    assert (latest / "training_info.json").is_file()
    state = torch.load(latest / "train_state.pt", weights_only=False)
    assert "async_grpo" in state and "allocator" in state
