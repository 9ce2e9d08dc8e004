"""Parameter, byte and FLOP counts against hand computation and published model sizes."""

import numpy as np
import pytest

from nemo_rl_spec.sim import model_math as mm
from nemo_rl_spec.sim.presets import DRAFTS, MODELS


def test_qwen3_8b_counts():
    m = MODELS["qwen3-8b"]
    assert mm.attention_params_per_layer(m) == 4096 * 48 * 128 + 32 * 128 * 4096 == 41_943_040
    per_layer = 41_943_040 + 3 * 4096 * 12288
    assert mm.total_params(m) == 36 * per_layer + 2 * 151936 * 4096 == 8_190_427_136  # published: 8.19B
    assert mm.kv_bytes_per_token(m) == 2 * 36 * 8 * 128 * 2 == 147_456


def test_qwen3_235b_total_and_active():
    m = MODELS["qwen3-235b-a22b"]
    attn = 4096 * 72 * 128 + 64 * 128 * 4096
    expert = 3 * 4096 * 1536
    total = 94 * (attn + 128 * (expert + 4096)) + 2 * 151936 * 4096
    assert mm.total_params(m) == total == 235_092_836_352  # "235B"
    active = 94 * (attn + 8 * expert + 4096 * 128) + 2 * 151936 * 4096
    assert mm.active_params(m) == active == 22_189_965_312  # "A22B"


def test_smollm2_matches_hf_count_without_norms():
    m = MODELS["smollm2-135m"]
    assert mm.total_params(m) == 134_479_872
    norms = 30 * 2 * 576 + 576
    assert mm.total_params(m) + norms == 134_515_008  # the HF checkpoint's parameter count


def test_random_eagle3_head_matches_design_md():
    d = DRAFTS["eagle3-smollm2-135m"]
    assert round(mm.total_params(d) / 1e6, 1) == 33.4  # docs/results/cpu_step_costs.md: 33.4M parameters
    assert round(mm.output_params(d) / 1e6, 1) == 28.3  # of them 28.3M the full-vocabulary output layer


def test_distinct_experts_uniform_routing():
    m = MODELS["qwen3-235b-a22b"]
    assert mm.distinct_experts(m, np.array([1.0]))[0] == pytest.approx(8.0)
    assert mm.distinct_experts(m, np.array([2.0]))[0] == pytest.approx(128 * (1 - (15 / 16) ** 2))  # 15.5
    assert mm.distinct_experts(m, np.array([1e6]))[0] == pytest.approx(128.0)
    assert mm.distinct_experts(MODELS["qwen3-8b"], np.array([5.0]))[0] == 0.0


def test_weight_bytes_dense_and_moe():
    dense = MODELS["qwen3-8b"]
    matmul = mm.total_params(dense) - 151936 * 4096  # everything but the input embedding
    assert mm.weight_bytes_read(dense, np.array([1.0, 64.0])) == pytest.approx([2.0 * matmul] * 2)
    moe = MODELS["qwen3-235b-a22b"]
    one, many = mm.weight_bytes_read(moe, np.array([1.0, 1e6]))
    assert one == pytest.approx(2.0 * mm.matmul_params_per_token(moe))  # one token reads its 8 experts
    assert many == pytest.approx(2.0 * (mm.total_params(moe) - 151936 * 4096))  # a big batch reads all


def test_forward_flops_sequences_hand():
    m = MODELS["smollm2-135m"]
    s = np.full(8, 256)
    hand = 2 * 134_479_872 * 2048 + 2 * 30 * 9 * 64 * 8 * 256**2
    assert mm.forward_flops_sequences(m, s) == pytest.approx(hand, rel=1e-12)
