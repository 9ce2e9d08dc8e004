"""``policy.draft.train_period`` (issue 35 item 1): the online draft trains on every n-th policy step only, and the
refit pushes it only after those steps; in between the engines keep the last draft pushed, paired with the policy
version it was pushed at.

The refit side runs the real :class:`~nemo_rl_spec.algorithms.refit.WeightRefitter` against in-process stand-ins of
the two Ray controllers whose engines hold the real :class:`~nemo_rl_spec.speculative.draft_refit.DraftVersionGuard`
(the rule the vLLM worker applies to a draft refit); the worker side is tests/functional/test_online_draft.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nemo_rl_spec.algorithms.grpo_setup import draft_train_period
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
    """The policy controller's refit surface: a draft whose version counts the steps that trained it."""

    def __init__(self, period: int) -> None:
        self.period, self.step, self.draft_version, self.weight_version = period, 0, 0, 0
        self.draft_exports: list[int] = []

    def train(self) -> None:
        self.draft_version += int(draft_trains_at(self.step, self.period))
        self.step += 1

    def export_hf_weights(self, version: int, dtype: str) -> dict:
        self.weight_version = version  # as the worker: the next draft export is paired with this version
        return {"w": torch.zeros(1)}

    def export_draft_weights(self, dtype: str) -> dict:
        self.draft_exports.append(self.weight_version)
        return {"weights": {}, "draft_version": self.draft_version, "policy_version": self.weight_version}

    def get_logprobs(self, data: dict, temperature: float) -> torch.Tensor:
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


def _refitter(period: int, engines: int = 2) -> tuple[WeightRefitter, _Policy, _Generation]:
    policy, generation = _Policy(period), _Generation(engines)
    refitter = WeightRefitter(policy, generation, [[1, 2, 3]], None, 0, sync_draft=True, draft_train_period=period)
    return refitter, policy, generation


def _run(refitter: WeightRefitter, policy: _Policy, steps: int) -> list[dict]:
    """The sync loop's refits: the initial one at version 0, then one after each training step (version step + 1)."""
    out = [refitter.refit(version=0)]
    for step in range(steps):
        policy.train()
        out.append(refitter.refit(version=step + 1))
    return out


def test_refit_pushes_the_draft_only_after_the_steps_that_trained_it():
    refitter, policy, generation = _refitter(period=3)
    metrics = _run(refitter, policy, steps=6)
    # steps 0 and 3 train the draft: pushes at the initial refit and at versions 1 and 4
    assert policy.draft_exports == [0, 1, 4]
    assert [m.get("refit/draft_version") for m in metrics] == [0.0, 1.0, None, None, 2.0, None, None]
    assert [m["refit/draft_policy_lag"] for m in metrics] == [0.0, 0.0, 1.0, 2.0, 0.0, 1.0, 2.0]
    for guard in generation.guards:  # every engine holds policy 6 and the draft pushed at version 4
        assert guard.as_dict() == {"policy_version": 6, "draft_version": 2, "draft_policy_version": 4}


def test_period_one_pushes_the_draft_at_every_refit():
    refitter, policy, _ = _refitter(period=1)
    metrics = _run(refitter, policy, steps=4)
    assert policy.draft_exports == [0, 1, 2, 3, 4]
    assert all(m["refit/draft_policy_lag"] == 0.0 for m in metrics)


def test_a_resumed_run_pushes_its_draft_at_the_first_refit():
    """A run resumed at step 5 with period 3: the first refit pushes the restored draft although step 4 did not
    train it, then the rule resumes (step 6 trains it: pushed at version 7)."""
    refitter, policy, _ = _refitter(period=3)
    policy.step = policy.draft_version = 5
    refitter.refit(version=5)
    for _ in range(2):
        policy.train()
        refitter.refit(version=policy.step)
    assert policy.draft_exports == [5, 7]


def test_an_engine_that_missed_the_policy_refit_is_named_between_draft_pushes():
    refitter, policy, generation = _refitter(period=2)
    _run(refitter, policy, steps=1)  # the draft was pushed at version 1
    generation.skip_policy_refit = {1}
    policy.train()  # step 1 does not train the draft: the refit to version 2 checks the policy versions only
    assert not refitter.pushes_draft(2)
    with pytest.raises(EngineVersionMismatchError, match="engine 1"):
        refitter.refit(version=2)


def test_the_setup_passes_the_period_of_an_online_draft_only():
    online = load_config(SPEC_RECIPE, ["policy.draft.train_period=4"])
    assert online.policy.draft.online and draft_train_period(online) == 4
    assert draft_train_period(load_config(SPEC_RECIPE, [])) == 1
    frozen = load_config(SPEC_RECIPE, ["policy.draft.train_period=4", "policy.draft.online=false"])
    assert draft_train_period(frozen) == 1  # ignored for a frozen draft, like precision


@pytest.mark.parametrize("value", ["0", "-2", "1.5"])
def test_a_bad_train_period_names_the_key(value):
    with pytest.raises(ConfigError, match="policy.draft.train_period"):
        load_config(SPEC_RECIPE, [f"policy.draft.train_period={value}"])
