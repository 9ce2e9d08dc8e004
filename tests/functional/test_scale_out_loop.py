"""Scale-out end to end: GRPO with 2 Megatron workers and 2 vLLM engines through the real driver.

- sync GRPO, colocated (``configs/grpo_math_tiny_dp2.yaml``: DP=2 policy, 2 engines, online EAGLE-3, Pilot-Commit) and
  async GRPO, split placement with the collective refit transport (``configs/grpo_math_tiny_dp2_async.yaml``,
  ``refit_transport: nccl``: gloo on CPU) and one engine SIGKILLed after step 1 (restarted), 3 steps each: finite metrics, every engine's
  probe below 1e-3, and the first step's rewards and loss equal to the 1 policy worker + 1 engine run of the same
  recipe and seeds (the independent computation: the single-worker path; one sync run serves both, see
  ``single_step``).
- PP=2 policy (two stages) with 2 engines, sync, 2 steps: step 1 equal to the 1 + 1 run; one checkpoint file per stage.
- TP=2 policy with 2 engines (in process, through ``setup``): one GRPO step, every engine's probe below 1e-3 and its
  (policy, draft) versions equal to the step; then a refit that skips engine 1 on purpose is detected by name.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
DP2 = ROOT / "configs" / "grpo_math_tiny_dp2.yaml"
DP2_ASYNC = ROOT / "configs" / "grpo_math_tiny_dp2_async.yaml"
pytestmark = pytest.mark.timeout(1800)
COMMON = (
    "grpo.max_num_steps=3",
    "grpo.val_at_start=false",
    "data.validation.max_samples=2",
    "logger.progress_bar=false",
    "checkpointing.enabled=false",
    "env.reward=char_fraction",
)  # scripted reward: real advantages, so the policy loss and refits carry the checks


def run_grpo(recipe: Path, tmp: Path, *overrides: str, kill_engine_after: int | None = None) -> tuple[list[dict], str]:
    """Run the real driver in a subprocess; returns the metrics records and its full console (``console.log``: the
    placement lines are kept off a quiet terminal). ``kill_engine_after``: once that step's metrics are logged,
    SIGKILL one vLLM engine process (:func:`_kill_one_engine`)."""
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "run_grpo.py"),
        "--config",
        str(recipe),
        f"logger.log_dir={tmp}/logs",
        f"checkpointing.checkpoint_dir={tmp}/ckpt",
        *COMMON,
        *overrides,
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if kill_engine_after is not None:
        _kill_one_engine(proc, tmp / "logs" / "metrics.jsonl", kill_engine_after)
    stdout, stderr = proc.communicate(timeout=1500)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-6000:]
    return (
        [json.loads(x) for x in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()],
        (tmp / "logs" / "console.log").read_text(),
    )


def _kill_one_engine(proc: subprocess.Popen, metrics: Path, step: int) -> None:
    """Wait until ``metrics`` holds step ``step`` (while ``proc`` runs), then SIGKILL one vLLM engine actor process
    (Ray names the process after the actor class) and check that it is gone."""
    deadline = time.time() + 900
    while not (metrics.is_file() and any(json.loads(x)["step"] >= step for x in metrics.read_text().splitlines())):
        assert proc.poll() is None and time.time() < deadline, "the run ended before the engine could be killed"
        time.sleep(0.2)
    engines = [
        p for p in psutil.process_iter(["cmdline"]) if "VllmGenerationWorker" in " ".join(p.info["cmdline"] or [])
    ]
    assert len(engines) == 2, [p.info["cmdline"] for p in engines]
    engines[1].kill()
    engines[1].wait(timeout=30)


def _check_scaled_run(records: list[dict], console: str, engines: int) -> None:
    steps = {r["step"]: r for r in records}
    assert sorted(steps) == [1, 2, 3], sorted(steps)
    for step, m in steps.items():
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), (step, m)
        assert m["refit/weight_version"] == step
        for e in range(engines):
            assert m[f"refit/logprob_mismatch_engine_{e}"] < 1e-3, (step, e)
        assert m["refit/draft_version"] == step
        assert m["train/grad_norm"] > 1e-6 and m["rollout_alloc/mean_group_reward_var"] > 0, (step, m)  # it trains
    assert console.count("[placement] policy rank") == 2 and console.count("[placement] generation engine") == engines


def _assert_first_step_equal(scaled: dict, single: dict) -> None:
    """Rewards and response lengths equal (the engines sampled the same tokens), losses within fp32 rounding. The
    scripted reward (env.reward=char_fraction) gives a non-zero policy-gradient loss and gradient, and the online
    EAGLE-3 loss depends on every sampled token and on DP's global normalisation: all three carry the check."""
    assert single["train/draft_loss"] > 1.0 and single["train/grad_norm"] > 1e-6 and single["train/loss"] != 0.0
    for key in ("train/reward", "train/mean_response_length"):
        assert scaled[key] == single[key], key
    for key in ("train/loss", "train/grad_norm", "train/draft_loss"):
        assert scaled[key] == pytest.approx(single[key], rel=1e-5, abs=1e-7), key
    for key in single:
        if key.startswith(("pilot_commit/", "rollouts/")):
            assert scaled[key] == single[key], key


