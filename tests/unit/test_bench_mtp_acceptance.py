"""``nemo_rl_spec.bench.mtp_acceptance``: finding a bench run's final checkpoint and the per-mode summary (the vLLM
measurement itself needs an engine and runs in the benchmark, docs/results/occ.md)."""

from __future__ import annotations

import pytest

from nemo_rl_spec.bench import mtp_acceptance as ma


def test_final_checkpoint_takes_the_highest_complete_step(tmp_path):
    assert ma.final_checkpoint(tmp_path) is None
    for step in (10, 40):
        (tmp_path / "ckpt" / f"step_{step}" / "policy").mkdir(parents=True)
        (tmp_path / "ckpt" / f"step_{step}" / "policy" / ma.CKPT_FILE).write_bytes(b"")
    (tmp_path / "ckpt" / "tmp_step_50" / "policy").mkdir(parents=True)  # unfinished: ignored
    (tmp_path / "ckpt" / "step_60" / "policy").mkdir(parents=True)  # no policy file: ignored
    assert ma.final_checkpoint(tmp_path) == (40, tmp_path / "ckpt" / "step_40" / "policy")


def test_summarise_per_mode_acceptance_and_training_metric():
    runs = {
        "detach": {
            "43": {"k1": {"acceptance_length": 1.4}, "k3": {"acceptance_length": 1.7}, "train_mtp_acceptance": 0.40},
            "44": {"k1": {"acceptance_length": 1.6}, "k3": {"acceptance_length": 1.9}, "train_mtp_acceptance": 0.50},
        }
    }
    out = ma.summarise(runs, ["k1", "k3"])["detach"]
    assert out["k1"]["per_seed"] == {"43": 1.4, "44": 1.6} and out["k1"]["mean"] == pytest.approx(1.5)
    assert out["k3"]["mean"] == pytest.approx(1.8) and out["train_mtp_acceptance"]["mean"] == pytest.approx(0.45)
    assert 1.4 <= out["k1"]["interval90"][0] <= out["k1"]["interval90"][1] <= 1.6
