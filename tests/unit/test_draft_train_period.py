"""``policy.draft.train_period``: the online draft trains on every n-th GRPO step only, and the
refit pushes it only after those steps; in between the engines keep the last draft pushed, paired with the policy
version it was pushed at.

The driver decides per GRPO step (``GRPOSetup.trains_draft``); the refit pushes the draft when its version moved. The
refit side runs the real :class:`~nemo_rl_spec.algorithms.refit.WeightRefitter` against in-process stand-ins of the two
Ray controllers whose engines hold the real :class:`~nemo_rl_spec.speculative.draft_refit.DraftVersionGuard` (the rule
the vLLM worker applies to a draft refit), with one or several mini-batches (optimizer steps) per GRPO step and with a
step that has nothing to train; the worker side is tests/functional/test_online_draft.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_rl_spec.algorithms.grpo_setup import GRPOSetup
from nemo_rl_spec.algorithms.refit import EngineVersionMismatchError, WeightRefitter
from nemo_rl_spec.speculative.draft_refit import DraftVersionGuard
from nemo_rl_spec.speculative.online import draft_trains_at
from nemo_rl_spec.utils.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
SPEC_RECIPE = ROOT / "configs" / "grpo_math_smollm2_135m_spec.yaml"


@pytest.mark.parametrize(
    "period,trains",
    [
        (1, [1, 1, 1, 1, 1, 1, 1]),
        (2, [1, 0, 1, 0, 1, 0, 1]),
        (3, [1, 0, 0, 1, 0, 0, 1]),
        (4, [1, 0, 0, 0, 1, 0, 0]),
    ],
)
def test_draft_trains_on_every_nth_step_from_the_first(period, trains):
    assert [int(draft_trains_at(step, period)) for step in range(7)] == trains


@pytest.mark.parametrize("step,period", [(0, 0), (3, -1), (-1, 2)])
def test_draft_trains_at_refuses_bad_arguments(step, period):
    with pytest.raises(ValueError, match="train_period"):
        draft_trains_at(step, period)


class _Policy:
    """The policy controller's refit surface: a drafter whose version counts its optimizer steps (one per
    mini-batch of a step that trains it, as the Megatron worker's ``DraftTrainer``)."""

    def __init__(self) -> None:
        self.version, self.weight_version = 0, 0
        self.draft_exports: list[int] = []

    def train(self, train_draft: bool, minibatches: int = 1) -> None:
        self.version += minibatches if train_draft else 0

    def draft_version(self) -> int:
        return self.version

    def export_hf_weights(self, version: int, dtype: str) -> dict:
        self.weight_version = version  # as the worker: the next draft export is paired with this version
        return {"w": torch.zeros(1)}

    def export_draft_weights(self, dtype: str) -> dict:
        self.draft_exports.append(self.weight_version)
        return {"weights": {}, "draft_version": self.version, "policy_version": self.weight_version}

    def get_logprobs(self, data: dict, temperature: float, filtered: bool = True) -> torch.Tensor:
        return torch.zeros(data["input_ids"].shape)


