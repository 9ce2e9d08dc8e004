"""Roofline time of one forward pass of a generation engine: bytes moved, FLOPs, collectives, fixed overhead.

Time of a forward over ``batch`` sequences with ``query`` new tokens each (1 for decode, k+1 for verification)
on an engine of ``devices`` devices (weights and KV sharded evenly, TP/EP):

    T = batch * query                                            tokens in the forward
    flops = 2 P T + 4 L H d (query * context)                    P = matmul params per token
    bytes = W(T) + kv_per_token (context + T) + 8 V T            W(T) = weights streamed (MoE: experts touched);
                                                                 8 V T = fp32 logits written + read by sampler
    t = overhead + combine(flops / (d F e_f), bytes / (d B e_b)) + collectives
    combine = max (GPU: compute and memory overlap) or sum (CPU)
    collectives = 2 L (latency + 2 T h b (d-1)/d / link)         two all-reduce/all-to-all per layer when d > 1
"""
from __future__ import annotations

import numpy as np

from nemo_rl_spec.sim import model_math as mm
from nemo_rl_spec.sim.interfaces import ModelSpec, SystemProfile


def compute_seconds(model: ModelSpec, profile: SystemProfile, devices: int, tokens: np.ndarray,
                    query_context: np.ndarray) -> np.ndarray:
    """Seconds of the FLOPs: (2 P T + attention FLOPs) / (devices * peak * decode_flops_eff). Shape: like tokens."""
    flops = 2.0 * mm.matmul_params_per_token(model) * tokens + mm.attention_flops(model, query_context)
    hw, eff = profile.hardware, profile.efficiency
    return flops / (devices * hw.peak_flops * eff.decode_flops_eff)


LOGIT_BYTES_PER_TOKEN_VOCAB = 8.0  # fp32 logits written by lm_head and read back by the (rejection) sampler


def memory_seconds(model: ModelSpec, profile: SystemProfile, devices: int, tokens: np.ndarray,
                   context_tokens: np.ndarray) -> np.ndarray:
    """Seconds of the bytes: (weights streamed + KV read and written + fp32 logits written and read by the
    sampler) / (devices * bandwidth * mem_bw_eff)."""
    tokens = np.asarray(tokens, dtype=float)
    nbytes = (mm.weight_bytes_read(model, tokens) + mm.kv_bytes_per_token(model) * (context_tokens + tokens)
              + LOGIT_BYTES_PER_TOKEN_VOCAB * model.vocab * tokens)
    hw, eff = profile.hardware, profile.efficiency
    return nbytes / (devices * hw.mem_bw * eff.mem_bw_eff)


def collective_seconds(model: ModelSpec, profile: SystemProfile, devices: int, tokens: np.ndarray) -> np.ndarray:
    """Seconds of the per-layer collectives of a sharded engine: 2 L (latency + ring bytes / link); 0 if d = 1."""
    tokens = np.asarray(tokens, dtype=float)
    if devices <= 1:
        return np.zeros_like(tokens)
    hw = profile.hardware
    ring_bytes = 2.0 * tokens * model.hidden * model.bytes_per_param * (devices - 1) / devices
    return 2.0 * model.n_layers * (hw.collective_latency_s + ring_bytes / hw.link_bw)


def forward_seconds(model: ModelSpec, profile: SystemProfile, devices: int, batch: np.ndarray,
                    context_tokens: np.ndarray, query: int, overhead_s: float) -> np.ndarray:
    """Seconds of one forward (module formula). Shapes: batch, context_tokens [P] -> [P].

    Args:
        batch: sequences in the forward.
        context_tokens: KV-cache tokens attended, summed over the batch.
        query: new tokens per sequence (1 decode, k+1 verification).
        overhead_s: fixed cost added per forward (engine scheduling, sampling, launches).
    Passes with batch 0 cost 0.
    """
    batch = np.asarray(batch, dtype=float)
    context_tokens = np.asarray(context_tokens, dtype=float)
    tokens = batch * query
    t_c = compute_seconds(model, profile, devices, tokens, query * context_tokens)
    t_m = memory_seconds(model, profile, devices, tokens, context_tokens)
    body = np.maximum(t_c, t_m) if profile.efficiency.overlap else t_c + t_m
    total = overhead_s + body + collective_seconds(model, profile, devices, tokens)
    return np.where(batch > 0, total, 0.0)


def tabulated_forward(model: ModelSpec, profile: SystemProfile, devices: int, max_batch: int, query: int,
                      overhead_s: float):
    """:func:`forward_seconds` as a fast callable of (batch, context): the batch-only terms (weights, experts
    touched, collectives) are tabulated for batch 0..max_batch, the context terms are linear. Same values."""
    b = np.arange(max_batch + 1, dtype=float)
    zero = np.zeros_like(b)
    c_const = compute_seconds(model, profile, devices, b * query, zero)
    m_const = memory_seconds(model, profile, devices, b * query, zero)
    fixed = overhead_s + collective_seconds(model, profile, devices, b * query)
    one = np.ones(1)
    c_ctx = float(compute_seconds(model, profile, devices, 0 * one, query * one)[0])
    m_ctx = float(memory_seconds(model, profile, devices, 0 * one, one)[0] - memory_seconds(model, profile, devices, 0 * one, 0 * one)[0])
    overlap = profile.efficiency.overlap

    def seconds(batch: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        idx = np.asarray(batch).astype(np.int64)
        t_c = c_const[idx] + c_ctx * context_tokens
        t_m = m_const[idx] + m_ctx * context_tokens
        body = np.maximum(t_c, t_m) if overlap else t_c + t_m
        return np.where(idx > 0, fixed[idx] + body, 0.0)

    return seconds


def kv_capacity_tokens(model: ModelSpec, profile: SystemProfile, devices: int, kv_fraction: float,
                       extra_weight_params: int = 0) -> float:
    """KV-cache tokens an engine holds: (devices * capacity * kv_fraction - weight bytes) / kv_bytes_per_token.

    Raises ValueError when the weights alone do not fit.
    """
    budget = devices * profile.hardware.mem_capacity * kv_fraction
    weights = (mm.total_params(model) + extra_weight_params) * model.bytes_per_param
    if weights >= budget:
        raise ValueError(f"{model.name} weights ({weights / 1e9:.1f} GB) do not fit in {devices} x "
                         f"{profile.hardware.name} at kv_fraction {kv_fraction}")
    return (budget - weights) / mm.kv_bytes_per_token(model)
