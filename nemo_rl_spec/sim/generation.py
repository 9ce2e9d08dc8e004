"""Generation phase: data-parallel engines with continuous batching, costed pass by pass with the roofline.

Autoregressive pass = one target forward of 1 token per sequence. Speculative pass = k draft forwards (1 token
per sequence each, draft weights and the draft's own KV) + one target forward verifying k+1 tokens per sequence;
it emits ``tokens_per_pass`` = E(alpha, k) tokens per sequence on average. The verification forward streams the
same weights and KV as a decode forward but does (k+1)x the FLOPs, so its extra cost is ~0 while memory-bound
(small batch, the tail) and grows once the batch is compute-bound: the gain shrinks with batch size and returns
as the batch drains.
"""

from __future__ import annotations

import numpy as np

from nemo_rl_spec.sim import model_math as mm
from nemo_rl_spec.sim.batching import active_batch_and_context, admission_passes, passes_needed
from nemo_rl_spec.sim.interfaces import GenerationResult, ModelSpec, PassCostFn, SystemProfile
from nemo_rl_spec.sim.lengths import length_biased_mean_progress
from nemo_rl_spec.sim.roofline import kv_capacity_tokens, tabulated_forward


def ar_pass_cost(
    model: ModelSpec, profile: SystemProfile, devices: int, max_batch: int, pipeline: int = 1
) -> PassCostFn:
    """Cost of an autoregressive pass: one decode forward (query 1) plus the per-forward overhead."""
    return tabulated_forward(model, profile, devices, max_batch, 1, profile.efficiency.forward_overhead_s, pipeline)


def spec_pass_cost(
    model: ModelSpec, draft: ModelSpec, profile: SystemProfile, devices: int, k: int, max_batch: int, pipeline: int = 1
) -> PassCostFn:
    """Cost of a speculative pass: k draft forwards + one (k+1)-token verification forward.

    Formula: t = t_target(b, C, query=k+1) + k * t_draft(b, C, query=1), each with its own fixed overhead; the
    one-layer draft runs on the last pipeline stage's tp devices.
    """
    eff = profile.efficiency
    verify = tabulated_forward(model, profile, devices, max_batch, k + 1, eff.forward_overhead_s, pipeline)
    draft_fwd = tabulated_forward(draft, profile, devices // pipeline, max_batch, 1, eff.draft_forward_overhead_s)

    def cost(batch: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        return verify(batch, context_tokens) + k * draft_fwd(batch, context_tokens)

    return cost


def max_concurrency(
    model: ModelSpec,
    profile: SystemProfile,
    devices: int,
    max_num_seqs: int,
    kv_fraction: float,
    lengths: np.ndarray,
    prompt_tokens: int,
    draft: ModelSpec | None = None,
) -> int:
    """Sequences an engine runs at once: min(max_num_seqs, KV capacity / live KV per sequence).

    Live KV per sequence = prompt + E[L^2] / (2 E[L]) (length-biased mean progress), a static stand-in for vLLM's
    admit-and-preempt policy.
    """
    extra = mm.total_params(draft) if draft is not None else 0
    capacity = kv_capacity_tokens(model, profile, devices, kv_fraction, extra)
    live = prompt_tokens + length_biased_mean_progress(lengths)
    return int(max(1, min(max_num_seqs, capacity // live)))


def prefill_seconds(models: list[ModelSpec], profile: SystemProfile, devices: int, prompt_tokens_total: float) -> float:
    """Prompt prefill of one engine: 2 P * prompt tokens / (devices * peak * prefill_mfu), summed over models."""
    flops = sum(2.0 * mm.matmul_params_per_token(m) for m in models) * prompt_tokens_total
    return flops / (devices * profile.hardware.peak_flops * profile.efficiency.prefill_mfu)


def split_across_engines(lengths: np.ndarray, n_engines: int) -> list[np.ndarray]:
    """Deal sequences round-robin to ``n_engines`` data-parallel engines (arrival order kept)."""
    return [lengths[i::n_engines] for i in range(n_engines) if len(lengths[i::n_engines])]


def critical_engines(parts: list[np.ndarray], per_criterion: int = 6) -> list[np.ndarray]:
    """The engines that can be the slowest: those with the longest single responses (the tail) and those with
    the most tokens (the bulk), ``per_criterion`` of each. Engines hold statistically identical shares, so the
    slowest is always among them; simulating only these keeps a 256-engine phase at a few milliseconds."""
    if len(parts) <= 2 * per_criterion:
        return parts
    longest = np.argsort([p.max() for p in parts])[-per_criterion:]
    biggest = np.argsort([p.sum() for p in parts])[-per_criterion:]
    return [parts[i] for i in sorted(set(longest) | set(biggest))]


def engine_makespan(
    lengths: np.ndarray, prompt_tokens: int, tokens_per_pass: float, concurrency: int, cost: PassCostFn
) -> tuple[float, np.ndarray, np.ndarray]:
    """Seconds for one engine to finish ``lengths``, with its per-pass batch and time traces. Shapes: [P], [P]."""
    passes = passes_needed(lengths, tokens_per_pass)
    starts = admission_passes(passes, concurrency)
    batch, context = active_batch_and_context(passes, starts, np.full(len(lengths), prompt_tokens), tokens_per_pass)
    times = cost(batch, context)
    return float(times.sum()), batch, times


def simulate_generation(
    lengths: np.ndarray,
    prompt_tokens: int,
    n_engines: int,
    tokens_per_pass: float,
    concurrency: int,
    cost: PassCostFn,
    prefill_per_engine_s: float,
    steps_in_flight: int = 1,
) -> GenerationResult:
    """Generation time of one RL step over ``n_engines`` engines: the slowest engine's makespan.

    ``steps_in_flight`` > 1 (async GRPO with policy lag = steps_in_flight - 1): the engines receive that many
    steps' requests back to back, new ones filling slots that finishing ones free, and the per-step time is the
    makespan divided by steps_in_flight (a straggler's latency is spread over the steps it may span).
    """
    work = np.concatenate([lengths] * steps_in_flight)
    best = (-1.0, np.zeros(0), np.zeros(0))
    for part in critical_engines(split_across_engines(work, n_engines)):
        result = engine_makespan(part, prompt_tokens, tokens_per_pass, concurrency, cost)
        best = max(best, result, key=lambda r: r[0])
    seconds, batch, times = best
    total = (seconds + prefill_per_engine_s * steps_in_flight) / steps_in_flight
    return GenerationResult(
        seconds=total, passes=len(batch), tokens=int(lengths.sum()), batch_trace=batch, time_trace=times
    )
