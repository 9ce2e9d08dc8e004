"""Generation phase: makespans on hand-checkable cost functions, speculative pass cost, batch dependence."""

import numpy as np

from nemo_rl_spec.sim.generation import (
    ar_pass_cost,
    critical_engines,
    engine_makespan,
    simulate_generation,
    spec_pass_cost,
    split_across_engines,
)
from nemo_rl_spec.sim.presets import DRAFTS, MODELS, resolve_profile
from nemo_rl_spec.sim.roofline import forward_seconds


def unit_cost(batch, context):
    return np.where(batch > 0, 1.0, 0.0)


def batch_cost(batch, context):
    return batch.astype(float)


def test_makespan_counts_passes():
    lengths = np.array([5, 2, 9, 4])
    assert engine_makespan(lengths, 0, 1.0, 10, unit_cost)[0] == 9.0  # all at once: the longest
    assert engine_makespan(lengths, 0, 1.0, 2, unit_cost)[0] == 11.0  # slots: 5 | 2, then 9 from 2 -> 11
    assert engine_makespan(lengths, 0, 2.0, 10, unit_cost)[0] == 5.0  # two tokens per pass: ceil(9 / 2)
    # cost = active sequences: total = sum of per-sequence passes
    assert engine_makespan(lengths, 0, 1.0, 10, batch_cost)[0] == 20.0


def test_simulate_generation_max_over_engines_plus_prefill():
    lengths = np.array([5, 2, 9, 4])  # engine 0 gets 5, 9; engine 1 gets 2, 4
    r = simulate_generation(lengths, 0, 2, 1.0, 10, unit_cost, prefill_per_engine_s=0.5)
    assert r.seconds == 9.5 and r.passes == 9 and r.tokens == 20


def test_steps_in_flight_spread_the_straggler():
    lengths = np.array([10, 1, 1, 1])
    one = simulate_generation(lengths, 0, 1, 1.0, 4, unit_cost, 0.0)
    two = simulate_generation(lengths, 0, 1, 1.0, 4, unit_cost, 0.0, steps_in_flight=2)
    assert one.seconds == 10.0
    # [10,1,1,1 | 10,1,1,1] in 4 slots: the second 10 starts at pass 1 when a 1 ends -> 11 passes for 2 steps
    assert two.seconds == 5.5


def test_critical_engines_find_the_slowest():
    rng = np.random.default_rng(1)
    lengths = rng.lognormal(5, 1, 4000).astype(int) + 1
    parts = split_across_engines(lengths, 40)
    cost = lambda b, c: 1e-3 + 1e-5 * b + 1e-8 * c  # noqa: E731
    full = max(engine_makespan(p, 50, 1.0, 32, cost)[0] for p in parts)
    subset = max(engine_makespan(p, 50, 1.0, 32, cost)[0] for p in critical_engines(parts))
    assert len(critical_engines(parts)) <= 12
    assert subset == full


def test_spec_pass_is_verify_plus_k_drafts():
    model, draft, prof = MODELS["qwen3-8b"], DRAFTS["eagle3-qwen3-8b"], resolve_profile("gb200")
    b, c = np.array([1.0, 64.0]), np.array([1000.0, 64000.0])
    eff = prof.efficiency
    hand = forward_seconds(model, prof, 1, b, c, 4, eff.forward_overhead_s) + 3 * forward_seconds(
        draft, prof, 1, b, c, 1, eff.draft_forward_overhead_s
    )
    np.testing.assert_allclose(spec_pass_cost(model, draft, prof, 1, 3, 64)(b, c), hand, rtol=1e-10)


def test_gain_shrinks_with_batch_and_returns_in_the_tail():
    """Short contexts: verifying k+1 tokens turns compute-bound at large batch, so the per-pass gain falls below
    its batch-1 value (and below 1 at 512); the tail (batch 1) keeps the full gain."""
    model, draft, prof = MODELS["qwen3-8b"], DRAFTS["eagle3-qwen3-8b"], resolve_profile("gb200")
    b = np.array([1.0, 64.0, 512.0])
    ctx = 256.0 * b
    gain = 2.47 * ar_pass_cost(model, prof, 1, 512)(b, ctx) / spec_pass_cost(model, draft, prof, 1, 3, 512)(b, ctx)
    assert gain[2] < 1.0 < gain[0]
    assert gain[2] < gain[1]
    assert gain[0] > 1.5
