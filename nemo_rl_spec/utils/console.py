"""The console of a run: quiet by default (``logger.verbose: false``), everything with ``logger.verbose: true``.

Quiet means: the progress bar (``logger.progress_bar``), one line per step (:func:`step_line`), and warnings
and errors. vLLM's INFO lines are dropped by ``VLLM_LOGGING_LEVEL=WARNING`` (vLLM's own variable: a value the
user exported is kept, in both modes), and one harmless warning vLLM repeats at every refit is filtered
(:class:`HarmlessVllmWarnings`). The engines run in Ray actors, so the settings travel as environment variables
(:func:`worker_log_env`, put into each actor's ``runtime_env``) and each worker process applies them
(:func:`quiet_harmless_warnings`).
"""
from __future__ import annotations

import logging
import math
import os
from typing import Mapping

VERBOSE_ENV = "NEMO_RL_SPEC_VERBOSE"
"""``1``: ``logger.verbose`` is on (set by :func:`configure_console`, read by worker processes)."""
VLLM_LEVEL_ENV = "VLLM_LOGGING_LEVEL"
REFIT_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def configure_console(verbose: bool) -> None:
    """Set the console mode of this (driver) process and of the workers it starts.

    ``verbose=False``: ``VLLM_LOGGING_LEVEL=WARNING`` unless the user set it; ``verbose=True``: vLLM's default
    (INFO) unless the user set it. Must run before Ray starts (worker environments are built from it).
    """
    os.environ[VERBOSE_ENV] = "1" if verbose else "0"
    if not verbose:
        os.environ.setdefault(VLLM_LEVEL_ENV, "WARNING")
    quiet_harmless_warnings()


def worker_log_env() -> dict[str, str]:
    """The console variables a worker's ``runtime_env`` must carry (those set in this process)."""
    return {k: os.environ[k] for k in (VERBOSE_ENV, VLLM_LEVEL_ENV) if k in os.environ}


def is_verbose() -> bool:
    """``logger.verbose`` as this process received it (default: quiet)."""
    return os.environ.get(VERBOSE_ENV, "0") == "1"


class HarmlessVllmWarnings(logging.Filter):
    """Drops vLLM's ``RotaryEmbedding: Failed to load weights`` warning, which every refit logs.

    Why it is harmless: a refit reloads the engine's weights layer by layer
    (``vllm/model_executor/model_loader/reload/layerwise.py``). A rotary-embedding layer holds only its
    ``cos_sin_cache`` buffer, computed from the config and never part of a checkpoint, so a refit with the
    policy's weights loads nothing into it; vLLM then warns and puts the layer's existing cache back, which is
    exactly the right tensor (the rotary base and sizes do not change in training). The refit probe, which
    compares engine and trainer log-probs after every refit, would catch a layer that really failed. Only that
    message from a rotary layer is dropped: the same warning for any other layer class still shows.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) for the rotary-embedding refit warning, True for every other record."""
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        return not str(record.args[0]).endswith("RotaryEmbedding")


def quiet_harmless_warnings() -> None:
    """In quiet mode, install :class:`HarmlessVllmWarnings` on vLLM's layerwise-reload logger (idempotent; call
    before or after vLLM is imported: the logger object is shared). No-op with ``logger.verbose: true``."""
    target = logging.getLogger(REFIT_LOGGER)
    if is_verbose():
        for f in [f for f in target.filters if isinstance(f, HarmlessVllmWarnings)]:
            target.removeFilter(f)
    elif not any(isinstance(f, HarmlessVllmWarnings) for f in target.filters):
        target.addFilter(HarmlessVllmWarnings())


def _fmt(metrics: Mapping[str, float], key: str, spec: str, unit: str = "") -> str | None:
    value = metrics.get(key)
    return None if value is None or not math.isfinite(float(value)) else f"{float(value):{spec}}{unit}"


def step_line(metrics: Mapping[str, float], step: int) -> str:
    """The console line of one logged step, e.g. ``step 2: reward 0.375 | val accuracy 0.500 | 14.2 s``.

    Fields (each only when present and finite): ``train/reward``, ``validation/accuracy``,
    ``timing/train/total_step_time`` (seconds).
    """
    fields = [("reward ", _fmt(metrics, "train/reward", ".3f")),
              ("val accuracy ", _fmt(metrics, "validation/accuracy", ".3f")),
              ("", _fmt(metrics, "timing/train/total_step_time", ".1f", " s"))]
    return f"step {step}: " + " | ".join(label + value for label, value in fields if value is not None)