class _Generation:
    """Engines that hold the real DraftVersionGuard and apply its rule to every draft refit."""

    def __init__(self, engines: int) -> None:
        self.guards = [DraftVersionGuard() for _ in range(engines)]
        self.skip_policy_refit: set[int] = set()

    def update_weights(self, weights: dict, version: int) -> None:
        for e, guard in enumerate(self.guards):
            if e not in self.skip_policy_refit:
                guard.policy_version = version

    def update_draft_weights(self, draft: dict) -> list[dict]:
        for guard in self.guards:
            guard.check(draft["policy_version"])
            guard.record(draft["draft_version"], draft["policy_version"])
        return [guard.as_dict() for guard in self.guards]

    def get_versions(self) -> list[dict]:
        return [guard.as_dict() for guard in self.guards]

    def score(self, ids: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        return [torch.zeros(ids.shape) for _ in self.guards]


def _refitter(engines: int = 2) -> tuple[WeightRefitter, _Policy, _Generation]:
    policy, generation = _Policy(), _Generation(engines)
    return WeightRefitter(policy, generation, [[1, 2, 3]], None, 0, sync_draft=True), policy, generation


def _loop(refitter, policy, period: int, steps: int, minibatches: int = 1, skipped=(), start: int = 0) -> list[dict]:
    """The sync driver's refits: one at ``start`` (a run's first), then after each GRPO step ``step`` (version
    ``step + 1``), the draft trained in that step when ``draft_trains_at(step, period)`` (GRPOSetup.trains_draft);
    a step in ``skipped`` has nothing to train on (the policy is not trained, the refit still runs)."""
    out = [refitter.refit(version=start)]
    for step in range(start, start + steps):
        if step not in skipped:
            policy.train(draft_trains_at(step, period), minibatches)
        out.append(refitter.refit(version=step + 1))
    return out


@pytest.mark.parametrize("minibatches", [1, 4])
def test_refit_pushes_the_draft_only_after_the_steps_that_trained_it(minibatches):
    """Period 3: steps 0 and 3 train the draft, so it is pushed at the first refit and at versions 1 and 4, however
    many optimizer steps (mini-batches) a GRPO step takes."""
    refitter, policy, generation = _refitter()
    metrics = _loop(refitter, policy, period=3, steps=6, minibatches=minibatches)
    assert policy.draft_exports == [0, 1, 4]
    pushed = [m.get("refit/draft_version") for m in metrics]
    assert pushed == [0.0, minibatches, None, None, 2.0 * minibatches, None, None]
    assert [m["refit/draft_policy_lag"] for m in metrics] == [0.0, 0.0, 1.0, 2.0, 0.0, 1.0, 2.0]
    for guard in generation.guards:  # every engine holds policy 6 and the draft pushed at version 4
        assert guard.as_dict() == {"policy_version": 6, "draft_version": 2 * minibatches, "draft_policy_version": 4}


def test_period_one_pushes_the_draft_at_every_refit():
    refitter, policy, _ = _refitter()
    metrics = _loop(refitter, policy, period=1, steps=4)
    assert policy.draft_exports == [0, 1, 2, 3, 4]
    assert all(m["refit/draft_policy_lag"] == 0.0 for m in metrics)


def test_a_step_with_nothing_to_train_leaves_the_draft_in_the_engines():
    """Period 1 with step 1 skipped (e.g. Pilot-Commit kept no group): no push at version 2, then pushes resume."""
    refitter, policy, _ = _refitter()
    metrics = _loop(refitter, policy, period=1, steps=4, skipped={1})
    assert policy.draft_exports == [0, 1, 3, 4]
    assert [m["refit/draft_policy_lag"] for m in metrics] == [0.0, 0.0, 1.0, 0.0, 0.0]


def test_a_resumed_run_pushes_its_draft_at_the_first_refit():
    """A run resumed at step 5 with period 3: the first refit pushes the restored draft although step 4 did not
    train it; step 5 does not train it (no push at 6), step 6 does (pushed at 7)."""
    refitter, policy, _ = _refitter()
    policy.version = 2
    _loop(refitter, policy, period=3, steps=2, start=5)
    assert policy.draft_exports == [5, 7]


def test_an_engine_that_missed_the_policy_refit_is_named_between_draft_pushes():
    refitter, policy, generation = _refitter()
    _loop(refitter, policy, period=2, steps=1)  # the draft was pushed at version 1
    generation.skip_policy_refit = {1}
    policy.train(draft_trains_at(1, 2))  # step 1 does not train the draft: the refit checks the policy versions only
    assert not refitter.pushes_draft()
    with pytest.raises(EngineVersionMismatchError, match="engine 1"):
        refitter.refit(version=2)


def test_the_driver_trains_the_online_draft_on_every_nth_step():
    def trains(*overrides: str) -> list[bool]:
        setup = SimpleNamespace(cfg=load_config(SPEC_RECIPE, list(overrides)))
        return [GRPOSetup.trains_draft(setup, step) for step in range(6)]

    assert trains("policy.draft.train_period=4") == [True, False, False, False, True, False]
    assert trains() == [True] * 6
    # ignored for a frozen draft, like precision
    assert trains("policy.draft.train_period=4", "policy.draft.online=false") == [True] * 6


@pytest.mark.parametrize("value", ["0", "-2", "1.5"])
def test_a_bad_train_period_names_the_key(value):
    with pytest.raises(ConfigError, match="policy.draft.train_period"):
        load_config(SPEC_RECIPE, [f"policy.draft.train_period={value}"])
