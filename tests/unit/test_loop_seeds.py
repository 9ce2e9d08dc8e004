"""examples/loop_seeds_table.py (nemo_rl_spec.bench.loop_seeds): per-seed ratios of the loop benchmark's outputs,
against values worked by hand from two small synthetic outputs."""

from __future__ import annotations

import json

import pytest

from nemo_rl_spec.bench import loop_seeds


def _output(ar_tps, ar_gen, ar_reward, spec_tps, spec_gen, spec_reward, gen_ratio, step_ratio) -> dict:
    return {
        "modes": {
            "sync/autoregressive": {"tokens_per_s": ar_tps, "exposed_generation_s": ar_gen, "mean_reward": ar_reward},
            "sync/speculative": {
                "tokens_per_s": spec_tps,
                "exposed_generation_s": spec_gen,
                "mean_reward": spec_reward,
                "acceptance_length": 2.0,
            },
            "sync/speculative@broken": {"error": "engine did not start"},
            "async1/speculative": {"tokens_per_s": 1.0, "exposed_generation_s": 0.1, "mean_reward": 0.0},
        },
        "ratios_vs_autoregressive": {
            "sync/speculative": {"generation": {"of_means": gen_ratio}, "step": {"of_means": step_ratio}}
        },
    }


def test_per_seed_ratios_and_the_interval_over_seeds(tmp_path):
    a, b = tmp_path / "seed3.json", tmp_path / "seed4.json"
    # seed 3: 200 tok/s x 10 s = 2000 tokens (AR); 250 tok/s x 9 s = 2250 tokens
    a.write_text(json.dumps(_output(200.0, 10.0, 0.25, 250.0, 9.0, 0.30, 0.9, 1.1)))
    # seed 4: 100 x 8 = 800 tokens (AR); 150 x 4 = 600 tokens
    b.write_text(json.dumps(_output(100.0, 8.0, 0.50, 150.0, 4.0, 0.25, 0.5, 0.95)))
    summary = loop_seeds.summarize([str(a), str(b)])
    assert set(summary["modes"]) == {"sync/speculative"}  # the failed mode and the async one are left out
    spec = summary["modes"]["sync/speculative"]
    assert spec["tokens_per_s"]["per_seed"] == {"seed3": 1.25, "seed4": 1.5}
    assert spec["tokens"]["per_seed"] == {"seed3": 1.125, "seed4": 0.75}
    assert spec["generation"]["per_seed"] == {"seed3": 0.9, "seed4": 0.5}
    assert spec["step"]["per_seed"] == {"seed3": 1.1, "seed4": 0.95}
    assert spec["mean_reward_minus_ar"]["per_seed"] == pytest.approx({"seed3": 0.05, "seed4": -0.25})
    assert spec["tokens_per_s"]["mean"] == pytest.approx(1.375)
    low, high = spec["tokens_per_s"]["interval90"]
    assert (low, high) == (1.25, 1.5)  # two seeds: the resampled means run from one seed's value to the other's
    assert "| sync/speculative | tokens_per_s | 1.250 / 1.500 | 1.375 | [1.250, 1.500] |" in loop_seeds.table(summary)


def test_one_seed_has_no_interval(tmp_path):
    a = tmp_path / "seed3.json"
    a.write_text(json.dumps(_output(200.0, 10.0, 0.25, 250.0, 9.0, 0.30, 0.9, 1.1)))
    out = tmp_path / "summary.json"
    assert loop_seeds.main(["--out", str(out), str(a)]) == 0
    assert json.loads(out.read_text())["modes"]["sync/speculative"]["step"]["interval90"] is None


def test_inputs_with_the_same_stem_are_refused(tmp_path):
    paths = []
    for seed in (3, 4):
        (tmp_path / f"seed{seed}").mkdir()
        paths.append(tmp_path / f"seed{seed}" / "bench.json")
        paths[-1].write_text(json.dumps(_output(200.0, 10.0, 0.25, 250.0, 9.0, 0.30, 0.9, 1.1)))
    with pytest.raises(ValueError, match="stems repeat"):
        loop_seeds.summarize([str(p) for p in paths])
