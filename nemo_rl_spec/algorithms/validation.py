"""Validation: greedy answers to held-out problems, scored by the math environment."""
from __future__ import annotations

from nemo_rl_spec.algorithms.rollouts import generate_rollouts


def validate(generation, tokenizer, env, problems: list[dict], prompt_ids: list[list[int]],
             max_new_tokens: int) -> dict[str, float]:
    """Greedy-decode one answer per validation problem; return ``validation/accuracy`` (fraction in [0, 1]) and
    ``validation/mean_response_length`` (tokens)."""
    batch = generate_rollouts(generation, tokenizer, env, problems, prompt_ids, n=1, seed=0,
                              temperature=0.0, max_new_tokens=max_new_tokens)
    gen = batch.generation
    lengths = (gen["unpadded_sequence_lengths"] - gen["input_lengths"]).float()
    return {"validation/accuracy": float(batch.rewards.mean()),
            "validation/mean_response_length": float(lengths.mean())}
