"""Benchmark plumbing shared by ``examples/bench_*.py``: one real GRPO run as a subprocess, resumable, and
bootstrap intervals over seeds.

Each run is ``examples/run_grpo.py`` in its own directory ``run_dir`` (``logs/metrics.jsonl``, ``ckpt/``,
``stdout.log``, ``run.json``); ``run.json`` is written only when the subprocess has ended, so an interrupted
benchmark re-runs exactly the runs that did not finish.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nemo_rl_spec.utils import logger

ROOT = Path(__file__).resolve().parents[2]


def read_metrics(path: Path) -> list[dict]:
    """Records of a ``metrics.jsonl`` (:func:`nemo_rl_spec.utils.logger.read_metrics`); empty when a run wrote none."""
    return logger.read_metrics(path) if path.is_file() else []


def result_paths(out: str, work_dir: str | None) -> tuple[Path, Path]:
    """A benchmark's (result JSON, run directory): ``out`` resolved, with its parent created; ``work_dir`` resolved,
    or ``<out stem>_runs/`` next to ``out`` when it is None (the ``--out`` / ``--work-dir`` of the bench commands)."""
    path = Path(out).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    return path, Path(work_dir).resolve() if work_dir else path.with_name(path.stem + "_runs")


def run_grpo_subprocess(
    config: str, overrides: list[str], run_dir: Path, *, label: str, timeout_s: float, reuse: bool
) -> dict:
    """Run ``examples/run_grpo.py --config config overrides...`` with its logs and checkpoints in ``run_dir``.

    With ``reuse``, a run whose ``run.json`` records return code 0 is not run again (its record is returned).
    Otherwise ``run_dir`` is emptied first. Returns ``{"command", "returncode" (int, or "timeout"), "wall_s"}``;
    never raises for a failed run (the caller reports it).
    """
    info_path = run_dir / "run.json"
    if reuse and info_path.is_file() and json.loads(info_path.read_text()).get("returncode") == 0:
        return json.loads(info_path.read_text())
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [
        sys.executable,
        str(ROOT / "examples" / "run_grpo.py"),
        "--config",
        config,
        *overrides,
        f"logger.log_dir={run_dir}/logs",
        f"checkpointing.checkpoint_dir={run_dir}/ckpt",
        "logger.progress_bar=false",
    ]
    print(f"[bench] {label}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.time()
    with open(run_dir / "stdout.log", "w") as log:
        try:
            rc = subprocess.run(
                cmd,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    info = {"command": cmd, "returncode": rc, "wall_s": round(time.time() - t0, 1)}
    info_path.write_text(json.dumps(info, indent=1))
    print(f"[bench] {label}: rc={rc} in {info['wall_s']:.0f} s", flush=True)
    return info


def bootstrap_interval(
    values: list[float], *, level: float = 0.9, resamples: int = 10000, seed: int = 0
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean of ``values`` (resampling seeds with replacement).

    Returns ``(low, high)`` at the given two-sided ``level``, or None for fewer than 2 values. Deterministic in
    ``seed``. With a handful of seeds it is narrow-biased (the percentile bootstrap of n = 3 sees only 10 distinct
    resample means); report the per-seed values beside it.

    Raises:
        ValueError: level not in (0, 1).
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level={level}; expected 0 < level < 1")
    if len(values) < 2:
        return None
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(resamples))
    lo_idx = int((1.0 - level) / 2.0 * resamples)
    hi_idx = min(resamples - 1, int((1.0 + level) / 2.0 * resamples))
    return means[lo_idx], means[hi_idx]


def mean_and_interval(values: list[float]) -> dict:
    """``{"mean": mean of values (None if empty), "interval90": bootstrap_interval(values) (None below 2)}``: the
    per-method / per-mode summary over seeds of the benchmarks."""
    return {"mean": statistics.fmean(values) if values else None, "interval90": bootstrap_interval(values)}


def finish_plot(fig, ax, png: Path, xlabel: str, ylabel: str) -> None:
    """Label, grid and legend ``ax`` (a matplotlib Axes), write ``fig`` to ``png`` (110 dpi) and close it."""
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
