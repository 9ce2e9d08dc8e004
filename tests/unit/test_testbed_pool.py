"""The multi-family testbed (TESTBED_POOL, nemo_rl_spec/models/testbed_pool.py), its shipped file and the pool tools."""

from __future__ import annotations

import dataclasses
import importlib.util
import io
import tarfile
from pathlib import Path

import pytest
import torch

from nemo_rl_spec.bench import batch_limited as bl
from nemo_rl_spec.models import testbed as tb
from nemo_rl_spec.models import testbed_pool as tp

ROOT = Path(__file__).resolve().parents[2]


def _terms(question: str) -> int:
    return len(question.rsplit(":", 1)[1].replace("=", "").split()) // 2 + 1


def test_stage_corpus_splits_families_and_applies_each_direct_rate():
    recipe = dataclasses.replace(tb.TESTBED_POOL, families=((tb.POOL_EASY, 0.0), (tb.POOL_MIXED, 1.0)))
    stage1 = tb.stage_corpus(recipe, 1, 7, 9)  # 5 easy + 4 mixed, chains only
    assert [_terms(q) == 2 for q, _ in stage1] == [True] * 5 + [False] * 4
    assert all("\n" in a for _, a in stage1)
    stage2 = tb.stage_corpus(recipe, 2, 7, 9)  # easy keeps its chains, mixed answers directly (rate 1)
    assert [("\n" in a) for _, a in stage2] == [True] * 5 + [False] * 4
    assert stage2[:5] == stage1[:5]  # same seed per family: the same problems
    # the single-family recipe is the stage's sft_conversations call, unchanged
    assert tb.stage_corpus(tb.TESTBED, 2, 3, 6) == tb.sft_conversations(tb.TESTBED, tb.TESTBED.direct_rate, 3, 6)


def _archive(tmp_path: Path, payload: bytes) -> Path:
    path = tmp_path / "pool.tar.xz"
    with tarfile.open(path, "w:xz") as tar:
        info = tarfile.TarInfo("model.safetensors")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    return path


def test_install_refuses_weights_that_do_not_match_the_pin(tmp_path):
    with pytest.raises(RuntimeError, match="pinned"):
        tp.install_testbed_pool(tmp_path / "out", _archive(tmp_path, b"not the pinned weights"))
    with pytest.raises(FileNotFoundError, match="missing"):
        tp.install_testbed_pool(tmp_path / "out2", tmp_path / "absent.tar.xz")


def test_shipped_archive_installs_with_the_pinned_weights(tmp_path):
    tp.install_testbed_pool(tmp_path)
    assert tp.file_sha256(tmp_path / "model.safetensors") == tp.POOL_SHA256
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "model.safetensors")
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert all(torch.equal(w, w.to(torch.bfloat16).float()) for w in weights.values())  # rounded to bf16


def _curve(accs, every=4):
    return [(i * every, 64.0 * i * every, a) for i, a in enumerate(accs)]


def test_batch_limited_by_hand():
    # start 0.2; K plateaus at 0.6 (last 3), 2K at 0.7 -> targets 0.2 + f * 0.5: 0.45 and 0.65
    k = _curve([0.2, 0.3, 0.4, 0.5, 0.6, 0.6, 0.6, 0.66])
    k2 = _curve([0.2, 0.5, 0.66, 0.7, 0.7, 0.7])
    r = bl.compare_seed(k, k2)
    assert r["plateau_K"] == pytest.approx(0.62) and r["plateau_2K"] == pytest.approx(0.7)
    assert r["target_0.9"] == pytest.approx(0.65)
    assert (r["peak_K"], r["peak_step_K"], r["peak_2K"], r["peak_step_2K"]) == (0.66, 28, 0.7, 12)
    assert (r["steps_K_0.5"], r["steps_2K_0.5"]) == (12, 4)
    assert (r["steps_K_0.9"], r["steps_2K_0.9"], r["ratio_0.9"]) == (28, 8, 3.5)
    runs = lambda c: {"runs": {"uniform": {"0": {"curve": c}, "1": {"curve": c}}}}  # noqa: E731
    assert bl.compare_setting(runs(k), runs(k2))["batch_limited"] is True
    assert bl.compare_setting(runs(k), runs(k))["batch_limited"] is False  # same curve: ratio 1
    never = _curve([0.2, 0.2, 0.2, 0.2])
    assert bl.compare_setting(runs(never), runs(k2))["ratios_0.9"] == [None, None]
    fell = _curve([0.2, 0.1, 0.1, 0.1])  # both end below the start: no target, not "reached at step 0"
    r = bl.compare_seed(fell, _curve([0.2, 0.3, 0.15, 0.15, 0.15]))
    assert (r["steps_K_0.9"], r["steps_2K_0.9"], r["ratio_0.9"]) == (None, None, None)


def test_per_source_pass_rates():
    spec = importlib.util.spec_from_file_location("eval_pass_rates", ROOT / "examples" / "eval_pass_rates.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rewards = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 0], dtype=torch.float32)  # 3 prompts x n 4
    out = mod.per_source_summary(rewards, ["a", "b", "a"], 4)
    assert out["a"]["problems"] == 2 and out["a"]["mean_pass_rate"] == pytest.approx(0.625)
    assert out["a"]["share_at_least_0.95"] == 0.5 and out["b"]["share_at_most_0.05"] == 1.0
