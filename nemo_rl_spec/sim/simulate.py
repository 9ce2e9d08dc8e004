"""Entry point: simulate a scenario autoregressive and speculative and report the speedups and their drivers."""

from __future__ import annotations

import numpy as np

from nemo_rl_spec.sim.interfaces import GenerationResult, PhaseTimes, ScenarioSpec, StepResult
from nemo_rl_spec.sim.roofline import forward_seconds
from nemo_rl_spec.sim.step import (
    Resolved,
    fit_length_scale,
    generation,
    resolve,
    scenario_lengths,
    speculative_overheads,
    train_side,
)


def sync_phases(res: Resolved, lengths: np.ndarray, speculative: bool) -> tuple[PhaseTimes, GenerationResult]:
    """Predicted phases of a synchronous step (colocated: every phase on all devices; else gen/train pools)."""
    lay = res.scenario.layout
    gen_dev = lay.total_devices if lay.colocated else (lay.gen_devices or lay.total_devices // 2)
    train_dev = lay.total_devices if lay.colocated else lay.total_devices - gen_dev
    gen = generation(res, lengths, gen_dev, speculative)
    lp, tr, rf = train_side(res, lengths, train_dev, speculative)
    return PhaseTimes(generation=gen.seconds, logprob=lp, training=tr, refit=rf), gen


_FIT_CACHE: dict[str, float] = {}


def cached_length_scale(res: Resolved) -> float:
    """:func:`fit_length_scale` to the baseline generation time, cached on everything it depends on (the
    scenario without its speculative settings), so sweeps over k or acceptance fit once."""
    scn = res.scenario
    key = scn.model_copy(update=dict(speculative=None, paper=None, name="", description="")).model_dump_json()
    if key not in _FIT_CACHE:
        _FIT_CACHE[key] = fit_length_scale(res, scn.baseline.generation, scn.layout.total_devices)
    return _FIT_CACHE[key]


def baseline_phases(res: Resolved) -> tuple[PhaseTimes, PhaseTimes, GenerationResult, GenerationResult]:
    """Measured AR phases -> (AR, predicted spec) phases: lengths fitted to the measured generation time, the
    non-generation phases kept, plus the draft's refit bytes (and online draft training)."""
    base, devices = res.scenario.baseline, res.scenario.layout.total_devices
    lengths = scenario_lengths(res, cached_length_scale(res))
    gen_ar = generation(res, lengths, devices, False)
    gen_sp = generation(res, lengths, devices, True)
    extra_train, extra_refit = speculative_overheads(res, lengths, devices)
    spec = base.model_copy(
        update=dict(generation=gen_sp.seconds, training=base.training + extra_train, refit=base.refit + extra_refit)
    )
    return base.model_copy(update=dict(generation=gen_ar.seconds)), spec, gen_ar, gen_sp


def async_generation(res: Resolved, lengths: np.ndarray, speculative: bool, gen_devices: int) -> GenerationResult:
    """Per-step generation of async GRPO on ``gen_devices``: max_policy_lag + 1 steps of requests in flight."""
    return generation(res, lengths, gen_devices, speculative, steps_in_flight=res.scenario.max_policy_lag + 1)


def async_step(res: Resolved, lengths: np.ndarray, speculative: bool, gen_devices: int) -> tuple[float, PhaseTimes]:
    """(step seconds, phases) of async GRPO with ``gen_devices`` generating and the rest training.

    Formula: step = max(generation per step, logprob + training) + refit + other (refit is exposed)."""
    lay = res.scenario.layout
    gen = async_generation(res, lengths, speculative, gen_devices)
    lp, tr, rf = train_side(res, lengths, lay.total_devices - gen_devices, speculative)
    phases = PhaseTimes(generation=gen.seconds, logprob=lp, training=tr, refit=rf)
    return max(gen.seconds, lp + tr) + rf, phases


def best_async_split(res: Resolved, lengths: np.ndarray, speculative: bool) -> tuple[float, PhaseTimes, int]:
    """Async step at the given split, or at the best split in whole engines (bisection on the crossing of the
    falling generation time and the rising training time, then the better neighbour)."""
    lay = res.scenario.layout
    if lay.gen_devices is not None:
        return (*async_step(res, lengths, speculative, lay.gen_devices), lay.gen_devices)
    d = lay.gen_devices_per_engine
    lo, hi = 1, lay.total_devices // d - 1  # engines; at least one engine's worth of devices trains
    if hi < lo:
        raise ValueError(
            f"{res.scenario.name}: {lay.total_devices} devices cannot hold a generation engine of "
            f"{d} and a training pool"
        )
    while lo < hi:  # smallest engine count whose generation is no slower than training
        mid = (lo + hi) // 2
        step, ph = async_step(res, lengths, speculative, mid * d)
        lo, hi = (lo, mid) if ph.generation <= ph.logprob + ph.training else (mid + 1, hi)
    runs = [(*async_step(res, lengths, speculative, n * d), n * d) for n in {max(1, lo - 1), lo}]
    return min(runs, key=lambda r: r[0])


def pass_cost_ratios(res: Resolved, batch: float, context_per_seq: float) -> dict[str, float]:
    """Draft forward and (k+1)-token verification relative to one decode forward at ``batch`` sequences."""
    d, k, eff = res.scenario.layout.gen_devices_per_engine, res.scenario.speculative.k, res.profile.efficiency
    b, c = np.array([batch]), np.array([batch * context_per_seq])
    dec = forward_seconds(res.model, res.profile, d, b, c, 1, eff.forward_overhead_s)[0]
    ver = forward_seconds(res.model, res.profile, d, b, c, k + 1, eff.forward_overhead_s)[0]
    dra = forward_seconds(res.draft, res.profile, d, b, c, 1, eff.draft_forward_overhead_s)[0]
    return {"draft_cost": dra / dec, "verify_cost": ver / dec, "pass_cost": (ver + k * dra) / dec}


def drivers(res: Resolved, gen_ar: GenerationResult, gen_sp: GenerationResult, conc_ctx: float) -> dict[str, float]:
    """What drives the speedup: acceptance, per-pass costs in the tail (batch 1) and the bulk (full batch), the
    share of AR generation time spent in the tail (batch below a quarter of its peak)."""
    peak = float(gen_ar.batch_trace.max())
    tail = gen_ar.batch_trace < 0.25 * peak
    out = {
        "tokens_per_pass": res.tokens_per_pass,
        "alpha": res.alpha,
        "k": float(res.scenario.speculative.k),
        "peak_batch": peak,
        "ar_tail_time_fraction": float(gen_ar.time_trace[tail].sum() / gen_ar.time_trace.sum()),
        "ar_passes": float(gen_ar.passes),
        "spec_passes": float(gen_sp.passes),
    }
    out.update({f"tail_{k}": v for k, v in pass_cost_ratios(res, 1.0, conc_ctx).items()})
    out.update({f"bulk_{k}": v for k, v in pass_cost_ratios(res, peak, conc_ctx).items()})
    return out


def simulate(scenario: ScenarioSpec) -> StepResult:
    """Simulate ``scenario`` autoregressive and speculative; speedups are AR seconds / speculative seconds."""
    res = resolve(scenario)
    if scenario.mode == "async":
        return _simulate_async(res)
    if scenario.baseline is not None:
        ar, sp, gen_ar, gen_sp = baseline_phases(res)
    else:
        lengths = scenario_lengths(res)
        (ar, gen_ar), (sp, gen_sp) = sync_phases(res, lengths, False), sync_phases(res, lengths, True)
    ctx = scenario.workload.prompt_tokens + scenario.workload.response.median_tokens
    details = drivers(res, gen_ar, gen_sp, ctx)
    details["ar_generation_fraction"] = ar.generation / ar.total
    return StepResult(
        name=scenario.name,
        ar=ar,
        spec=sp,
        ar_step_s=ar.total,
        spec_step_s=sp.total,
        generation_speedup=ar.generation / sp.generation,
        e2e_speedup=ar.total / sp.total,
        details=details,
    )


def _simulate_async(res: Resolved) -> StepResult:
    """Async AR vs async speculative, each at its best device split. ``generation_speedup`` compares the two at the
    AR split (same devices); details add both against synchronous AR on all devices, and the exposed generation
    (generation not hidden behind log-probs + training) of AR and speculative at the AR split."""
    lay = res.scenario.layout
    if lay.colocated:
        raise ValueError(f"{res.scenario.name}: async GRPO needs a non-colocated layout (colocated: false)")
    lengths = scenario_lengths(res)
    step_ar, ar, g_ar = best_async_split(res, lengths, False)
    step_sp, sp, g_sp = best_async_split(res, lengths, True)
    gen_sp_same = async_generation(res, lengths, True, g_ar)
    _, sp_same = async_step(res, lengths, True, g_ar)
    sync_res = Resolved(
        res.scenario.model_copy(update=dict(layout=lay.model_copy(update=dict(colocated=True)))),
        res.model,
        res.draft,
        res.profile,
        res.tokens_per_pass,
        res.alpha,
    )
    sync_ar, gen_sync = sync_phases(sync_res, lengths, False)
    sync_sp, gen_sync_sp = sync_phases(sync_res, lengths, True)
    ctx = res.scenario.workload.prompt_tokens + res.scenario.workload.response.median_tokens
    details = drivers(sync_res, gen_sync, gen_sync_sp, ctx)
    details.update(
        {
            "ar_gen_devices": float(g_ar),
            "spec_gen_devices": float(g_sp),
            "sync_ar_step_s": sync_ar.total,
            "sync_spec_step_s": sync_sp.total,
            "sync_generation_speedup": sync_ar.generation / sync_sp.generation,
            "sync_e2e_speedup": sync_ar.total / sync_sp.total,
            "async_ar_vs_sync_ar": sync_ar.total / step_ar,
            "e2e_speedup_vs_sync_ar": sync_ar.total / step_sp,
            "generation_speedup_vs_sync_ar": sync_ar.generation / sp.generation,
            # generation on the trainer's critical path, max(0, generation - (logprob + training)), both at the AR split
            "exposed_generation_ar_s": max(0.0, ar.generation - ar.logprob - ar.training),
            "exposed_generation_spec_s": max(0.0, sp_same.generation - sp_same.logprob - sp_same.training),
            "ar_generation_fraction": sync_ar.generation / sync_ar.total,
        }
    )
    return StepResult(
        name=res.scenario.name,
        ar=ar,
        spec=sp,
        ar_step_s=step_ar,
        spec_step_s=step_sp,
        generation_speedup=ar.generation / gen_sp_same.seconds,
        e2e_speedup=step_ar / step_sp,
        details=details,
    )


def generation_traces(scenario: ScenarioSpec) -> tuple[GenerationResult, GenerationResult]:
    """(AR, speculative) generation results of a synchronous scenario on all its devices, with per-pass traces
    of the slowest engine (lengths fitted to the baseline when one is given)."""
    res = resolve(scenario)
    scale = cached_length_scale(res) if scenario.baseline is not None else 1.0
    lengths = scenario_lengths(res, scale)
    devices = scenario.layout.total_devices
    return generation(res, lengths, devices, False), generation(res, lengths, devices, True)


def without_baseline(scenario: ScenarioSpec) -> ScenarioSpec:
    """``scenario`` with its baseline-fitted response lengths made explicit and the baseline dropped, so every
    phase is predicted (for sweeps to other hardware or scales)."""
    if scenario.baseline is None:
        return scenario
    scale = cached_length_scale(resolve(scenario))
    data = scenario.model_dump()
    data["workload"]["response"]["median_tokens"] *= scale
    data["baseline"] = None
    return ScenarioSpec.model_validate(data)
