"""Precision choices: ``policy.precision: auto``, the engine dtype and the refit check's tolerance (docs/guides/precision.md).

- :func:`native_bf16` probes the CPU for native bfloat16 arithmetic (AMX-BF16 or AVX512-BF16 in ``/proc/cpuinfo``);
  oneDNN runs bf16 matmuls on those units, about twice as fast as fp32 on this machine (docs/results/precision.md). Without
  them bf16 is emulated and slower than fp32.
- :func:`choose_precision` turns ``policy.precision`` (``float32 | bfloat16 | auto``) into the dtype a run uses, with
  the one-line reason the driver prints: ``auto`` is bf16 on a GPU and on a CPU with native bf16, fp32 otherwise; an
  explicit ``bfloat16`` on a CPU without native bf16 runs, with a warning.
- :func:`refit_tolerance` is ``policy.refit.logprob_mismatch_threshold: auto``: the largest mean |log-prob difference|
  (nats) between the trainer and a freshly refit engine that still means "the weights arrived", per pair of dtypes
  (measured, :data:`REFIT_TOLERANCE`).
"""

from __future__ import annotations

import warnings
from pathlib import Path

PRECISIONS = ("float32", "bfloat16")
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
CPUINFO = Path("/proc/cpuinfo")

#: (trainer dtype, engine dtype) -> refit probe tolerance in nats (mean |logp_engine - logp_trainer| over the probe's
#: tokens). fp32/fp32 is the threshold the project has always used (measured mismatches ~1e-5 on CPU). A pair with
#: bf16 gets ~3x the largest mismatch measured (0.0798 nats, SmolLM2-135M, bf16/bf16, over 3 seeds x 10 steps of the
#: default recipe; docs/guides/precision.md, "Refit tolerance"); a stale layer moves the probe by far more.
REFIT_TOLERANCE: dict[tuple[str, str], float] = {
    ("float32", "float32"): 1.0e-3,
    ("bfloat16", "bfloat16"): 0.25,
    ("float32", "bfloat16"): 0.25,
    ("bfloat16", "float32"): 0.25,
}


def read_cpuinfo(cpuinfo: Path = CPUINFO) -> str | None:
    """The text of ``cpuinfo`` (``/proc/cpuinfo``); None when it cannot be read (not Linux)."""
    try:
        return cpuinfo.read_text()
    except OSError:
        return None


def cpuinfo_value(text: str, *names: str) -> str | None:
    """The value of the first line of a ``/proc/cpuinfo`` text whose field name (before the ``:``, stripped,
    lower-cased) is one of ``names`` (lower case); None without one."""
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip().lower() in names:
            return value.strip()
    return None


def cpu_flags(cpuinfo: Path = CPUINFO) -> set[str]:
    """The ``flags`` of the first processor in ``cpuinfo`` (empty when the file is missing: not Linux)."""
    flags = cpuinfo_value(read_cpuinfo(cpuinfo) or "", "flags")
    return set(flags.split()) if flags else set()


def native_bf16(cpuinfo: Path = CPUINFO) -> tuple[bool, list[str]]:
    """(True, the flags found) when the CPU has native bf16 arithmetic (any of :data:`NATIVE_BF16_FLAGS`)."""
    found = [f for f in NATIVE_BF16_FLAGS if f in cpu_flags(cpuinfo)]
    return bool(found), found


def choose_precision(requested: str, on_gpu: bool) -> tuple[str, str]:
    """The dtype a run uses for ``policy.precision=requested`` and why (one line for the console).

    Args:
        requested: ``float32``, ``bfloat16`` or ``auto``.
        on_gpu: ``cluster.gpus_per_node > 0``.
    Returns:
        (``"float32"`` or ``"bfloat16"``, reason).
    Raises:
        ValueError: ``requested`` is none of the three.
    Warns:
        UserWarning: explicit ``bfloat16`` on a CPU without native bf16 (it runs, emulated, slower than fp32).
    """
    if requested not in (*PRECISIONS, "auto"):
        raise ValueError(f"policy.precision={requested!r}: expected float32, bfloat16 or auto")
    if on_gpu:
        return ("bfloat16", "auto: a GPU run") if requested == "auto" else (requested, "set in the recipe")
    native, flags = native_bf16()
    if requested == "auto":
        if native:
            return "bfloat16", f"auto: this CPU has native bf16 ({', '.join(flags)})"
        return "float32", f"auto: this CPU has no native bf16 (none of {', '.join(NATIVE_BF16_FLAGS)} in /proc/cpuinfo)"
    if requested == "bfloat16" and not native:
        warnings.warn(
            "policy.precision=bfloat16 on a CPU without native bf16 (none of "
            f"{', '.join(NATIVE_BF16_FLAGS)}): it runs, emulated, slower than float32",
            stacklevel=2,
        )
    return requested, "set in the recipe"


def refit_tolerance(trainer: str, engine: str) -> float:
    """The refit probe's tolerance (nats) for a trainer in ``trainer`` dtype and an engine in ``engine`` dtype.

    Raises:
        KeyError: a dtype outside :data:`PRECISIONS` (``auto`` must be resolved first).
    """
    return REFIT_TOLERANCE[(trainer, engine)]


def precision_line(policy) -> str:
    """One console line for a run's ``policy`` section (:class:`~nemo_rl_spec.utils.config_schema.PolicyConfig`):
    the training and engine dtypes, why (``auto`` resolved, or set), and the refit probe's tolerance."""
    engine = "policy.generation.vllm_cfg.precision" if policy.generation.vllm_cfg.precision else "follows the policy"
    return (
        f"precision: training {policy.precision} ({policy.precision_reason}); engine {policy.engine_precision} "
        f"({engine}); refit tolerance {policy.refit_threshold} nats"
    )
