"""The one generate path of sync and async GRPO (:class:`RolloutGenerator`) and the one place speculative metrics
are made (:class:`SpeculationMonitor`), against hand-worked values on a scripted engine (no Ray)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from nemo_rl_spec.algorithms.interfaces import RolloutRequest, Stage
from nemo_rl_spec.algorithms.rollouts import RolloutGenerator
from nemo_rl_spec.speculative.metrics import LowAcceptanceAlarm, SpecDecodeCounters, SpeculationMonitor


class _Engine:
    """generate(): each prompt's ids + ``width`` response tokens (prompt id + 10); versions and spec counts per
    call as scripted (call i reports policy version 5 + i, draft version 7 + i, 3 drafts with 2 accepted tokens)."""

    def __init__(self, width: int = 2) -> None:
        self.calls, self.width = [], width

    def generate(self, prompts, n, seed, **overrides):
        i = len(self.calls)
        self.calls.append((prompts["prompt_token_ids"], n, seed))
        rows = [ids + [ids[-1] + 10] * self.width for ids in prompts["prompt_token_ids"] for _ in range(n)]
        width = max(map(len, rows))
        return {
            "output_ids": torch.tensor([r + [0] * (width - len(r)) for r in rows]),
            "input_lengths": torch.tensor([len(r) - self.width for r in rows]),
            "unpadded_sequence_lengths": torch.tensor([len(r) for r in rows]),
            "generation_logprobs": torch.full((len(rows), width), -0.25),
            "prompt_index": torch.arange(len(prompts["prompt_token_ids"])).repeat_interleave(n),
            "policy_version": 5 + i,
            "draft_version": 7 + i,
            "spec_counters": SpecDecodeCounters(3, 9, 2, (2, 0, 0)),
        }


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Env:
    """Reward 1.0 for responses of prompt id 1, else 0.0."""

    def step(self, responses, problems):
        return torch.tensor([float(p["id"] == 1) for p in problems])


def _requests(ns: list[int]) -> list[RolloutRequest]:
    return [RolloutRequest(prompt_id=i, n=n, stage=Stage.GROUP, target_step=0, seed=100 + i) for i, n in enumerate(ns)]


def _generator(engine, **kwargs) -> RolloutGenerator:
    pool = [{"id": i} for i in range(4)]
    return RolloutGenerator(engine, _Tokenizer(), _Env(), pool, lambda ps: [[1, 2 + p["id"]] for p in ps], **kwargs)


def test_one_call_per_n_rewards_versions_and_stats():
    engine = _Engine()
    gen = _generator(engine, version=3)
    results = gen(_requests([2, 4, 2]))
    assert [(ids, n) for ids, n, _ in engine.calls] == [([[1, 2], [1, 4]], 2), ([[1, 3]], 4)]  # grouped by n
    assert [r.prompt_id for r in results] == [0, 2, 1]
    assert [r.rewards.tolist() for r in results] == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    assert {r.policy_version for r in results} == {3}  # sync: the step's version, whatever the engine says
    assert results[2].payload["output_ids"].tolist() == [[1, 3, 13, 13]] * 4
    assert "draft_version" not in results[0].payload and results[0].payload["reward_valid"].all()
    # 2 calls: 2 x 2 + 4 rows of 2 response tokens each; counters summed over the calls
    assert gen.stats.generated_tokens == (4 + 4) * 2 and gen.stats.generation_s > 0
    assert gen.stats.spec_counters == SpecDecodeCounters(6, 18, 4, (4, 0, 0)) and gen.stats.draft_version == 8


def test_engine_reported_versions_gate_and_draft_tags():
    engine, entered = _Engine(), []

    @contextlib.contextmanager
    def gate():
        entered.append(len(engine.calls))
        yield

    gen = _generator(engine, version=None, gate=gate, tag_draft_version=True)
    results = gen(_requests([2, 4]))
    assert entered == [0, 1]  # every call under the gate
    assert [(r.policy_version, r.payload["draft_version"]) for r in results] == [(5, 7), (6, 8)]


def test_speculation_monitor_metrics_and_alarm():
    monitor = SpeculationMonitor(floor=1.5)
    assert monitor.counts_to_metrics(None) == {} and monitor.step_metrics({}) == {}
    low = monitor.counts_to_metrics(SpecDecodeCounters(20, 60, 4, (4, 0, 0)))  # 1 + 4/20 = 1.2
    assert low["vllm/spec_acceptance_length"] == pytest.approx(1.2)
    assert monitor.step_metrics(low)[LowAcceptanceAlarm.METRIC] == 0.0  # no refit yet: not judged
    monitor.notify_refit()
    with pytest.warns(RuntimeWarning, match="still being refit"):
        assert monitor.step_metrics(low)[LowAcceptanceAlarm.METRIC] == 1.0
    monitor.notify_refit()
    high = monitor.counts_to_metrics(SpecDecodeCounters(20, 60, 30, (15, 10, 5)))  # 2.5
    assert monitor.step_metrics(high) == {**high, LowAcceptanceAlarm.METRIC: 0.0}


@pytest.mark.parametrize(
    "controller, protocol",
    [
        ("nemo_rl_spec.models.policy.lm_policy:Policy", "nemo_rl_spec.models.policy.interfaces:PolicyController"),
        (
            "nemo_rl_spec.models.generation.vllm_generation:VllmGeneration",
            "nemo_rl_spec.models.generation.interfaces:GenerationController",
        ),
    ],
)
def test_controllers_implement_their_protocols_and_return_no_ray_handles(controller, protocol):
    """Every protocol method exists on the controller with the protocol's parameters (extra optional ones
    allowed), and no controller method is annotated to return a Ray ObjectRef."""
    import importlib
    import inspect

    def load(path):
        module, name = path.split(":")
        return getattr(importlib.import_module(module), name)

    cls, proto = load(controller), load(protocol)
    for name, fn in inspect.getmembers(proto, inspect.isfunction):
        if name.startswith("_"):
            continue
        impl = getattr(cls, name, None)
        assert impl is not None, f"{cls.__name__} lacks {name}"
        want = list(inspect.signature(fn).parameters)
        got = inspect.signature(impl).parameters
        assert list(got)[: len(want)] == want, (name, list(got), want)
        assert all(p.default is not inspect.Parameter.empty for p in list(got.values())[len(want) :]), name
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        assert "ObjectRef" not in str(inspect.signature(fn).return_annotation), name
