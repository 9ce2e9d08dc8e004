"""Non-generation phases of an RL step from FLOPs and MFU (log-probs, training) and bytes over links (refit)."""

from __future__ import annotations

import numpy as np

from nemo_rl_spec.sim import model_math as mm
from nemo_rl_spec.sim.interfaces import LayoutSpec, ModelSpec, SystemProfile


def logprob_seconds(
    model: ModelSpec, profile: SystemProfile, devices: int, seq_tokens: np.ndarray, with_reference: bool = False
) -> float:
    """Log-prob recompute: forward FLOPs / (devices * peak * logprob_mfu), twice with a reference model.

    Formula: (1 + ref) * sum_i [2 P s_i + 2 L H d s_i^2] / (d F mfu), s_i = prompt + response tokens.
    """
    flops = mm.forward_flops_sequences(model, seq_tokens) * (2 if with_reference else 1)
    return flops / (devices * profile.hardware.peak_flops * profile.efficiency.logprob_mfu)


def training_seconds(model: ModelSpec, profile: SystemProfile, devices: int, seq_tokens: np.ndarray) -> float:
    """Policy training: 3 x forward FLOPs (forward + backward) / (devices * peak * train_mfu)."""
    flops = 3.0 * mm.forward_flops_sequences(model, seq_tokens)
    return flops / (devices * profile.hardware.peak_flops * profile.efficiency.train_mfu)


def draft_training_seconds(
    draft: ModelSpec, profile: SystemProfile, devices: int, seq_tokens: np.ndarray, ttt_steps: int = 1
) -> float:
    """Online EAGLE-3 training on captured (detached) hidden states with a training-time-test unroll of
    ``ttt_steps``: the head runs once per unroll step, so ``ttt_steps x 3 x`` the draft's forward FLOPs / (devices *
    peak * train_mfu)."""
    return ttt_steps * training_seconds(draft, profile, devices, seq_tokens)


def refit_seconds(params: int, bytes_per_param: float, profile: SystemProfile, layout: LayoutSpec) -> float:
    """Weight refit: overhead + shard bytes / (link or network bandwidth * refit_bw_eff).

    Every generation device receives its 1/gen_devices_per_engine shard of the weights; engines receive in
    parallel. Formula: t = t0 + params * bytes_per_param / d_engine / (bw * eff).
    """
    hw, eff = profile.hardware, profile.efficiency
    bw = hw.net_bw if layout.refit_over_network else hw.link_bw
    shard = params * bytes_per_param / layout.gen_devices_per_engine
    return eff.refit_overhead_s + shard / (bw * eff.refit_bw_eff)
