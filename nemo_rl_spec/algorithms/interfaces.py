"""Rollout-allocation protocol: how the GRPO driver asks *which prompts get how many rollouts*.

An allocator (uniform GRPO, DAPO dynamic sampling, Pilot-Commit) decides what to generate and which rollouts form
the train batch. It never touches vLLM, Ray or tokens: the driver injects a ``generate_fn`` that turns
:class:`RolloutRequest` s into scored :class:`RolloutResult` s. One training step may need several generation
*rounds* (Pilot-Commit cold start: pilot, then commit; DAPO: up to ``max_gen_batches``); every allocator bounds the
number of rounds per step by :attr:`RolloutAllocator.max_rounds_per_step`, so a step always ends.

Low-level protocol (one round; :meth:`RolloutAllocator.step` runs the loop, its class docstring shows the sync
driver and a worked example)::

    requests = allocator.plan()            # list[RolloutRequest]; [] when nothing is left to generate
    results = generate_fn(requests)        # one RolloutResult per request, any order
    selection = allocator.observe(results) # TrainSelection when the step is complete, None -> another round
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch


class Stage(str, Enum):
    """What a request's rollouts are for.

    PILOT: a few rollouts to estimate a prompt's success rate (Pilot-Commit).
    COMMIT: the rest of a selected prompt's group (Pilot-Commit).
    GROUP: a full GRPO group (uniform GRPO, DAPO dynamic sampling).
    """

    PILOT = "pilot"
    COMMIT = "commit"
    GROUP = "group"


@dataclass(frozen=True)
class RolloutRequest:
    """Generate ``n`` rollouts of one prompt.

    Attributes:
        prompt_id: index of the prompt in the training pool (the dataset index the allocator was built with).
        n: number of rollouts (>= 1).
        stage: see :class:`Stage`.
        target_step: the training step whose batch these rollouts serve (a bound pilot serves the next step).
        seed: per-request sampling seed, a function of (allocator seed, step, round, stage, prompt_id) only, so a
            resumed run asks for exactly what the original asked for. Use it for a per-request torch.Generator or
            vLLM ``SamplingParams(seed=...)``.
    """

    prompt_id: int
    n: int
    stage: Stage
    target_step: int
    seed: int

    def result(self, rewards: torch.Tensor | list[float], policy_version: int, payload: Any = None) -> "RolloutResult":
        """Build the :class:`RolloutResult` answering this request (``rewards``: [n])."""
        res = RolloutResult(self.prompt_id, self.stage, rewards, policy_version, payload)
        if res.rewards.numel() != self.n:
            raise ValueError(
                f"request for prompt {self.prompt_id} ({self.stage.value}) asked for {self.n} rollouts, "
                f"got {res.rewards.numel()} rewards"
            )
        return res


@dataclass
class RolloutResult:
    """Scored rollouts answering one :class:`RolloutRequest`.

    Attributes:
        prompt_id, stage: copied from the request (the pair identifies the request within a round).
        rewards: [n] float32, one scalar reward per rollout (Pilot-Commit requires values in [0, 1]: success rate).
        policy_version: weight version of the policy that generated these rollouts. Pilot-Commit trains on pilot
            rollouts one or more versions old; the loss must importance-correct them with their generation
            log-probs (``loss_fn.use_importance_sampling_correction``).
        payload: opaque to the allocator (tokens, generation log-probs ...). It may be kept across steps (pilot
            results wait for their commit; the replay buffer) and is written by ``state_dict``: store
            self-contained per-request tensors, not indices into a transient batch.

    Raises:
        ValueError: rewards not 1-D or not finite.
    """

    prompt_id: int
    stage: Stage
    rewards: torch.Tensor
    policy_version: int
    payload: Any = None

    def __post_init__(self) -> None:
        self.stage = Stage(self.stage)
        self.rewards = torch.as_tensor(self.rewards, dtype=torch.float32).detach().cpu()
        if self.rewards.dim() != 1 or self.rewards.numel() == 0:
            raise ValueError(
                f"rewards of prompt {self.prompt_id} must be a non-empty 1-D tensor, "
                f"got shape {tuple(self.rewards.shape)}"
            )
        if not torch.isfinite(self.rewards).all():
            raise ValueError(f"rewards of prompt {self.prompt_id} contain NaN/inf: {self.rewards.tolist()}")

    def to_state(self) -> dict[str, Any]:
        """Plain-container form for checkpoints (inverse: :meth:`from_state`)."""
        return {
            "prompt_id": self.prompt_id,
            "stage": self.stage.value,
            "rewards": self.rewards.clone(),
            "policy_version": self.policy_version,
            "payload": self.payload,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "RolloutResult":
        """Rebuild a result written by :meth:`to_state`."""
        return cls(
            state["prompt_id"], Stage(state["stage"]), state["rewards"], state["policy_version"], state["payload"]
        )


@dataclass
class TrainGroup:
    """All rollouts of one prompt that enter the train batch together (one GRPO advantage group).

    Attributes:
        prompt_id: the prompt.
        results: its results in order (Pilot-Commit: pilot first, then commit).
    """

    prompt_id: int
    results: list[RolloutResult]

    @property
    def rewards(self) -> torch.Tensor:
        """Shape: [size] float32, the group's rewards in result order."""
        return torch.cat([r.rewards for r in self.results])

    @property
    def policy_versions(self) -> torch.Tensor:
        """Shape: [size] int64, generating policy version of each rollout, aligned with :attr:`rewards`."""
        return torch.cat([torch.full((r.rewards.numel(),), r.policy_version, dtype=torch.int64) for r in self.results])

    @property
    def size(self) -> int:
        """Number of rollouts in the group."""
        return sum(r.rewards.numel() for r in self.results)


