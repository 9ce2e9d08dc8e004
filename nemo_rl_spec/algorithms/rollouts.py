"""Rollouts: prompts -> vLLM samples -> math rewards -> a padded training batch (TrainDatumSpec)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from nemo_rl_spec.algorithms.interfaces import RolloutRequest, RolloutResult, TrainSelection
from nemo_rl_spec.algorithms.rollout_allocation import mix_seed, requests_by_n
from nemo_rl_spec.distributed.interfaces import TrainDatumSpec
from nemo_rl_spec.environments.reward_check import check_rewards
from nemo_rl_spec.models.generation.interfaces import GenerationOutputSpec
from nemo_rl_spec.speculative.metrics import SpecDecodeCounters


@dataclass
class RolloutBatch:
    """Samples of one generation call with their rewards.

    Attributes:
        generation: the worker's output (N = B prompts x n rows, prompt-major).
        rewards: [N] float32 in {0, 1}, finite (a masked non-finite reward is 0.0).
        responses: N decoded response strings.
        problem_index: [N] int64, index into the list of problems passed to :func:`generate_rollouts`.
        reward_valid: [N] bool, False where the environment's reward was NaN/inf and masked.
    """

    generation: GenerationOutputSpec
    rewards: torch.Tensor
    responses: list[str]
    problem_index: torch.Tensor
    reward_valid: torch.Tensor


def response_mask(input_lengths: torch.Tensor, sequence_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """1.0 on response tokens (positions in [prompt length, sequence length)), 0.0 elsewhere.

    Shape: input_lengths [N], sequence_lengths [N] -> [N, width] float32.
    """
    pos = torch.arange(width).unsqueeze(0)
    return ((pos >= input_lengths.unsqueeze(1)) & (pos < sequence_lengths.unsqueeze(1))).float()


def decode_responses(tokenizer, gen: GenerationOutputSpec) -> list[str]:
    """Decode the response part of each row (special tokens dropped)."""
    out_ids, starts, ends = gen["output_ids"], gen["input_lengths"], gen["unpadded_sequence_lengths"]
    return [
        tokenizer.decode(out_ids[i, starts[i] : ends[i]].tolist(), skip_special_tokens=True) for i in range(len(starts))
    ]


def score_rollouts(
    env,
    responses: list[str],
    problems: list[dict],
    gen: GenerationOutputSpec,
    n: int,
    non_finite_reward: str = "error",
    prompt_names: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score the rows of one generation call with ``env`` and check the rewards for NaN / inf.

    Shape: N responses (prompt-major, ``n`` per prompt) -> (rewards [N] float32, finite; valid [N] bool).

    Args:
        problems: the call's problems; ``gen["prompt_index"]`` indexes them.
        non_finite_reward: ``grpo.non_finite_reward`` (see :mod:`nemo_rl_spec.environments.reward_check`).
        prompt_names: ids naming the call's prompts in an error (training-pool indices); default 0, 1, ...

    Raises:
        NonFiniteRewardError: a reward is NaN/inf and ``non_finite_reward == "error"``.
    """
    rewards = env.step(responses, [problems[i] for i in gen["prompt_index"].tolist()])
    return check_rewards(rewards, n, non_finite_reward, prompt_names)


def generate_rollouts(
    generation,
    tokenizer,
    env,
    problems: list[dict],
    prompt_ids: list[list[int]],
    n: int,
    seed: int,
    non_finite_reward: str = "error",
    prompt_names: list[int] | None = None,
    **overrides,
) -> RolloutBatch:
    """Sample ``n`` responses for each prompt on the generation engines and score them with ``env``.

    Args:
        generation: the :class:`~nemo_rl_spec.models.generation.vllm_generation.VllmGeneration` controller (or any
            object with its ``generate``).
        problems: dicts with ``answer`` (ground truth), aligned with ``prompt_ids``.
        non_finite_reward, prompt_names: see :func:`score_rollouts`.
        overrides: forwarded to ``generate`` (``temperature``, ``max_new_tokens``).

    Raises:
        NonFiniteRewardError: see :func:`score_rollouts`.
    """
    gen = generation.generate({"prompt_token_ids": prompt_ids}, n, seed, **overrides)
    responses = decode_responses(tokenizer, gen)
    rewards, valid = score_rollouts(env, responses, problems, gen, n, non_finite_reward, prompt_names)
    return RolloutBatch(gen, rewards, responses, gen["prompt_index"], valid)


