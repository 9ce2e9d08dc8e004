"""Projection of measured CPU speculative rows to GPUs (nemo_rl_spec.sim.projection), against independent paths:
the rollout benchmark and the long-tail recipe's bench_spec_schedule JSONs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nemo_rl_spec.sim.formulas import alpha_for_acceptance_length
from nemo_rl_spec.sim.generation import ar_pass_cost, engine_makespan, spec_pass_cost
from nemo_rl_spec.sim.interfaces import ScenarioSpec
from nemo_rl_spec.sim.presets import MODELS, eagle3_draft, resolve_profile
from nemo_rl_spec.sim.projection import (
    GPU_BYTES,
    acceptance_from_rollout,
    main,
    project_bench,
    project_longtail,
    rollout_profile,
    rollout_seconds,
)
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


def scenario(hw: str, k: int, alpha: float, draft_vocab: int) -> ScenarioSpec:
    """SmolLM2-135M (bf16 on GPUs) with an EAGLE-3 draft of ``draft_vocab`` rows, one device, through ScenarioSpec."""
    target = MODELS["smollm2-135m"].model_copy(update=GPU_BYTES) if hw != "cpu" else MODELS["smollm2-135m"]
    return ScenarioSpec.model_validate(
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
            "speculative": {"k": k, "alpha": alpha, "draft": eagle3_draft(target, draft_vocab).model_dump()},
        }
    )


@pytest.mark.parametrize("hw", ["h100", "gb200"])
def test_sweep_matches_scenario_path(hw):
    """The sweep's E_k(a) / r equals the scenario machinery's per-pass gain (sweeps.pass_speedup_vs_batch: model,
    draft and acceptance resolved through ScenarioSpec), same model (bf16), draft shape, context and batch."""
    out = project_bench(bench(), hardware=[hw], sweep_batches=(1, 8, 32))
    for k, a in ((1, 0.7), (3, 0.6)):
        ref = pass_speedup_vs_batch(scenario(hw, k, a, 1160), [1, 8, 32], CONTEXT_PROMPT + MAX_NEW / 2)
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


# --- the long-tail recipe's benchmark (bench_spec_schedule JSONs) ---

LT_VOCAB, LT_PROMPT, LT_SWEEP_TOKENS = 1647, 45.0, 16
LT_GROUPS = ([5, 9, 2, 20], [3, 3, 7, 1])  # AR response lengths per group (invented)


def schedule_bench(tmp_path: Path) -> tuple[str, dict]:
    """A bench_spec_schedule JSON (values invented, shape as spec_schedule.main writes) with the recipe and the
    calibration entry it references written to ``tmp_path``."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "policy:\n  model_name: smollm2-135m-instruct\n  generation:\n    max_new_tokens: 64\n"
        "    dynamic_speculation: {acceptance_rate: 0.6, min_speedup: 1.2}\n"
    )
    entry = tmp_path / "entry.json"
    entry.write_text(
        json.dumps(
            {
                "key": {"draft": {"draft_vocab_rows": LT_VOCAB}},
                "step_costs": {
                    "ar_step_s": {"1": 0.02, "8": 0.04},
                    "spec_step_s": {str(k): {"1": 0.02 + 0.004 * k, "8": 0.04 + 0.03 * k} for k in (1, 2, 3)},
                },
            }
        )
    )
    rollouts = []
    for lengths in LT_GROUPS:
        by_batch = {str(b): 0.1 for b in sorted({sum(x > p for x in lengths) for p in range(max(lengths))})}
        rollouts.append(
            {
                "ar": {
                    "seconds": 2.0,
                    "response_tokens": lengths,
                    "acceptance_length": None,
                    "seconds_by_batch": by_batch,
                },
                "spec": {"seconds": 1.6, "response_tokens": lengths, "acceptance_length": 1.8},
                "order": ["ar", "spec"],
            }
        )
    sweep = {
        "1": {"k": 2, "ar_tokens_per_s": 40.0, "spec": {"speedup": 1.3, "acceptance_length": 1.9}},
        "4": {"k": 0, "ar_tokens_per_s": 90.0, "spec": {"speedup": 0.95, "acceptance_length": float("nan")}},
    }
    meta = {
        "command": f"python examples/bench_spec_schedule.py --sweep-tokens {LT_SWEEP_TOKENS} --out x.json",
        "config": str(recipe),
        "step_costs": str(entry),
        "max_new_tokens": 64,
    }
    return str(tmp_path / "bench_rep1.json"), {
        "schedule": [[1, 2, 2], [3, 64, 0]],
        "rollouts": rollouts,
        "sweep": sweep,
        "meta": meta,
    }


