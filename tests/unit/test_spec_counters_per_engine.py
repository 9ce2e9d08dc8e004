"""Per-engine speculative-decoding counters (:class:`SpecDecodeStatLogger`): fed through vLLM's own
``StatLoggerManager.record`` loop with vLLM's ``SpecDecodingStats``, two engines' counts stay apart (the
process-global Prometheus registry mixed them up: NaN acceptance on the older engine). No engine starts."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from nemo_rl_spec.speculative.metrics import (
    SpecDecodeCounters,
    SpecDecodeMeter,
    SpecDecodeStatLogger,
    attach_spec_decode_counter,
    read_spec_decode_counters,
)

vllm_loggers = pytest.importorskip("vllm.v1.metrics.loggers")
from vllm.v1.spec_decode.metrics import SpecDecodingStats  # noqa: E402


def fake_llm():
    """What the counters touch of a ``vllm.LLM``: ``llm_engine.logger_manager`` with its ``stat_loggers`` list."""
    return NS(llm_engine=NS(logger_manager=NS(stat_loggers=[], engine_indexes=[0])))


def step(llm, rounds: list[int], k: int) -> None:
    """One engine step through vLLM's own StatLoggerManager.record, one drafting round per entry of ``rounds``
    (the number of accepted proposals of that round)."""
    stats = SpecDecodingStats.new(k)
    for accepted in rounds:
        stats.observe_draft(num_draft_tokens=k, num_accepted_tokens=accepted)
    vllm_loggers.StatLoggerManager.record(llm.llm_engine.logger_manager, NS(spec_decoding_stats=stats), None)


def test_two_engines_count_apart():
    a, b = fake_llm(), fake_llm()
    attach_spec_decode_counter(a)
    assert attach_spec_decode_counter(a) is attach_spec_decode_counter(a)  # one logger per engine
    assert len(a.llm_engine.logger_manager.stat_loggers) == 1
    meter = SpecDecodeMeter(a)
    meter.start()
    step(a, [1, 0], k=1)
    before_b = read_spec_decode_counters(b)  # attaches on first read: counts from here
    step(b, [3, 2, 0], k=3)
    step(a, [1], k=1)
    vllm_loggers.StatLoggerManager.record(a.llm_engine.logger_manager, NS(spec_decoding_stats=None), None)  # no drafts
    vllm_loggers.StatLoggerManager.record(a.llm_engine.logger_manager, None, None)
    assert read_spec_decode_counters(a) == SpecDecodeCounters(3, 3, 2, (2,))
    assert read_spec_decode_counters(b) - before_b == SpecDecodeCounters(3, 9, 5, (2, 2, 1))
    metrics = meter.stop()
    assert metrics["vllm/spec_acceptance_length"] == pytest.approx(1 + 2 / 3)
    assert metrics["vllm/spec_acceptance_rate_pos0"] == pytest.approx(2 / 3)
    assert isinstance(attach_spec_decode_counter(b), vllm_loggers.AggregateStatLoggerBase)  # vLLM's interface


def test_logger_interface_and_growing_positions():
    log = SpecDecodeStatLogger()
    log.log_engine_initialized(), log.log(), log.record_sleep_state(1, 0), log.record_admission_rejection("x")
    log.record(None, None)
    log.observe(NS(num_drafts=1, num_draft_tokens=1, num_accepted_tokens=1, num_accepted_tokens_per_pos=[1]))
    log.observe(NS(num_drafts=1, num_draft_tokens=3, num_accepted_tokens=2, num_accepted_tokens_per_pos=[1, 1, 0]))
    assert log.counters() == SpecDecodeCounters(2, 4, 3, (2, 1, 0))


def test_stats_off_or_not_an_engine_is_loud():
    with pytest.raises(RuntimeError, match="disable_log_stats=False"):
        read_spec_decode_counters(NS(llm_engine=NS(logger_manager=None)))
    with pytest.raises(RuntimeError, match="logger_manager"):
        read_spec_decode_counters(NS())
