"""Rollout allocation baselines (uniform GRPO, DAPO dynamic sampling), the shared prompt stream and bookkeeping.
:func:`nemo_rl_spec.algorithms.allocators.build_rollout_allocator` picks the allocator from the config.

The protocol the GRPO driver calls lives in :mod:`nemo_rl_spec.algorithms.interfaces`; Pilot-Commit lives in
:mod:`nemo_rl_spec.algorithms.pilot_commit`.

Epochs. Every allocator walks its prompt pool epoch by epoch: epoch ``e`` visits every prompt still in the pool
once, in ``torch.randperm`` order seeded by ``(seed, e)`` (or ascending id order with ``shuffle=False``). A batch
never crosses an epoch boundary, so the last batch of an epoch may be smaller and a pool smaller than a batch gives
one batch per epoch (no prompt twice in a batch). The ``rollout_alloc/*`` metrics every allocator reports are
listed in :class:`AllocatorBase`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping, Sequence

import torch

from nemo_rl_spec.algorithms.interfaces import (
    RolloutAllocator,
    RolloutRequest,
    RolloutResult,
    Stage,
    TrainGroup,
    TrainSelection,
)

_MASK64 = (1 << 64) - 1
_STAGE_CODE = {Stage.PILOT: 1, Stage.COMMIT: 2, Stage.GROUP: 3}


def mix_seed(*values: int) -> int:
    """Deterministic 31-bit seed from integers (splitmix64-style mixing); no global RNG involved."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (int(v) & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h & 0x7FFFFFFF


def scaled_count(factor: float, count: int, *, round_up: bool) -> int:
    """``factor * count`` as a whole number of prompts: ceil (``round_up``) or floor of the product, taken after
    rounding the product to 9 decimals so that binary float error cannot move it across an integer
    (1.1 x 10 = 11.000000000000002 -> 11 either way; 1.15 x 20 = 22.999999999999996 -> 23).
    Used for DAPO's ``batch_multiplier`` (floor) and Pilot-Commit's ``pilot_oversampling`` (ceil)."""
    product = round(factor * count, 9)
    return math.ceil(product) if round_up else math.floor(product)


def requests_by_n(requests: list[RolloutRequest]) -> dict[int, list[int]]:
    """Indices of ``requests`` grouped by rollout count ``n`` (first-seen order), for generation backends that take
    one ``n`` per call. Example: n = [4, 4, 2, 2, 2] -> {4: [0, 1], 2: [2, 3, 4]}."""
    out: dict[int, list[int]] = {}
    for i, req in enumerate(requests):
        out.setdefault(req.n, []).append(i)
    return out


def difficulty_bucket(problem: Mapping[str, Any]) -> str:
    """Difficulty bucket of one training problem, for the ``rollout_alloc/trained_bucket/*`` metrics.

    Rule: the problem's own ``difficulty`` field if it has one (``str(value)``); else for a reasoning-gym
    ``chain_sum`` problem ``terms_<n>``, n = the number of integers in the expression (the text after the last
    ``:`` of the question, e.g. "... problem: 0 - 4 - 8 =" -> ``terms_3``); else the generator name (``source``
    up to its first ``:``), or ``unknown``.
    """
    if "difficulty" in problem:
        return str(problem["difficulty"])
    source = str(problem.get("source", "unknown"))
    name = source.split(":", 1)[0] or "unknown"
    if name == "chain_sum" and "question" in problem:
        expr = str(problem["question"]).rsplit(":", 1)[-1]
        return f"terms_{len(re.findall(r'[0-9]+', expr))}"
    return name


