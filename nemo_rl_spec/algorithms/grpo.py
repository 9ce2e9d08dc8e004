"""Synchronous GRPO driver (NeMo-RL's grpo_train, one screen): generate -> score -> log-probs -> advantages ->
train -> refit, with validation, logging and checkpoints.

Weight versions: the generation workers hold version ``step`` while sampling step ``step``; after training they
receive version ``step + 1``.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from nemo_rl_spec.algorithms.advantages import estimate_advantages, reward_kl_penalty
from nemo_rl_spec.algorithms.grpo_setup import GRPOSetup, save_checkpoint
from nemo_rl_spec.algorithms.overlong import apply_overlong_filtering, truncated_rows
from nemo_rl_spec.algorithms.reward_shaping import scale_rewards, shape_rewards
from nemo_rl_spec.algorithms.rollouts import build_train_data, logprob_agreement_metrics, selection_reward_valid
from nemo_rl_spec.algorithms.seq_logprob_mask import apply_seq_logprob_error_masking
from nemo_rl_spec.algorithms.validation import run_validation, validation_stop_message
from nemo_rl_spec.utils.timer import Timer


def grpo_step(s: GRPOSetup, step: int, timer: Timer) -> tuple[dict[str, float], bool]:
    """One synchronous GRPO step; returns its metrics (without timings) and whether the prompt pool is exhausted
    (every prompt evicted by Pilot-Commit)."""
    with timer.time("generation"):
        generate = s.rollout_generator(version=step)
        selection = s.allocator.step(generate)
    metrics = {
        "train/reward": float(selection.rewards.mean()) if selection.groups else float("nan"),
        **selection.metrics,
        **s.spec_step_metrics(generate.stats.spec_counters),
    }
    if selection.groups:
        metrics.update(train_on_selection(s, selection, timer, step))
    with timer.time("weight_sync"):
        metrics.update(s.refitter.refit(version=step + 1))
    if s.spec is not None:
        s.spec.notify_refit()
    return metrics, selection.exhausted


def train_on_selection(s: GRPOSetup, selection, timer: Timer, step: int) -> dict[str, float]:
    """Trainer log-probs (pi_old) -> advantages -> one policy update, for the rollouts of ``selection`` in GRPO step
    ``step`` (which decides whether the online draft trains too: :meth:`GRPOSetup.trains_draft`)."""
    cfg = s.cfg
    valid = selection_reward_valid(selection)  # False: a masked NaN/inf reward (grpo.non_finite_reward=mask)
    data = build_train_data(selection, torch.zeros_like(selection.rewards), s.pad_token_id)  # advantages: below
    overlong = overlong_metrics(s, data)
    with timer.time("policy_and_reference_logprobs"):
        data["prev_logprobs"] = s.policy.get_logprobs(data, cfg.policy.generation.temperature)
        if cfg.loss_fn.reference_policy_kl_penalty > 0:  # the loss's KL term, or the reward's (use_kl_in_reward)
            data["reference_policy_logprobs"] = s.policy.get_reference_policy_logprobs(
                data, cfg.policy.generation.temperature
            )
    seq_error = apply_seq_logprob_error_masking(data, selection.rewards, cfg.grpo.seq_logprob_error_threshold)
    kl_penalty = step_reward_kl_penalty(s, data)
    data["advantages"] = step_advantages(s, selection, data, valid, kl_penalty)  # after every sample_mask change
    with timer.time("policy_training"):
        train_metrics = s.policy.train(data, train_draft=s.trains_draft(step))
    agreement = logprob_agreement_metrics(data["prev_logprobs"], data["generation_logprobs"], data["token_mask"])
    return {
        "train/mean_response_length": float(data["token_mask"].sum(1).mean()),
        "train/non_finite_rewards": float((~valid).sum()),
        **({"train/reward": float(selection.rewards[valid].mean())} if not valid.all() else {}),
        **{f"train/{k}": v for k, v in train_metrics.items()},
        **agreement,
        **overlong,
        **seq_error,
        **reward_kl_metrics(kl_penalty, data),
    }


def step_reward_kl_penalty(s: GRPOSetup, data) -> torch.Tensor | None:
    """``loss_fn.use_kl_in_reward``: beta * kl per token of pi_old against the reference
    (:func:`~.advantages.reward_kl_penalty`); None when the KL stays in the loss. Shape: [N, S] float64."""
    loss = s.cfg.loss_fn
    if not loss.use_kl_in_reward:
        return None
    return reward_kl_penalty(
        data["prev_logprobs"],
        data["reference_policy_logprobs"],
        loss.reference_policy_kl_penalty,
        loss.reference_policy_kl_type,
    )


def reward_kl_metrics(kl_penalty: torch.Tensor | None, data) -> dict[str, float]:
    """``train/reward_kl_penalty``: the mean of beta * kl over the tokens in the loss (the loss's own
    ``train/kl_penalty`` is then 0); empty when the KL stays in the loss."""
    if kl_penalty is None:
        return {}
    mask = data["token_mask"] * data["sample_mask"].unsqueeze(-1) > 0
    n = int(mask.sum())
    return {"train/reward_kl_penalty": float(kl_penalty[mask].sum() / n) if n else 0.0}


def step_advantages(
    s: GRPOSetup, selection, data, valid: torch.Tensor, kl_penalty: torch.Tensor | None = None
) -> torch.Tensor:
    """NeMo-RL's order: ``grpo.reward_scaling`` -> ``grpo.reward_shaping`` -> ``grpo.adv_estimator`` ->
    ``grpo.advantage_clip_low/high``, on the rewards of ``selection``. Shapes: selection.rewards [N], data rows N ->
    [N] float32 advantages (reinforce_plus_plus whitens over the tokens in the loss: token_mask x sample_mask), or
    [N, S] with ``kl_penalty`` ([N, S], :func:`step_reward_kl_penalty`: subtracted per token before whitening)."""
    g = s.cfg.grpo
    lengths = data["token_mask"].sum(1)
    rewards = scale_rewards(selection.rewards, g.reward_scaling)
    rewards = shape_rewards(rewards, g.reward_shaping, lengths, lambda: truncated_of(s, data))
    token_counts = lengths * data["sample_mask"]
    mask = data["token_mask"] * data["sample_mask"].unsqueeze(-1)
    return estimate_advantages(
        g, rewards, selection.group_ids, token_counts, valid=valid, token_penalty=kl_penalty, mask=mask
    ).float()


def truncated_of(s: GRPOSetup, data) -> torch.Tensor:
    """[B] bool: rows of ``data`` cut off by a length limit (:func:`~.overlong.truncated_rows`)."""
    gen = s.cfg.policy.generation
    ends = [int(s.tokenizer.eos_token_id), *(gen.stop_token_ids or ())]  # a stop token ends a response like EOS
    return truncated_rows(
        data, gen.max_new_tokens, gen.vllm_cfg.max_model_len, ends, gen.stop_strings or (), s.tokenizer.decode
    )


def overlong_metrics(s: GRPOSetup, data) -> dict[str, float]:
    """``grpo.overlong_filtering``: mask truncated responses out of the loss (:mod:`~.overlong`); its metrics."""
    if not s.cfg.grpo.overlong_filtering:
        return {}
    return apply_overlong_filtering(data, truncated_of(s, data))


def grpo_train(s: GRPOSetup) -> list[dict[str, float]]:
    """Run steps ``start_step .. max_num_steps - 1``; returns every step's metrics."""
    cfg, timer, history = s.cfg, Timer(), []
    start = s.state.start_step
    if validate_at_start(s, lambda: run_validation(s)):
        return history
    steps = range(start, cfg.grpo.max_num_steps)
    for step in tqdm(
        steps, desc="GRPO", disable=not cfg.logger.progress_bar, initial=start, total=cfg.grpo.max_num_steps
    ):
        if epochs_finished(
            cfg.grpo.max_num_epochs, s.allocator.epochs_completed()
        ):  # resumed after the last epoch's final step
            break
        timer.reset()
        with timer.time("total_step_time"):
            metrics, exhausted = grpo_step(s, step, timer)
        metrics.update(timer.metrics("timing/train/"))
        history.append(metrics)
        checkpoint = lambda m, done=step + 1: save_checkpoint(s, done, m)  # noqa: E731
        if end_step(s, step, metrics, exhausted, lambda: run_validation(s), checkpoint):
            break
    return history


