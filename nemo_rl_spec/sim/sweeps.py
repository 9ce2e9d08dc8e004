"""Sweeps of a scenario over draft length k, acceptance, batch size, hardware and scale."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from nemo_rl_spec.sim.formulas import expected_tokens_per_pass
from nemo_rl_spec.sim.generation import ar_pass_cost, spec_pass_cost
from nemo_rl_spec.sim.interfaces import ScenarioSpec
from nemo_rl_spec.sim.presets import resolve_profile
from nemo_rl_spec.sim.simulate import simulate, without_baseline
from nemo_rl_spec.sim.step import resolve


def with_speculation(scenario: ScenarioSpec, k: int, alpha: float) -> ScenarioSpec:
    """``scenario`` with draft length ``k`` and constant per-position acceptance ``alpha`` (validated)."""
    spec = scenario.speculative.model_dump()
    spec.update(k=k, alpha=alpha, per_position=None, acceptance_length=None)
    return ScenarioSpec.model_validate({**scenario.model_dump(), "speculative": spec})


def _row(scenario: ScenarioSpec, **keys: Any) -> dict[str, float]:
    r = simulate(scenario)
    return {
        **keys,
        "generation_speedup": r.generation_speedup,
        "e2e_speedup": r.e2e_speedup,
        "ar_step_s": r.ar_step_s,
        "spec_step_s": r.spec_step_s,
        "spec_generation_s": r.spec.generation,
    }


def k_sweep(scenario: ScenarioSpec, ks: Sequence[int] = (1, 2, 3, 4, 5, 6, 7)) -> list[dict[str, float]]:
    """Speedups vs draft length at the scenario's per-position acceptance (constant alpha, Leviathan model)."""
    alpha = resolve(scenario).alpha
    return [
        _row(with_speculation(scenario, k, alpha), k=k, tokens_per_pass=expected_tokens_per_pass(alpha, k)) for k in ks
    ]


def acceptance_sweep(
    scenario: ScenarioSpec, alphas: Sequence[float] = tuple(np.round(np.arange(0, 1.0, 0.1), 2)), k: int | None = None
) -> list[dict[str, float]]:
    """Speedups vs per-position acceptance alpha at draft length ``k`` (default: the scenario's)."""
    k = k or scenario.speculative.k
    return [
        _row(with_speculation(scenario, k, float(a)), alpha=float(a), tokens_per_pass=expected_tokens_per_pass(a, k))
        for a in alphas
    ]


def pass_speedup_vs_batch(
    scenario: ScenarioSpec, batches: Sequence[int], context_per_seq: float, hardware: str | None = None
) -> list[dict[str, float]]:
    """Per-pass speculative gain at a fixed batch: tokens_per_pass * t_decode(b) / t_spec_pass(b).

    This is the steady-state speedup of an engine held at batch b (the bulk of a phase at large b, the tail at
    small b); it falls as verification of k+1 tokens turns compute-bound.
    """
    res = resolve(scenario)
    profile = resolve_profile(hardware, None) if hardware else res.profile
    d, k, bmax = scenario.layout.gen_devices_per_engine, scenario.speculative.k, int(max(batches))
    ar = ar_pass_cost(res.model, profile, d, bmax)
    sp = spec_pass_cost(res.model, res.draft, profile, d, k, bmax)
    b = np.asarray(batches, dtype=float)
    ctx = b * context_per_seq
    gain = res.tokens_per_pass * ar(b, ctx) / sp(b, ctx)
    return [{"batch": int(x), "pass_speedup": float(g), "ar_pass_s": float(t)} for x, g, t in zip(b, gain, ar(b, ctx))]


def hardware_sweep(
    scenario: ScenarioSpec, hardware: Sequence[str] = ("h100", "h200", "b200", "gb200")
) -> list[dict[str, float]]:
    """Generation speedup of ``scenario`` on each hardware preset (lengths as given, no baseline fit)."""
    rows = []
    for hw in hardware:
        scn = ScenarioSpec.model_validate({**without_baseline(scenario).model_dump(), "hardware": hw})
        r = simulate(scn)
        rows.append(
            {
                "hardware": hw,
                "generation_speedup": r.generation_speedup,
                "e2e_speedup": r.e2e_speedup,
                "ar_generation_s": r.ar.generation,
            }
        )
    return rows


def concurrency_sweep(
    scenario: ScenarioSpec, caps: Sequence[int] = (16, 32, 64, 128, 256, 512)
) -> list[dict[str, float]]:
    """Speedups vs the engine's batch cap (vLLM max_num_seqs), all phases predicted (baseline lengths kept)."""
    base = without_baseline(scenario).model_dump()
    rows = []
    for cap in caps:
        base["layout"]["max_num_seqs"] = cap
        rows.append(_row(ScenarioSpec.model_validate(base), max_num_seqs=cap))
    return rows


def scale_sweep(
    scenario: ScenarioSpec, devices: Sequence[int] = (256, 512, 1024, 2048), weak: bool = False
) -> list[dict[str, float]]:
    """Speedups vs cluster size. Strong scaling (default): the step's rollouts stay fixed, so each engine holds
    fewer sequences as devices grow; weak: prompts per step scale with the devices."""
    per_device = scenario.workload.num_prompts / scenario.layout.total_devices
    rows = []
    for n in devices:
        data = scenario.model_dump()
        data["layout"]["total_devices"] = n
        if weak:
            data["workload"]["num_prompts"] = max(1, int(round(per_device * n)))
        r = simulate(ScenarioSpec.model_validate(data))
        rows.append(
            {
                "devices": n,
                "generation_speedup": r.generation_speedup,
                "e2e_speedup": r.e2e_speedup,
                "e2e_speedup_vs_sync_ar": r.details.get("e2e_speedup_vs_sync_ar", r.e2e_speedup),
                "ar_step_s": r.ar_step_s,
                "spec_step_s": r.spec_step_s,
            }
        )
    return rows
