"""Non-generation phases of an RL step from FLOPs and MFU (log-probs, training) and bytes over links (refit)."""

from __future__ import annotations

import numpy as np

from nemo_rl_spec.sim import model_math as mm
from nemo_rl_spec.sim.interfaces import LayoutSpec, ModelSpec, RefitSpec, SystemProfile
from nemo_rl_spec.sim.refit import fixed_seconds, transport_seconds


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


def refit_seconds(
    params: int,
    bytes_per_param: float,
    profile: SystemProfile,
    layout: LayoutSpec,
    refit: RefitSpec | None = None,
    gen_devices: int | None = None,
) -> float:
    """Weight refit, seconds. Lumped model (``refit`` None): overhead + shard bytes / (link or network bandwidth *
    refit_bw_eff); every generation device receives its 1/gen_devices_per_engine shard, engines in parallel:
    t = t0 + params * bytes_per_param / d_engine / (bw * eff).

    With a :class:`RefitSpec`: t = fixed + the transport's seconds for all params * bytes_per_param bytes to
    ``gen_devices`` generation devices (default ``layout.gen_devices`` or all devices); see :mod:`.refit`.
    """
    hw, eff = profile.hardware, profile.efficiency
    if refit is not None:
        devices = gen_devices or layout.gen_devices or layout.total_devices
        moved = transport_seconds(params * bytes_per_param, refit, hw, layout, devices)
        return fixed_seconds(refit, eff) + moved
    bw = hw.net_bw if layout.refit_over_network else hw.link_bw
    shard = params * bytes_per_param / layout.gen_devices_per_engine
    return eff.refit_overhead_s + shard / (bw * eff.refit_bw_eff)


def refit_fixed_seconds(profile: SystemProfile, refit: RefitSpec | None = None) -> float:
    """The fixed part of :func:`refit_seconds`, seconds: the transport's fixed cost, or ``refit_overhead_s``."""
    return profile.efficiency.refit_overhead_s if refit is None else fixed_seconds(refit, profile.efficiency)