def epochs_finished(limit: int | None, epochs_completed: float) -> bool:
    """True once ``limit`` (``grpo.max_num_epochs``) epochs over the prompt pool are handed out (None: no epoch
    limit). The run stops at whichever of ``grpo.max_num_steps`` / ``grpo.max_num_epochs`` comes first, as NeMo-RL's
    loop does."""
    return limit is not None and epochs_completed >= limit


def should_validate(done: int, val_period: int, val_start_at: int, val_at_end: bool, last: bool) -> bool:
    """NeMo-RL's validation schedule (``grpo_train``): validate after finished step ``done`` (1-based, the logged
    step) when::

        (val_period > 0 and done >= val_start_at and done % val_period == 0) or (val_at_end and last)

    ``val_start_at`` = -1 (or any value <= val_period) delays nothing; ``last``: the run's final step (step limit,
    last epoch, or every prompt evicted). Example: val_period=5, val_start_at=12, val_at_end, 22 steps -> 15, 20, 22.
    """
    periodic = val_period > 0 and done >= val_start_at and done % val_period == 0
    return periodic or (val_at_end and last)


def validate_at_start(s: GRPOSetup, val) -> bool:
    """``grpo.val_at_start`` on a fresh run (sync and async loops): log ``val()`` as step 0. Returns True when that
    validation already reaches the early-stop threshold (NeMo-RL then trains no step)."""
    g = s.cfg.grpo
    if not (g.val_at_start and s.state.start_step == 0):
        return False
    metrics = val()
    s.logger.log_metrics(metrics, step=0)
    stop = validation_stop_message(metrics, g.stop_at_validation_metric, g.stop_at_validation_threshold)
    if stop is not None:
        print(f"initial {stop}")
    return stop is not None


