"""Comparisons with the paper (arXiv 2604.26779): the 8B measurements, the k sweep's shape, the 235B projection."""

from __future__ import annotations

from typing import Any, Sequence

from nemo_rl_spec.sim.interfaces import ScenarioSpec, StepResult
from nemo_rl_spec.sim.simulate import simulate
from nemo_rl_spec.sim.step import resolve
from nemo_rl_spec.sim.sweeps import k_sweep, with_speculation

PAPER_KS = (3, 5, 7)  # the draft lengths the paper compares


def predicted_values(result: StepResult) -> dict[str, float]:
    """The simulator's values under the names used in a scenario's ``paper:`` block."""
    return {
        "generation_ar_s": result.ar.generation,
        "generation_spec_s": result.spec.generation,
        "step_ar_s": result.ar_step_s,
        "step_spec_s": result.spec_step_s,
        "generation_speedup": result.generation_speedup,
        "e2e_speedup": result.e2e_speedup,
    }


def compare_to_paper(scenario: ScenarioSpec, result: StepResult) -> dict[str, dict[str, float]]:
    """Per published value: predicted, paper, relative error (pred - paper) / paper. Null paper values skipped."""
    pred = predicted_values(result)
    return {
        name: {"predicted": pred[name], "paper": ref, "error": (pred[name] - ref) / ref}
        for name, ref in (scenario.paper or {}).items()
        if ref is not None and name in pred
    }


def k_sweep_shape(scenario: ScenarioSpec, ks: Sequence[int] = PAPER_KS) -> dict[str, Any]:
    """Step time per k, the best k among ``ks``, and whether k = 7 is slower than k = 3 (the paper's findings)."""
    rows = k_sweep(scenario, ks)
    step = {int(r["k"]): r["spec_step_s"] for r in rows}
    return {
        "spec_step_s": step,
        "best_k": min(step, key=step.get),
        "k7_slower_than_k3": step.get(7, float("inf")) > step.get(3, float("inf")),
        "rows": rows,
    }


def projection(scenario: ScenarioSpec, ks: Sequence[int] = PAPER_KS) -> dict[str, Any]:
    """The 235B projection at each k (same acceptance per position) and at the best k by async step time."""
    alpha = resolve(scenario).alpha
    rows = []
    for k in ks:
        r = simulate(with_speculation(scenario, k, alpha))
        rows.append(
            {
                "k": k,
                "generation_speedup": r.generation_speedup,
                "e2e_speedup": r.e2e_speedup,
                **{
                    name: r.details[name]
                    for name in (
                        "sync_generation_speedup",
                        "sync_e2e_speedup",
                        "e2e_speedup_vs_sync_ar",
                        "async_ar_vs_sync_ar",
                        "generation_speedup_vs_sync_ar",
                        "tokens_per_pass",
                        "ar_generation_fraction",
                        "ar_tail_time_fraction",
                        "tail_pass_cost",
                        "bulk_pass_cost",
                        "bulk_draft_cost",
                        "tail_verify_cost",
                        "ar_gen_devices",
                        "spec_gen_devices",
                    )
                },
                "async_ar_step_s": r.ar_step_s,
                "async_spec_step_s": r.spec_step_s,
            }
        )
    best = min(rows, key=lambda row: row["async_spec_step_s"])
    return {"rows": rows, "best": best, "paper": {"generation_speedup_min": 3.5, "e2e_speedup": 2.5}}
