"""Roofline forward time of a toy model, computed by hand."""

import numpy as np
import pytest

from nemo_rl_spec.sim.interfaces import EfficiencySpec, HardwareSpec, ModelSpec, SystemProfile
from nemo_rl_spec.sim.roofline import forward_seconds, kv_capacity_tokens, tabulated_forward

# 1 layer, h 2, 1 head, 1 KV head, d 2, d_ff 2, vocab 4, bf16: attention 2*3*2 + 2*2 = 16, MLP 12, lm_head 8.
TOY = ModelSpec(name="toy", n_layers=1, hidden=2, n_heads=1, n_kv_heads=1, head_dim=2, intermediate=2, vocab=4)
HW = HardwareSpec(
    name="toy",
    peak_flops=100.0,
    mem_bw=100.0,
    mem_capacity=1000.0,
    link_bw=100.0,
    net_bw=10.0,
    domain_size=2,
    collective_latency_s=0.01,
)


def profile(overlap: bool) -> SystemProfile:
    eff = EfficiencySpec(
        decode_flops_eff=0.5,
        mem_bw_eff=0.5,
        overlap=overlap,
        forward_overhead_s=1.0,
        draft_forward_overhead_s=0.0,
        prefill_mfu=0.5,
        logprob_mfu=0.5,
        train_mfu=0.5,
        refit_overhead_s=0.0,
        refit_bw_eff=1.0,
    )
    return SystemProfile(hardware=HW, efficiency=eff)


# batch 2, query 1, 10 context tokens: flops = 2*36*2 + 4*1*1*2*10 = 224;
# bytes = 36*2 (weights) + 8*(10+2) (KV, 8 B/token) + 8*4*2 (fp32 logits written + read) = 232.
def test_overlapping_roofline_takes_the_max():
    t = forward_seconds(TOY, profile(True), 1, np.array([2.0]), np.array([10.0]), 1, 1.0)
    assert t[0] == pytest.approx(1.0 + max(224 / 50, 232 / 50), abs=1e-12)  # 5.64


def test_cpu_roofline_sums_compute_and_memory():
    t = forward_seconds(TOY, profile(False), 1, np.array([2.0]), np.array([10.0]), 1, 1.0)
    assert t[0] == pytest.approx(1.0 + 224 / 50 + 232 / 50, abs=1e-12)  # 10.12


def test_two_devices_split_work_and_pay_collectives():
    # per device halves; 2 collectives x (0.01 s + ring 2*2*2*2*(1/2) = 8 B / 100 B/s)
    t = forward_seconds(TOY, profile(True), 2, np.array([2.0]), np.array([10.0]), 1, 1.0)
    assert t[0] == pytest.approx(1.0 + 232 / 100 + 2 * (0.01 + 0.08), abs=1e-12)  # 3.50


def test_empty_batch_costs_nothing():
    assert forward_seconds(TOY, profile(True), 1, np.array([0.0]), np.array([0.0]), 1, 1.0)[0] == 0.0


def test_tabulated_forward_matches_direct():
    rng = np.random.default_rng(0)
    b = rng.integers(0, 65, 50).astype(float)
    c = b * rng.uniform(0, 300, 50)
    for overlap in (True, False):
        for devices, query in ((1, 1), (2, 4)):
            direct = forward_seconds(TOY, profile(overlap), devices, b, c, query, 0.3)
            fast = tabulated_forward(TOY, profile(overlap), devices, 64, query, 0.3)(b, c)
            np.testing.assert_allclose(fast, direct, rtol=1e-12, atol=1e-15)


def test_kv_capacity():
    # (2 devices * 1000 B * 0.5 - 44 params * 2 B) / 8 B per token = 114 tokens
    assert kv_capacity_tokens(TOY, profile(True), 2, 0.5) == pytest.approx((1000 - 88) / 8)
    with pytest.raises(ValueError):
        kv_capacity_tokens(TOY, profile(True), 1, 0.05)


def test_pipeline_stages_add_compute_not_weight_bandwidth():
    # tp 1 x pp 2, batch 2 -> micro-batches of 1: weights 72 B read twice (once per micro-batch) = 144 B,
    # KV 96 B + logits 64 B; per device / 2: compute 224 / 100, memory (144 + 96 + 64) / 100;
    # collectives: pp latency 2 * 0.01 + stage sends 2 tokens * 2 h * 2 B / 100 B/s = 0.08
    t = forward_seconds(TOY, profile(True), 2, np.array([2.0]), np.array([10.0]), 1, 1.0, pipeline=2)
    assert t[0] == pytest.approx(1.0 + max(2.24, 3.04) + 0.02 + 0.08, abs=1e-12)
    fast = tabulated_forward(TOY, profile(True), 2, 4, 1, 1.0, pipeline=2)(np.array([2.0]), np.array([10.0]))
    assert fast[0] == pytest.approx(t[0], rel=1e-12)
    with pytest.raises(ValueError):
        forward_seconds(TOY, profile(True), 3, np.array([2.0]), np.array([10.0]), 1, 1.0, pipeline=2)