def end_step(s: GRPOSetup, step: int, metrics: dict[str, float], exhausted: bool, val, checkpoint) -> bool:
    """Validation (:func:`should_validate`), logging and checkpointing of finished step ``step`` (sync and async
    loops). ``val()`` returns validation metrics; ``checkpoint(metrics)`` saves step + 1. Returns True when the run
    must stop: every prompt was evicted, the last epoch (``grpo.max_num_epochs``) was handed out, or validation
    reached ``grpo.stop_at_validation_threshold`` (NeMo-RL's early stop; that step is checkpointed like a last)."""
    g = s.cfg.grpo
    epochs_done = epochs_finished(g.max_num_epochs, metrics.get("rollout_alloc/epochs_completed", 0))
    last = exhausted or epochs_done or step + 1 == g.max_num_steps
    stop = None
    if should_validate(step + 1, g.val_period, g.val_start_at, g.val_at_end, last):
        metrics.update(val())
        stop = validation_stop_message(metrics, g.stop_at_validation_metric, g.stop_at_validation_threshold)
    s.logger.log_metrics(metrics, step=step + 1)
    if last or stop is not None or (step + 1) % s.cfg.checkpointing.save_period == 0:
        checkpoint(metrics)
    if stop is not None:
        print(f"{stop} after step {step + 1}")
    elif exhausted:
        print(f"every training prompt was evicted (solved); stopping after step {step + 1}")
    elif epochs_done and step + 1 < g.max_num_steps:
        print(f"grpo.max_num_epochs={g.max_num_epochs} epochs done; stopping after step {step + 1}")
    return exhausted or epochs_done or stop is not None
