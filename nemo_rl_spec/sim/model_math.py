"""Parameter, FLOP and byte counts of a decoder-only transformer (GQA attention, SwiGLU MLP, optional MoE).

Conventions: a matmul with an [n x m] weight costs 2 n m FLOPs per token; the input-embedding lookup costs no
FLOPs and reads only the looked-up rows (counted as zero bytes); the output projection (lm_head, the embedding
matrix itself when tied) is a full matmul. Norms, biases and the MoE router's softmax are ignored (< 0.1%).
"""

from __future__ import annotations

import numpy as np

from nemo_rl_spec.sim.interfaces import ModelSpec


def attention_params_per_layer(model: ModelSpec) -> int:
    """Q, K, V and O projection parameters of one layer.

    Formula: h_in (n_heads + 2 n_kv_heads) d_head + n_heads d_head h, with h_in = attn_input_multiple * h.
    Qwen3-8B: 4096 * (32 + 16) * 128 + 32 * 128 * 4096 = 41,943,040.
    """
    h_in = model.hidden * model.attn_input_multiple
    return (
        h_in * (model.n_heads + 2 * model.n_kv_heads) * model.head_dim + model.n_heads * model.head_dim * model.hidden
    )


def expert_params(model: ModelSpec) -> int:
    """Parameters of one SwiGLU expert: 3 h d_expert (0 for a dense model)."""
    return 3 * model.hidden * model.moe.expert_intermediate if model.moe else 0


def dense_mlp_params_per_layer(model: ModelSpec) -> int:
    """Dense SwiGLU parameters of one layer: 3 h d_ff (used when the model has no MoE)."""
    return 0 if model.moe else 3 * model.hidden * model.intermediate


def output_params(model: ModelSpec) -> int:
    """Output projection parameters: vocab * h (the embedding matrix when tied)."""
    return model.vocab * model.hidden


def total_params(model: ModelSpec) -> int:
    """All parameters (what a refit moves). Qwen3-8B: 8.19e9; Qwen3-235B-A22B: 2.35e11; SmolLM2-135M: 1.345e8."""
    per_layer = attention_params_per_layer(model) + dense_mlp_params_per_layer(model)
    if model.moe:
        per_layer += model.moe.n_experts * (expert_params(model) + model.hidden)  # experts + router
    embed = model.vocab * model.hidden
    return (
        model.n_layers * per_layer + embed + (0 if model.tied_embeddings else output_params(model)) + model.extra_params
    )


def matmul_params_per_token(model: ModelSpec) -> int:
    """Parameters one token multiplies through (active parameters minus the embedding lookup, plus lm_head).

    FLOPs per token of a forward = 2 * this (+ attention over the context). Qwen3-235B-A22B: ~2.1e10.
    """
    per_layer = attention_params_per_layer(model) + dense_mlp_params_per_layer(model)
    if model.moe:
        per_layer += model.moe.top_k * expert_params(model) + model.hidden * model.moe.n_experts
    return model.n_layers * per_layer + output_params(model) + model.extra_params


def active_params(model: ModelSpec) -> int:
    """Parameters used per token including the input embedding (the 'A22B' of Qwen3-235B-A22B), count."""
    embed_extra = 0 if model.tied_embeddings else model.vocab * model.hidden
    return matmul_params_per_token(model) + embed_extra


def kv_bytes_per_token(model: ModelSpec) -> float:
    """KV-cache bytes one token occupies: 2 (K and V) * layers * kv_heads * d_head * bytes per element.

    Qwen3-8B bf16: 2 * 36 * 8 * 128 * 2 = 147,456 B.
    """
    return 2.0 * model.n_layers * model.n_kv_heads * model.head_dim * model.kv_bytes_per_elem


def distinct_experts(model: ModelSpec, tokens: np.ndarray) -> np.ndarray:
    """Expected distinct experts a layer touches for ``tokens`` tokens under uniform independent top-k routing.

    Formula: E (1 - (1 - top_k / E)^T). One token touches top_k; T -> infinity touches all E. Shape: like tokens.
    """
    tokens = np.asarray(tokens, dtype=float)
    if not model.moe:
        return np.zeros_like(tokens)
    e, k = model.moe.n_experts, model.moe.top_k
    return e * (1.0 - (1.0 - k / e) ** tokens)


def weight_bytes_read(model: ModelSpec, tokens: np.ndarray) -> np.ndarray:
    """Weight bytes one forward over ``tokens`` tokens streams from memory (whole model, all devices).

    Formula: bytes_per_param * (L (attn + dense MLP + router) + lm_head + extra + L * distinct_experts(T) * expert).
    Dense models read every matmul weight once per forward regardless of T. Shape: like tokens.
    """
    tokens = np.asarray(tokens, dtype=float)
    fixed = model.n_layers * (attention_params_per_layer(model) + dense_mlp_params_per_layer(model))
    fixed += output_params(model) + model.extra_params
    if model.moe:
        fixed += model.n_layers * model.hidden * model.moe.n_experts
    experts = model.n_layers * distinct_experts(model, tokens) * expert_params(model)
    return model.bytes_per_param * (fixed + experts)


def attention_flops(model: ModelSpec, query_context_products: np.ndarray) -> np.ndarray:
    """FLOPs of QK^T and PV: 4 * layers * n_heads * d_head per (query token, context token) pair.

    ``query_context_products`` = sum over query tokens of the context each attends to. Shape: like input.
    """
    return 4.0 * model.n_layers * model.n_heads * model.head_dim * np.asarray(query_context_products, dtype=float)


def forward_flops_sequences(model: ModelSpec, seq_tokens: np.ndarray) -> float:
    """FLOPs of one causal forward over whole sequences (log-prob recompute, training forward).

    Formula: sum_i [2 P s_i + 2 L n_heads d_head s_i^2], P = matmul_params_per_token, s_i = tokens of sequence i
    (the causal half of the 4 L H d s^2 score/value products).
    """
    s = np.asarray(seq_tokens, dtype=float)
    linear = 2.0 * matmul_params_per_token(model) * s.sum()
    return float(linear + 2.0 * model.n_layers * model.n_heads * model.head_dim * np.square(s).sum())
