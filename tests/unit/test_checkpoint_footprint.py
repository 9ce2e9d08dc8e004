"""The demo's disk footprint: ``checkpointing.keep_top_k`` bounds what stays on disk after many saves,
``checkpointing.save_optimizer`` (NeMo-RL's key) is false in the default recipe only, and a resume from a weights-only
checkpoint says that the optimizer restarted."""

from pathlib import Path

import pytest

from nemo_rl_spec.algorithms.grpo_setup import resume_line
from nemo_rl_spec.utils.checkpoint import CheckpointManager
from nemo_rl_spec.utils.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PAYLOAD = 1000  # bytes of the stand-in policy file of each checkpoint


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("k", [1, 2, 3])
def test_keep_top_k_bounds_the_checkpoints_on_disk(tmp_path, k):
    """Seven saves (steps 5, 10, ... 35): after each only the newest min(saves, k) remain, stale tmp dirs included."""
    mgr = CheckpointManager(tmp_path, keep_top_k=k)
    saved = []
    for step in range(5, 40, 5):
        tmp = mgr.begin(step)
        (tmp / "policy.pt").write_bytes(b"w" * PAYLOAD)
        mgr.finalize(tmp, step, {"train/reward": 0.5, "optimizer_saved": False}, "grpo: {}\n")
        saved.append(step)
        assert mgr.steps() == saved[-k:]
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"step_{s}" for s in saved[-k:])
    per_checkpoint = _disk_bytes(tmp_path / "step_35")
    assert per_checkpoint > PAYLOAD and _disk_bytes(tmp_path) == k * per_checkpoint


def test_save_optimizer_is_false_in_the_demo_only():
    assert load_config(CONFIGS / "grpo_math_smollm2_135m.yaml", []).checkpointing.save_optimizer is False
    assert load_config(CONFIGS / "grpo_math_tiny.yaml", []).checkpointing.save_optimizer is True  # NeMo-RL's default
    demo = load_config(CONFIGS / "grpo_math_smollm2_135m.yaml", ["checkpointing.save_optimizer=true"])
    assert demo.checkpointing.save_optimizer is True  # README: how to keep the optimizer for an exact resume


def test_resume_line_says_the_optimizer_restarts():
    assert resume_line(Path("ck/step_5"), {"step": 5, "optimizer_saved": True}) == "resumed from ck/step_5 (step 5)"
    assert resume_line(Path("ck/step_5"), {"step": 5}) == "resumed from ck/step_5 (step 5)"  # older checkpoints
    line = resume_line(Path("ck/step_10"), {"step": 10, "optimizer_saved": False})
    assert line.startswith("resumed from ck/step_10 (step 10); it holds no optimizer state")
    assert "checkpointing.save_optimizer=false" in line and "not an exact resume" in line
