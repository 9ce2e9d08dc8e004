"""The rollout allocator a run uses, picked from its config: uniform GRPO, DAPO dynamic sampling
(:mod:`nemo_rl_spec.algorithms.rollout_allocation`) or Pilot-Commit (:mod:`nemo_rl_spec.algorithms.pilot_commit`)."""

from __future__ import annotations

from typing import Any, Iterable

from nemo_rl_spec.algorithms.interfaces import RolloutAllocator
from nemo_rl_spec.algorithms.pilot_commit import PilotCommitAllocator
from nemo_rl_spec.algorithms.pilot_commit_fixed import FixedBatchPilotCommitAllocator
from nemo_rl_spec.algorithms.rollout_allocation import DynamicSamplingAllocator, UniformAllocator
from nemo_rl_spec.utils.feature_configs import DynamicSamplingConfig


def build_rollout_allocator(
    prompt_ids: Iterable[int],
    *,
    num_prompts_per_step: int,
    num_generations_per_prompt: int,
    seed: int,
    pilot_commit: Any = None,
    dynamic_sampling: DynamicSamplingConfig | None = None,
    shuffle: bool = True,
) -> RolloutAllocator:
    """The allocator selected by config: Pilot-Commit if ``grpo.pilot_commit`` is present and enabled, DAPO dynamic
    sampling if ``grpo.dynamic_sampling`` is, else uniform GRPO.

    Pilot-Commit's ``rollout_budget_per_step`` defaults to the uniform budget
    ``num_prompts_per_step * num_generations_per_prompt``, so the methods compare at equal budget; with
    ``fixed_train_batch`` it trains ``num_prompts_per_step`` groups of ``num_generations_per_prompt`` instead
    (:class:`~nemo_rl_spec.algorithms.pilot_commit.FixedBatchPilotCommitAllocator`). DAPO generates batches of
    ``dynamic_sampling.batch_multiplier`` x ``num_prompts_per_step`` prompts.

    Args:
        pilot_commit: a :class:`~nemo_rl_spec.algorithms.pilot_commit.PilotCommitConfig` or None.

    Raises:
        ValueError: both methods enabled, or a configuration the chosen allocator rejects.
    """
    pc_on = pilot_commit is not None and pilot_commit.enabled
    ds_on = dynamic_sampling is not None and dynamic_sampling.enabled
    if pc_on and ds_on:
        raise ValueError("grpo.pilot_commit and grpo.dynamic_sampling are both enabled; choose one")
    if pc_on and pilot_commit.fixed_train_batch:
        return FixedBatchPilotCommitAllocator(
            prompt_ids,
            pilot_commit,
            num_prompts_per_step=num_prompts_per_step,
            num_generations_per_prompt=num_generations_per_prompt,
            seed=seed,
            shuffle=shuffle,
        )
    if pc_on:
        return PilotCommitAllocator(
            prompt_ids,
            pilot_commit,
            seed=seed,
            shuffle=shuffle,
            default_rollout_budget=num_prompts_per_step * num_generations_per_prompt,
        )
    if ds_on:
        return DynamicSamplingAllocator(
            prompt_ids,
            num_prompts_per_step,
            num_generations_per_prompt,
            dynamic_sampling.max_gen_batches,
            seed=seed,
            shuffle=shuffle,
            batch_multiplier=dynamic_sampling.batch_multiplier,
        )
    return UniformAllocator(prompt_ids, num_prompts_per_step, num_generations_per_prompt, seed=seed, shuffle=shuffle)
