"""Calibrate a scenario's efficiencies from a measured run's ``metrics.jsonl`` and check fidelity per phase.

Reads NeMo-RL timing metrics (``timing/train/generation``, ``timing/train/policy_and_reference_logprobs``,
``timing/train/policy_training``, ``timing/train/weight_sync``, ``timing/train/total_step_time``) plus
``train/mean_response_length`` and ``vllm/spec_acceptance_length`` when present; takes the median over steps
after ``skip`` warm-up steps. Fitting: each phase gets a single multiplicative correction of the prior profile, so
the relative shape fitted from docs/results/cpu_step_costs.md's step costs is kept::

    decode:   decode_flops_eff, mem_bw_eff, prefill_mfu /= r;  overheads *= r;   r = measured / predicted gen
    logprob:  logprob_mfu *= predicted / measured             training: train_mfu likewise
    refit:    refit_bw_eff /= r, refit_overhead_s *= r;        other = total - sum of the four phases

Errors reported: ``prior_ar_errors`` (a-priori profile vs the AR run), ``in_sample_ar_residuals`` (~0 by
construction, a consistency check) and ``spec_errors`` (the AR-fitted profile predicts the speculative run). Held-out
fidelity within one run: :mod:`nemo_rl_spec.sim.fidelity`.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from nemo_rl_spec.sim.interfaces import PhaseTimes, ScenarioSpec
from nemo_rl_spec.sim.lengths import sample_lengths
from nemo_rl_spec.sim.simulate import sync_phases
from nemo_rl_spec.sim.step import resolve, rollout_counts

PHASE_KEYS = {
    "generation": "timing/train/generation",
    "logprob": "timing/train/policy_and_reference_logprobs",
    "training": "timing/train/policy_training",
    "refit": "timing/train/weight_sync",
}
TOTAL_KEY = "timing/train/total_step_time"
LENGTH_KEY = "train/mean_response_length"
ACCEPTANCE_KEY = "vllm/spec_acceptance_length"


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl file (one JSON object per non-empty line)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def summarize(records: list[dict[str, Any]], skip: int = 1) -> dict[str, float]:
    """Median of every numeric metric over the records that carry timings, after the first ``skip`` of them.

    Raises ValueError when no timed record remains.
    """
    timed = [r for r in records if TOTAL_KEY in r][skip:]
    if not timed:
        raise ValueError(f"no records with {TOTAL_KEY} after skipping {skip}")
    keys = {k for r in timed for k, v in r.items() if isinstance(v, (int, float)) and k != "step"}
    return {k: float(median(r[k] for r in timed if k in r)) for k in sorted(keys)}


def measured_phases(summary: dict[str, float]) -> PhaseTimes:
    """Measured phase times; ``other`` = total_step_time - the four timed phases (clipped at 0)."""
    phases = {name: summary.get(key, 0.0) for name, key in PHASE_KEYS.items()}
    other = max(0.0, summary[TOTAL_KEY] - sum(phases.values()))
    return PhaseTimes(**phases, other=other)


def with_measured_inputs(scenario: ScenarioSpec, summary: dict[str, float]) -> ScenarioSpec:
    """The scenario with the run's measured mean response length (median rescaled) and acceptance length."""
    update: dict[str, Any] = {}
    if ACCEPTANCE_KEY in summary:
        spec = scenario.speculative.model_dump()
        spec.update(alpha=None, per_position=None, acceptance_length=min(summary[ACCEPTANCE_KEY], spec["k"] + 1.0))
        update["speculative"] = spec
    if LENGTH_KEY in summary:
        w = scenario.workload
        scale = fit_mean_length_scale(scenario, summary[LENGTH_KEY])
        response = w.response.model_copy(update=dict(median_tokens=w.response.median_tokens * scale))
        update["workload"] = w.model_copy(update=dict(response=response))
    return ScenarioSpec.model_validate({**scenario.model_dump(), **update})


def fit_mean_length_scale(scenario: ScenarioSpec, mean_tokens: float, iters: int = 60) -> float:
    """Median multiplier whose sampled lengths have mean ``mean_tokens`` (bisection; the mean rises with it).

    Raises ValueError when the mean lies outside [min_tokens, max_tokens]."""
    w = scenario.workload
    if not w.response.min_tokens <= mean_tokens <= w.response.max_tokens:
        raise ValueError(
            f"mean response length {mean_tokens} outside [{w.response.min_tokens}, {w.response.max_tokens}]"
        )
    n, _ = rollout_counts(scenario)
    lo, hi = np.log(1e-4), np.log(1e4)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        mean = sample_lengths(w.response, n, w.seed, float(np.exp(mid))).mean()
        lo, hi = (mid, hi) if mean < mean_tokens else (lo, mid)
    return float(np.exp(0.5 * (lo + hi)))