def test_rollout_profile_and_seconds_by_hand():
    batch, ctx = rollout_profile([3, 1, 2], prompt_tokens=10)
    assert batch.tolist() == [3, 2, 1]  # pass p: rows with more than p tokens
    assert ctx.tolist() == [30, 22, 12]  # each running row holds prompt + p tokens of KV
    costs = {0: lambda b, c: 0.01 * b + 0.001 * c, 3: lambda b, c: 0.02 * b + 0.002 * c}
    # schedule k = 3 at b = 1 only; a = 0.5 -> E_3 = 1.875
    want = (0.03 + 0.030) + (0.02 + 0.022) + (0.02 + 0.024) / 1.875
    assert rollout_seconds(batch, ctx, costs, [[1, 1, 3], [2, 64, 0]], 0.5) == pytest.approx(want, rel=1e-12)
    assert rollout_seconds(batch, ctx, costs, None, 0.5) == pytest.approx(0.06 + 0.042 + 0.022, rel=1e-12)


def test_acceptance_from_rollout_inverts_by_hand():
    batch = np.array([2.0, 1.0])
    # one k: the closed-form inversion of formulas.alpha_for_acceptance_length
    for length in (1.3, 1.9, 2.6):
        assert acceptance_from_rollout(batch, [[1, 64, 2]], length) == pytest.approx(
            alpha_for_acceptance_length(length, 2), abs=1e-6
        )
    # mixed k: b = 2 drafts k = 1 (2 request-tokens), b = 1 drafts k = 3 (1); at a = 0.5 E_1 = 1.5, E_3 = 1.875,
    # L = 3 / (2 / 1.5 + 1 / 1.875) = 1.6071428...
    assert acceptance_from_rollout(batch, [[1, 1, 3], [2, 2, 1]], 3 / (2 / 1.5 + 1 / 1.875)) == pytest.approx(
        0.5, abs=1e-6
    )
    with pytest.raises(ValueError, match="drafts at no running batch"):
        acceptance_from_rollout(np.array([4.0, 3.0]), [[1, 2, 2], [3, 64, 0]], 1.5)
    with pytest.raises(ValueError, match="outside"):
        acceptance_from_rollout(batch, [[1, 64, 2]], 3.5)