class PromptStream:
    """Epoch-ordered stream over a prompt pool with permanent eviction.

    Args:
        prompt_ids: the pool (unique non-negative ints, usually ``range(len(dataset))``).
        seed: permutation seed; epoch ``e`` uses ``torch.randperm`` with a generator seeded by ``mix_seed(seed, e)``.
        shuffle: False visits prompts in ascending id order every epoch.

    Raises:
        ValueError: empty pool, duplicate or negative ids.
    """

    def __init__(self, prompt_ids: Iterable[int], seed: int, shuffle: bool = True) -> None:
        ids = [int(i) for i in prompt_ids]
        if not ids:
            raise ValueError("the prompt pool is empty")
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise ValueError("prompt ids must be unique non-negative integers")
        self.prompt_ids = sorted(ids)
        self.seed, self.shuffle = seed, shuffle
        self.evicted: set[int] = set()
        self.epoch = 0
        self.order = self._permutation(0)
        self.pos = 0

    @property
    def pool_size(self) -> int:
        """Prompts not evicted."""
        return len(self.prompt_ids) - len(self.evicted)

    def remaining_in_epoch(self) -> int:
        """Prompts of the current epoch not yet handed out (evicted ones excluded)."""
        return sum(1 for pid in self.order[self.pos :] if pid not in self.evicted)

    def epochs_completed(self) -> int:
        """Epochs whose every prompt has been handed out (the current one counts once it is used up)."""
        return self.epoch + (self.remaining_in_epoch() == 0)

    def next_batch(self, size: int) -> list[int]:
        """Up to ``size`` prompts of the current epoch; starts the next epoch first if this one is used up.

        Returns [] only when the pool is empty.
        """
        if self.remaining_in_epoch() == 0:
            if self.pool_size == 0:
                return []
            self.epoch += 1
            self.order, self.pos = self._permutation(self.epoch), 0
        batch: list[int] = []
        while len(batch) < size and self.pos < len(self.order):
            pid = self.order[self.pos]
            self.pos += 1
            if pid not in self.evicted:
                batch.append(pid)
        return batch

    def evict(self, prompt_id: int) -> None:
        """Remove a prompt from the pool for good (it is skipped for the rest of the epoch and never drawn again)."""
        self.evicted.add(prompt_id)

    def _permutation(self, epoch: int) -> list[int]:
        active = [pid for pid in self.prompt_ids if pid not in self.evicted]
        if not self.shuffle:
            return active
        gen = torch.Generator().manual_seed(mix_seed(self.seed, epoch))
        return [active[i] for i in torch.randperm(len(active), generator=gen).tolist()]

    def state_dict(self) -> dict[str, Any]:
        """Epoch, order, position and evictions."""
        return {
            "prompt_ids": list(self.prompt_ids),
            "evicted": sorted(self.evicted),
            "epoch": self.epoch,
            "order": list(self.order),
            "pos": self.pos,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: the state was written for a different pool.
        """
        if list(state["prompt_ids"]) != self.prompt_ids:
            raise ValueError("checkpointed prompt pool differs from this allocator's pool")
        self.evicted = set(state["evicted"])
        self.epoch, self.order, self.pos = int(state["epoch"]), list(state["order"]), int(state["pos"])


def group_reward_stats(groups: list[TrainGroup]) -> tuple[float, float, int]:
    """(mean population variance of group rewards, fraction of groups with all-equal rewards, rollouts in groups
    with a spread). Empty list -> (0.0, 0.0, 0)."""
    if not groups:
        return 0.0, 0.0, 0
    variances, zero, useful = [], 0, 0
    for g in groups:
        r = g.rewards
        variances.append(float(r.var(unbiased=False)))
        if bool(r.max() == r.min()):
            zero += 1
        else:
            useful += r.numel()
    return sum(variances) / len(variances), zero / len(groups), useful


class AllocatorBase(RolloutAllocator):
    """Shared bookkeeping: prompt stream, round/step counters, request seeds, result matching, common metrics and
    their checkpointing. Subclasses implement ``plan``/``observe`` with :meth:`_issue`, :meth:`_take` and
    :meth:`_finish`.

    Metrics every allocator reports per step (``rollout_alloc/``):
        step_rollouts, cumulative_rollouts: rollouts generated (all rounds, all stages).
        gen_rounds: generation rounds this step.
        train_groups, train_rollouts: size of the train batch.
        mean_group_reward_var: mean over train groups of the population variance of the group's rewards
            (for 0/1 rewards: p_hat * (1 - p_hat)), the GRPO signal the Pilot-Commit paper tracks; 0.0 if no group.
        zero_adv_group_frac: fraction of train groups whose rewards are all equal (zero GRPO advantage, no
            gradient); 0.0 if no group. For uniform GRPO with success rate p and n rollouts its expectation is
            p^n + (1-p)^n.
        cumulative_useful_rollouts, useful_rollout_frac: rollouts that ended in a train group with a reward spread,
            and their share of all rollouts generated so far (1 - wasted share).
        epoch, epochs_completed (epochs whose every prompt was handed out; ``grpo.max_num_epochs`` stops on it),
        max_policy_lag (max over train rollouts of the newest version seen this step minus the rollout's).

    Which prompts were trained on, so that over-focus on a narrow slice of the pool is visible:
        trained_prompts: distinct prompts in this step's train batch.
        trained_times_seen_mean, trained_times_seen_max: over this step's trained prompts, the number of steps (this
            one included) on which the prompt was in a train batch so far.
        trained_unique_frac: distinct prompts ever trained / train groups so far (1.0: no prompt trained twice).
        trained_group_reward_mean: mean reward over the train batch's rollouts (0.0 if none).
        trained_bucket/<b>: train groups of difficulty bucket ``b`` this step, for every bucket of the pool, when
            the driver gave the allocator the pool's buckets (:meth:`set_prompt_buckets`, e.g.
            :func:`difficulty_bucket` of each problem: ``terms_3`` for a 3-term chain sum).
    """

    kind = "base"

    def __init__(self, prompt_ids: Iterable[int], seed: int, shuffle: bool) -> None:
        self.stream = PromptStream(prompt_ids, seed, shuffle)
        self.seed = seed
        self._step = 0
        self._round = 0
        self._issued: list[RolloutRequest] | None = None
        self._cum = {"rollouts": 0, "useful_rollouts": 0}
        self._step_rollouts = 0
        self._step_max_version: int | None = None
        self._times_trained: dict[int, int] = {}  # prompt -> steps it was in a train batch
        self._train_groups_total = 0
        self._buckets: dict[int, str] | None = None

    def set_prompt_buckets(self, buckets: Sequence[str] | Mapping[int, str]) -> None:
        """Difficulty bucket of every prompt (a sequence indexed by prompt id, or a mapping) for the
        ``rollout_alloc/trained_bucket/<b>`` metrics; each step then reports a count for every bucket of the pool
        (0 included). Prompts missing from a mapping count as ``unknown``."""
        items = buckets.items() if isinstance(buckets, Mapping) else enumerate(buckets)
        self._buckets = {int(k): str(v) for k, v in items}

    def _trained_prompt_metrics(self, groups: list[TrainGroup]) -> dict[str, float]:
        """Update the times-trained counts with this step's groups and return the ``trained_*`` metrics."""
        ids = sorted({g.prompt_id for g in groups})
        for pid in ids:
            self._times_trained[pid] = self._times_trained.get(pid, 0) + 1
        self._train_groups_total += len(groups)
        seen = [self._times_trained[pid] for pid in ids]
        n_rows = sum(g.size for g in groups)
        out = {
            "rollout_alloc/trained_prompts": float(len(ids)),
            "rollout_alloc/trained_times_seen_mean": sum(seen) / len(seen) if seen else 0.0,
            "rollout_alloc/trained_times_seen_max": float(max(seen, default=0)),
            "rollout_alloc/trained_unique_frac": len(self._times_trained) / max(self._train_groups_total, 1),
            "rollout_alloc/trained_group_reward_mean": (
                sum(float(g.rewards.sum()) for g in groups) / n_rows if n_rows else 0.0
            ),
        }
        if self._buckets is not None:
            counts = {b: 0 for b in sorted(set(self._buckets.values()))}
            for g in groups:
                b = self._buckets.get(g.prompt_id, "unknown")
                counts[b] = counts.get(b, 0) + 1
            out.update({f"rollout_alloc/trained_bucket/{b}": float(c) for b, c in counts.items()})
        return out

    def epochs_completed(self) -> int:
        """Epochs over the prompt pool fully handed out so far (:meth:`PromptStream.epochs_completed`)."""
        return self.stream.epochs_completed()

    @property
    def current_step(self) -> int:
        """The step the next selection will be for."""
        return self._step

    def _request(self, prompt_id: int, n: int, stage: Stage, target_step: int) -> RolloutRequest:
        seed = mix_seed(self.seed, self._step, self._round, _STAGE_CODE[stage], prompt_id)
        return RolloutRequest(prompt_id, n, stage, target_step, seed)

    def _check_idle(self) -> None:
        if self._issued is not None:
            raise RuntimeError("plan() called twice without observe()")

    def _issue(self, requests: list[RolloutRequest]) -> list[RolloutRequest]:
        self._check_idle()
        self._issued = requests
        self._round += 1
        return list(requests)

    def _take(self, results: list[RolloutResult]) -> list[RolloutResult]:
        """Match results to the issued requests; returns them in request order. Validates before any state change."""
        if self._issued is None:
            raise RuntimeError("observe() called without a pending plan()")
        by_key: dict[tuple[int, Stage], RolloutResult] = {}
        for res in results:
            key = (res.prompt_id, Stage(res.stage))
            if key in by_key:
                raise ValueError(f"duplicate result for prompt {key[0]} ({key[1].value})")
            by_key[key] = res
        ordered = []
        for req in self._issued:
            res = by_key.pop((req.prompt_id, req.stage), None)
            if res is None:
                raise ValueError(f"missing result for prompt {req.prompt_id} ({req.stage.value})")
            if res.rewards.numel() != req.n:
                raise ValueError(
                    f"prompt {req.prompt_id} ({req.stage.value}): expected {req.n} rewards, got {res.rewards.numel()}"
                )
            self._validate(res)
            ordered.append(res)
        if by_key:
            extra = sorted((k[0], k[1].value) for k in by_key)
            raise ValueError(f"results for prompts that were not requested: {extra}")
        self._issued = None
        for res in ordered:
            self._step_rollouts += res.rewards.numel()
            if self._step_max_version is None or res.policy_version > self._step_max_version:
                self._step_max_version = res.policy_version
        return ordered

    def _validate(self, result: RolloutResult) -> None:
        """Hook for method-specific reward checks (raise ValueError)."""

    def _finish(self, groups: list[TrainGroup], extra: dict[str, float], exhausted: bool = False) -> TrainSelection:
        mean_var, zero_frac, useful = group_reward_stats(groups)
        self._cum["rollouts"] += self._step_rollouts
        self._cum["useful_rollouts"] += useful
        newest = self._step_max_version
        lags = [newest - r.policy_version for g in groups for r in g.results] if newest is not None else []
        metrics = {
            "rollout_alloc/step_rollouts": float(self._step_rollouts),
            "rollout_alloc/cumulative_rollouts": float(self._cum["rollouts"]),
            "rollout_alloc/gen_rounds": float(self._round),
            "rollout_alloc/train_groups": float(len(groups)),
            "rollout_alloc/train_rollouts": float(sum(g.size for g in groups)),
            "rollout_alloc/mean_group_reward_var": mean_var,
            "rollout_alloc/zero_adv_group_frac": zero_frac,
            "rollout_alloc/cumulative_useful_rollouts": float(self._cum["useful_rollouts"]),
            "rollout_alloc/useful_rollout_frac": self._cum["useful_rollouts"] / max(self._cum["rollouts"], 1),
            "rollout_alloc/epoch": float(self.stream.epoch),
            "rollout_alloc/epochs_completed": float(self.stream.epochs_completed()),
            "rollout_alloc/max_policy_lag": float(max(lags, default=0)),
            **self._trained_prompt_metrics(groups),
            **extra,
        }
        selection = TrainSelection(self._step, groups, metrics, exhausted=exhausted and not groups)
        self._step += 1
        self._round = 0
        self._step_rollouts = 0
        self._step_max_version = None
        return selection

    def _check_between_steps(self) -> None:
        if self._issued is not None or self._round != 0:
            raise RuntimeError("state_dict() is only valid between steps (after observe() returned a selection)")

    def _base_state(self) -> dict[str, Any]:
        self._check_between_steps()
        return {
            "kind": self.kind,
            "step": self._step,
            "cum": dict(self._cum),
            "stream": self.stream.state_dict(),
            "times_trained": dict(self._times_trained),
            "train_groups_total": self._train_groups_total,
        }

    def _load_base_state(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"checkpoint is for allocator {state.get('kind')!r}, this is {self.kind!r}")
        self.stream.load_state_dict(state["stream"])
        self._step, self._cum = int(state["step"]), dict(state["cum"])
        # absent in checkpoints written before the trained-prompt metrics: counts restart from 0
        self._times_trained = {int(k): int(v) for k, v in state.get("times_trained", {}).items()}
        self._train_groups_total = int(state.get("train_groups_total", 0))
        self._round, self._issued, self._step_rollouts, self._step_max_version = 0, None, 0, None


