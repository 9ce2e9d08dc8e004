"""Synchronous GRPO driver (NeMo-RL's grpo_train, one screen): generate -> score -> advantages -> log-probs ->
train -> refit, with validation, logging and checkpoints.

Weight versions: the generation workers hold version ``step`` while sampling step ``step``; after training they
receive version ``step + 1``.
"""
from __future__ import annotations

import ray
import torch
from tqdm import tqdm

from nemo_rl_spec.algorithms.advantages import compute_grpo_advantages
from nemo_rl_spec.algorithms.grpo_setup import GRPOSetup, save_checkpoint
from nemo_rl_spec.algorithms.rollouts import build_train_data, generate_rollouts, logprob_agreement_metrics
from nemo_rl_spec.algorithms.validation import validate
from nemo_rl_spec.utils.timer import Timer


def rollout_seed(base_seed: int, step: int) -> int:
    """Per-step generation seed: a function of (seed, step) only, so a resumed run samples what the original did."""
    return base_seed * 1_000_003 + step


def grpo_step(s: GRPOSetup, step: int, timer: Timer) -> dict[str, float]:
    """One synchronous GRPO step; returns its metrics (without timings)."""
    cfg = s.cfg
    problems = s.train_loader.next_batch()
    with timer.time("generation"):
        batch = generate_rollouts(s.generation, s.tokenizer, s.env, problems, s.prompt_ids(problems),
                                  cfg.grpo.num_generations_per_prompt, rollout_seed(cfg.grpo.seed, step))
    advantages = compute_grpo_advantages(batch.rewards, cfg.grpo.num_generations_per_prompt,
                                         cfg.grpo.use_leave_one_out_baseline, cfg.grpo.normalize_rewards)
    data = build_train_data(batch, advantages)
    with timer.time("policy_and_reference_logprobs"):
        data["prev_logprobs"] = ray.get(s.policy.get_logprobs.remote(data, cfg.policy.generation.temperature))
    with timer.time("policy_training"):
        train_metrics = ray.get(s.policy.train.remote(data))
    with timer.time("weight_sync"):
        refit_metrics = s.refitter.refit(version=step + 1)
    agreement = logprob_agreement_metrics(data["prev_logprobs"], data["generation_logprobs"], data["token_mask"])
    return {"train/reward": float(batch.rewards.mean()),
            "train/mean_response_length": float(data["token_mask"].sum(1).mean()),
            **{f"train/{k}": v for k, v in train_metrics.items()}, **agreement, **refit_metrics}


def grpo_train(s: GRPOSetup) -> list[dict[str, float]]:
    """Run steps ``start_step .. max_num_steps - 1``; returns every step's metrics."""
    cfg, timer, history = s.cfg, Timer(), []
    val = lambda: validate(s.generation, s.tokenizer, s.env, s.val_problems, s.val_prompt_ids,  # noqa: E731
                           cfg.policy.generation.max_new_tokens)
    if cfg.grpo.val_at_start and s.start_step == 0:
        s.logger.log_metrics(val(), step=0)
    steps = range(s.start_step, cfg.grpo.max_num_steps)
    for step in tqdm(steps, desc="GRPO", disable=not cfg.logger.progress_bar, initial=s.start_step,
                     total=cfg.grpo.max_num_steps):
        timer.reset()
        with timer.time("total_step_time"):
            metrics = grpo_step(s, step, timer)
        metrics.update(timer.metrics("timing/train/"))
        last = step + 1 == cfg.grpo.max_num_steps
        if last or (cfg.grpo.val_period and (step + 1) % cfg.grpo.val_period == 0):
            metrics.update(val())
        s.logger.log_metrics(metrics, step=step + 1)
        history.append(metrics)
        if last or (step + 1) % cfg.checkpointing.save_period == 0:
            save_checkpoint(s, step + 1, metrics)
    return history


def finite_metrics(metrics: dict[str, float]) -> bool:
    """True if every metric is a finite number."""
    return all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values())