@pytest.fixture(scope="module")
def single_step(tmp_path_factory) -> dict:
    """Step 1 of the 1 policy worker + 1 engine run of the DP2 recipe (sync, colocated). Async GRPO trains batch 0 at
    version 0 with the same request seeds, so it is the reference for both scaled runs (measured: the sync and async
    1 + 1 runs agree bitwise on step 1)."""
    records, _ = run_grpo(DP2, tmp_path_factory.mktemp("single"), "grpo.max_num_steps=1", "cluster.workers_per_node=1")
    return records[0]


def test_sync_dp2_two_engines_equals_one_plus_one(tmp_path, single_step):
    scaled, out = run_grpo(DP2, tmp_path / "dp2")
    _check_scaled_run(scaled, out, engines=2)
    _assert_first_step_equal(scaled[0], single_step)


def test_async_split_dp2_two_engines_equals_one_plus_one(tmp_path, single_step):
    """Also the collective refit transport on CPU: the trainer's rank 0 broadcasts policy and draft to both engines
    over gloo in 1 MiB buckets (the 1 + 1 reference refits through the object store), so every probe below 1e-3 and
    step 1 equal to the reference check its weights and versions.

    And an engine killed mid-run (``grpo.async_grpo.max_generation_failures=1``): once step 1 is logged, one of the
    two engines is SIGKILLed; it is restarted with what rank 0 last broadcast, the group is rebuilt, and the run
    finishes its steps with every probe below 1e-3 (the restarted engine holds the pushed weights), finite metrics,
    the restart counted and no trained rollout older than the age bound."""
    scaled, out = run_grpo(
        DP2_ASYNC,
        tmp_path / "dp2",
        "policy.generation.refit_transport=nccl",
        "policy.refit.bucket_size_mb=1",
        "grpo.async_grpo.max_generation_failures=1",
        kill_engine_after=1,
    )
    _check_scaled_run(scaled, out, engines=2)
    assert "async/trajectory_age_max" in scaled[1]
    assert all(r["refit/broadcast_buckets"] > 1 for r in scaled), [r["refit/broadcast_buckets"] for r in scaled]
    assert scaled[0]["generation/engine_restarts"] == 0 and scaled[-1]["generation/engine_restarts"] == 1
    assert max(r["async/trajectory_age_max"] for r in scaled) <= 1
    _assert_first_step_equal(scaled[0], single_step)


