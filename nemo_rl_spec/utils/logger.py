"""Metric logging: ``metrics.jsonl`` (always), TensorBoard, W&B and MLflow (optional; utils/trackers.py), plus the
end-of-run plot.

Metric names follow NeMo-RL (``train/reward``, ``validation/accuracy``, ``timing/train/generation`` ...). Each JSONL
line is ``{"step": int, "<name>": float, ...}``; lines are flushed as written, so a killed run keeps every step
it finished.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping, Sequence

from tqdm import tqdm

from nemo_rl_spec.utils.console import step_report
from nemo_rl_spec.utils.trackers import Tracker


class Logger:
    """Writes scalar metrics to ``<log_dir>/metrics.jsonl`` and, if enabled, TensorBoard event files and trackers.

    Args:
        log_dir: output folder (created).
        tensorboard_enabled: also write TensorBoard scalars under ``<log_dir>/tensorboard``.
        console: also print one line per logged step (:func:`~nemo_rl_spec.utils.console.step_report`: the step
            line, plus a per-step table with ``logger.verbose``; through ``tqdm.write``, so a progress bar stays
            intact).
        trackers: started experiment trackers (:func:`~nemo_rl_spec.utils.trackers.build_trackers`) that get every
            record with the same names, and the curve image (:meth:`log_image`); closed by :meth:`close`.
    """

    def __init__(
        self, log_dir: str | Path, tensorboard_enabled: bool, console: bool = False, trackers: Sequence[Tracker] = ()
    ) -> None:
        self.console = console
        self.trackers = list(trackers)
        self.last_step = 0
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.log_dir / "metrics.jsonl"
        self._tb = None
        if tensorboard_enabled:
            from torch.utils.tensorboard import SummaryWriter  # lazy: this module imports without torch

            self._tb = SummaryWriter(log_dir=str(self.log_dir / "tensorboard"))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Append one JSONL record for ``step``, mirror finite scalars to TensorBoard and all to the trackers."""
        record = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with open(self.jsonl_path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        self.last_step = max(self.last_step, step)
        for tracker in self.trackers:
            tracker.log_metrics({k: v for k, v in record.items() if k != "step"}, step)
        if self._tb is not None:
            for name, value in record.items():
                if name != "step" and math.isfinite(value):
                    self._tb.add_scalar(name, value, step)
            self._tb.flush()
        if self.console:
            tqdm.write(step_report(record, step))  # + the per-step table with logger.verbose

    def truncate_after(self, step: int) -> None:
        """Drop records with ``step > step`` (used on resume, so replayed steps are not logged twice)."""
        if not self.jsonl_path.exists():
            return
        kept = [line for line in self.jsonl_path.read_text().splitlines() if json.loads(line)["step"] <= step]
        self.jsonl_path.write_text("".join(line + "\n" for line in kept))

    def log_image(self, png: str | Path) -> None:
        """Give the trackers the image at ``png`` (the training curves), at the last logged step."""
        for tracker in self.trackers:
            tracker.log_image(png, self.last_step)

    def close(self) -> None:
        """Flush and close TensorBoard and the trackers."""
        if self._tb is not None:
            self._tb.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []


def read_metrics(jsonl_path: str | Path) -> list[dict]:
    """All records of a ``metrics.jsonl`` file, in order."""
    return [json.loads(line) for line in Path(jsonl_path).read_text().splitlines() if line.strip()]


def plot_training_curves(jsonl_path: str | Path, out_png: str | Path) -> Path:
    """Plot ``train/reward`` and ``validation/accuracy`` against step into ``out_png``."""
    import matplotlib  # lazy: matplotlib only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot

    records = read_metrics(jsonl_path)
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, style in (("train/reward", "-o"), ("validation/accuracy", "--s")):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points), style, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return Path(out_png)
