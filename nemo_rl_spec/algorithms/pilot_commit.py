"""Pilot-Commit rollout allocation (docs/design/methods.md section 2): spend GRPO rollouts where the learning signal is.

For a 0/1 reward with success rate p the GRPO group signal is the reward variance p(1 - p): a group whose rollouts
all agree (probability p^n + (1-p)^n for n rollouts) has zero advantage and no gradient. Pilot-Commit therefore
spends a small pilot on many prompts, estimates each prompt's success rate, and commits the rest of the step's
budget only to prompts whose estimate lies between the thresholds.

One step (:class:`PilotCommitAllocator`): ``n_pilot`` rollouts on each of the next P prompts give ``p_hat``; too hard
(``p_hat < p_lower``) is deferred to the next epoch, too easy is not committed, solved in every pilot too often in a
row is evicted; the first K selected prompts get ``n_commit`` more rollouts (the surplus goes to a replay buffer, a
shortfall is filled from it) and train on their pilot + commit rollouts. With ``bind_pilot_to_commit`` a step's
generation call also carries the next step's pilot (lag 1, importance-corrected). ``all_too_hard_fallback`` decides
a step where nothing can be committed; :class:`~.pilot_commit_fixed.FixedBatchPilotCommitAllocator` trains exactly
``grpo.num_prompts_per_step`` groups a step. Metrics: ``pilot_commit/*`` and ``rollout_alloc/*``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable

from nemo_rl_spec.algorithms.interfaces import RolloutRequest, RolloutResult, Stage, TrainGroup, TrainSelection
from nemo_rl_spec.algorithms.rollout_allocation import AllocatorBase
from nemo_rl_spec.utils.feature_configs import PilotCommitConfig

logger = logging.getLogger(__name__)


@dataclass
class PilotEntry:
    """A piloted prompt waiting for its commit (pending, or in the replay buffer).

    Attributes:
        prompt_id: the prompt. target_step: the step its pilot was generated for (buffer age = step - target_step).
        p_hat: mean pilot reward (estimated success rate). results: its pilot results.
    """

    prompt_id: int
    target_step: int
    p_hat: float
    results: list[RolloutResult]

    def to_state(self) -> dict[str, Any]:
        """Plain-container form for checkpoints."""
        return {
            "prompt_id": self.prompt_id,
            "target_step": self.target_step,
            "p_hat": self.p_hat,
            "results": [r.to_state() for r in self.results],
        }

    @classmethod
    def from_state(cls, s: dict[str, Any]) -> "PilotEntry":
        """Inverse of :meth:`to_state`."""
        return cls(s["prompt_id"], s["target_step"], s["p_hat"], [RolloutResult.from_state(r) for r in s["results"]])


def pilot_std(p_hat: float) -> float:
    """Bernoulli standard deviation sqrt(p_hat (1 - p_hat)) of a pilot's estimated success rate, the replay
    buffer's priority with ``buffer_order: pilot_std`` (0 for p_hat in {0, 1}, largest, 0.5, at p_hat = 0.5)."""
    return math.sqrt(max(p_hat * (1.0 - p_hat), 0.0))


_STEP_COUNTERS = (
    "pilot_rollouts",
    "commit_rollouts",
    "piloted",
    "selected",
    "deferred",
    "too_easy",
    "evicted",
    "committed",
    "from_buffer",
    "fallback_used",
    "buffer_expired",
    "buffer_dropped",
)
_TOTALS = ("pilot_rollouts", "commit_rollouts", "evicted", "deferred", "fallback")


