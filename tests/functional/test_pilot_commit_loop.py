"""Pilot-Commit through the real GRPO loop (Ray + vLLM + Megatron, tiny recipe): the rollouts each step generates
and trains on are exactly the allocator's plan, and a run resumed from the step-2 checkpoint continues exactly
like an uninterrupted one (allocator state included: pool position, pending pilots, replay buffer).

The thresholds p_lower=0, p_upper=1 select every piloted prompt (the tiny model is random, so its rewards cannot
drive the filter); the filter itself is tested on synthetic pools in tests/unit/test_pilot_commit.py. With
pilot_batch_size=2, n_pilot=2, n_commit=4 and the tiny budget 2 x 4 = 8 there is K=1 commit slot per step, so one
selected prompt per pilot goes to the replay buffer, and max_off_steps=1 makes the oldest entry expire in step 3.

Every run selects the scripted reward (``env.reward=char_fraction``) so the policy trains and the resume comparison
covers the optimizer state. Start-ups: one uninterrupted 3-step run serves the plan test (its steps 1-2 and step_2
checkpoint) and the resume test's reference; the resume restarts from a copy of its step_2 (2 start-ups, was 3).
"""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loop_training_checks import TRAINS, assert_trained, policy_weights

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "grpo_math_tiny.yaml"
PC = (
    "+grpo.pilot_commit.n_pilot=2",
    "+grpo.pilot_commit.pilot_batch_size=2",
    "+grpo.pilot_commit.n_commit=4",
    "+grpo.pilot_commit.p_lower=0.0",
    "+grpo.pilot_commit.p_upper=1.0",
    "+grpo.pilot_commit.evict_after_consecutive_solved=1000",
    "+grpo.pilot_commit.max_off_steps=1",
    "loss_fn.use_importance_sampling_correction=true",
    "checkpointing.save_period=1",
    "grpo.val_at_start=false",
    "data.validation.max_samples=2",
    "logger.progress_bar=false",
    "logger.tensorboard_enabled=false",
    *TRAINS,
)
COUNT_KEYS = (
    "rollout_alloc/step_rollouts",
    "rollout_alloc/cumulative_rollouts",
    "rollout_alloc/gen_rounds",
    "rollout_alloc/train_groups",
    "rollout_alloc/train_rollouts",
    "rollout_alloc/max_policy_lag",
    "pilot_commit/pilot_rollouts",
    "pilot_commit/commit_rollouts",
    "pilot_commit/piloted",
    "pilot_commit/selected",
    "pilot_commit/deferred",
    "pilot_commit/too_easy",
    "pilot_commit/evicted",
    "pilot_commit/committed",
    "pilot_commit/from_buffer",
    "pilot_commit/fallback_used",
    "pilot_commit/buffer_size",
    "pilot_commit/buffer_expired",
    "pilot_commit/pool_size",
    "pilot_commit/cumulative_pilot_rollouts",
    "pilot_commit/cumulative_commit_rollouts",
)


def run_grpo(tmp: Path, steps: int, recipe: Path = TINY, extra: tuple[str, ...] = ()) -> list[dict]:
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "run_grpo.py"),
        "--config",
        str(recipe),
        *PC,
        *extra,
        f"grpo.max_num_steps={steps}",
        f"logger.log_dir={tmp}/logs",
        f"checkpointing.checkpoint_dir={tmp}/ckpt",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(x) for x in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]


def offline_plan(steps: int) -> tuple[list[dict], dict]:
    """The allocator the loop builds from the same recipe, stepped with made-up rewards (its decisions do not
    depend on rewards under p_lower=0 / p_upper=1). The made-up rewards (0, 1/n, ..., (n-1)/n) spread within every
    group, as the scripted reward's do, so the useful-rollout counts agree too. Returns its per-step metrics and
    final state."""
    from nemo_rl_spec.algorithms.grpo_setup import build_allocator
    from nemo_rl_spec.utils.config import load_config

    cfg = load_config(TINY, [*PC, f"grpo.max_num_steps={steps}"])
    alloc = build_allocator(cfg, cfg.data.train.size)
    metrics = []
    for step in range(steps):
        sel = alloc.step(lambda reqs, v=step: [r.result(torch.arange(r.n) / r.n, v) for r in reqs])
        metrics.append(sel.metrics)
    return metrics, alloc.state_dict()


def allocator_state(ckpt: Path) -> dict:
    return torch.load(ckpt / "train_state.pt", weights_only=False)["allocator"]