@dataclass
class TrainSelection:
    """What one training step trains on.

    Attributes:
        step: the training step (0-based, the allocator's own counter).
        groups: advantage groups; may be empty (fallback ``skip``, DAPO ran out of batches, pool exhausted).
        metrics: per-step metrics (``rollout_alloc/*`` for every method, ``pilot_commit/*`` or
            ``dynamic_sampling/*`` for the method's own).
        exhausted: True when the pool is empty (every prompt evicted); the driver should stop.
    """

    step: int
    groups: list[TrainGroup]
    metrics: dict[str, float] = field(default_factory=dict)
    exhausted: bool = False

    @property
    def num_rollouts(self) -> int:
        """Rollouts in the train batch."""
        return sum(g.size for g in self.groups)

    @property
    def results(self) -> list[RolloutResult]:
        """Every result in row order (group by group, each group's results in order); concatenating their payloads
        row-wise gives rows aligned with :attr:`rewards`."""
        return [r for g in self.groups for r in g.results]

    @property
    def rewards(self) -> torch.Tensor:
        """Shape: [num_rollouts] float32, group-major (the layout GRPO advantage code expects)."""
        return torch.cat([g.rewards for g in self.groups]) if self.groups else torch.zeros(0)

    @property
    def policy_versions(self) -> torch.Tensor:
        """Shape: [num_rollouts] int64, aligned with :attr:`rewards`."""
        if not self.groups:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([g.policy_versions for g in self.groups])

    @property
    def group_ids(self) -> torch.Tensor:
        """Shape: [num_rollouts] int64, the index of each row's group (0 .. len(groups) - 1), aligned with
        :attr:`rewards`; groups may differ in size (Pilot-Commit's ``fill_commit_budget``)."""
        sizes = torch.tensor([g.size for g in self.groups], dtype=torch.int64)
        return torch.repeat_interleave(torch.arange(len(self.groups), dtype=torch.int64), sizes)

    @property
    def group_size(self) -> int:
        """Rollouts per group (uniform/DAPO: n; Pilot-Commit: n_pilot + n_commit); 0 for an empty batch.

        Raises:
            ValueError: groups of different sizes.
        """
        sizes = {g.size for g in self.groups}
        if len(sizes) > 1:
            raise ValueError(f"train groups have different sizes {sorted(sizes)}")
        return sizes.pop() if sizes else 0

    def max_policy_lag(self, current_version: int) -> int:
        """Largest ``current_version - policy_version`` over the batch's rollouts (0 for an empty batch)."""
        versions = [r.policy_version for g in self.groups for r in g.results]
        return max((current_version - v for v in versions), default=0)