@dataclass
class RolloutStats:
    """What the generate calls of one allocator step cost and reported (:class:`RolloutGenerator` adds to it).

    Attributes:
        generation_s: seconds inside the engines' generate calls (scoring excluded).
        generated_tokens: response tokens generated.
        spec_counters: speculative-decoding counts of those calls, summed (None without speculation); each call
            returns its own counts, so nothing queries the engines (a query would queue behind the next call).
        draft_version: the drafter version the engines reported for the latest call (None without a draft refit).
    """

    generation_s: float = 0.0
    generated_tokens: int = 0
    spec_counters: SpecDecodeCounters | None = None
    draft_version: int | None = None

    def add(self, gen: GenerationOutputSpec, seconds: float) -> None:
        """Account one generate call's output ``gen`` that took ``seconds``."""
        self.generation_s += seconds
        self.generated_tokens += int((gen["unpadded_sequence_lengths"] - gen["input_lengths"]).sum())
        self.draft_version = gen.get("draft_version")
        if gen.get("spec_counters") is not None:
            self.spec_counters = gen["spec_counters"] + (self.spec_counters or SpecDecodeCounters())


class RolloutGenerator:
    """The :class:`GenerateFn` a rollout allocator calls, in sync and async GRPO alike: one vLLM call per distinct
    ``n``, scored by ``env``; :attr:`stats` accumulates what the calls cost and reported (:class:`RolloutStats`).

    Each result's payload holds its rows: ``output_ids`` [n, L], ``input_lengths`` [n], ``sequence_lengths`` [n],
    ``generation_logprobs`` [n, L] (L = longest of the n rows), so a replayed pilot keeps its behaviour log-probs,
    and ``reward_valid`` [n] bool (False: a masked non-finite reward, see :func:`score_rollouts`); with
    ``tag_draft_version`` also ``draft_version`` (int or None) of the call that sampled it.

    Args:
        generation: the generation controller (its ``generate``).
        problems: the training pool; ``RolloutRequest.prompt_id`` indexes it.
        prompt_ids_of: callable mapping a list of problems to their chat-formatted token ids.
        non_finite_reward: ``grpo.non_finite_reward`` (``error`` or ``mask``).
        version: policy version of the weights the engines hold (sync GRPO); None: each result takes the version
            the engines reported for the call that sampled it (async GRPO, where refits land between calls).
        gate: a context-manager factory every generate call runs under (async GRPO's
            ``GenerationGate.generation``: no refit while a call runs); None: no gate.
        tag_draft_version: put the call's ``draft_version`` into each payload.

    Raises:
        NonFiniteRewardError: from a call, see :func:`score_rollouts`.
    """

    def __init__(
        self,
        generation,
        tokenizer,
        env,
        problems: list[dict],
        prompt_ids_of,
        non_finite_reward: str = "error",
        version: int | None = None,
        gate: Callable[[], AbstractContextManager] | None = None,
        tag_draft_version: bool = False,
    ) -> None:
        self.generation, self.tokenizer, self.env = generation, tokenizer, env
        self.problems, self.prompt_ids_of, self.non_finite_reward = problems, prompt_ids_of, non_finite_reward
        self.version, self.gate, self.tag_draft_version = version, gate or nullcontext, tag_draft_version
        self.stats = RolloutStats()

    def __call__(self, requests: list[RolloutRequest]) -> list[RolloutResult]:
        results = []
        for n, idx in requests_by_n(requests).items():
            reqs = [requests[i] for i in idx]
            chosen = [self.problems[r.prompt_id] for r in reqs]
            prompts = {"prompt_token_ids": self.prompt_ids_of(chosen)}
            with self.gate():
                start = time.perf_counter()
                gen = self.generation.generate(prompts, n, mix_seed(*(r.seed for r in reqs)))
                self.stats.add(gen, time.perf_counter() - start)
            rewards, valid = score_rollouts(
                self.env,
                decode_responses(self.tokenizer, gen),
                chosen,
                gen,
                n,
                self.non_finite_reward,
                [r.prompt_id for r in reqs],
            )
            version = int(gen["policy_version"]) if self.version is None else self.version
            extra = {"draft_version": gen.get("draft_version")} if self.tag_draft_version else {}
            for j, req in enumerate(reqs):
                rows = slice(j * n, (j + 1) * n)
                payload = {**_row_payload(gen, rows), **extra, "reward_valid": valid[rows].clone()}
                results.append(req.result(rewards[rows], version, payload=payload))
        return results