def predict(scenario: ScenarioSpec, speculative: bool) -> PhaseTimes:
    """Predicted synchronous phases of ``scenario`` (no baseline), autoregressive or speculative."""
    res = resolve(scenario.model_copy(update=dict(baseline=None)))
    w = scenario.workload
    lengths = sample_lengths(w.response, rollout_counts(scenario)[0], w.seed)
    return sync_phases(res, lengths, speculative)[0]


def phase_ratio(measured: float, predicted: float) -> float:
    """measured / predicted (times of one phase, any one unit), or 1 (keep the prior) when either is missing (0)."""
    return measured / predicted if measured > 0 and predicted > 0 else 1.0


def fitted_efficiency(scenario: ScenarioSpec, measured: PhaseTimes) -> dict[str, float | bool]:
    """Efficiency overrides that make the autoregressive prediction of ``scenario`` match ``measured``
    (a phase measured as 0, i.e. not logged, keeps its prior)."""
    eff = resolve(scenario).profile.efficiency
    pred = predict(scenario, speculative=False)
    r_gen, r_refit = phase_ratio(measured.generation, pred.generation), phase_ratio(measured.refit, pred.refit)
    return {
        **eff.model_dump(),
        "decode_flops_eff": min(1.0, eff.decode_flops_eff / r_gen),
        "mem_bw_eff": min(1.0, eff.mem_bw_eff / r_gen),
        "prefill_mfu": min(1.0, eff.prefill_mfu / r_gen),
        "forward_overhead_s": eff.forward_overhead_s * r_gen,
        "draft_forward_overhead_s": eff.draft_forward_overhead_s * r_gen,
        "logprob_mfu": min(1.0, eff.logprob_mfu / phase_ratio(measured.logprob, pred.logprob)),
        "train_mfu": min(1.0, eff.train_mfu / phase_ratio(measured.training, pred.training)),
        "refit_bw_eff": min(1.0, eff.refit_bw_eff / r_refit),
        "refit_overhead_s": eff.refit_overhead_s * r_refit,
    }


def phase_errors(predicted: PhaseTimes, measured: PhaseTimes) -> dict[str, float]:
    """(predicted - measured) / measured per phase and for the step total (phases measured as 0 are skipped)."""
    out = {name: (getattr(predicted, name) - m) / m for name, m in measured.model_dump().items() if m > 0}
    out["total"] = (predicted.total - measured.total) / measured.total
    return out


def calibrate(
    scenario: ScenarioSpec, ar_records: list[dict], spec_records: list[dict] | None = None, skip: int = 1
) -> tuple[ScenarioSpec, dict[str, Any]]:
    """Fit ``scenario`` to a measured AR run; report prior and cross-run (AR fit -> speculative run) errors."""
    ar_summary = summarize(ar_records, skip)
    ar_meas = measured_phases(ar_summary)
    base = with_measured_inputs(scenario, ar_summary)
    report: dict[str, Any] = {
        "measured_ar": ar_meas.model_dump(),
        "prior_ar_errors": phase_errors(predict(base, False).model_copy(update=dict(other=ar_meas.other)), ar_meas),
    }
    fitted = base.model_copy(update=dict(efficiency=fitted_efficiency(base, ar_meas)))
    # In-sample residuals (fitted on these very numbers, ~0 by construction): not a fidelity measure; use
    # fidelity.fidelity (held-out steps) or spec_errors (another run) for that.
    report["in_sample_ar_residuals"] = phase_errors(
        predict(fitted, False).model_copy(update=dict(other=ar_meas.other)), ar_meas
    )
    if spec_records:
        sp_summary = summarize(spec_records, skip)
        sp_meas = measured_phases(sp_summary)
        sp_scn = with_measured_inputs(scenario.model_copy(update=dict(efficiency=fitted.efficiency)), sp_summary)
        report["measured_spec"] = sp_meas.model_dump()
        # "other" (prepare, scoring, bookkeeping) is not modelled: the AR run's measured value is the prediction.
        report["spec_errors"] = phase_errors(
            predict(sp_scn, True).model_copy(update=dict(other=ar_meas.other)), sp_meas
        )
    return fitted, report
