"""bf16 through the whole GRPO loop (docs/design/precision.md): the features that run in fp32 run in bf16.

Each run is ``examples/run_grpo.py`` with ``policy.precision=bfloat16`` on a tiny recipe, several features packed into
one start-up, and the scripted reward (loop_training_checks.TRAINS) so every step trains:

- ``mtp_drafter_occ`` (CI): the MTP drafter (vLLM ``method: mtp``, refit with the policy) with OCC co-training of
  the MTP layer on fp32 masters (tiny-llama: one KV head, so no TP here);
- ``dp2_distopt`` (slow tier): DP=2 with the distributed optimizer (sharded fp32 masters), two engines, the online
  EAGLE-3 draft and Pilot-Commit (configs/grpo_math_tiny_dp2.yaml);
- ``tp2`` (slow tier): the same recipe with Megatron TP=2 (DP=1);
- ``dp2_async_split`` (slow tier): DP=2 policy, two engines on split placement, async GRPO.
Pilot-Commit, async GRPO and the online EAGLE-3 draft run in bf16 in CI through
test_pilot_commit_loop.py's async variant; the worker-level DP=2 / distributed optimizer / resume / refit checks are
test_bf16_training.py and test_megatron_parallel.py.

Per run: every step finite, trains, its refit probe between fp32's level (1e-4: a bf16 engine really runs) and the
bf16 tolerance (``refit/logprob_mismatch`` above it would have stopped the run), and the feature's own metrics.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loop_training_checks import TRAINS

from nemo_rl_spec.utils.precision import REFIT_TOLERANCE

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
COMMON = (
    "policy.precision=bfloat16",
    "grpo.max_num_steps=2",
    "grpo.val_at_start=false",
    "data.validation.max_samples=2",
    "logger.progress_bar=false",
    "logger.tensorboard_enabled=false",
    "checkpointing.save_period=2",
    *TRAINS,
)
RUNS = {
    "mtp_drafter_occ": (CONFIGS / "grpo_math_tiny_mtp_spec.yaml", ("policy.megatron_cfg.mtp_loss_mode=occ",)),
    "dp2_distopt": (
        CONFIGS / "grpo_math_tiny_dp2.yaml",
        ("policy.megatron_cfg.optimizer.use_distributed_optimizer=true",),
    ),
    "tp2": (CONFIGS / "grpo_math_tiny_dp2.yaml", ("policy.megatron_cfg.tensor_model_parallel_size=2",)),
    "dp2_async_split": (CONFIGS / "grpo_math_tiny_dp2_async.yaml", ()),
}


def _run(tmp: Path, name: str) -> tuple[list[dict], str]:
    recipe, extra = RUNS[name]
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "run_grpo.py"),
        "--config",
        str(recipe),
        *COMMON,
        *extra,
        f"logger.log_dir={tmp}/logs",
        f"checkpointing.checkpoint_dir={tmp}/ckpt",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads(x) for x in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["step"] > 0], proc.stdout


def _check_steps(metrics: list[dict], stdout: str) -> None:
    assert "precision: training bfloat16 (set in the recipe); engine bfloat16 (follows the policy)" in stdout
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["train/grad_norm"] > 1e-6 and m["rollout_alloc/mean_group_reward_var"] > 0, m  # it trains
        assert 1e-4 < m["refit/logprob_mismatch"] <= REFIT_TOLERANCE[("bfloat16", "bfloat16")], m
        assert m["train/token_mult_prob_error"] >= 1.0


def _check_checkpoint(ckpt: Path, tp: int) -> None:
    """The step-2 checkpoint holds bf16 parameters and their fp32 masters (every TP rank's file)."""
    for rank in range(tp):
        saved = torch.load(ckpt / "step_2" / "policy" / f"megatron_policy_tp{rank}.pt", weights_only=False)
        assert {v.dtype for v in saved["model"].values()} == {torch.bfloat16}
        assert saved["adam"] and all(e["master"].dtype == torch.float32 for e in saved["adam"].values())


def _check_drafts(metrics: list[dict], per_optimizer_step: bool = False) -> None:
    """The drafter refit with every step; its version counts GRPO steps (online EAGLE-3) or, with
    ``per_optimizer_step`` (the MTP drafter), the policy's optimizer steps (mini-batches of train_global_batch_size)."""
    done = 0
    for m in metrics:
        done += int(m["train/num_optimizer_steps"]) if per_optimizer_step else 1
        assert m["refit/draft_version"] == done and m["refit/weight_version"] == m["step"], m
        assert m["vllm/spec_num_drafts"] > 0 and m["vllm/spec_acceptance_length"] >= 1.0, m


@pytest.mark.timeout(1200)
def test_mtp_drafter_with_occ_in_bf16(tmp_path):
    metrics, stdout = _run(tmp_path, "mtp_drafter_occ")
    _check_steps(metrics, stdout)
    _check_drafts(metrics, per_optimizer_step=True)
    for m in metrics:
        # OCC's lambda is signed; it is reported per optimizer step (2 a step), and is finite in bf16
        lams = [m["train/mtp/lambda/mb0"], m["train/mtp/lambda/mb1"]]
        assert all(math.isfinite(x) for x in lams) and m["train/mtp/grad_norm"] > 0.0, m
        assert 0.0 <= m["train/mtp/acceptance"] <= 1.0, m
    _check_checkpoint(tmp_path / "ckpt", tp=1)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name, tp", [("dp2_distopt", 1), ("tp2", 2)])
def test_two_workers_eagle3_pilot_commit_in_bf16(tmp_path, name, tp):
    metrics, stdout = _run(tmp_path, name)
    _check_steps(metrics, stdout)
    _check_drafts(metrics)
    assert all(m["pilot_commit/commit_rollouts"] == m["pilot_commit/committed"] * 2 for m in metrics)
    _check_checkpoint(tmp_path / "ckpt", tp=tp)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_dp2_async_split_placement_in_bf16(tmp_path):
    metrics, stdout = _run(tmp_path, "dp2_async_split")
    _check_steps(metrics, stdout)
    assert all(m["async/trajectory_age_max"] <= 1 for m in metrics)
    _check_checkpoint(tmp_path / "ckpt", tp=1)