class UniformAllocator(AllocatorBase):
    """Uniform GRPO: each step, the next ``num_prompts_per_step`` prompts of the epoch x ``n`` rollouts, all
    trained (one round per step). Budget per step: ``num_prompts_per_step * n`` rollouts.

    Raises:
        ValueError: empty pool or non-positive sizes.
    """

    kind = "uniform"
    max_rounds_per_step = 1

    def __init__(
        self,
        prompt_ids: Iterable[int],
        num_prompts_per_step: int,
        num_generations_per_prompt: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if num_prompts_per_step < 1 or num_generations_per_prompt < 1:
            raise ValueError("num_prompts_per_step and num_generations_per_prompt must be >= 1")
        super().__init__(prompt_ids, seed, shuffle)
        self.num_prompts, self.n = num_prompts_per_step, num_generations_per_prompt

    def plan(self) -> list[RolloutRequest]:
        """The next batch of the epoch, ``n`` rollouts each (Stage.GROUP)."""
        self._check_idle()
        batch = self.stream.next_batch(self.num_prompts)
        return self._issue([self._request(pid, self.n, Stage.GROUP, self._step) for pid in batch])

    def observe(self, results: list[RolloutResult]) -> TrainSelection:
        """Every result is one train group."""
        ordered = self._take(results)
        groups = [TrainGroup(r.prompt_id, [r]) for r in ordered]
        return self._finish(groups, {}, exhausted=self.stream.pool_size == 0)

    def state_dict(self) -> dict[str, Any]:
        """Step, counters and prompt-stream position."""
        return self._base_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._load_base_state(state)


class DynamicSamplingAllocator(AllocatorBase):
    """DAPO dynamic sampling: generate batches of G = floor(``batch_multiplier`` x ``num_prompts_per_step``) prompts
    (:func:`scaled_count`; NeMo-RL's ``grpo.batch_multiplier``, default 1: G = K) x ``n`` rollouts, keep groups
    whose rewards are not all equal (``max > min``), until K = ``num_prompts_per_step`` groups are kept or
    ``max_gen_batches`` batches were generated. Kept groups beyond the first K (in generation order) are discarded
    (surplus, counted; their rollouts count in ``rollout_alloc/step_rollouts``); if the budget of batches runs out
    first the step trains on the groups it kept (``dynamic_sampling/batch_incomplete`` = 1; NeMo-RL raises there).

    Extra metrics (``dynamic_sampling/``): gen_batches, kept_groups (before truncation), discarded_groups
    (zero spread), surplus_groups, batch_incomplete, generated_zero_adv_frac (over all generated groups).

    Raises:
        ValueError: empty pool, non-positive sizes, ``max_gen_batches < 1`` or ``batch_multiplier < 1``.
    """

    kind = "dynamic_sampling"

    def __init__(
        self,
        prompt_ids: Iterable[int],
        num_prompts_per_step: int,
        num_generations_per_prompt: int,
        max_gen_batches: int,
        seed: int = 0,
        shuffle: bool = True,
        batch_multiplier: float = 1.0,
    ) -> None:
        if num_prompts_per_step < 1 or num_generations_per_prompt < 1 or max_gen_batches < 1:
            raise ValueError("num_prompts_per_step, num_generations_per_prompt and max_gen_batches must be >= 1")
        if batch_multiplier < 1.0:
            raise ValueError(
                f"batch_multiplier={batch_multiplier} must be >= 1 (a generation batch >= the train batch)"
            )
        super().__init__(prompt_ids, seed, shuffle)
        self.num_prompts, self.n = num_prompts_per_step, num_generations_per_prompt
        self.gen_batch_prompts = scaled_count(batch_multiplier, num_prompts_per_step, round_up=False)
        self.max_rounds_per_step = max_gen_batches
        self._kept: list[TrainGroup] = []
        self._discarded = 0

    def plan(self) -> list[RolloutRequest]:
        """The next generation batch of the epoch, ``gen_batch_prompts`` prompts (Stage.GROUP)."""
        self._check_idle()
        batch = self.stream.next_batch(self.gen_batch_prompts)
        return self._issue([self._request(pid, self.n, Stage.GROUP, self._step) for pid in batch])

    def observe(self, results: list[RolloutResult]) -> TrainSelection | None:
        """Keep groups with a reward spread; finish when full, out of batches, or nothing was generated."""
        ordered = self._take(results)
        for res in ordered:
            if bool(res.rewards.max() > res.rewards.min()):
                self._kept.append(TrainGroup(res.prompt_id, [res]))
            else:
                self._discarded += 1
        full = len(self._kept) >= self.num_prompts
        if not (full or self._round >= self.max_rounds_per_step or not ordered):
            return None
        groups = self._kept[: self.num_prompts]
        generated = len(self._kept) + self._discarded
        extra = {
            "dynamic_sampling/gen_batches": float(self._round),
            "dynamic_sampling/kept_groups": float(len(self._kept)),
            "dynamic_sampling/discarded_groups": float(self._discarded),
            "dynamic_sampling/surplus_groups": float(len(self._kept) - len(groups)),
            "dynamic_sampling/batch_incomplete": float(not full),
            "dynamic_sampling/generated_zero_adv_frac": self._discarded / max(generated, 1),
        }
        self._kept, self._discarded = [], 0
        return self._finish(groups, extra, exhausted=self.stream.pool_size == 0)

    def state_dict(self) -> dict[str, Any]:
        """Step, counters and prompt-stream position (kept groups never outlive a step)."""
        return self._base_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self._load_base_state(state)
        self._kept, self._discarded = [], 0