class PilotCommitAllocator(AllocatorBase):
    """Pilot-Commit allocator.

    One step ``t`` (P = ``pilot_batch_size``, K = commit slots, see :class:`PilotCommitConfig`):

    1. Pilot: ``n_pilot`` rollouts for each of the next P prompts of the epoch; ``p_hat`` = mean pilot reward (float64).
    2. Filter (the paper's asymmetric thresholds, both edges inclusive): ``p_hat < p_lower`` -> too hard: *deferred*
       (not committed this epoch, stays in the pool, the next epoch pilots it again); ``p_hat > p_upper`` -> too easy:
       not committed; ``p_lower <= p_hat <= p_upper`` -> *selected*. A prompt whose pilot is all-solved (every reward
       1) for ``evict_after_consecutive_solved`` pilots in a row (across epochs) is *evicted* from the pool for good;
       eviction is checked first.
    3. Commit: the first K selected prompts (pilot order) get ``n_commit`` more rollouts; selected prompts beyond K go
       to the replay buffer; if fewer than K were selected the batch is filled from the buffer (``buffer_order``:
       oldest first, or highest pilot std :func:`pilot_std` first; entries older than ``max_off_steps`` steps are
       expired first). If still fewer than K and ``fill_commit_budget`` is on, the K * n_commit commit rollouts are
       spread over the committed prompts (:meth:`commit_sizes`).
    4. Train batch: for each committed prompt, its pilot rollouts followed by its commit rollouts (group size
       ``n_pilot + n_commit``, or larger with ``fill_commit_budget``).

    Binding (``bind_pilot_to_commit``): the generation call of step t carries the commits of step t *and* the pilot
    of step t+1, so a step costs one generation call; the pilot rollouts a step trains on were generated by the
    previous policy version (lag 1, plus the buffer age for buffered prompts). Results carry ``policy_version``; the
    loss must importance-correct them with their generation log-probs. The first step (cold start) runs an extra
    pilot-only round, so it spends one pilot more than the per-step budget.

    Fallback when nothing can be committed: if no prompt was selected, the buffer is empty and the pilot found
    too-hard prompts, ``all_too_hard_fallback`` decides: ``commit_top`` commits the K too-hard prompts with the
    highest ``p_hat`` (ties: pilot order) anyway, so the step still trains and explores them with n_pilot + n_commit
    samples; ``skip`` trains on nothing this step (the policy is unchanged; the pilot of the next step still runs).
    Either way a warning is logged and ``pilot_commit/fallback_used`` = 1. A step never takes more than two
    generation rounds, so "everything too hard" cannot loop: deferred prompts come back next epoch. Every prompt
    evicted: the epoch ends, the next batch is empty and the step returns ``exhausted=True`` with no groups.

    Metrics (``pilot_commit/``): pilot_rollouts, commit_rollouts (this step), cumulative_pilot_rollouts,
    cumulative_commit_rollouts; for the pilots observed in this step's generation: piloted, selected, deferred,
    too_easy, evicted; committed, from_buffer, fallback_used; totals evicted_total, deferred_total, fallback_total,
    deferred_in_epoch; pool_size, buffer_size, buffer_mean_age (steps, relative to this step), buffer_expired,
    buffer_dropped (overflow of max_buffer_size). The ``rollout_alloc/*`` metrics are listed in
    :class:`~nemo_rl_spec.algorithms.rollout_allocation.AllocatorBase`.

    Args:
        prompt_ids: the prompt pool (dataset indices).
        config: :class:`PilotCommitConfig`.
        seed: epoch-permutation and request-seed base. shuffle: False walks the pool in id order (tests).
        default_rollout_budget: used when ``config.rollout_budget_per_step`` is None.

    Raises:
        ValueError: no budget given, a budget without a commit slot, an empty pool; ``observe`` raises it for
            rewards outside [0, 1].
    """

    kind = "pilot_commit"
    max_rounds_per_step = 2

    def __init__(
        self,
        prompt_ids: Iterable[int],
        config: PilotCommitConfig,
        *,
        seed: int = 0,
        shuffle: bool = True,
        default_rollout_budget: int | None = None,
    ) -> None:
        super().__init__(prompt_ids, seed, shuffle)
        self.cfg = config
        self.rollout_budget, self.commit_slots = self._budget(default_rollout_budget)
        self._consecutive_solved: dict[int, int] = {}
        self._deferred: set[int] = set()  # too hard in the current epoch
        self._deferred_epoch = self.stream.epoch
        self._pending: list[PilotEntry] = []  # selected by the pilot of step _pilot_target
        self._pending_hard: list[PilotEntry] = []  # too hard in that pilot (fallback candidates)
        self._pilot_target: int | None = None
        self._buffer: list[PilotEntry] = []  # oldest first
        self._commit_entries: list[PilotEntry] = []
        self._round_kind = ""
        self._totals = {k: 0 for k in _TOTALS}
        self._counts = {k: 0 for k in _STEP_COUNTERS}

    def _budget(self, default_rollout_budget: int | None) -> tuple[int | None, int]:
        """(rollout budget per step, K commit slots) of this mode."""
        budget = self.cfg.rollout_budget_per_step or default_rollout_budget
        if budget is None:
            raise ValueError("Pilot-Commit needs grpo.pilot_commit.rollout_budget_per_step or a default budget")
        return budget, self.cfg.commit_slots(budget)

    # ------------------------------------------------------------------ protocol
    def plan(self) -> list[RolloutRequest]:
        """Pilot-only round if no pilot for this step was observed yet (cold start, or binding off); otherwise the
        commit round: commits of this step, plus the pilot of the next step when binding is on."""
        self._check_idle()
        t = self._step
        if self._pilot_target != t:
            self._round_kind = "pilot"
            return self._issue(self._pilot_requests(t))
        self._round_kind = "commit"
        requests = self._commit_requests(t)
        if self.cfg.bind_pilot_to_commit:
            requests += self._pilot_requests(t + 1)
        return self._issue(requests)

    def observe(self, results: list[RolloutResult]) -> TrainSelection | None:
        """Classify pilot results (select / defer / too easy / evict); after the commit round, return the step's
        selection (pilot + commit rollouts of each committed prompt)."""
        commits = self._absorb(self._take(results))
        if self._round_kind == "pilot":
            if self.stream.pool_size == 0:
                return self._finish_step([])
            return None
        return self._finish_step(self._commit_groups(commits))

    def commit_sizes(self, n_committed: int) -> list[int]:
        """Commit rollouts for each of ``n_committed`` prompts, in commit order.

        ``n_commit`` each; with ``fill_commit_budget`` and fewer than K prompts (K = ``commit_slots``), the commit
        budget K * n_commit split as evenly as possible, the first ``K * n_commit % n_committed`` prompts getting
        one more (e.g. K = 5, n_commit = 6, 2 prompts -> [15, 15]; 4 prompts -> [8, 8, 7, 7]). The fallback may
        commit up to K prompts, never more, so the sum never exceeds the budget.
        """
        k, n = self.commit_slots, self.cfg.n_commit
        if not self.cfg.fill_commit_budget or n_committed == 0 or n_committed >= k:
            return [n] * n_committed
        base, extra = divmod(k * n, n_committed)
        return [base + (1 if i < extra else 0) for i in range(n_committed)]

    # ------------------------------------------------------------------ internals
    def _absorb(self, ordered: list[RolloutResult]) -> dict[int, RolloutResult]:
        """Count every result's rollouts and classify the pilots; returns the commit results by prompt id."""
        commits: dict[int, RolloutResult] = {}
        for res in ordered:
            n = res.rewards.numel()
            if res.stage == Stage.PILOT:
                self._counts["pilot_rollouts"] += n
                self._classify(res)
            else:
                self._counts["commit_rollouts"] += n
                commits[res.prompt_id] = res
        return commits

    def _commit_requests(self, t: int) -> list[RolloutRequest]:
        """Choose step ``t``'s commits (:meth:`_choose_commits`) and request their rollouts (:meth:`commit_sizes`)."""
        self._commit_entries = self._choose_commits(t)
        sizes = self.commit_sizes(len(self._commit_entries))
        return [self._request(e.prompt_id, n, Stage.COMMIT, t) for e, n in zip(self._commit_entries, sizes)]

    def _commit_groups(self, commits: dict[int, RolloutResult]) -> list[TrainGroup]:
        """The train groups of this step's committed prompts: pilot results, then the commit result."""
        groups = [TrainGroup(e.prompt_id, e.results + [commits[e.prompt_id]]) for e in self._commit_entries]
        self._commit_entries = []
        return groups

    def _validate(self, result: RolloutResult) -> None:
        if bool((result.rewards < 0).any() or (result.rewards > 1).any()):
            raise ValueError(
                f"Pilot-Commit needs rewards in [0, 1] (success), prompt {result.prompt_id} "
                f"({result.stage.value}) has {result.rewards.tolist()}"
            )

    def _pilot_requests(self, target_step: int, size: int | None = None) -> list[RolloutRequest]:
        """Pilot requests for the next ``size`` prompts of the epoch (default ``pilot_batch_size``)."""
        batch = self.stream.next_batch(self.cfg.pilot_batch_size if size is None else size)
        if self.stream.epoch != self._deferred_epoch:  # deferred prompts are back in the new epoch
            self._deferred, self._deferred_epoch = set(), self.stream.epoch
        self._pilot_target = target_step
        return [self._request(pid, self.cfg.n_pilot, Stage.PILOT, target_step) for pid in batch]

    def _classify(self, res: RolloutResult) -> None:
        pid, rewards = res.prompt_id, res.rewards
        p_hat = float(rewards.double().mean())  # float64: k / n_pilot equals the threshold written as that fraction
        self._counts["piloted"] += 1
        self._drop_entries_of(pid)  # a fresh pilot supersedes a buffered one (or an earlier one of this step)
        if bool((rewards == 1.0).all()):
            self._consecutive_solved[pid] = self._consecutive_solved.get(pid, 0) + 1
        else:
            self._consecutive_solved.pop(pid, None)
        if self._consecutive_solved.get(pid, 0) >= self.cfg.evict_after_consecutive_solved:
            self.stream.evict(pid)
            self._consecutive_solved.pop(pid, None)
            self._counts["evicted"] += 1
            self._totals["evicted"] += 1
            return
        entry = PilotEntry(pid, self._pilot_target, p_hat, [res])
        if p_hat < self.cfg.p_lower:
            self._deferred.add(pid)
            self._pending_hard.append(entry)
            self._counts["deferred"] += 1
            self._totals["deferred"] += 1
        elif p_hat > self.cfg.p_upper:
            self._counts["too_easy"] += 1
        else:
            self._pending.append(entry)
            self._counts["selected"] += 1

    def _drop_entries_of(self, prompt_id: int) -> None:
        """Remove ``prompt_id`` from the replay buffer and from this step's pending pilots."""
        self._buffer = [e for e in self._buffer if e.prompt_id != prompt_id]
        self._pending = [e for e in self._pending if e.prompt_id != prompt_id]
        self._pending_hard = [e for e in self._pending_hard if e.prompt_id != prompt_id]

    def _rank_buffer(self, entries: list[PilotEntry]) -> list[PilotEntry]:
        """``entries`` in commit-priority order (``buffer_order``): ``oldest`` keeps insertion order (oldest pilot
        first); ``pilot_std`` sorts by :func:`pilot_std` descending, ties: the more recent pilot (larger target_step)
        first, then insertion order (the sort is stable)."""
        if self.cfg.buffer_order == "oldest":
            return list(entries)
        return sorted(entries, key=lambda e: (-pilot_std(e.p_hat), -e.target_step))

    def _drop_overflow(self) -> None:
        """Keep at most ``max_buffer_size`` entries: ``oldest`` drops the oldest, ``pilot_std`` the lowest std."""
        overflow = max(0, len(self._buffer) - self.cfg.max_buffer_size)
        if self.cfg.buffer_order == "oldest":
            self._buffer = self._buffer[overflow:]
        else:
            self._buffer = self._rank_buffer(self._buffer)[: len(self._buffer) - overflow]
        self._counts["buffer_dropped"] += overflow

    def _choose_commits(self, t: int) -> list[PilotEntry]:
        k = self.commit_slots
        chosen, surplus = self._pending[:k], self._pending[k:]
        live = [e for e in self._buffer if t - e.target_step <= self.cfg.max_off_steps]
        self._counts["buffer_expired"] += len(self._buffer) - len(live)
        ids = {e.prompt_id for e in chosen}
        taken = []
        for e in self._rank_buffer(live):
            if len(chosen) + len(taken) >= k:
                break
            if e.prompt_id not in ids:
                taken.append(e)
                ids.add(e.prompt_id)
        self._buffer = [e for e in live if all(e is not x for x in taken)] + surplus
        self._drop_overflow()
        self._counts["from_buffer"] += len(taken)
        chosen = chosen + taken
        if not chosen and self._pending_hard:
            chosen = self._fallback(t, k)
        self._pending, self._pending_hard = [], []
        self._counts["committed"] += len(chosen)
        return chosen

    def _fallback(self, t: int, k: int) -> list[PilotEntry]:
        self._counts["fallback_used"] = 1
        self._totals["fallback"] += 1
        hard = self._pending_hard
        if self.cfg.all_too_hard_fallback == "skip":
            logger.warning(
                "Pilot-Commit step %d: no prompt selected, replay buffer empty, %d piloted prompts too "
                "hard (p_hat < p_lower=%g); fallback 'skip': no training this step",
                t,
                len(hard),
                self.cfg.p_lower,
            )
            return []
        top = sorted(hard, key=lambda e: -e.p_hat)[:k]  # stable: ties keep pilot order
        logger.warning(
            "Pilot-Commit step %d: no prompt selected, replay buffer empty, %d piloted prompts too hard "
            "(p_hat < p_lower=%g); fallback 'commit_top': committing prompts %s",
            t,
            len(hard),
            self.cfg.p_lower,
            [e.prompt_id for e in top],
        )
        return top

    def _finish_step(self, groups: list[TrainGroup]) -> TrainSelection:
        t = self._step
        self._totals["pilot_rollouts"] += self._counts["pilot_rollouts"]
        self._totals["commit_rollouts"] += self._counts["commit_rollouts"]
        ages = [t - e.target_step for e in self._buffer]
        extra = {f"pilot_commit/{k}": float(v) for k, v in self._counts.items()}
        extra.update(
            {
                "pilot_commit/cumulative_pilot_rollouts": float(self._totals["pilot_rollouts"]),
                "pilot_commit/cumulative_commit_rollouts": float(self._totals["commit_rollouts"]),
                "pilot_commit/evicted_total": float(self._totals["evicted"]),
                "pilot_commit/deferred_total": float(self._totals["deferred"]),
                "pilot_commit/fallback_total": float(self._totals["fallback"]),
                "pilot_commit/deferred_in_epoch": float(len(self._deferred)),
                "pilot_commit/pool_size": float(self.stream.pool_size),
                "pilot_commit/buffer_size": float(len(self._buffer)),
                "pilot_commit/buffer_mean_age": sum(ages) / len(ages) if ages else 0.0,
                **self._mode_metrics(groups),
            }
        )
        self._counts = {k: 0 for k in _STEP_COUNTERS}
        return self._finish(groups, extra, exhausted=self.stream.pool_size == 0)

    def _mode_metrics(self, groups: list[TrainGroup]) -> dict[str, float]:
        """Metrics only one mode reports (none in the budget mode)."""
        return {}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Pool and epoch position, evictions, consecutive-solved counts, deferrals, pending pilot results, replay
        buffer (with their payloads), counters."""
        state = self._base_state()
        state.update(
            {
                "consecutive_solved": dict(self._consecutive_solved),
                "deferred": sorted(self._deferred),
                "deferred_epoch": self._deferred_epoch,
                "pending": [e.to_state() for e in self._pending],
                "pending_hard": [e.to_state() for e in self._pending_hard],
                "pilot_target": self._pilot_target,
                "buffer": [e.to_state() for e in self._buffer],
                "totals": dict(self._totals),
            }
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (exact: later requests, seeds and selections are identical)."""
        self._load_base_state(state)
        self._consecutive_solved = {int(k): int(v) for k, v in state["consecutive_solved"].items()}
        self._deferred, self._deferred_epoch = set(state["deferred"]), int(state["deferred_epoch"])
        self._pending = [PilotEntry.from_state(s) for s in state["pending"]]
        self._pending_hard = [PilotEntry.from_state(s) for s in state["pending_hard"]]
        self._pilot_target = state["pilot_target"]
        self._buffer = [PilotEntry.from_state(s) for s in state["buffer"]]
        self._totals = dict(state["totals"])
        self._counts = {k: 0 for k in _STEP_COUNTERS}
        self._commit_entries, self._round_kind = [], ""
