"""Validation: answers to held-out problems (greedy by default, or sampled), scored by the math environment."""

from __future__ import annotations

import torch

from nemo_rl_spec.algorithms.rollouts import generate_rollouts


def validate(
    generation,
    tokenizer,
    env,
    problems: list[dict],
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    non_finite_reward: str = "error",
    batch_size: int | None = None,
    temperature: float = 0.0,
    num_generations: int = 1,
) -> dict[str, float]:
    """Decode ``num_generations`` answers per validation problem at ``temperature`` (0: greedy) and score them.

    Returns ``validation/accuracy`` (mean reward over all answers, in [0, 1]; with several sampled answers per
    problem, the mean per-problem pass rate), ``validation/mean_response_length`` (tokens) and
    ``validation/non_finite_rewards`` (how many answers got a NaN/inf reward).

    Args:
        temperature, num_generations: ``grpo.val_temperature`` / ``grpo.val_num_generations``. Sampled validation
            uses seed 0 with per-row seeds, so a policy's validation is the same in every call and every run.
        non_finite_reward: ``grpo.non_finite_reward``. ``"mask"``: a NaN/inf reward counts as a wrong answer
            (reward 0, still in the accuracy's denominator) and is counted in ``validation/non_finite_rewards``;
            ``"error"``: it stops the run.
        batch_size: NeMo-RL's ``grpo.val_batch_size``, prompts per generate call (None: all in one call); greedy
            decoding makes the metrics independent of the split.

    Raises:
        NonFiniteRewardError: a reward is NaN/inf and ``non_finite_reward == "error"`` (the message names the
            validation problem's index).
    """
    step = batch_size or max(len(problems), 1)
    rewards, lengths, valid = [], [], []
    for start in range(0, len(problems), step):
        batch = generate_rollouts(
            generation,
            tokenizer,
            env,
            problems[start : start + step],
            prompt_ids[start : start + step],
            n=num_generations,
            seed=0,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            non_finite_reward=non_finite_reward,
            prompt_names=list(range(start, min(start + step, len(problems)))),
        )
        gen = batch.generation
        rewards.append(batch.rewards.float())
        lengths.append((gen["unpadded_sequence_lengths"] - gen["input_lengths"]).float())
        valid.append(batch.reward_valid)
    return {
        "validation/accuracy": float(torch.cat(rewards).mean()),
        "validation/mean_response_length": float(torch.cat(lengths).mean()),
        "validation/non_finite_rewards": float((~torch.cat(valid)).sum()),
    }


def run_validation(s) -> dict[str, float]:
    """:func:`validate` with a run's setup ``s`` (a ``GRPOSetup``): its engines, held-out set and ``grpo.val_*`` keys
    (``grpo.val_temperature: null`` takes ``policy.generation.temperature``)."""
    cfg = s.cfg
    gen = cfg.policy.generation
    temperature = gen.temperature if cfg.grpo.val_temperature is None else cfg.grpo.val_temperature
    return validate(
        s.generation,
        s.tokenizer,
        s.env,
        s.val_problems,
        s.val_prompt_ids,
        gen.max_new_tokens,
        cfg.grpo.non_finite_reward,
        batch_size=cfg.grpo.val_batch_size,
        temperature=temperature,
        num_generations=cfg.grpo.val_num_generations,
    )