def test_longtail_against_independent_paths(tmp_path: Path):
    name, b = schedule_bench(tmp_path)
    out = project_longtail([(name, b)], hardware=["cpu", "h100"], prompt_tokens=LT_PROMPT)
    assert out["inputs"]["draft_vocab"] == LT_VOCAB and out["inputs"]["model"] == "smollm2-135m-instruct"
    a = alpha_for_acceptance_length(1.8, 2)  # the schedule drafts only k = 2
    for hw in ("cpu", "h100"):
        target, draft = scenario(hw, 2, 0.5, LT_VOCAB).model, scenario(hw, 2, 0.5, LT_VOCAB).speculative.draft
        profile = resolve_profile(hw)
        ar_fn, spec_fn = ar_pass_cost(target, profile, 1, 64), spec_pass_cost(target, draft, profile, 1, 2, 64)
        tot_ar = tot_spec = 0.0
        for g, lengths in zip(out["rollout"]["groups"], LT_GROUPS):
            assert g["a"] == pytest.approx(a, abs=1e-6) and g["profile_matches_measured_batches"]
            n = len(lengths)
            # AR: the simulator's own continuous-batching engine (generation.engine_makespan) at 1 token per pass
            ar_s = engine_makespan(np.array(lengths), int(LT_PROMPT), 1.0, n, ar_fn)[0]
            assert g[hw]["ar_s"] == pytest.approx(ar_s, rel=1e-9)
            # recipe schedule, pass by pass: at running batch b <= 2 one k = 2 step emits E_2(a) tokens per request
            spec_s = 0.0
            for p in range(max(lengths)):
                bp = sum(x > p for x in lengths)
                one = np.array([float(bp)]), np.array([bp * (LT_PROMPT + p)])
                spec_s += float(spec_fn(*one)[0]) / (1 + a + a * a) if bp <= 2 else float(ar_fn(*one)[0])
            assert g[hw]["recipe_s"] == pytest.approx(spec_s, rel=1e-6)
            tot_ar, tot_spec = tot_ar + ar_s, tot_spec + spec_s
        assert out["rollout"]["phase"][hw]["recipe_speedup"] == pytest.approx(tot_ar / tot_spec, rel=1e-6)
        # sweep row b = 1, k = 2: measured L over the scenario path's r at context prompt + sweep_tokens / 2
        row = next(r for r in out["sweep"][name]["rows"] if r["batch"] == 1)
        ref = pass_speedup_vs_batch(
            scenario(hw, 2, alpha_for_acceptance_length(1.9, 2), LT_VOCAB), [1], LT_PROMPT + LT_SWEEP_TOKENS / 2
        )
        assert row[f"speedup_{hw}"] == pytest.approx(ref[0]["pass_speedup"], rel=1e-6)
    assert out["sweep"][name]["k0_measured_speedup"] == {4: 0.95}
    # the measured CPU step costs (interpolated over b) cost the AR passes of group 0 exactly
    cal = sum(0.02 + 0.02 * (bp - 1) / 7 for bp in (4, 4, 3, 3, 3, 2, 2, 2, 2) + (1,) * 11)
    assert out["rollout"]["groups"][0]["cpu_calibrated"]["ar_s"] == pytest.approx(cal, rel=1e-12)


def test_longtail_bad_input_is_named(tmp_path: Path):
    name, b = schedule_bench(tmp_path)
    with pytest.raises(KeyError, match="bench_rep1.json: no 'rollouts'"):
        project_longtail([(name, {k: v for k, v in b.items() if k != "rollouts"})])
    b2 = json.loads(json.dumps(b))
    del b2["rollouts"][1]["spec"]["acceptance_length"]
    with pytest.raises(KeyError, match=r"rollouts\[1\]\.spec\.acceptance_length"):
        project_longtail([(name, b2)])
    b3 = json.loads(json.dumps(b))
    b3["meta"]["step_costs"] = str(tmp_path / "gone.json")
    with pytest.raises(FileNotFoundError, match="meta.step_costs=.*gone.json"):
        project_longtail([(name, b3)])
    roll, sched = tmp_path / "roll.json", tmp_path / "sched.json"
    roll.write_text(json.dumps(bench()))
    sched.write_text(json.dumps(b))
    with pytest.raises(SystemExit, match="only bench_spec_schedule"):
        main(["--bench", str(roll), str(sched), "--out", str(tmp_path / "o.json")])


def test_longtail_cli_writes_labelled_json(tmp_path: Path):
    name, b = schedule_bench(tmp_path)
    Path(name).write_text(json.dumps(b))
    assert main(["--bench", name, "--hardware", "h100", "--out", str(tmp_path / "p.json")]) == 0
    got = json.loads((tmp_path / "p.json").read_text())
    assert "not a GPU measurement" in got["label"] and got["bench"] == [name]
    assert set(got["rollout"]["schedules"]) == {"h100", "cpu_calibrated"}


def test_longtail_calibrated_derivation_reproduces_the_engines_schedules(monkeypatch):
    """On the committed bench JSONs, derive_schedule over the referenced calibration entry with the recipe's a gives
    the schedules the engines recorded: min_speedup 1.0 (rep 1) and the recipe's 1.2 (reps 2-3)."""
    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    paths = [f"docs/results/longtail/bench_rep{i}.json" for i in (1, 2)]
    benches = [(p, json.loads(Path(p).read_text())) for p in paths]
    for min_speedup, (_, ran) in zip((1.0, 1.2), benches):
        out = project_longtail(benches, hardware=(), min_speedup=min_speedup)
        assert out["rollout"]["schedules"]["cpu_calibrated"]["derived_a_recipe"] == ran["schedule"]
