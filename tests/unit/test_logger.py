"""metrics.jsonl records, resume truncation, and the end-of-run plot."""

import json

from nemo_rl_spec.utils.logger import Logger, plot_training_curves, read_metrics


def test_jsonl_tensorboard_truncate_and_plot(tmp_path):
    log = Logger(tmp_path, tensorboard_enabled=True)
    log.log_metrics({"validation/accuracy": 0.25}, step=0)
    for step in (1, 2, 3):
        log.log_metrics({"train/reward": step / 4, "timing/train/generation": 1.5}, step=step)
    log.close()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[2] == {"step": 2, "train/reward": 0.5, "timing/train/generation": 1.5}
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    log.truncate_after(1)
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    png = plot_training_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
