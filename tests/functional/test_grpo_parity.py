"""NeMo-RL GRPO parity on the real Megatron worker (tiny random Qwen3, CPU fp32, in process).

- ``policy.train_global_batch_size``: 16 rows with GBS 8 are two optimizer steps (the controller's loop,
  :func:`~nemo_rl_spec.models.policy.lm_policy.train_minibatches`); the second step's PPO ratio is
  pi_after_step_1 / pi_old != 1. Independent computation: a second worker steps on rows 0..7 only, its log-probs
  of rows 8..15 give the ratio by hand, and the clipped loss is rebuilt from them in plain torch.
- ``policy.megatron_cfg.scheduler``: the lr of every step (warmup then cosine decay to ``min_lr``) against the formula
  worked by hand, the MTP block's AdamW at the same lr, the first update's size (Adam's first step moves every
  weight with a gradient by lr exactly), and a checkpoint resumes the schedule at its step.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fixtures_models as fm  # noqa: E402

from nemo_rl_spec.algorithms.loss import ClippedPGLossFn  # noqa: E402
from nemo_rl_spec.models.policy.lm_policy import combine_minibatch_metrics, train_minibatches  # noqa: E402
from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker  # noqa: E402
from nemo_rl_spec.utils.config_schema import PolicyConfig  # noqa: E402

torch.set_num_threads(1)
LOSS_CFG = fm.base_recipe_section("loss_fn")
LOSS = ClippedPGLossFn(LOSS_CFG)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_qwen3_parity")
    fm.save_tiny_model(path, "qwen3", True)
    return str(path)


def _cfg(scheduler: dict | None = None, mtp: bool = False, **optimizer) -> PolicyConfig:
    cfg = fm.base_recipe_section("policy")
    cfg.update(train_micro_batch_size=4, logprob_batch_size=8, train_global_batch_size=8)
    cfg["megatron_cfg"]["optimizer"].update(lr=1e-2, **optimizer)
    if scheduler is not None:
        cfg["megatron_cfg"]["scheduler"] = scheduler
    if mtp:
        cfg["megatron_cfg"].update(mtp_num_layers=1, mtp_loss_mode="ce")
    return PolicyConfig.model_validate(cfg)


def _rollouts(rows: int = 16, seq: int = 12, seed: int = 7) -> dict:
    """``rows`` random sequences (lengths 12 - (b % 5)), response from position 3, advantages ~ N(0, 1)."""
    data = fm.random_token_batch([seq - b % 5 for b in range(rows)], seq, seed)
    gen = data.pop("generator")
    return {
        **data,
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, generator=gen),
        "generation_logprobs": torch.zeros(rows, seq),
    }


def _rows(data: dict, start: int, stop: int) -> dict:
    return {k: v[start:stop] for k, v in data.items()}


def test_global_batch_size_two_optimizer_steps_second_ratio_off_policy(model_dir):
    cfg = _cfg()
    worker, reference = MegatronPolicyWorker(cfg, LOSS, model_dir, 0), MegatronPolicyWorker(cfg, LOSS, model_dir, 0)
    data = fm.on_policy(worker, _rollouts())  # pi_old: before the first mini-batch
    steps = train_minibatches(worker.train, data, cfg.train_global_batch_size)
    assert len(steps) == 2 and worker.step == 2

    reference.train(_rows(data, 0, 8))
    second = _rows(data, 8, 16)
    mask = second["token_mask"]
    log_ratio = reference.get_logprobs(second) - second["prev_logprobs"]
    ratio = torch.exp(log_ratio) * mask
    expected_ratio = float(ratio.sum() / mask.sum())
    adv = second["advantages"].unsqueeze(1)
    clipped = ratio.clamp(0.8, 1.2)
    expected_loss = float((torch.maximum(-adv * ratio, -adv * clipped) * mask).sum() / mask.sum())
    outside = float((((ratio < 0.8) | (ratio > 1.2)).float() * mask).sum() / mask.sum())

    assert steps[0]["probs_ratio"] == pytest.approx(1.0, abs=1e-6)  # on-policy first step
    assert abs(steps[1]["probs_ratio"] - 1.0) > 1e-3, steps[1]["probs_ratio"]
    assert steps[1]["probs_ratio"] == pytest.approx(expected_ratio, rel=1e-5)
    assert steps[1]["loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    assert steps[1]["probs_ratio_clamped"] == pytest.approx(outside, abs=1e-6)
    combined = combine_minibatch_metrics(steps)
    assert combined["num_optimizer_steps"] == 2.0
    assert combined["num_valid_tokens"] == float(data["token_mask"].sum())
    assert combined["probs_ratio"] == pytest.approx((steps[0]["probs_ratio"] + steps[1]["probs_ratio"]) / 2)


def _hand_lr(n: int, lr=1e-2, min_lr=1e-3, init=1e-3, warmup=2, decay=6) -> float:
    """Step n's lr: linear warmup from init over ``warmup`` steps, cosine to min_lr at step ``decay``, then min_lr."""
    if n <= warmup:
        return init + (lr - init) * n / warmup
    if n > decay:
        return min_lr
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (n - warmup) / (decay - warmup)))


SCHEDULE = {"lr_warmup_iters": 2, "lr_warmup_init": 1e-3, "lr_decay_style": "cosine", "lr_decay_iters": 6}


def test_scheduler_lr_per_step_and_resume(model_dir, tmp_path):
    cfg = _cfg(SCHEDULE, mtp=True, min_lr=1e-3, adam_eps=1e-12, clip_grad=1e6)
    worker = MegatronPolicyWorker(cfg, LOSS, model_dir, 0)
    before = {k: v.clone() for k, v in worker.export_megatron_weights().items()}
    lrs = []
    for n in range(4):
        lrs.append(worker.train(fm.on_policy(worker, fm.train_batch(seed=n)))["lr"])
        if n == 0:  # Adam's first update is lr * g / |g| on every weight with a gradient
            after = worker.export_megatron_weights()
            moved = max(float((after[k] - before[k]).abs().max()) for k in before)
            assert moved == pytest.approx(_hand_lr(0), rel=1e-4)
    assert worker.mtp_optimizer.param_groups[0]["lr"] == pytest.approx(_hand_lr(4), rel=1e-12)
    worker.save_checkpoint(str(tmp_path))
    resumed = MegatronPolicyWorker(cfg, LOSS, model_dir, 1)
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.mtp_optimizer.param_groups[0]["lr"] == pytest.approx(_hand_lr(4), rel=1e-12)
    for n in range(4, 8):
        lrs.append(resumed.train(fm.on_policy(resumed, fm.train_batch(seed=n)))["lr"])
    # hand values: 1e-3, 5.5e-3, 1e-2, 1e-3 + 9e-3 * (1 + cos(pi/4)) / 2, ..., 1e-3 from step 6 on
    assert lrs[3] == pytest.approx(1e-3 + 9e-3 * (1 + math.sqrt(0.5)) / 2, rel=1e-12)
    assert lrs == pytest.approx([_hand_lr(n) for n in range(8)], rel=1e-12)


def test_without_scheduler_lr_is_constant(model_dir):
    worker = MegatronPolicyWorker(_cfg(), LOSS, model_dir, 0)
    lrs = [worker.train(fm.on_policy(worker, fm.train_batch(seed=n)))["lr"] for n in range(2)]
    assert lrs == [1e-2, 1e-2]
