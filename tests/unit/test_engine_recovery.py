"""EngineRecovery's restart budget and what it keeps (nemo_rl_spec.models.generation.engine_recovery), without Ray:
a stand-in worker group counts restarts. The Ray path (kill -9 of an engine in async GRPO) is
tests/functional/test_scale_out_loop.py::test_async_split_dp2_two_engines_equals_one_plus_one."""

from __future__ import annotations

import pytest

from nemo_rl_spec.models.generation.engine_recovery import EngineFailureError, EngineRecovery


class _Workers:
    def __init__(self) -> None:
        self.restarted: list[int] = []
        self.workers = [None, None]  # nothing is loaded into them: no weights were kept in these tests

    def restart(self, rank: int) -> None:
        self.restarted.append(rank)


def test_restarts_up_to_the_budget_then_raises_with_the_cause():
    workers = _Workers()
    recovery = EngineRecovery(workers, max_failures=2)
    cause = RuntimeError("actor died")
    recovery.restart(1, cause)
    recovery.restart(0, cause)
    assert workers.restarted == [1, 0] and recovery.metrics() == {"generation/engine_restarts": 2.0}
    with pytest.raises(EngineFailureError, match="engine 1 died and .*max_generation_failures=2") as info:
        recovery.restart(1, cause)
    assert info.value.__cause__ is cause and workers.restarted == [1, 0]


def test_disabled_keeps_nothing_and_reports_nothing():
    workers = _Workers()
    recovery = EngineRecovery(workers, max_failures=0)
    recovery.keep_policy(object(), 3)
    recovery.keep_draft(object())
    assert recovery._policy is None and recovery._draft is None and recovery.metrics() == {}
    with pytest.raises(EngineFailureError, match="max_generation_failures=0"):
        recovery.restart(0, RuntimeError("died"))
    assert workers.restarted == []


def test_schema_accepts_restarts_with_either_transport_and_refuses_a_negative_budget():
    from nemo_rl_spec.utils.config import load_config

    recipe, overrides = "configs/grpo_math_tiny_dp2_async.yaml", ["grpo.async_grpo.max_generation_failures=1"]
    assert load_config(recipe, overrides).grpo.async_grpo.max_generation_failures == 1
    cfg = load_config(recipe, [*overrides, "policy.generation.refit_transport=nccl"])
    assert cfg.policy.generation.refit_transport == "nccl"
    for bad in ("-1", "true"):  # a negative budget, and a yes/no where a count is meant
        with pytest.raises(ValueError, match="max_generation_failures"):
            load_config(recipe, [f"grpo.async_grpo.max_generation_failures={bad}"])


def test_a_source_replaces_the_kept_copies():
    """With a source (the collective transport: rank 0 keeps what it sent), a restarted engine is given what the
    callbacks return, not the object-store copies."""
    asked = []
    workers = _Workers()
    recovery = EngineRecovery(workers, max_failures=1)
    recovery.keep_policy(object(), 3)
    recovery.set_source(lambda: asked.append("policy"), lambda: asked.append("draft"))
    recovery.restart(0, RuntimeError("died"))
    assert asked == ["policy", "draft"] and workers.restarted == [0]
