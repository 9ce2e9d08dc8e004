"""Checkpoints in NeMo-RL's layout, written so that a failure never damages an earlier checkpoint.

Layout::

    checkpoint_dir/
      step_5/                 complete checkpoint (only ever created by an atomic rename)
        training_info.json    {"step": 5, ...}
        config.yaml           the resolved recipe
        policy/               model + optimizer (written by the policy worker)
        train_state.pt        dataloader / RNG / algorithm state (written by the driver)
      tmp_step_10/            a checkpoint being written; renamed to step_10 only when complete

A run killed while writing leaves ``tmp_step_N`` behind; it is ignored by :meth:`latest` and removed by the next
:meth:`begin`. ``os.rename`` of a directory is atomic on POSIX file systems.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from safetensors import safe_open

_STEP_RE = re.compile(r"^step_(\d+)$")


class CheckpointManager:
    """Creates, finalizes, lists and prunes checkpoints under ``checkpoint_dir``.

    Args:
        checkpoint_dir: root folder (created if missing).
        keep_top_k: number of complete checkpoints kept; the others are deleted after a new one is finalized
            (never before). Without ``metric_name`` the most recent ones.
        metric_name: NeMo-RL's ``checkpointing.metric_name``: keep the ``keep_top_k`` best by this key of
            ``training_info.json`` (e.g. ``validation/accuracy``), and always the newest (the one a resume loads).
            Checkpoints without the key rank below every one with it (older first).
        higher_is_better: ``checkpointing.higher_is_better``: the best is the largest value (else the smallest).
    """

    def __init__(
        self, checkpoint_dir: str | Path, keep_top_k: int, metric_name: str | None = None, higher_is_better: bool = True
    ) -> None:
        self.root = Path(checkpoint_dir)
        self.keep_top_k = keep_top_k
        self.metric_name, self.higher_is_better = metric_name, higher_is_better
        self.root.mkdir(parents=True, exist_ok=True)

    def steps(self) -> list[int]:
        """Steps of complete checkpoints, ascending."""
        found = (_STEP_RE.match(p.name) for p in self.root.iterdir() if p.is_dir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> Path | None:
        """Path of the newest complete checkpoint, or None."""
        steps = self.steps()
        return self.root / f"step_{steps[-1]}" if steps else None

    def begin(self, step: int) -> Path:
        """Create an empty ``tmp_step_<step>`` (removing leftovers of killed runs) and return it."""
        for stale in self.root.glob("tmp_step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = self.root / f"tmp_step_{step}"
        tmp.mkdir()
        return tmp

    def finalize(self, tmp: Path, step: int, info: dict, config_yaml: str) -> Path:
        """Write ``training_info.json`` and ``config.yaml`` into ``tmp``, fsync, rename to ``step_<step>``,
        then prune old checkpoints.

        Raises:
            FileExistsError: ``step_<step>`` already exists (a checkpoint is never overwritten).
        """
        (tmp / "config.yaml").write_text(config_yaml)
        with open(tmp / "training_info.json", "w") as fh:
            json.dump({"step": step, **info}, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        final = self.root / f"step_{step}"
        if final.exists():
            raise FileExistsError(f"checkpoint {final} already exists; refusing to overwrite it")
        os.rename(tmp, final)
        self._prune()
        return final

    def kept_steps(self) -> list[int]:
        """The steps :meth:`_prune` keeps, ascending: the ``keep_top_k`` newest, or with ``metric_name`` the
        ``keep_top_k`` best by the metric (ties: the newer) plus the newest."""
        steps = self.steps()
        if self.metric_name is None:
            return steps[-self.keep_top_k :]
        sign = 1.0 if self.higher_is_better else -1.0

        def rank(step: int) -> tuple[int, float, int]:
            value = self.read_info(self.root / f"step_{step}").get(self.metric_name)
            return (0, 0.0, step) if value is None else (1, sign * float(value), step)

        best = sorted(steps, key=rank, reverse=True)[: self.keep_top_k]
        return sorted(set(best) | set(steps[-1:]))

    def _prune(self) -> None:
        kept = set(self.kept_steps())
        for step in self.steps():
            if step not in kept:
                shutil.rmtree(self.root / f"step_{step}", ignore_errors=True)

    @staticmethod
    def read_info(path: Path) -> dict:
        """The ``training_info.json`` of a complete checkpoint."""
        return json.loads((path / "training_info.json").read_text())


def read_safetensors(directory: str | Path, names: set[str]) -> dict:
    """Those of ``names`` found in the ``*.safetensors`` files of the HF checkpoint ``directory`` (files in sorted
    order), as ``{name: torch.Tensor}`` with their stored shapes and dtypes; a name in no file is absent."""
    found = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for name in set(fh.keys()) & names:
                found[name] = fh.get_tensor(name)
    return found
