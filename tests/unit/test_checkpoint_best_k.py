"""checkpointing.metric_name / higher_is_better: best-k pruning by a logged metric, the newest always kept
(worked by hand after every finalize)."""

from pathlib import Path

import pytest

from nemo_rl_spec.utils.checkpoint import CheckpointManager
from nemo_rl_spec.utils.config import ConfigError, load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_tiny.yaml"

ACC = {1: 0.2, 2: 0.9, 3: None, 4: 0.5, 5: 0.1}  # step 3 has no validation metric


def _run(tmp_path, higher_is_better: bool) -> list[list[int]]:
    mgr = CheckpointManager(
        tmp_path, keep_top_k=2, metric_name="validation/accuracy", higher_is_better=higher_is_better
    )
    kept = []
    for step, acc in ACC.items():
        info = {"train/reward": 0.0} if acc is None else {"validation/accuracy": acc}
        mgr.finalize(mgr.begin(step), step, info, "grpo: {}\n")
        kept.append(mgr.steps())
    return kept


def test_best_k_higher_is_better(tmp_path):
    # after 3: best 2 (0.9), 1 (0.2), newest 3; after 4: best 2, 4 (newest); after 5: 2, 4 + newest 5
    assert _run(tmp_path, True) == [[1], [1, 2], [1, 2, 3], [2, 4], [2, 4, 5]]


def test_best_k_lower_is_better(tmp_path):
    # after 4: best 1 (0.2), 4 (0.5); after 5: best 5 (0.1), 1 (0.2)
    assert _run(tmp_path, False) == [[1], [1, 2], [1, 2, 3], [1, 4], [1, 5]]


def test_metric_name_keys_validate():
    cfg = load_config(TINY, ["+checkpointing.metric_name=validation/accuracy", "+checkpointing.higher_is_better=false"])
    assert cfg.checkpointing.metric_name == "validation/accuracy" and not cfg.checkpointing.higher_is_better
    with pytest.raises(ConfigError, match="checkpointing.higher_is_better"):
        load_config(TINY, ["+checkpointing.higher_is_better=maybe"])
