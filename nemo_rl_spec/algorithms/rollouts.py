"""Rollouts: prompts -> vLLM samples -> math rewards -> a padded training batch (TrainDatumSpec)."""
from __future__ import annotations

from dataclasses import dataclass

import ray
import torch

from nemo_rl_spec.distributed.interfaces import TrainDatumSpec
from nemo_rl_spec.models.generation.interfaces import GenerationOutputSpec


@dataclass
class RolloutBatch:
    """Samples of one generation call with their rewards.

    Attributes:
        generation: the worker's output (N = B prompts x n rows, prompt-major).
        rewards: [N] float32 in {0, 1}.
        responses: N decoded response strings.
        problem_index: [N] int64, index into the list of problems passed to :func:`generate_rollouts`.
    """

    generation: GenerationOutputSpec
    rewards: torch.Tensor
    responses: list[str]
    problem_index: torch.Tensor


def response_mask(input_lengths: torch.Tensor, sequence_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """1.0 on response tokens (positions in [prompt length, sequence length)), 0.0 elsewhere.

    Shape: input_lengths [N], sequence_lengths [N] -> [N, width] float32.
    """
    pos = torch.arange(width).unsqueeze(0)
    return ((pos >= input_lengths.unsqueeze(1)) & (pos < sequence_lengths.unsqueeze(1))).float()


def decode_responses(tokenizer, gen: GenerationOutputSpec) -> list[str]:
    """Decode the response part of each row (special tokens dropped)."""
    out_ids, starts, ends = gen["output_ids"], gen["input_lengths"], gen["unpadded_sequence_lengths"]
    return [tokenizer.decode(out_ids[i, starts[i] : ends[i]].tolist(), skip_special_tokens=True) for i in range(len(starts))]


def generate_rollouts(generation, tokenizer, env, problems: list[dict], prompt_ids: list[list[int]], n: int,
                      seed: int, **overrides) -> RolloutBatch:
    """Sample ``n`` responses for each prompt on the generation actor and score them with ``env``.

    Args:
        generation: Ray actor handle of a :class:`GenerationInterface` worker.
        problems: dicts with ``answer`` (ground truth), aligned with ``prompt_ids``.
        overrides: forwarded to ``generate`` (``temperature``, ``max_new_tokens``).
    """
    gen = ray.get(generation.generate.remote({"prompt_token_ids": prompt_ids}, n, seed, **overrides))
    responses = decode_responses(tokenizer, gen)
    index = gen["prompt_index"]
    rewards = env.step(responses, [problems[i] for i in index.tolist()])
    return RolloutBatch(gen, rewards.float(), responses, index)


def build_train_data(batch: RolloutBatch, advantages: torch.Tensor) -> TrainDatumSpec:
    """Turn a rollout batch and its per-sample advantages ([N]) into a :class:`TrainDatumSpec`."""
    gen = batch.generation
    ids = gen["output_ids"]
    return TrainDatumSpec(
        input_ids=ids,
        input_lengths=gen["unpadded_sequence_lengths"],
        token_mask=response_mask(gen["input_lengths"], gen["unpadded_sequence_lengths"], ids.shape[1]),
        sample_mask=torch.ones(ids.shape[0]),
        advantages=advantages.float(),
        generation_logprobs=gen["generation_logprobs"].float(),
    )


def masked_mean_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of |a - b| over positions where ``mask`` is 1. Shapes: [N, S] each. Returns 0.0 for an empty mask."""
    count = mask.sum()
    return float(((a - b).abs() * mask).sum() / count) if count > 0 else 0.0


def logprob_agreement_metrics(prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor,
                              mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer's log-probs are from the sampler's on the sampled tokens.

    Shapes: [N, S] each (mask 1 on response tokens). Returns
    ``train/token_mult_prob_error`` = masked mean of exp(|prev - gen|) (NeMo-RL's metric; 1.0 is perfect) and
    ``train/importance_ratio_max_abs_dev`` = max |exp(prev - gen) - 1| (0.0 is perfect).
    """
    diff = (prev_logprobs - generation_logprobs) * mask
    count = mask.sum().clamp(min=1)
    mult_err = float((torch.exp(diff.abs()) * mask).sum() / count)
    max_dev = float(((torch.exp(diff) - 1).abs() * mask).max()) if mask.any() else 0.0
    return {"train/token_mult_prob_error": mult_err, "train/importance_ratio_max_abs_dev": max_dev}