class GenerateFn(Protocol):
    """Driver-side callable: generate and score every request; return one :class:`RolloutResult` per request
    (any order), each with ``request.n`` rewards and the policy version that produced them."""

    def __call__(self, requests: list[RolloutRequest]) -> list[RolloutResult]: ...


class RolloutAllocator(ABC):
    """Decides which prompts get how many rollouts and which rollouts form each train batch.

    Sync GRPO driver::

        for step in range(start_step, max_num_steps):
            sel = allocator.step(lambda reqs: rollout(reqs, policy_version=step))   # generate + score
            if sel.exhausted:                                 # every prompt evicted: nothing left to learn
                break
            if sel.groups:                                    # empty when a fallback skipped the step
                train(sel)                                    # advantages per sel.groups[i]; IS-correct stale rows
            logger.log_metrics(sel.metrics, step=step + 1)
            checkpoint(step + 1, allocator=allocator.state_dict())

    Worked example (Pilot-Commit, binding on, n_pilot=2, n_commit=4): the generation call of step 5 holds
    ``RolloutRequest(prompt_id=7, n=4, stage=COMMIT, target_step=5, seed=...)`` (prompt 7 passed its pilot in step
    4's call) and ``RolloutRequest(prompt_id=12, n=2, stage=PILOT, target_step=6, seed=...)``. The train group of
    prompt 7 is its 2 pilot rewards (policy_version 4) followed by its 4 commit rewards (policy_version 5):
    ``TrainGroup(prompt_id=7).rewards = [1., 0., 1., 1., 0., 1.]``, ``.policy_versions = [4, 4, 5, 5, 5, 5]``.

    Checkpoint contract: :meth:`state_dict` is only valid between steps (after :meth:`observe` returned a
    selection); restoring it into a fresh allocator built with the same arguments reproduces every later request,
    seed and selection exactly.
    """

    #: Upper bound on plan/observe rounds in one step; :meth:`step` raises RuntimeError beyond it.
    max_rounds_per_step: int = 1

    @abstractmethod
    def plan(self) -> list[RolloutRequest]:
        """Requests of the next generation round. [] means nothing to generate; still call :meth:`observe` ([]).

        Raises:
            RuntimeError: called twice without :meth:`observe` in between.
        """

    @abstractmethod
    def observe(self, results: list[RolloutResult]) -> TrainSelection | None:
        """Feed the results of the last :meth:`plan`; return the step's selection, or None if another round is
        needed.

        Raises:
            ValueError: results do not answer the planned requests one-to-one (missing, extra, duplicate, wrong n)
                or carry invalid rewards.
            RuntimeError: no round is pending.
        """

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed for an exact resume (plain containers and tensors, ``torch.save``-able).

        Raises:
            RuntimeError: called in the middle of a step.
        """

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Raises:
            ValueError: the state belongs to a different allocator kind or prompt pool.
        """

    @abstractmethod
    def epochs_completed(self) -> int:
        """Epochs over the prompt pool whose every prompt has been handed out (``grpo.max_num_epochs``)."""

    def step(self, generate_fn: GenerateFn) -> TrainSelection:
        """Run plan -> generate_fn -> observe rounds until the step's selection is ready.

        ``generate_fn`` is not called for an empty plan.

        Raises:
            RuntimeError: more than :attr:`max_rounds_per_step` rounds (an allocator bug, never an endless loop).
        """
        for _ in range(self.max_rounds_per_step):
            requests = self.plan()
            selection = self.observe(generate_fn(requests) if requests else [])
            if selection is not None:
                return selection
        raise RuntimeError(f"{type(self).__name__} did not finish a step within {self.max_rounds_per_step} rounds")
