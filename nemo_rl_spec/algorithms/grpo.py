"""Synchronous GRPO driver (NeMo-RL's grpo_train, one screen): generate -> score -> advantages -> log-probs ->
train -> refit, with validation, logging and checkpoints.

Weight versions: the generation workers hold version ``step`` while sampling step ``step``; after training they
receive version ``step + 1``.
"""

from __future__ import annotations

from tqdm import tqdm

from nemo_rl_spec.algorithms.advantages import compute_grpo_advantages_by_group
from nemo_rl_spec.algorithms.grpo_setup import GRPOSetup, save_checkpoint
from nemo_rl_spec.algorithms.overlong import apply_overlong_filtering, truncated_rows
from nemo_rl_spec.algorithms.rollouts import build_train_data, logprob_agreement_metrics, selection_reward_valid
from nemo_rl_spec.algorithms.validation import run_validation
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
    """Advantages -> trainer log-probs (pi_old) -> one policy update, for the rollouts of ``selection`` in GRPO step
    ``step`` (which decides whether the online draft trains too: :meth:`GRPOSetup.trains_draft`)."""
    cfg = s.cfg
    valid = selection_reward_valid(selection)  # False: a masked NaN/inf reward (grpo.non_finite_reward=mask)
    advantages = compute_grpo_advantages_by_group(
        selection.rewards,
        selection.group_ids,
        cfg.grpo.use_leave_one_out_baseline,
        cfg.grpo.normalize_rewards,
        valid=valid,
    )
    data = build_train_data(selection, advantages, s.pad_token_id)
    overlong = overlong_metrics(s, data)
    with timer.time("policy_and_reference_logprobs"):
        data["prev_logprobs"] = s.policy.get_logprobs(data, cfg.policy.generation.temperature)
        if cfg.loss_fn.reference_policy_kl_penalty > 0:
            data["reference_policy_logprobs"] = s.policy.get_reference_policy_logprobs(
                data, cfg.policy.generation.temperature
            )
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
    }


def overlong_metrics(s: GRPOSetup, data) -> dict[str, float]:
    """``grpo.overlong_filtering``: mask truncated responses out of the loss (:mod:`~.overlong`); its metrics."""
    if not s.cfg.grpo.overlong_filtering:
        return {}
    gen = s.cfg.policy.generation
    ends = [int(s.tokenizer.eos_token_id), *(gen.stop_token_ids or ())]  # a stop token ends a response like EOS
    truncated = truncated_rows(
        data, gen.max_new_tokens, gen.vllm_cfg.max_model_len, ends, gen.stop_strings or (), s.tokenizer.decode
    )
    return apply_overlong_filtering(data, truncated)


def grpo_train(s: GRPOSetup) -> list[dict[str, float]]:
    """Run steps ``start_step .. max_num_steps - 1``; returns every step's metrics."""
    cfg, timer, history = s.cfg, Timer(), []
    start = s.state.start_step
    if cfg.grpo.val_at_start and start == 0:
        s.logger.log_metrics(run_validation(s), step=0)
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


def end_step(s: GRPOSetup, step: int, metrics: dict[str, float], exhausted: bool, val, checkpoint) -> bool:
    """Validation (every ``grpo.val_period`` steps and at the end), logging and checkpointing of finished step
    ``step`` (sync and async loops). ``val()`` returns validation metrics; ``checkpoint(metrics)`` saves step + 1.
    Returns True when the run must stop: every prompt was evicted, or the last epoch (``grpo.max_num_epochs``)
    was handed out."""
    cfg = s.cfg
    epochs_done = epochs_finished(cfg.grpo.max_num_epochs, metrics.get("rollout_alloc/epochs_completed", 0))
    last = exhausted or epochs_done or step + 1 == cfg.grpo.max_num_steps
    if last or (cfg.grpo.val_period and (step + 1) % cfg.grpo.val_period == 0):
        metrics.update(val())
    s.logger.log_metrics(metrics, step=step + 1)
    if last or (step + 1) % cfg.checkpointing.save_period == 0:
        checkpoint(metrics)
    if exhausted:
        print(f"every training prompt was evicted (solved); stopping after step {step + 1}")
    elif epochs_done and step + 1 < cfg.grpo.max_num_steps:
        print(f"grpo.max_num_epochs={cfg.grpo.max_num_epochs} epochs done; stopping after step {step + 1}")
    return exhausted or epochs_done
