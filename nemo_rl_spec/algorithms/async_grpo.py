"""Asynchronous GRPO with bounded policy lag (``grpo.async_grpo``): generation overlaps training.

Two threads in the driver, two Ray actors: the *producer* thread (:class:`TrajectoryProducer`) runs the rollout
allocator (uniform GRPO, DAPO or Pilot-Commit, unchanged) on the vLLM actor and puts each step's selection into a
bounded :class:`TrajectoryBuffer`, every rollout tagged with the policy version that sampled it; the *trainer*
(:func:`async_grpo_train`, main thread) takes the next batch whose groups are within the age bound, trains on it
with :func:`grpo.train_on_selection` (truncated importance sampling against the behaviour log-probs) and refits.

Batch ``b`` may start generating only once the vLLM actor holds a version ``v >= b - A`` (``A`` =
``max_trajectory_age_steps``, inclusive), so nothing is evicted in a normal run; the buffer still evicts (and
counts) any older group, so the bound is enforced where data is consumed. ``A = 1`` is the one-step-off-policy
pipeline. Refits happen between generate calls (:class:`GenerationGate`), so a refit never splits a prompt group;
``in_flight_weight_updates`` is refused by ``check_runtime_support``. Metrics and checkpoint contents:
:func:`async_grpo_train`.
"""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm

from nemo_rl_spec.algorithms.grpo import end_step, epochs_finished, train_on_selection, validate_at_start
from nemo_rl_spec.algorithms.grpo_setup import GRPOSetup, save_checkpoint
from nemo_rl_spec.algorithms.rollouts import RolloutGenerator
from nemo_rl_spec.algorithms.trajectory_buffer import (
    TrajectoryBatch,
    TrajectoryBuffer,
    group_age,
)
from nemo_rl_spec.algorithms.validation import run_validation
from nemo_rl_spec.speculative.metrics import SpeculationMonitor
from nemo_rl_spec.utils.timer import Timer

_POLL_S = 0.5


