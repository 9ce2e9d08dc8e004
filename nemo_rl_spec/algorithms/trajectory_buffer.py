"""Bounded, thread-safe buffer of generated trajectory batches for async GRPO, with an inclusive age bound.

Vocabulary (all versions are integers counted in optimizer steps, as in the sync loop):

- *policy version* ``v`` of a rollout: the weights the generation worker held when it sampled the rollout
  (``GenerationOutputSpec.policy_version``; version ``t`` = the initial weights after ``t`` updates).
- *current version* ``t``: the version the trainer holds when it takes a batch for training step ``t``.
- *age* of a prompt group: ``t - min(v over the group's rollouts)`` (a Pilot-Commit group may mix versions; the
  oldest rollout decides).
- *bound* ``max_trajectory_age_steps`` = ``A``. **The bound is inclusive**: a group with age ``<= A`` is trained on,
  a group with age ``> A`` is evicted and counted. ``A = 0`` would be the sync loop (every group on-policy).

Whole groups only: a batch holds whole prompt groups (each produced by one generation call, which the generation
actor runs between refits), so a refit never splits a group; eviction drops whole groups. Worked example:
:class:`TrajectoryBuffer`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from nemo_rl_spec.algorithms.interfaces import RolloutResult, TrainGroup, TrainSelection


def group_min_version(group: TrainGroup) -> int:
    """Oldest policy version among the rollouts of ``group``."""
    return min(r.policy_version for r in group.results)


def group_age(group: TrainGroup, current_version: int) -> int:
    """Age in steps of ``group`` for a trainer at ``current_version`` (``current_version - oldest version``)."""
    return current_version - group_min_version(group)


@dataclass
class TrajectoryBatch:
    """One generation batch: the train selection of one allocator step plus its provenance.

    Attributes:
        index: 0-based count of generation batches in the run (batch ``b`` normally trains at step ``b``).
        selection: the allocator's :class:`TrainSelection` (whole prompt groups; results carry ``policy_version``).
        draft_version: draft weights version the generation worker held (None: no draft / not tracked).
        allocator_state: the rollout allocator's ``state_dict()`` right after this batch was produced (what a
            checkpoint restores so generation resumes after the last buffered batch); None if not captured.
        generation_s: seconds the generation worker spent in this batch's generate calls.
        generated_tokens: response tokens sampled for this batch.
    """

    index: int
    selection: TrainSelection
    draft_version: int | None = None
    allocator_state: dict | None = None
    generation_s: float = 0.0
    generated_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def min_version(self) -> int | None:
        """Oldest policy version in the batch (None for a batch without groups)."""
        return min((group_min_version(g) for g in self.selection.groups), default=None)

    def to_state(self) -> dict[str, Any]:
        """Plain containers for ``torch.save`` (inverse: :meth:`from_state`); the allocator state is not included
        (the buffer keeps only the newest one)."""
        sel = self.selection
        return {
            "index": self.index,
            "draft_version": self.draft_version,
            "generation_s": self.generation_s,
            "generated_tokens": self.generated_tokens,
            "metrics": dict(self.metrics),
            "selection": {
                "step": sel.step,
                "metrics": dict(sel.metrics),
                "exhausted": sel.exhausted,
                "groups": [
                    {"prompt_id": g.prompt_id, "results": [r.to_state() for r in g.results]} for g in sel.groups
                ],
            },
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TrajectoryBatch:
        """Rebuild a batch written by :meth:`to_state`."""
        s = state["selection"]
        groups = [TrainGroup(g["prompt_id"], [RolloutResult.from_state(r) for r in g["results"]]) for g in s["groups"]]
        sel = TrainSelection(s["step"], groups, dict(s["metrics"]), s["exhausted"])
        return cls(
            state["index"],
            sel,
            state["draft_version"],
            None,
            state["generation_s"],
            state["generated_tokens"],
            dict(state["metrics"]),
        )


class BufferClosed(RuntimeError):
    """The producer failed; raised from :meth:`TrajectoryBuffer.get` with the producer's exception as cause."""


