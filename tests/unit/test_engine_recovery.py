"""EngineRecovery's restart budget and what it keeps (nemo_rl_spec.models.generation.engine_recovery), without Ray:
a stand-in worker group counts restarts. The Ray path (kill -9 of an engine in async GRPO) is
tests/functional/test_async_grpo.py::test_killed_engine_is_restarted_and_the_run_finishes."""

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


def test_schema_refuses_restarts_with_the_collective_transport():
    from nemo_rl_spec.utils.config import load_config

    overrides = ["grpo.async_grpo.max_generation_failures=1"]
    cfg = load_config("configs/grpo_math_tiny_dp2_async.yaml", overrides)
    assert cfg.grpo.async_grpo.max_generation_failures == 1
    with pytest.raises(ValueError, match="max_generation_failures=1 with policy.generation.refit_transport=nccl"):
        load_config("configs/grpo_math_tiny_dp2_async.yaml", [*overrides, "policy.generation.refit_transport=nccl"])
    with pytest.raises(ValueError, match="max_generation_failures"):
        load_config("configs/grpo_math_tiny_dp2_async.yaml", ["grpo.async_grpo.max_generation_failures=-1"])
