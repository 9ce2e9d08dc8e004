"""Validation: answers to held-out problems (greedy by default, or sampled), scored by the math environment;
NeMo-RL's pass@k (``grpo.val_num_generations_per_prompt``) and early stop (``grpo.stop_at_validation_metric``)."""

from __future__ import annotations

import math

import torch

from nemo_rl_spec.algorithms.rollouts import generate_rollouts


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct answers among ``n`` samples (Chen et al. 2021; NeMo-RL's
    ``evals.eval.eval_pass_k``): the chance that ``k`` answers drawn without replacement hold a correct one::

        pass@k = 1 - C(n - c, k) / C(n, k)        (1 when n - c < k)

    Example: n=4, c=2, k=2 -> 1 - 1/6 = 5/6. With k = n it is 1 if any answer is correct, else 0.

    Raises:
        ValueError: not 0 <= c <= n, or not 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def validation_pass_k(rewards: torch.Tensor, k: int) -> float:
    """NeMo-RL's ``validation/pass_k`` (``grpo.validate``): the mean over prompts of pass@k of each prompt's ``k``
    answers, an answer correct when its reward is > 0. With n = k samples per prompt :func:`pass_at_k` is the
    fraction of prompts with at least one correct answer::

        pass_k = mean_p [ any_j rewards[p, j] > 0 ]

    Shape: rewards [P * k], prompt-major (row = prompt * k + sample) -> float.
    """
    correct = (rewards.view(-1, k) > 0).sum(1).tolist()
    return sum(pass_at_k(k, int(c), k) for c in correct) / max(len(correct), 1)


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
    **sampling,
) -> dict[str, float]:
    """Decode ``num_generations`` answers per validation problem at ``temperature`` (0: greedy) and score them.

    Returns ``validation/accuracy`` (mean reward over all answers, in [0, 1]; with several sampled answers per
    problem, the mean per-problem pass rate), ``validation/mean_response_length`` (tokens; NeMo-RL's name
    ``validation/avg_length`` too), ``validation/non_finite_rewards`` (how many answers got a NaN/inf reward) and,
    with ``num_generations`` k > 1, ``validation/pass_k`` (:func:`validation_pass_k`).

    Args:
        temperature, num_generations: ``grpo.val_temperature`` / ``grpo.val_num_generations``. Sampled validation
            uses seed 0 with per-row seeds, so a policy's validation is the same in every call and every run.
        sampling: ``top_p`` / ``top_k`` for the generate calls (``grpo.val_top_p`` / ``val_top_k``; absent: the
            rollout values).
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
            **sampling,
            prompt_names=list(range(start, min(start + step, len(problems)))),
        )
        gen = batch.generation
        rewards.append(batch.rewards.float())
        lengths.append((gen["unpadded_sequence_lengths"] - gen["input_lengths"]).float())
        valid.append(batch.reward_valid)
    return validation_metrics(torch.cat(rewards), torch.cat(lengths), torch.cat(valid), num_generations)


def validation_metrics(rewards: torch.Tensor, lengths: torch.Tensor, valid: torch.Tensor, k: int) -> dict[str, float]:
    """The metrics of :func:`validate` from every answer's reward, response length and reward validity.

    Shapes: [P * k] each, prompt-major."""
    length = float(lengths.mean())
    out = {
        "validation/accuracy": float(rewards.mean()),
        "validation/mean_response_length": length,
        "validation/avg_length": length,
        "validation/non_finite_rewards": float((~valid).sum()),
    }
    if k > 1:
        out["validation/pass_k"] = validation_pass_k(rewards, k)
    return out


def validation_stop_message(metrics: dict[str, float], metric: str | None, threshold: float | None) -> str | None:
    """NeMo-RL's early stop (``grpo.stop_at_validation_metric`` / ``stop_at_validation_threshold``): a message
    when ``metrics[validation/<metric>] >= threshold``, else None (also when ``metric`` is None). ``metric`` is
    NeMo-RL's name (``accuracy``, ``pass_k``) or this project's full one (``validation/accuracy``).

    Raises:
        ValueError: ``metric`` is not among ``metrics`` (the message names the key and lists the reported ones).
    """
    if metric is None:
        return None
    key = metric if metric.startswith("validation/") else f"validation/{metric}"
    if key not in metrics:
        raise ValueError(
            f"grpo.stop_at_validation_metric={metric!r} is not a reported validation metric; "
            f"reported: {sorted(k.removeprefix('validation/') for k in metrics if k.startswith('validation/'))}"
        )
    value = metrics[key]
    if value < threshold:
        return None
    return f"validation {metric} = {value:.4f} reached grpo.stop_at_validation_threshold={threshold}; stopping"


def run_validation(s) -> dict[str, float]:
    """:func:`validate` with a run's setup ``s`` (a ``GRPOSetup``): its engines, held-out set and ``grpo.val_*`` keys
    (``grpo.val_temperature: null`` takes ``policy.generation.temperature``; ``grpo.val_top_p`` / ``val_top_k``
    reach the engines only when set: null is the rollout value)."""
    cfg = s.cfg
    gen = cfg.policy.generation
    temperature = gen.temperature if cfg.grpo.val_temperature is None else cfg.grpo.val_temperature
    sampling = {k: v for k, v in (("top_p", cfg.grpo.val_top_p), ("top_k", cfg.grpo.val_top_k)) if v is not None}
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
        **sampling,
    )
