"""Restarting a generation engine that died, up to ``grpo.async_grpo.max_generation_failures`` times a run.

When an engine's actor dies (its process killed, an out-of-memory kill, a crashed node), the call that was running
on it fails with Ray's ``RayActorError``. :class:`EngineRecovery` then

1. counts the failure and, past the limit, raises :class:`EngineFailureError` (the run stops; checkpoints already
   written stay as they are);
2. replaces the actor by a new engine in the same placement-group bundle (``RayWorkerGroup.restart``: the engine
   starts from the run's checkpoint, weight version 0);
3. loads into it the last policy weights every engine was given (and the drafter pushed last, when there is one),
   so the new engine holds the same weight version as its peers: from the object-store copies it kept
   (``refit_transport: ray``), or from the trainer's rank 0, which keeps what it last broadcast (``nccl``: a
   :meth:`EngineRecovery.set_source` callback; the collective group is rebuilt before the next refit);
4. lets the controller re-issue the failed call on the new engine. A generate call's rows keep their seeds
   (``row_offset``), so the re-issued requests are sampled as the lost ones would have been, at the same version:
   no trajectory mixes versions.

Keeping the last copies costs one copy of the policy (and drafter) weights for the whole run (in the object store, or
in the trainer's rank 0 with the collective transport); with ``max_generation_failures: 0`` (the default) nothing is
kept and a dead engine ends the run as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

__all__ = ["EngineFailureError", "EngineRecovery"]


class EngineFailureError(RuntimeError):
    """A generation engine died and ``grpo.async_grpo.max_generation_failures`` restarts were already used."""


class EngineRecovery:
    """Restart budget and the weights a restarted engine is given (module docstring).

    Args:
        workers: the engines' :class:`~nemo_rl_spec.distributed.worker_group.RayWorkerGroup`.
        max_failures: restarts allowed over the run (0: none; a dead engine raises at once).
    """

    def __init__(self, workers, max_failures: int) -> None:
        self.workers, self.max_failures = workers, int(max_failures)
        self.restarts = 0
        self._policy: tuple[ray.ObjectRef, int] | None = None  # last weights every engine loaded, and their version
        self._draft: ray.ObjectRef | None = None  # last drafter export every engine loaded
        self._source: tuple[Callable, Callable] | None = None

    @property
    def enabled(self) -> bool:
        """Whether engines are restarted (``max_failures > 0``)."""
        return self.max_failures > 0

    def keep_policy(self, ref: ray.ObjectRef, version: int) -> None:
        """Every engine now holds the weights behind ``ref`` as ``version``: a restarted engine gets them."""
        if self.enabled:
            self._policy = (ref, int(version))

    def keep_draft(self, ref: ray.ObjectRef) -> None:
        """Every engine now holds the drafter export behind ``ref``: a restarted engine gets it too."""
        if self.enabled:
            self._draft = ref

    def set_source(
        self,
        policy: Callable[[], tuple[ray.ObjectRef, int] | None],
        draft: Callable[[], ray.ObjectRef | None],
    ) -> None:
        """Take a restarted engine's weights from these callbacks instead of kept copies: ``policy()`` gives the
        (ref, version) every engine holds, ``draft()`` the drafter export they hold (None: nothing pushed yet)."""
        self._source = (policy, draft)

    def restart(self, rank: int, cause: BaseException) -> None:
        """Replace dead engine ``rank`` and give it the kept weights (module docstring).

        Raises:
            EngineFailureError: the restart budget is spent (``cause`` chained).
        """
        if self.restarts >= self.max_failures:
            raise EngineFailureError(
                f"generation engine {rank} died and grpo.async_grpo.max_generation_failures={self.max_failures} "
                f"restart(s) are used up: {cause}"
            ) from cause
        self.restarts += 1
        print(
            f"[engine recovery] generation engine {rank} died ({type(cause).__name__}); restarting it "
            f"({self.restarts} of grpo.async_grpo.max_generation_failures={self.max_failures})",
            flush=True,
        )
        self.workers.restart(rank)
        worker = self.workers.workers[rank]
        policy, draft = (self._source[0](), self._source[1]()) if self._source else (self._policy, self._draft)
        if policy is not None:
            ray.get(worker.update_weights.remote(*policy))
        if draft is not None:  # as its peers hold it, even when paired with an earlier policy version
            ray.get(worker.restore_draft_weights.remote(draft))

    def metrics(self) -> dict[str, Any]:
        """``generation/engine_restarts`` (restarts so far this run) when restarts are enabled, else nothing."""
        return {"generation/engine_restarts": float(self.restarts)} if self.enabled else {}
