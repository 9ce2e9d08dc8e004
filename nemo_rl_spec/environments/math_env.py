"""Math environment: binary correctness reward checked with math-verify (HF Math-Verify, parse + verify).

Reward of a response r against the ground truth g::

    reward = 1.0  if verify(parse(\\boxed{g}), parse(\\boxed{extract_final_answer(r)}))  else 0.0

``extract_final_answer`` takes the content of the *last* ``\\boxed{...}`` (or ``\\fbox{...}``, nested braces
matched); without one it falls back to the last number in the text (``-12``, ``3.5``, ``1,000``). No answer,
an answer longer than :data:`MAX_ANSWER_CHARS`, or any parser/verifier error gives 0.0. Equivalent forms are
math-verify's business: ``\\frac{1}{2}`` == ``0.5``, ``1,000`` == ``1000``, ``50\\%`` == ``0.5``.
Timeouts (math-verify's ``signal.alarm`` works only in the main thread; ``num_workers > 1`` gives a hard bound):
:class:`MathEnvironment`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import re
import signal
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nemo_rl_spec.environments.interfaces import EnvironmentInterface
from nemo_rl_spec.utils.config_schema import MathEnvConfig

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

TIMEOUT_S = 5
"""Seconds math-verify may spend parsing one string / comparing one pair (main thread only)."""
MAX_ANSWER_CHARS = 256
"""Extracted answers longer than this are scored 0 without parsing."""

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\d.])-?\.\d+")


def extract_final_answer(response: str) -> str | None:
    """The final answer of a response: content of the last ``\\boxed{...}``, else the last number, else None.

    An unbalanced last ``\\boxed{`` (truncated generation) is skipped in favour of an earlier complete one.
    Trailing periods/spaces inside the box are stripped (``\\boxed{7.}`` -> ``7``).
    """
    for match in reversed(list(_BOXED.finditer(response))):
        depth, start = 1, match.end()
        for pos in range(start, len(response)):
            depth += {"{": 1, "}": -1}.get(response[pos], 0)
            if depth == 0:
                content = response[start:pos].strip().rstrip(".").strip()
                if content:
                    return content
                break
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def score_response(response: str, ground_truth: str, timeout_s: int | None) -> float:
    """1.0 if the response's final answer is mathematically equal to ``ground_truth`` (math-verify), else 0.0.

    Args:
        timeout_s: math-verify's signal-based timeout in seconds; must be None off the main thread.
    """
    from math_verify import parse, verify  # lazy: math-verify only where answers are scored

    answer = extract_final_answer(response)
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return 0.0
    try:
        gold = parse("\\boxed{" + str(ground_truth).strip() + "}", parsing_timeout=timeout_s)
        pred = parse("\\boxed{" + answer + "}", parsing_timeout=timeout_s)
        if not gold or not pred:
            return 0.0
        return 1.0 if verify(gold, pred, timeout_seconds=timeout_s) else 0.0
    except Exception:  # a malformed answer must cost reward, never the run
        logger.debug("math-verify failed on answer %r vs %r", answer, ground_truth, exc_info=True)
        return 0.0


def _score_chunk(pairs: list[tuple[str, str]]) -> list[float]:
    """Score (response, ground_truth) pairs; also the worker-process entry point.

    On the main thread math-verify's ``signal.alarm`` would cancel any timer the caller had armed (e.g.
    pytest-timeout's); the caller's ITIMER_REAL is saved and re-armed with its remaining time afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        return [score_response(r, g, None) for r, g in pairs]
    remaining_s, interval_s = signal.getitimer(signal.ITIMER_REAL)
    start = time.monotonic()
    try:
        return [score_response(r, g, TIMEOUT_S) for r, g in pairs]
    finally:
        if remaining_s > 0:
            elapsed = time.monotonic() - start
            signal.setitimer(signal.ITIMER_REAL, max(remaining_s - elapsed, 1e-3), interval_s)


class MathEnvironment(EnvironmentInterface):
    """Binary math-answer reward (see the module docstring for extraction and equivalence).

    Timeouts and threads: math-verify bounds parsing and comparison with ``signal.alarm``, which only works in the
    main thread (elsewhere it raises ``ValueError: signal only works in main thread``). This class therefore passes
    ``parsing_timeout`` / ``timeout_seconds`` of :data:`TIMEOUT_S` only when called on the main thread and ``None``
    otherwise (e.g. a threaded Ray actor). Without the alarm nothing interrupts a runaway sympy call; the risk is
    reduced (not removed) by scoring only the short extracted answer (<= MAX_ANSWER_CHARS characters), never the
    whole response. For a hard bound use ``num_workers > 1``: scoring then runs in spawned worker processes, whose
    main thread does get the alarm.

    Args:
        cfg: the ``env.math`` config section (:class:`~nemo_rl_spec.utils.config_schema.MathEnvConfig`, or a mapping
            validated into one): ``num_workers`` (int >= 1). 1 scores in the calling process; > 1 scores in that many
            spawned worker processes (started lazily, stopped by :meth:`close`).

    Metadata: each dict needs ``answer`` (ground truth, str or number), e.g. the problem dicts of
    :mod:`nemo_rl_spec.data.datasets`.
    """

    def __init__(self, cfg: MathEnvConfig | Mapping[str, Any]):
        if not isinstance(cfg, MathEnvConfig):
            num_workers = cfg["num_workers"]
            if not isinstance(num_workers, int) or num_workers < 1:
                raise ValueError(f"env.math.num_workers must be >= 1, got {num_workers!r}")
            cfg = MathEnvConfig.model_validate(dict(cfg))
        self.num_workers = cfg.num_workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def step(self, responses: list[str], metadata: list[dict]) -> torch.Tensor:
        """Rewards in {0.0, 1.0}. Shape: N responses -> [N] float32.

        Raises:
            ValueError: len(responses) != len(metadata).
            KeyError: a metadata dict has no ``answer``.
        """
        import torch  # imported here: spawned scoring workers import this module and never need torch

        if len(responses) != len(metadata):
            raise ValueError(f"{len(responses)} responses but {len(metadata)} metadata dicts")
        pairs = []
        for i, (response, meta) in enumerate(zip(responses, metadata)):
            if "answer" not in meta:
                raise KeyError(f"metadata[{i}] has no 'answer' (keys: {sorted(meta)})")
            pairs.append((response, str(meta["answer"])))
        if self.num_workers == 1 or len(pairs) <= 1:
            rewards = _score_chunk(pairs)
        else:
            rewards = self._score_in_workers(pairs)
        return torch.tensor(rewards, dtype=torch.float32)

    def _score_in_workers(self, pairs: list[tuple[str, str]]) -> list[float]:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self.num_workers, mp_context=multiprocessing.get_context("spawn")
            )
        size = -(-len(pairs) // self.num_workers)
        chunks = [pairs[i : i + size] for i in range(0, len(pairs), size)]
        return [reward for chunk in self._pool.map(_score_chunk, chunks) for reward in chunk]

    def close(self) -> None:
        """Stop the worker processes, if any were started."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
