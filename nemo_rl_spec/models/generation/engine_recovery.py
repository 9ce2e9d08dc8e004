"""Restarting a generation engine that died, up to ``grpo.async_grpo.max_generation_failures`` times a run.

When an engine's actor dies (its process killed, an out-of-memory kill, a crashed node), the call that was running
on it fails with Ray's ``RayActorError``. :class:`EngineRecovery` then

1. counts the failure and, past the limit, raises :class:`EngineFailureError` (the run stops; checkpoints already
   written stay as they are);
2. replaces the actor by a new engine in the same placement-group bundle (``RayWorkerGroup.restart``: the engine
   starts from the run's checkpoint, weight version 0);
3. loads into it the last policy weights every engine was given (and the drafter pushed last, when there is one),
   from the object-store copies it kept, so the new engine holds the same weight version as its peers;
4. lets the controller re-issue the failed call on the new engine. A generate call's rows keep their seeds
   (``row_offset``), so the re-issued requests are sampled as the lost ones would have been, at the same version:
   no trajectory mixes versions.

Keeping the last copies costs one object-store copy of the policy (and drafter) weights for the whole run; with
``max_generation_failures: 0`` (the default) nothing is kept and a dead engine ends the run as before.
"""

from __future__ import annotations

from typing import Any

import ray

from nemo_rl_spec.speculative.draft_refit import DraftVersionMismatchError

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
        self.workers.restart(rank)
        worker = self.workers.workers[rank]
        if self._policy is not None:
            ray.get(worker.update_weights.remote(*self._policy))
        if self._draft is not None:
            try:
                ray.get(worker.update_draft_weights.remote(self._draft))
            except DraftVersionMismatchError:  # kept draft paired with an older policy: the retried push pairs it
                pass

    def metrics(self) -> dict[str, Any]:
        """``generation/engine_restarts`` (restarts so far this run) when restarts are enabled, else nothing."""
        return {"generation/engine_restarts": float(self.restarts)} if self.enabled else {}
