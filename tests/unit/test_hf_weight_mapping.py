"""HF <-> Megatron weight mapping: layouts checked by hand, round trips bit-identical (no megatron import)."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from nemo_rl_spec.models.hf_weight_mapping import (
    ModelSpec,
    fuse_qkv,
    hf_to_megatron,
    megatron_to_hf,
    model_spec_from_hf_config,
    split_qkv,
)

torch.set_num_threads(1)

SPEC = ModelSpec(
    architecture="Qwen3ForCausalLM",
    num_layers=2,
    hidden_size=8,
    ffn_hidden_size=12,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=3,
    vocab_size=20,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    qk_layernorm=True,
    tie_word_embeddings=False,
)


def _hf_state(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hid, dim, ffn = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, hid), "model.norm.weight": (hid,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, hid)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (hid,),
                p + "post_attention_layernorm.weight": (hid,),
                p + "self_attn.q_proj.weight": (spec.num_attention_heads * dim, hid),
                p + "self_attn.k_proj.weight": (spec.num_query_groups * dim, hid),
                p + "self_attn.v_proj.weight": (spec.num_query_groups * dim, hid),
                p + "self_attn.o_proj.weight": (hid, spec.num_attention_heads * dim),
                p + "mlp.gate_proj.weight": (ffn, hid),
                p + "mlp.up_proj.weight": (ffn, hid),
                p + "mlp.down_proj.weight": (hid, ffn),
            }
        )
        if spec.qk_layernorm:
            shapes.update({p + "self_attn.q_norm.weight": (dim,), p + "self_attn.k_norm.weight": (dim,)})
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def test_fuse_qkv_layout_by_hand():
    # 4 query heads in 2 groups, head_dim 3: row r of q head h holds 100*h + r, of k group g 10*g + r, v = -k.
    spec, dim = SPEC, SPEC.head_dim
    q = torch.tensor([[100.0 * h + r] for h in range(4) for r in range(dim)])
    k = torch.tensor([[10.0 * g + r] for g in range(2) for r in range(dim)])
    v = -k
    expected_rows = []
    for g in range(2):
        for h in (2 * g, 2 * g + 1):
            expected_rows += [100.0 * h + r for r in range(dim)]
        expected_rows += [10.0 * g + r for r in range(dim)] + [-(10.0 * g + r) for r in range(dim)]
    assert fuse_qkv(q, k, v, spec).squeeze(1).tolist() == expected_rows
    q2, k2, v2 = split_qkv(fuse_qkv(q, k, v, spec), spec)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_fc1_is_gate_then_up():
    hf = _hf_state(SPEC)
    fc1 = hf_to_megatron(hf, SPEC)["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[: SPEC.ffn_hidden_size], hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[SPEC.ffn_hidden_size :], hf["model.layers.1.mlp.up_proj.weight"])


@pytest.mark.parametrize("tied,qk_norm", [(False, True), (True, True), (True, False), (False, False)])
def test_round_trip_bit_identical_and_lm_head_always_exported(tied, qk_norm):
    spec = dataclasses.replace(SPEC, tie_word_embeddings=tied, qk_layernorm=qk_norm)
    hf = _hf_state(spec, seed=1)
    mcore = hf_to_megatron(hf, spec)
    assert ("output_layer.weight" in mcore) == (not tied)
    back = megatron_to_hf(mcore, spec)
    assert "lm_head.weight" in back
    if tied:
        assert torch.equal(back.pop("lm_head.weight"), hf["model.embed_tokens.weight"])
    assert set(back) == set(hf)
    assert all(torch.equal(back[name], hf[name]) for name in hf)


def test_missing_tensor_raises_key_error():
    hf = _hf_state(SPEC)
    del hf["model.layers.0.self_attn.k_norm.weight"]
    with pytest.raises(KeyError, match="k_norm"):
        hf_to_megatron(hf, SPEC)


def _hf_cfg(**overrides):
    base = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        num_attention_heads=4,
        hidden_size=64,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    return types.SimpleNamespace(**{**base, **overrides})


def test_spec_from_config_llama_defaults():
    spec = model_spec_from_hf_config(_hf_cfg())
    assert (spec.head_dim, spec.num_query_groups, spec.rope_theta) == (16, 2, 5e5)
    assert spec.tie_word_embeddings and not spec.qk_layernorm


def test_spec_from_config_legacy_rope_theta_and_qwen3():
    cfg = _hf_cfg(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_parameters=None, rope_theta=1e6, head_dim=32
    )
    spec = model_spec_from_hf_config(cfg)
    assert (spec.head_dim, spec.rope_theta, spec.qk_layernorm) == (32, 1e6, True)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(architectures=["MistralForCausalLM"]), "MistralForCausalLM"),
        (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "GPT2LMHeadModel"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(hidden_act="gelu"), "gelu"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5}), "llama3"),
    ],
)
def test_unsupported_configs_raise_value_error(overrides, match):
    with pytest.raises(ValueError, match=match):
        model_spec_from_hf_config(_hf_cfg(**overrides))
