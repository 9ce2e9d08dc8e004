"""Pilot-Commit with a fixed training batch (``grpo.pilot_commit.fixed_train_batch``; docs/guides/pilot_commit.md): every
step trains exactly ``grpo.num_prompts_per_step`` groups, re-piloting fresh prompts until they pass, as the
paper's reference recipe runs it. The classification, buffer, eviction and deferral are
:class:`~nemo_rl_spec.algorithms.pilot_commit.PilotCommitAllocator`'s.
"""

from __future__ import annotations

from typing import Any, Iterable

from nemo_rl_spec.algorithms.interfaces import RolloutRequest, RolloutResult, TrainGroup, TrainSelection
from nemo_rl_spec.algorithms.pilot_commit import PilotCommitAllocator
from nemo_rl_spec.algorithms.rollout_allocation import scaled_count
from nemo_rl_spec.utils.feature_configs import PilotCommitConfig


class FixedBatchPilotCommitAllocator(PilotCommitAllocator):
    """Pilot-Commit with a fixed training batch (``grpo.pilot_commit.fixed_train_batch``), as the paper's reference
    recipe runs it: every step trains K = ``num_prompts_per_step`` groups of ``num_generations_per_prompt`` rollouts.

    One step ``t`` (rounds of generation; ``m`` = prompts selected so far this step):

    1. Pilot rounds: while m < K, fewer than ``max_pilot_rounds`` pilot rounds ran and the pool is not empty, pilot
       ceil(``pilot_oversampling`` x (K - m)) fresh prompts of the epoch (:func:`scaled_count`) with ``n_pilot``
       rollouts each (policy version t, ``target_step`` t) and classify them as in the budget mode (evict, defer,
       too easy, select; thresholds inclusive).
    2. Commit round: the first K selected prompts (pilot order, earlier rounds first) get ``n_commit`` =
       ``num_generations_per_prompt - n_pilot`` rollouts each; surplus selected prompts go to the replay buffer.
       Only if the pilot rounds ended with m < K (bound reached, or pool empty) does the buffer fill the missing
       slots (``buffer_order``, entries older than ``max_off_steps`` expired); if nothing at all is selected and the
       buffer is empty, ``all_too_hard_fallback`` applies to this step's too-hard pilots. The step trains on what it
       has: ``pilot_commit/short_groups`` = K - groups trained (0 on a full step).

    With ``repilot_within_step`` false a prompt is piloted at most once a step: a round skips the prompts this step
    already piloted (the stream still advances past them) and asks for at most as many prompts as the pool has not
    yet seen this step; the pilot rounds end when none is left.

    Rounds per step: at most ``max_pilot_rounds + 1`` (:attr:`max_rounds_per_step`). Every rollout generated (the
    pilots of prompts that did not pass, re-pilots, commits) counts in ``rollout_alloc/step_rollouts`` and
    ``rollout_alloc/cumulative_rollouts``. Extra metrics: ``pilot_commit/pilot_rounds`` (pilot rounds this step),
    ``pilot_commit/short_groups``. Checkpoint kind ``pilot_commit_fixed`` (a budget-mode checkpoint is refused).

    Args:
        prompt_ids, config, seed, shuffle: as :class:`PilotCommitAllocator` (``config.fixed_train_batch`` true).
        num_prompts_per_step: K, groups trained a step. num_generations_per_prompt: group size n.

    Raises:
        ValueError: ``fixed_train_batch`` off, ``n_pilot + n_commit != num_generations_per_prompt``, K < 1, an empty
            pool.
    """

    kind = "pilot_commit_fixed"

    def __init__(
        self,
        prompt_ids: Iterable[int],
        config: PilotCommitConfig,
        *,
        num_prompts_per_step: int,
        num_generations_per_prompt: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if not config.fixed_train_batch:
            raise ValueError("FixedBatchPilotCommitAllocator needs grpo.pilot_commit.fixed_train_batch=true")
        if num_prompts_per_step < 1 or config.n_pilot + config.n_commit != num_generations_per_prompt:
            raise ValueError(
                f"fixed_train_batch: need grpo.num_prompts_per_step >= 1 (got {num_prompts_per_step}) and "
                f"grpo.pilot_commit.n_pilot + n_commit = {config.n_pilot} + {config.n_commit} equal to "
                f"grpo.num_generations_per_prompt = {num_generations_per_prompt}"
            )
        self._train_groups = num_prompts_per_step  # read by _budget during super().__init__
        super().__init__(prompt_ids, config, seed=seed, shuffle=shuffle)
        self.max_rounds_per_step = config.max_pilot_rounds + 1
        self._pilot_rounds = 0
        self._piloted_this_step: set[int] = set()

    def _budget(self, default_rollout_budget: int | None) -> tuple[int | None, int]:
        """No rollout budget; K = ``num_prompts_per_step`` commit slots."""
        return None, self._train_groups

    def plan(self) -> list[RolloutRequest]:
        """Another pilot round while prompts are missing (see the class docstring), else the commit round."""
        self._check_idle()
        t = self._step
        if self._wants_pilot():
            self._round_kind = "pilot"
            self._pilot_rounds += 1
            missing = self.commit_slots - len(self._pending)
            size = scaled_count(self.cfg.pilot_oversampling, missing, round_up=True)
            if self.cfg.repilot_within_step:
                return self._issue(self._pilot_requests(t, size))
            return self._issue(self._fresh_pilot_requests(t, min(size, self._unpiloted_this_step())))
        self._round_kind = "commit"
        return self._issue(self._commit_requests(t))

    def observe(self, results: list[RolloutResult]) -> TrainSelection | None:
        """Classify pilots (None: the next round is planned by :meth:`plan`); after the commit round, the step's
        selection."""
        commits = self._absorb(self._take(results))
        if self._round_kind == "pilot":
            return None
        selection = self._finish_step(self._commit_groups(commits))
        self._pilot_rounds = 0
        self._piloted_this_step = set()
        return selection

    def _unpiloted_this_step(self) -> int:
        """Prompts of the pool (evicted ones are out) not piloted this step."""
        return self.stream.pool_size - len(self._piloted_this_step - self.stream.evicted)

    def _fresh_pilot_requests(self, target_step: int, size: int) -> list[RolloutRequest]:
        """Pilot requests for up to ``size`` prompts not piloted this step (``repilot_within_step`` false): the
        stream's next prompts, skipping those already piloted this step, until ``size`` are found or a whole epoch's
        worth was drawn."""
        requests, drawn = [], 0
        while len(requests) < size and drawn < self.stream.pool_size + size:
            batch = self._pilot_requests(target_step, size - len(requests))
            drawn += len(batch)
            fresh = [r for r in batch if r.prompt_id not in self._piloted_this_step]
            self._piloted_this_step.update(r.prompt_id for r in fresh)
            requests += fresh
        return requests

    def _wants_pilot(self) -> bool:
        return (
            len(self._pending) < self.commit_slots
            and self._pilot_rounds < self.cfg.max_pilot_rounds
            and self.stream.pool_size > 0
            and (self.cfg.repilot_within_step or self._unpiloted_this_step() > 0)
        )

    def _mode_metrics(self, groups: list[TrainGroup]) -> dict[str, float]:
        return {
            "pilot_commit/pilot_rounds": float(self._pilot_rounds),
            "pilot_commit/short_groups": float(self.commit_slots - len(groups)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (a step in progress is never saved: no pilot round is pending)."""
        super().load_state_dict(state)
        self._pilot_rounds = 0
        self._piloted_this_step = set()