def _row_payload(gen: GenerationOutputSpec, rows: slice) -> dict[str, torch.Tensor]:
    lengths = gen["unpadded_sequence_lengths"][rows]
    width = int(lengths.max())
    return {
        "output_ids": gen["output_ids"][rows, :width].clone(),
        "input_lengths": gen["input_lengths"][rows].clone(),
        "sequence_lengths": lengths.clone(),
        "generation_logprobs": gen["generation_logprobs"][rows, :width].float().clone(),
    }


def _pad_cat(tensors: list[torch.Tensor], pad_value: float) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=pad_value) for t in tensors])


def selection_reward_valid(selection: TrainSelection) -> torch.Tensor:
    """Shape: [N] bool, aligned with ``selection.rewards``: False for rows whose non-finite reward was masked
    (payload ``reward_valid``; payloads without it count as valid)."""
    return (
        torch.cat(
            [r.payload.get("reward_valid", torch.ones(r.rewards.numel(), dtype=torch.bool)) for r in selection.results]
        )
        if selection.results
        else torch.zeros(0, dtype=torch.bool)
    )


def build_train_data(selection: TrainSelection, advantages: torch.Tensor, pad_token_id: int) -> TrainDatumSpec:
    """Stack the payloads of a train selection (group-major, as ``selection.rewards``) into a
    :class:`TrainDatumSpec`. Shapes: advantages [N] -> batch of N rows, right-padded with ``pad_token_id``;
    ``sample_mask`` is 0 on rows whose non-finite reward was masked (:func:`selection_reward_valid`); ``rewards``
    [N] are the environment's rewards (0 on those rows), read by ``loss_fn.positive_example_nll_weight``."""
    payloads = [r.payload for r in selection.results]
    valid = selection_reward_valid(selection)
    ids = _pad_cat([p["output_ids"] for p in payloads], pad_token_id)
    prompt_lens = torch.cat([p["input_lengths"] for p in payloads])
    seq_lens = torch.cat([p["sequence_lengths"] for p in payloads])
    return TrainDatumSpec(
        input_ids=ids,
        input_lengths=seq_lens,
        token_mask=response_mask(prompt_lens, seq_lens, ids.shape[1]),
        sample_mask=valid.float(),
        advantages=advantages.float(),
        rewards=torch.where(valid, selection.rewards.float(), 0.0),
        generation_logprobs=_pad_cat([p["generation_logprobs"] for p in payloads], 0.0),
    )


def masked_mean_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of |a - b| over positions where ``mask`` is 1. Shapes: [N, S] each. Returns 0.0 for an empty mask."""
    count = mask.sum()
    return float(((a - b).abs() * mask).sum() / count) if count > 0 else 0.0


def logprob_agreement_metrics(
    prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
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
