"""Roofline time of one forward pass of a generation engine: bytes moved, FLOPs, collectives, fixed overhead.

A forward over ``batch`` sequences with ``query`` new tokens each (1 for decode, k+1 for verification) on an engine
of ``devices`` = tp * pp devices (weights and KV sharded evenly; ``pipeline`` = pp stages fed pp micro-batches)::

    T = batch * query;  P = matmul params per token;  W(T) = weights streamed (MoE: experts touched)
    flops = 2 P T + 4 L H d (query * context)
    bytes = pp W(T / pp) + kv_per_token (context + T) + 8 V T    (weights re-read per micro-batch; fp32 logits)
    t = overhead + combine(flops / (d F e_f), bytes / (d B e_b)) + collectives
    combine = max (GPU: compute and memory overlap) or sum (CPU)
    collectives = 2 L (latency + 2 (T/pp) h b (tp-1)/tp / link)  two all-reduce/all-to-all per layer when tp > 1
                + pp latency + T h b / link                      stage-to-stage sends when pp > 1

So pipeline stages add compute but not weight bandwidth per pass: in the memory-bound regime an engine of
tp x pp devices decodes like one of tp devices.
"""

from __future__ import annotations

import numpy as np

from nemo_rl_spec.sim import model_math as mm
from nemo_rl_spec.sim.interfaces import ModelSpec, SystemProfile


def compute_seconds(
    model: ModelSpec, profile: SystemProfile, devices: int, tokens: np.ndarray, query_context: np.ndarray
) -> np.ndarray:
    """Seconds of the FLOPs: (2 P T + attention FLOPs) / (devices * peak * decode_flops_eff). Shape: like tokens."""
    flops = 2.0 * mm.matmul_params_per_token(model) * tokens + mm.attention_flops(model, query_context)
    hw, eff = profile.hardware, profile.efficiency
    return flops / (devices * hw.peak_flops * eff.decode_flops_eff)


LOGIT_BYTES_PER_TOKEN_VOCAB = 8.0  # fp32 logits written by lm_head and read back by the (rejection) sampler


def memory_seconds(
    model: ModelSpec,
    profile: SystemProfile,
    devices: int,
    tokens: np.ndarray,
    context_tokens: np.ndarray,
    pipeline: int = 1,
) -> np.ndarray:
    """Seconds of the bytes: (weights streamed once per micro-batch + KV read and written + fp32 logits written
    and read by the sampler) / (devices * bandwidth * mem_bw_eff)."""
    tokens = np.asarray(tokens, dtype=float)
    nbytes = (
        pipeline * mm.weight_bytes_read(model, tokens / pipeline)
        + mm.kv_bytes_per_token(model) * (context_tokens + tokens)
        + LOGIT_BYTES_PER_TOKEN_VOCAB * model.vocab * tokens
    )
    hw, eff = profile.hardware, profile.efficiency
    return nbytes / (devices * hw.mem_bw * eff.mem_bw_eff)


def collective_seconds(
    model: ModelSpec, profile: SystemProfile, devices: int, tokens: np.ndarray, pipeline: int = 1
) -> np.ndarray:
    """Seconds of the collectives of a sharded engine (module formula); 0 on one device."""
    tokens = np.asarray(tokens, dtype=float)
    hw, tp = profile.hardware, devices // pipeline
    out = np.zeros_like(tokens)
    if tp > 1:
        ring_bytes = 2.0 * (tokens / pipeline) * model.hidden * model.bytes_per_param * (tp - 1) / tp
        out += 2.0 * model.n_layers * (hw.collective_latency_s + ring_bytes / hw.link_bw)
    if pipeline > 1:
        out += pipeline * hw.collective_latency_s + tokens * model.hidden * model.bytes_per_param / hw.link_bw
    return out


def forward_seconds(
    model: ModelSpec,
    profile: SystemProfile,
    devices: int,
    batch: np.ndarray,
    context_tokens: np.ndarray,
    query: int,
    overhead_s: float,
    pipeline: int = 1,
) -> np.ndarray:
    """Seconds of one forward (module formula). Shapes: batch, context_tokens [P] -> [P].

    Args:
        devices: devices of the engine, tp * pipeline.
        batch: sequences in the forward.
        context_tokens: KV-cache tokens attended, summed over the batch.
        query: new tokens per sequence (1 decode, k+1 verification).
        overhead_s: fixed cost added per forward (engine scheduling, sampling, launches).
        pipeline: pipeline stages pp (must divide devices).
    Passes with batch 0 cost 0. Raises ValueError if pipeline does not divide devices.
    """
    if devices % pipeline:
        raise ValueError(f"pipeline {pipeline} does not divide {devices} devices")
    batch = np.asarray(batch, dtype=float)
    context_tokens = np.asarray(context_tokens, dtype=float)
    tokens = batch * query
    t_c = compute_seconds(model, profile, devices, tokens, query * context_tokens)
    t_m = memory_seconds(model, profile, devices, tokens, context_tokens, pipeline)
    body = np.maximum(t_c, t_m) if profile.efficiency.overlap else t_c + t_m
    total = overhead_s + body + collective_seconds(model, profile, devices, tokens, pipeline)
    return np.where(batch > 0, total, 0.0)


def tabulated_forward(
    model: ModelSpec,
    profile: SystemProfile,
    devices: int,
    max_batch: int,
    query: int,
    overhead_s: float,
    pipeline: int = 1,
):
    """:func:`forward_seconds` as a fast callable of (batch, context): the batch-only terms (weights, experts
    touched, collectives) are tabulated for batch 0..max_batch, the context terms are linear. Same values."""
    if devices % pipeline:
        raise ValueError(f"pipeline {pipeline} does not divide {devices} devices")
    b = np.arange(max_batch + 1, dtype=float)
    zero = np.zeros_like(b)
    c_const = compute_seconds(model, profile, devices, b * query, zero)
    m_const = memory_seconds(model, profile, devices, b * query, zero, pipeline)
    fixed = overhead_s + collective_seconds(model, profile, devices, b * query, pipeline)
    one = np.ones(1)
    c_ctx = float(compute_seconds(model, profile, devices, 0 * one, query * one)[0])
    m_ctx = float(
        memory_seconds(model, profile, devices, 0 * one, one, pipeline)[0]
        - memory_seconds(model, profile, devices, 0 * one, 0 * one, pipeline)[0]
    )
    overlap = profile.efficiency.overlap

    def seconds(batch: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        idx = np.asarray(batch).astype(np.int64)
        t_c = c_const[idx] + c_ctx * context_tokens
        t_m = m_const[idx] + m_ctx * context_tokens
        body = np.maximum(t_c, t_m) if overlap else t_c + t_m
        return np.where(idx > 0, fixed[idx] + body, 0.0)

    return seconds


def kv_capacity_tokens(
    model: ModelSpec, profile: SystemProfile, devices: int, kv_fraction: float, extra_weight_params: int = 0
) -> float:
    """KV-cache tokens an engine holds: (devices * capacity * kv_fraction - weight bytes) / kv_bytes_per_token.

    Raises ValueError when the weights alone do not fit.
    """
    budget = devices * profile.hardware.mem_capacity * kv_fraction
    weights = (mm.total_params(model) + extra_weight_params) * model.bytes_per_param
    if weights >= budget:
        raise ValueError(
            f"{model.name} weights ({weights / 1e9:.1f} GB) do not fit in {devices} x "
            f"{profile.hardware.name} at kv_fraction {kv_fraction}"
        )
    return (budget - weights) / mm.kv_bytes_per_token(model)