def overlap_seconds(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    """Total length (seconds) of the parts of ``[start, end]`` covered by ``intervals`` (non-overlapping
    ``(begin, finish)`` pairs on the same clock). Example: ``overlap_seconds(0, 10, [(-1, 2), (5, 6), (9, 12)])`` = 4.
    """
    return sum(max(0.0, min(end, f) - max(start, b)) for b, f in intervals)


class GenerationGate:
    """Serialises use of the generation actor between the producer's generate calls and the trainer's exclusive
    sections (refit + probe, validation). The trainer has priority: once it asks, no new generate call starts.

    It also records when generate calls ran (``perf_counter`` seconds) for :meth:`generation_overlap`.
    """

    def __init__(self, history: int = 256) -> None:
        self._cond = threading.Condition()
        self._busy = False
        self._exclusive_waiting = 0
        self._closed = False
        self._calls: deque[tuple[float, float]] = deque(maxlen=history)
        self._call_start: float | None = None

    @contextmanager
    def generation(self) -> Iterator[None]:
        """Hold the actor for one generate call (blocks while the trainer holds or waits for it).

        Raises:
            RuntimeError: the gate was closed (shutdown).
        """
        with self._cond:
            while (self._busy or self._exclusive_waiting) and not self._closed:
                self._cond.wait()
            if self._closed:
                raise RuntimeError("generation gate closed")
            self._busy, self._call_start = True, time.perf_counter()
        try:
            yield
        finally:
            with self._cond:
                self._calls.append((self._call_start, time.perf_counter()))
                self._busy, self._call_start = False, None
                self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[list[float]]:
        """Hold the actor for the trainer; yields ``[waited_s]``: seconds spent waiting for a call in flight."""
        start = time.perf_counter()
        with self._cond:
            self._exclusive_waiting += 1
            try:
                while self._busy:
                    self._cond.wait()
            finally:
                self._exclusive_waiting -= 1
            self._busy = True
        waited = [time.perf_counter() - start]
        try:
            yield waited
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def generation_overlap(self, start: float, end: float) -> float:
        """Seconds of ``[start, end]`` during which a generate call was running (including one still running)."""
        with self._cond:
            calls = list(self._calls)
            if self._call_start is not None:
                calls.append((self._call_start, end))
        return overlap_seconds(start, end, calls)

    def close(self) -> None:
        """Wake and refuse every waiting or later generate call."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def make_async_generator(s: GRPOSetup, gate: GenerationGate) -> RolloutGenerator:
    """The run's :class:`RolloutGenerator` for the producer thread: every generate call under ``gate``, each result
    tagged with the policy and draft versions the engines reported for the call that sampled it (a refit may land
    between calls); its ``stats`` carry the calls' seconds, tokens and speculative counts (returned by generate
    itself: querying the actor would queue behind the next generate call)."""
    return s.rollout_generator(version=None, gate=gate.generation, tag_draft_version=True)


def carried_lag(cfg) -> int:
    """Steps by which a batch's oldest rollouts predate the batch itself: 1 with Pilot-Commit's
    ``bind_pilot_to_commit`` (a group's pilot comes from the previous batch), else 0."""
    pc = cfg.grpo.pilot_commit
    return int(pc is not None and pc.enabled and pc.bind_pilot_to_commit)


class TrajectoryProducer(threading.Thread):
    """Generation thread: one allocator step per batch, throttled so that batch ``b`` starts only when the
    generation actor holds a version ``>= b - (max_age - carried_lag)``, and never past ``last_index``.

    Args:
        s: the run (its allocator is used by this thread only, from :meth:`start` until :meth:`stop`).
        buffer: where batches go (its ``next_index`` is the first batch to produce).
        gate: shared with the trainer.
        version: policy version the generation actor holds at start.
        last_index: produce batches ``< last_index`` (``grpo.max_num_steps``), and none after the prompt stream
            has handed out ``max_num_epochs`` epochs.
        carried_lag: see :func:`carried_lag`; the producer's lead shrinks by it so that carried pilot rollouts
            still meet the bound (with ``max_age = 1`` and bound pilots, generation no longer runs ahead).
        max_num_epochs: ``grpo.max_num_epochs`` (None: no epoch limit).
    """

    def __init__(
        self,
        s: GRPOSetup,
        buffer: TrajectoryBuffer,
        gate: GenerationGate,
        version: int,
        last_index: int,
        carried_lag: int = 0,
        max_num_epochs: int | None = None,
    ) -> None:
        super().__init__(name="trajectory-producer", daemon=True)
        self.s, self.buffer, self.gate = s, buffer, gate
        self.max_age, self.last_index = max(0, buffer.max_age - carried_lag), last_index
        self.max_num_epochs = max_num_epochs
        self._cond = threading.Condition()
        self._version = version
        self._stop_requested = False
        self.error: BaseException | None = None

    def set_version(self, version: int) -> None:
        """The generation actor now holds ``version`` (called by the trainer after a refit)."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def stop(self, timeout: float = 60.0) -> None:
        """Ask the thread to finish, unblock it, and join (a generate call in flight is waited for up to
        ``timeout`` seconds; teardown kills the actor if it is still running)."""
        with self._cond:
            self._stop_requested = True
            self._cond.notify_all()
        self.buffer.close()
        self.gate.close()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    def _wait_turn(self, index: int) -> bool:
        with self._cond:
            while not self._stop_requested and index > self._version + self.max_age:
                self._cond.wait()
            return not self._stop_requested

    def run(self) -> None:
        try:
            index = self.buffer.next_index
            epochs_done = lambda: epochs_finished(self.max_num_epochs, self.s.allocator.epochs_completed())  # noqa: E731
            while index < self.last_index and not epochs_done() and self._wait_turn(index):
                generate = make_async_generator(self.s, self.gate)
                selection = self.s.allocator.step(generate)
                stats = generate.stats
                batch = TrajectoryBatch(
                    index,
                    selection,
                    stats.draft_version,
                    copy.deepcopy(self.s.allocator.state_dict()),
                    stats.generation_s,
                    stats.generated_tokens,
                    SpeculationMonitor.counts_to_metrics(stats.spec_counters),
                )
                if not self.buffer.put(batch):
                    return
                index += 1
                if selection.exhausted:
                    break
            self.buffer.close()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer thread, which re-raises
            self.error = exc
            self.buffer.close(error=None if self._stop_requested else exc)


def _take_batch(buffer: TrajectoryBuffer, producer: TrajectoryProducer, version: int) -> TrajectoryBatch | None:
    """Block until an eligible batch arrives; None when the producer has finished and the buffer is empty."""
    while True:
        batch = buffer.get(version, timeout=_POLL_S)
        if batch is not None:
            return batch
        if not producer.is_alive() and len(buffer) == 0:
            return buffer.get(version, timeout=0)  # raises the producer's error if it failed


def _async_metrics(batch: TrajectoryBatch, buffer: TrajectoryBuffer, step: int) -> dict[str, float]:
    ages = [group_age(g, step) for g in batch.selection.groups]
    out = {
        "async/trajectory_age_max": float(max(ages, default=0)),
        "async/trajectory_age_mean": sum(ages) / len(ages) if ages else 0.0,
        "async/evicted_groups_total": float(buffer.evicted_groups),
        "async/evicted_batches_total": float(buffer.evicted_batches),
        "async/buffer_batches": float(len(buffer)),
        "async/batch_index": float(batch.index),
        "async/batch_generation_s": batch.generation_s,
        "async/batch_generated_tokens": float(batch.generated_tokens),
    }
    if batch.min_version() is not None:
        out["async/batch_policy_version"] = float(batch.min_version())
    if batch.draft_version is not None:
        out["async/batch_draft_version"] = float(batch.draft_version)
    return out


def _spec_metrics(s: GRPOSetup, batch: TrajectoryBatch) -> dict[str, float]:
    """``vllm/spec_*`` acceptance of the generate calls that produced ``batch`` (recorded by the producer from
    the calls' own counts) and the low-acceptance alarm's verdict on them; empty without speculation."""
    return {} if s.spec is None else s.spec.step_metrics(batch.metrics)


def async_train_step(
    s: GRPOSetup, step: int, buffer: TrajectoryBuffer, producer: TrajectoryProducer, gate: GenerationGate, timer: Timer
) -> tuple[dict[str, float], bool] | None:
    """One trainer step at version ``step``: wait for a batch, train, refit to ``step + 1``.

    Returns (metrics, exhausted), or None when the producer has nothing more to give.
    Raises:
        BufferClosed: the producer thread failed (its exception is the cause).
    """
    wait_start = time.perf_counter()
    batch = _take_batch(buffer, producer, step)
    wait_end = time.perf_counter()
    if batch is None:
        return None
    selection = batch.selection
    metrics = {
        "train/reward": float(selection.rewards.mean()) if selection.groups else float("nan"),
        **selection.metrics,
        **_async_metrics(batch, buffer, step),
        **_spec_metrics(s, batch),
        "timing/train/idle/buffer_starvation": wait_end - wait_start,
        "timing/train/exposed_generation": gate.generation_overlap(wait_start, wait_end),
    }
    if selection.groups:
        metrics.update(train_on_selection(s, selection, timer, step))
    with gate.exclusive() as waited:
        metrics["timing/train/idle/refit_bubble"] = waited[0]
        metrics["timing/train/exposed_generation"] += waited[0]  # the trainer waited on a running generate call
        with timer.time("weight_sync"):
            metrics.update(s.refitter.refit(version=step + 1))
        if s.spec is not None:
            s.spec.notify_refit()
    producer.set_version(step + 1)
    return metrics, selection.exhausted


def _checkpoint(s: GRPOSetup, buffer: TrajectoryBuffer, step: int, metrics: dict[str, float]) -> None:
    state = buffer.state_dict()
    allocator_state = state.pop("allocator_state")
    extra = {"async_grpo": {**state, "policy_version": step}}
    if allocator_state is not None:
        extra["allocator"] = allocator_state
    save_checkpoint(s, step, metrics, extra_state=extra)


def async_grpo_train(s: GRPOSetup) -> list[dict[str, float]]:
    """Run async GRPO steps ``start_step .. max_num_steps - 1``; returns every step's metrics.

    The producer thread is always stopped on return or on any exception (Ctrl-C included); the caller's
    ``grpo_setup.teardown`` then kills the actors.

    Per-step metrics (seconds): ``timing/train/idle/buffer_starvation`` (trainer waiting for an eligible batch),
    ``timing/train/idle/refit_bubble`` (refit waiting for the generate call in flight),
    ``timing/train/exposed_generation`` (generation on the critical path: the part of the buffer wait during which a
    generate call was running, plus the refit bubble), ``timing/train/weight_sync``,
    ``timing/train/policy_and_reference_logprobs``, ``timing/train/policy_training``,
    ``timing/train/total_step_time``; ``async/*``: trajectory ages, evictions, buffer depth, batch versions,
    ``async/batch_generation_s`` and ``async/batch_generated_tokens`` of the trained batch.

    Checkpoints: the buffer (batches with their tokens and behaviour log-probs), its counters, the next batch index
    and the allocator state *as of the last buffered batch* go into ``train_state.pt`` through ``save_checkpoint``'s
    ``extra_state``; a resumed run continues generation right after the last buffered batch (the batch that was in
    flight is generated again with the same request seeds) and trains the buffered batches first.

    Raises:
        BufferClosed: the generation thread failed.
        RefitMismatchError: see :class:`refit.WeightRefitter`.
    """
    cfg, timer, history = s.cfg, Timer(), []
    acfg = cfg.grpo.async_grpo
    buffer = TrajectoryBuffer(acfg.max_trajectory_age_steps, capacity=acfg.max_trajectory_age_steps + 1)
    start = s.state.start_step
    saved = s.state.resumed.get("async_grpo")
    if saved is not None:
        buffer.load_state_dict(saved)
    else:
        buffer.next_index = start
    # the allocator is between steps until the producer starts: its state goes with the (restored) buffer
    buffer.last_allocator_state = copy.deepcopy(s.allocator.state_dict())
    gate = GenerationGate()

    def val() -> dict[str, float]:
        with gate.exclusive():
            return run_validation(s)

    if validate_at_start(s, val):
        return history
    producer = TrajectoryProducer(
        s,
        buffer,
        gate,
        version=start,
        last_index=cfg.grpo.max_num_steps,
        carried_lag=carried_lag(cfg),
        max_num_epochs=cfg.grpo.max_num_epochs,
    )
    producer.start()
    try:
        for step in tqdm(
            range(start, cfg.grpo.max_num_steps),
            desc="async GRPO",
            disable=not cfg.logger.progress_bar,
            initial=start,
            total=cfg.grpo.max_num_steps,
        ):
            timer.reset()
            with timer.time("total_step_time"):
                out = async_train_step(s, step, buffer, producer, gate, timer)
            if out is None:
                break
            metrics, exhausted = out
            metrics.update(timer.metrics("timing/train/"))
            history.append(metrics)
            if end_step(s, step, metrics, exhausted, val, lambda m, done=step + 1: _checkpoint(s, buffer, done, m)):
                break
    finally:
        producer.stop()
    return history