def test_tp2_refit_reaches_every_engine_and_a_skipped_engine_is_named(tmp_path):
    """TP=2 policy (DP=1) with 2 colocated engines and the reference-policy KL term on: after one GRPO step every
    engine's probe is below 1e-3 and holds (policy, draft) version 1; then a refit that loads version 2 into engine 0
    only is caught by the refitter."""
    from nemo_rl_spec.algorithms.grpo import grpo_step
    from nemo_rl_spec.algorithms.grpo_setup import setup, teardown
    from nemo_rl_spec.algorithms.refit import EngineVersionMismatchError
    from nemo_rl_spec.utils.config import load_config
    from nemo_rl_spec.utils.timer import Timer

    cfg = load_config(
        DP2,
        [
            "policy.megatron_cfg.tensor_model_parallel_size=2",
            f"logger.log_dir={tmp_path}/logs",
            "checkpointing.enabled=false",
            "logger.progress_bar=false",
            "loss_fn.reference_policy_kl_penalty=0.01",  # reference log-probs through the loop
            "env.reward=char_fraction",
        ],
    )  # a real gradient: a stale engine's probe would show it
    s = setup(cfg)
    try:
        assert (s.policy.dp_size, s.policy.tp_size, s.generation.num_engines) == (1, 2, 2)
        timer = Timer()
        metrics, _ = grpo_step(s, 0, timer)
        assert metrics["train/kl_penalty"] == 0.0  # step 0: the policy is the reference
        assert metrics["train/grad_norm"] > 1e-6  # the weights move: the version-1 probes test a real refit
        assert "policy_and_reference_logprobs" in timer.metrics("")
        assert metrics["refit/logprob_mismatch_engine_0"] < 1e-3 and metrics["refit/logprob_mismatch_engine_1"] < 1e-3
        assert s.generation.get_versions() == [{"policy_version": 1, "draft_version": 1, "draft_policy_version": 1}] * 2
        s.generation.update_weights(s.policy.export_hf_weights(2), 2, ranks=[0])
        with pytest.raises(EngineVersionMismatchError, match="engine 1: .'policy_version': 1"):
            s.refitter.check_versions(2)
        s.refitter.refit(2)  # a full refit repairs it
        assert [v["policy_version"] for v in s.generation.get_versions()] == [2, 2]
    finally:
        teardown(s)


NO_DRAFT = ("policy.draft.enabled=false", "policy.generation.vllm_kwargs.speculative_config=null")


def test_sync_pp2_two_engines_equals_one_plus_one(tmp_path):
    """Pipeline parallelism end to end: the DP2 recipe with a PP=2 policy (two Megatron stages, DP=1) and 2 colocated
    engines, without speculation (the online draft is refused under PP), 2 steps; the refit exports both stages'
    layers (every engine's probe below 1e-3), and step 1 equals the 1 policy worker + 1 engine run of the same recipe:
    the same sampled tokens and rewards, loss and grad norm within fp32 rounding (the scripted reward gives real
    advantages). The checkpoint holds one file per stage."""
    common = ("grpo.max_num_steps=2", "checkpointing.enabled=true", *NO_DRAFT)
    single, _ = run_grpo(DP2, tmp_path / "single", *common, "cluster.workers_per_node=1")
    scaled, console = run_grpo(DP2, tmp_path / "pp2", *common, "policy.megatron_cfg.pipeline_model_parallel_size=2")
    assert [r["step"] for r in scaled] == [1, 2]
    for m in scaled:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
        assert m["refit/weight_version"] == m["step"]
        assert max(m[f"refit/logprob_mismatch_engine_{e}"] for e in range(2)) < 1e-3, m
        assert m["train/grad_norm"] > 1e-6 and m["rollout_alloc/mean_group_reward_var"] > 0, m
    for key in ("train/reward", "train/mean_response_length"):
        assert scaled[0][key] == single[0][key], key
    for key in ("train/loss", "train/grad_norm"):
        assert scaled[0][key] == pytest.approx(single[0][key], rel=1e-5, abs=1e-7), key
    assert console.count("[placement] policy rank") == 2 and console.count("[placement] generation engine") == 2
    assert sorted(os.listdir(tmp_path / "pp2" / "ckpt" / "step_2" / "policy"))[:2] == [
        "megatron_policy_tp0_pp0.pt",
        "megatron_policy_tp0_pp1.pt",
    ]
