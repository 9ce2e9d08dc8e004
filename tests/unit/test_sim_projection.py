"""Projection of measured CPU speculative rows to GPUs (nemo_rl_spec.sim.projection), against independent paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nemo_rl_spec.sim.interfaces import ScenarioSpec
from nemo_rl_spec.sim.presets import MODELS, eagle3_draft
from nemo_rl_spec.sim.projection import GPU_BYTES, main, project_bench
from nemo_rl_spec.sim.sweeps import pass_speedup_vs_batch

CONTEXT_PROMPT, MAX_NEW = 45.0, 80


def bench(acceptance: dict[int, float] | None = None) -> dict:
    """A rollout-benchmark JSON of two measured rows (values invented, shape as bench_spec_rollouts writes)."""
    rows = {
        "k1_b1": {"k": 1, "batch": 1, "acceptance_length": 1.7, "step_cost_ratio": 1.3, "speedup": 1.2},
        "k3_b8": {"k": 3, "batch": 8, "acceptance_length": 2.2, "step_cost_ratio": 2.7, "speedup": 0.9},
    }
    meta = {
        "model": "smollm2-135m-instruct",
        "prompt_tokens_mean": CONTEXT_PROMPT,
        "max_new_tokens": MAX_NEW,
        "draft_training": {"draft_vocab_size": 1160},
    }
    return {
        "meta": meta,
        "rows": rows,
        "step_costs": {"acceptance_rate": {str(k): a for k, a in (acceptance or {1: 0.7, 3: 0.6}).items()}},
    }


@pytest.mark.parametrize("hw", ["h100", "gb200"])
def test_sweep_matches_scenario_path(hw):
    """The sweep's E_k(a) / r equals the scenario machinery's per-pass gain (sweeps.pass_speedup_vs_batch: model,
    draft and acceptance resolved through ScenarioSpec), same model (bf16), draft shape, context and batch."""
    out = project_bench(bench(), hardware=[hw], sweep_batches=(1, 8, 32))
    target = MODELS["smollm2-135m"].model_copy(update=GPU_BYTES)
    for k, a in ((1, 0.7), (3, 0.6)):
        scn = ScenarioSpec.model_validate(
            {
                "name": "x",
                "model": target.model_dump(),
                "hardware": hw,
                "layout": {"total_devices": 1},
                "workload": {
                    "num_prompts": 1,
                    "generations_per_prompt": 1,
                    "prompt_tokens": 45,
                    "response": {"median_tokens": 80, "sigma": 0.0, "max_tokens": 80},
                },
                "speculative": {"k": k, "alpha": a, "draft": eagle3_draft(target, 1160).model_dump()},
            }
        )
        ref = pass_speedup_vs_batch(scn, [1, 8, 32], CONTEXT_PROMPT + MAX_NEW / 2)
        got = [r["speedup"] for r in out["sweep"][hw] if r["k"] == k]
        assert got == pytest.approx([r["pass_speedup"] for r in ref], rel=1e-9)


def test_rows_keep_measured_acceptance_and_schedule_is_argmax():
    out = project_bench(bench(), hardware=["cpu", "h100"], sweep_batches=(1, 2, 4, 8, 16, 32, 64))
    for r in out["rows"]:
        for hw in ("cpu", "h100"):
            assert r[f"speedup_{hw}"] == pytest.approx(r["acceptance_length"] / r[f"r_{hw}"])
    # Memory-bound GPU: verifying k+1 tokens costs little more than decoding 1, so r stays far below the CPU's.
    k3 = next(r for r in out["rows"] if r["k"] == 3)
    assert k3["r_h100"] < k3["r_cpu"]
    # The schedule picks, at each swept batch, the k with the larger E_k(a) / r (or 0 when neither beats 1).
    for hw in ("cpu", "h100"):
        sched = out["schedule"][hw]
        for b in (1, 2, 4, 8, 16, 32, 64):
            gains = {r["k"]: r["speedup"] for r in out["sweep"][hw] if r["batch"] == b}
            best = max(gains, key=lambda k: (gains[k], -k))
            want = best if gains[best] >= 1.0 else 0
            got = next(k for lo, hi, k in sched if lo <= b <= hi)
            assert got == want, (hw, b, gains, sched)


def test_bad_input_is_named(tmp_path: Path):
    with pytest.raises(KeyError, match="'rows'"):
        project_bench({"meta": {}})
    bad = bench()
    bad["meta"]["model"] = "llama-70b"
    with pytest.raises(KeyError, match="llama-70b"):
        project_bench(bad)
    with pytest.raises(KeyError, match="gpt-9"):
        project_bench(bench(), hardware=["h100"], target="gpt-9")
    with pytest.raises(SystemExit, match="no such file"):
        main(["--bench", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o.json")])


def test_cli_writes_labelled_json(tmp_path: Path):
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(bench()))
    assert main(["--bench", str(src), "--out", str(tmp_path / "p.json")]) == 0
    got = json.loads((tmp_path / "p.json").read_text())
    assert "not a GPU measurement" in got["label"]
    assert got["what_if_target"]["target"] == "qwen3-8b"
    assert "cpu" not in got["what_if_target"]["hardware"]