class TrajectoryBuffer:
    """FIFO of :class:`TrajectoryBatch` es between one producer (generation) thread and one consumer (trainer).

    Worked example (A = 1): groups generated at version 3 may train at steps 3 and 4; at step 5 (age 2) they are
    evicted: ``TrajectoryBuffer(1, capacity=2)``, ``put(batch of version 3)``, ``get(5)`` -> None (1 batch and its
    groups counted in ``evicted_batches`` / ``evicted_groups``), while ``get(4)`` would have returned it.

    Args:
        max_age: inclusive age bound ``A`` (steps, >= 0); groups older than ``A`` at :meth:`get` time are evicted.
        capacity: most batches held at once (>= 1); :meth:`put` blocks while full (back-pressure on generation).

    Raises:
        ValueError: ``max_age < 0`` or ``capacity < 1``.
    """

    def __init__(self, max_age: int, capacity: int) -> None:
        if max_age < 0 or capacity < 1:
            raise ValueError(f"need max_age >= 0 and capacity >= 1, got max_age={max_age}, capacity={capacity}")
        self.max_age, self.capacity = int(max_age), int(capacity)
        self._cond = threading.Condition()
        self._batches: list[TrajectoryBatch] = []
        self._closed = False
        self._error: BaseException | None = None
        self.evicted_groups = 0
        self.evicted_batches = 0
        self.next_index = 0
        self.last_allocator_state: dict | None = None

    def __len__(self) -> int:
        with self._cond:
            return len(self._batches)

    def put(self, batch: TrajectoryBatch, timeout: float | None = None) -> bool:
        """Append ``batch`` (blocking while the buffer is full). Records its allocator state and index.

        Returns:
            True when stored; False when the buffer was closed (or ``timeout`` seconds passed) first.
        Raises:
            ValueError: ``batch.index`` is not the next expected index (batches must arrive in order).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if batch.index != self.next_index:
                raise ValueError(f"batch index {batch.index} out of order (expected {self.next_index})")
            while len(self._batches) >= self.capacity and not self._closed:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            if self._closed:
                return False
            self._batches.append(batch)
            self.next_index = batch.index + 1
            if batch.allocator_state is not None:
                self.last_allocator_state = batch.allocator_state
            self._cond.notify_all()
            return True

    def get(self, current_version: int, timeout: float | None = None) -> TrajectoryBatch | None:
        """Oldest batch whose groups are within the bound, after evicting groups with age > ``max_age``.

        A batch with some stale groups is returned with only its fresh groups; a batch whose groups are all stale
        is dropped (``evicted_batches``); a batch with no groups at all (an allocator step that trained nothing,
        or the exhausted marker) is returned as is.

        Returns:
            the batch, or None on timeout or when the buffer is closed and empty.
        Raises:
            BufferClosed: the producer closed the buffer with an error (chained as ``__cause__``).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._error is not None:
                    raise BufferClosed(f"trajectory producer failed: {self._error!r}") from self._error
                while self._batches:
                    batch = self._batches.pop(0)
                    self._cond.notify_all()
                    kept = self._evict(batch, current_version)
                    if kept is not None:
                        return kept
                if self._closed:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)

    def _evict(self, batch: TrajectoryBatch, current_version: int) -> TrajectoryBatch | None:
        groups = batch.selection.groups
        if not groups:
            return batch
        fresh = [g for g in groups if group_age(g, current_version) <= self.max_age]
        self.evicted_groups += len(groups) - len(fresh)
        if not fresh:
            self.evicted_batches += 1
            return None
        if len(fresh) < len(groups):
            sel = batch.selection
            batch.selection = TrainSelection(sel.step, fresh, sel.metrics, sel.exhausted)
        return batch

    def close(self, error: BaseException | None = None) -> None:
        """Wake every waiter; later ``put`` returns False; ``get`` drains what is left, then returns None (or raises
        :class:`BufferClosed` at once when ``error`` is given)."""
        with self._cond:
            self._closed = True
            if error is not None and self._error is None:
                self._error = error
            self._cond.notify_all()

    def state_dict(self) -> dict[str, Any]:
        """Buffered batches, counters, next batch index and the newest allocator state, taken atomically."""
        with self._cond:
            return {
                "max_age": self.max_age,
                "batches": [b.to_state() for b in self._batches],
                "evicted_groups": self.evicted_groups,
                "evicted_batches": self.evicted_batches,
                "next_index": self.next_index,
                "allocator_state": self.last_allocator_state,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output. The age bound and capacity stay this buffer's own, so a resume may
        change them: restored batches older than the new bound are evicted at the next :meth:`get`, and more
        batches than ``capacity`` only make :meth:`put` wait until the trainer has drained them."""
        batches = [TrajectoryBatch.from_state(b) for b in state["batches"]]
        with self._cond:
            self._batches = batches
            self.evicted_groups, self.evicted_batches = int(state["evicted_groups"]), int(state["evicted_batches"])
            self.next_index = int(state["next_index"])
            self.last_allocator_state = state.get("allocator_state")
