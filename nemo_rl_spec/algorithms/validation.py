"""Validation: greedy answers to held-out problems, scored by the math environment."""
from __future__ import annotations

import torch

from nemo_rl_spec.algorithms.rollouts import generate_rollouts


def validate(generation, tokenizer, env, problems: list[dict], prompt_ids: list[list[int]],
             max_new_tokens: int, non_finite_reward: str = "error", batch_size: int | None = None) -> dict[str, float]:
    """Greedy-decode one answer per validation problem and score it.

    Returns ``validation/accuracy`` (mean reward over all problems, in [0, 1]), ``validation/mean_response_length``
    (tokens) and ``validation/non_finite_rewards`` (how many problems got a NaN/inf reward).

    Args:
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
        batch = generate_rollouts(generation, tokenizer, env, problems[start:start + step],
                                  prompt_ids[start:start + step], n=1, seed=0, temperature=0.0,
                                  max_new_tokens=max_new_tokens, non_finite_reward=non_finite_reward,
                                  prompt_names=list(range(start, min(start + step, len(problems)))))
        gen = batch.generation
        rewards.append(batch.rewards.float())
        lengths.append((gen["unpadded_sequence_lengths"] - gen["input_lengths"]).float())
        valid.append(batch.reward_valid)
    return {"validation/accuracy": float(torch.cat(rewards).mean()),
            "validation/mean_response_length": float(torch.cat(lengths).mean()),
            "validation/non_finite_rewards": float((~torch.cat(valid)).sum())}