def plan_view(state: dict) -> dict:
    """The reward-independent part of an allocator state: pool position, evictions, pending/buffered prompts."""
    entries = lambda key: [
        (
            e["prompt_id"],
            e["target_step"],
            [
                (
                    r["stage"],
                    r["policy_version"],  # noqa: E731
                    r["rewards"].numel(),
                )
                for r in e["results"]
            ],
        )
        for e in state[key]
    ]
    return {
        "step": state["step"],
        "cum": state["cum"],
        "stream": state["stream"],
        "pilot_target": state["pilot_target"],
        "pending": entries("pending"),
        "buffer": entries("buffer"),
        "deferred": state["deferred"],
        "totals": state["totals"],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pilot_commit_loop")
    full = run_grpo(tmp / "full", 3)
    return {"tmp": tmp, "full": full}


@pytest.fixture(scope="module")
def resumed(runs):
    """Run 3 steps in a fresh directory holding only a copy of the uninterrupted run's step_2 checkpoint."""
    shutil.copytree(runs["tmp"] / "full" / "ckpt" / "step_2", runs["tmp"] / "cut" / "ckpt" / "step_2")
    return run_grpo(runs["tmp"] / "cut", 3)


def test_counts_equal_the_allocators_plan(runs):
    by_step = {r["step"]: r for r in runs["full"] if r["step"] in (1, 2)}
    assert sorted(by_step) == [1, 2]
    assert_trained(runs["full"], runs["tmp"] / "full" / "ckpt", steps=[1, 2, 3])
    expected, expected_state = offline_plan(2)
    for step in (1, 2):
        m, e = by_step[step], expected[step - 1]
        assert all(math.isfinite(v) for v in m.values()), m
        assert {k: m[k] for k in COUNT_KEYS} == {k: e[k] for k in COUNT_KEYS}, step
        # the train batch the policy saw is the selection: committed groups x (n_pilot + n_commit) rows
        assert m["train/num_valid_seqs"] == m["rollout_alloc/train_rollouts"] == m["pilot_commit/committed"] * 6
        assert m["pilot_commit/pilot_rollouts"] == m["pilot_commit/piloted"] * 2
        assert m["pilot_commit/commit_rollouts"] == m["pilot_commit/committed"] * 4
        assert m["refit/weight_version"] == step
    # hand-computed: step 1 pilots twice (cold start + bound pilot of step 2), commits K=1; step 2 pilots once
    assert [by_step[s]["pilot_commit/pilot_rollouts"] for s in (1, 2)] == [8, 4]
    assert [by_step[s]["rollout_alloc/step_rollouts"] for s in (1, 2)] == [12, 8]
    assert [by_step[s]["rollout_alloc/max_policy_lag"] for s in (1, 2)] == [0, 1]  # step 2 trains on v1 pilots
    assert plan_view(allocator_state(runs["tmp"] / "full" / "ckpt" / "step_2")) == plan_view(expected_state)


def test_resume_in_the_middle_continues_exactly(runs, resumed):
    full = runs["full"]
    assert [r["step"] for r in resumed] == [3]
    expected, expected_state = offline_plan(3)
    last, ref = resumed[-1], full[-1]
    assert {k: last[k] for k in COUNT_KEYS} == {k: expected[2][k] for k in COUNT_KEYS}
    assert last["pilot_commit/buffer_expired"] >= 1  # the step-0 surplus aged out after the resume
    keys = {k for k in ref if not k.startswith("timing/")}
    assert keys == {k for k in last if not k.startswith("timing/")}
    for key in keys:
        assert last[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-7), key
    # allocator state after step 3: identical to the uninterrupted run's, rewards and payload tensors included
    got, want = (allocator_state(runs["tmp"] / d / "ckpt" / "step_3") for d in ("cut", "full"))
    assert plan_view(got) == plan_view(want) == plan_view(expected_state)
    for key in ("pending", "buffer"):
        for a, b in zip(got[key], want[key]):
            for ra, rb in zip(a["results"], b["results"]):
                assert torch.equal(ra["rewards"], rb["rewards"])
                for name, tensor in ra["payload"].items():
                    assert torch.allclose(tensor.float(), rb["payload"][name].float(), rtol=1e-6, atol=1e-7), name
    # the step-3 update used the restored optimizer state: the step_3 weights equal the uninterrupted run's
    want, have = (policy_weights(runs["tmp"] / d / "ckpt" / "step_3") for d in ("full", "cut"))
    for name in want:
        torch.testing.assert_close(have[name], want[name], rtol=1e-6, atol=1e-7, msg=name)


ASYNC = (
    "+grpo.async_grpo.enabled=true",
    "+grpo.async_grpo.max_trajectory_age_steps=1",
    "+grpo.async_grpo.in_flight_weight_updates=false",
    "loss_fn.truncated_importance_sampling_ratio=2.0",
)


# sync: slow tier since the CI-budget trim (docs/guides/testing.md): Pilot-Commit's exact plan in sync runs in CI
# (test_counts_equal_the_allocators_plan), speculation in the sync loop too (test_grpo_loop), and the combination in
# the async case below
@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow), "async"])
def test_pilot_commit_with_speculative_rollouts_sync_and_async(tmp_path, mode):
    """Pilot-Commit on top of speculative rollouts (online EAGLE-3 draft, refit with the policy), in sync and async
    GRPO: the loop runs, the rollout counts keep Pilot-Commit's identities, every step reports acceptance and a draft
    refit paired with the policy version; in sync mode the counts equal the allocator's plan exactly (speculation
    does not change which rollouts are made). Async runs in bf16, so Pilot-Commit, async GRPO and the online draft
    are covered in both precisions."""
    # the async variant runs in bf16 (Megatron mixed precision, bf16 engine and draft refit; docs/design/precision.md)
    extra = ("checkpointing.enabled=false", *(ASYNC + ("policy.precision=bfloat16",) if mode == "async" else ()))
    metrics = [m for m in run_grpo(tmp_path, 2, ROOT / "configs" / "grpo_math_tiny_spec.yaml", extra) if m["step"] > 0]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values()), m
        assert m["pilot_commit/pilot_rollouts"] == m["pilot_commit/piloted"] * 2
        assert m["pilot_commit/commit_rollouts"] == m["pilot_commit/committed"] * 4
        assert m["train/num_valid_seqs"] == m["rollout_alloc/train_rollouts"] == m["pilot_commit/committed"] * 6
        assert m["vllm/spec_num_drafts"] > 0 and m["vllm/spec_acceptance_length"] >= 1.0
        assert m["refit/draft_version"] == m["refit/weight_version"] == m["step"]
        assert m["train/grad_norm"] > 1e-6 and m["rollout_alloc/mean_group_reward_var"] > 0, m  # it trains
    if mode == "sync":
        expected, _ = offline_plan(2)
        for m, e in zip(metrics, expected):
            assert {k: m[k] for k in COUNT_KEYS} == {k: e[k] for k in COUNT_KEYS}
    else:
        assert all(m["async/trajectory_age_max"] <= 1 for m in metrics)
