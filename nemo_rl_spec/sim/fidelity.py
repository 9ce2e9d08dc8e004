"""Fidelity of the simulator against a measured run of the real GRPO loop, with held-out steps.

Method (``examples/run_sim.py fidelity``, :func:`fidelity`): each timed step's own response length (and, for a
speculative run, its acceptance) is the simulator's input for that step; after the warm-up steps, the first
``n_fit`` steps fit one multiplicative correction per phase (and a fixed refit cost), and every held-out step is
predicted from its own inputs with the fitted profile and with the a-priori profile. Per phase: the mean predicted
and measured seconds and the relative error (predicted - measured) / measured. No number of a held-out step is
used for fitting.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import median
from typing import Any

from nemo_rl_spec.sim.calibrate import (
    ACCEPTANCE_KEY,
    LENGTH_KEY,
    TOTAL_KEY,
    measured_phases,
    phase_ratio,
    predict,
    with_measured_inputs,
)
from nemo_rl_spec.sim.interfaces import PhaseTimes, ScenarioSpec
from nemo_rl_spec.sim.presets import eagle3_draft, resolve_model
from nemo_rl_spec.sim.step import resolve
from nemo_rl_spec.utils.feature_configs import SpeculativeConfig

PHASES = ("generation", "logprob", "training", "refit", "other")
POSITION_KEY = "vllm/spec_acceptance_rate_pos{}"


def timed_steps(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The records that carry ``timing/train/total_step_time`` (one per training step), ordered by ``step``."""
    timed = [dict(r) for r in records if TOTAL_KEY in r]
    return sorted(timed, key=lambda r: r.get("step", 0))


def split_fit_holdout(steps: Sequence[dict], warmup: int = 1, n_fit: int | None = None) -> tuple[list, list]:
    """(fit, held-out) steps: drop the first ``warmup``, fit on the next ``n_fit`` (default: half of the rest,
    rounded down, at least 1), hold out the remainder.

    Raises ValueError when either set would be empty."""
    rest = list(steps)[warmup:]
    n = max(1, len(rest) // 2) if n_fit is None else n_fit
    fit, held = rest[:n], rest[n:]
    if not fit or not held:
        raise ValueError(
            f"{len(steps)} timed steps, warm-up {warmup}, n_fit {n}: need at least one step to fit and one to hold out"
        )
    return fit, held


def conditional_acceptance(record: Mapping[str, Any], k: int) -> list[float] | None:
    """Per-position conditional acceptance alpha_i = P(i accepted | 1..i-1 accepted) from vLLM's unconditional
    per-position rates r_i = accepted at position i / drafts (``vllm/spec_acceptance_rate_pos{i}``, i from 0):
    alpha_1 = r_0, alpha_i = r_{i-1} / r_{i-2} (0 once a rate is 0). None unless all k rates are present."""
    rates = [record.get(POSITION_KEY.format(i)) for i in range(k)]
    if any(r is None or math.isnan(r) for r in rates):
        return None
    out, prev = [], 1.0
    for r in rates:
        out.append(min(1.0, max(0.0, r / prev)) if prev > 0 else 0.0)
        prev = r
    return out


def step_inputs(scenario: ScenarioSpec, record: Mapping[str, Any]) -> ScenarioSpec:
    """``scenario`` with one step's measured inputs: mean response length (median rescaled to it), acceptance
    (per-position rates when all k are logged, else the acceptance length)."""
    scn = with_measured_inputs(scenario, {k: v for k, v in record.items() if k in (LENGTH_KEY, ACCEPTANCE_KEY)})
    per_pos = conditional_acceptance(record, scenario.speculative.k)
    if per_pos is not None:
        spec = scn.speculative.model_dump()
        spec.update(alpha=None, acceptance_length=None, per_position=per_pos)
        scn = ScenarioSpec.model_validate({**scn.model_dump(), "speculative": spec})
    return scn


def predict_steps(
    scenario: ScenarioSpec, steps: Sequence[Mapping[str, Any]], speculative: bool, other_s: float = 0.0
) -> list[PhaseTimes]:
    """Predicted phases of each step from its own inputs; ``other`` set to ``other_s`` seconds."""
    return [predict(step_inputs(scenario, r), speculative).model_copy(update=dict(other=other_s)) for r in steps]


RATIO_PHASES = ("generation", "logprob", "training")


def phase_ratios(scenario: ScenarioSpec, fit_steps: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per phase (generation, logprob, training): median over ``fit_steps`` of measured / predicted
    autoregressive seconds (1 where a phase is not logged)."""
    preds = predict_steps(scenario, fit_steps, speculative=False)
    meas = [measured_phases(r) for r in fit_steps]
    return {
        ph: float(median(phase_ratio(getattr(m, ph), getattr(p, ph)) for m, p in zip(meas, preds)))
        for ph in RATIO_PHASES
    }


def refit_overhead(scenario: ScenarioSpec, fit_steps: Sequence[Mapping[str, Any]]) -> float:
    """Fixed seconds per refit: median over ``fit_steps`` of measured ``weight_sync`` minus the predicted
    bytes term (weights / (link bandwidth x refit_bw_eff), the prior bandwidth kept), clipped at 0.

    Additive, not a ratio: on this machine ``weight_sync`` is dominated by per-refit fixed work (RPC, the refit
    log-prob probe that scores fixed sequences with trainer and vLLM), not by bytes, so a draft's extra weights
    must add bytes / bandwidth rather than scale the fixed part."""
    eff = resolve(scenario).profile.efficiency
    preds = predict_steps(scenario, fit_steps, speculative=False)
    return float(
        max(0.0, median(measured_phases(r).refit - (p.refit - eff.refit_overhead_s) for r, p in zip(fit_steps, preds)))
    )


def apply_ratios(scenario: ScenarioSpec, ratios: Mapping[str, float]) -> ScenarioSpec:
    """``scenario`` with efficiencies corrected so each phase's predicted time is multiplied by its ratio
    (generation: decode FLOP/bandwidth efficiencies and prefill MFU / r, forward overheads x r; log-prob and
    training MFU / r; refit, if given: bandwidth efficiency / r, overhead x r). Efficiencies are capped at 1;
    a missing phase keeps its prior.

    Raises pydantic.ValidationError if a ratio is not positive."""
    eff = resolve(scenario).profile.efficiency
    g, lp, tr, rf = (ratios.get(k, 1.0) for k in ("generation", "logprob", "training", "refit"))
    new = {
        **eff.model_dump(),
        "decode_flops_eff": min(1.0, eff.decode_flops_eff / g),
        "mem_bw_eff": min(1.0, eff.mem_bw_eff / g),
        "prefill_mfu": min(1.0, eff.prefill_mfu / g),
        "forward_overhead_s": eff.forward_overhead_s * g,
        "draft_forward_overhead_s": eff.draft_forward_overhead_s * g,
        "logprob_mfu": min(1.0, eff.logprob_mfu / lp),
        "train_mfu": min(1.0, eff.train_mfu / tr),
        "refit_bw_eff": min(1.0, eff.refit_bw_eff / rf),
        "refit_overhead_s": eff.refit_overhead_s * rf,
    }
    return scenario.model_copy(update={"efficiency": new})


def fit_profile(scenario: ScenarioSpec, fit_steps: Sequence[Mapping[str, Any]]) -> tuple[ScenarioSpec, dict]:
    """``scenario`` fitted to ``fit_steps`` (:func:`phase_ratios`, :func:`refit_overhead`) and the fit's numbers
    (``ratios``, ``refit_overhead_s``, ``other_s`` = median unmodelled rest of the step)."""
    ratios = phase_ratios(scenario, fit_steps)
    overhead = refit_overhead(scenario, fit_steps)
    fitted = apply_ratios(scenario, ratios)
    fitted = fitted.model_copy(update={"efficiency": {**fitted.efficiency, "refit_overhead_s": overhead}})
    other = float(median(measured_phases(r).other for r in fit_steps))
    return fitted, {"ratios": ratios, "refit_overhead_s": overhead, "other_s": other}


def compare(predicted: Sequence[PhaseTimes], measured: Sequence[PhaseTimes], steps: Sequence[int]) -> dict[str, Any]:
    """Per phase and for the step total: mean measured and mean predicted seconds over the steps, the relative
    error of the means (predicted - measured) / measured, and the per-step errors.

    Raises ValueError on empty or mismatched inputs."""
    if not predicted or len(predicted) != len(measured) or len(steps) != len(measured):
        raise ValueError("need equally many (>0) predicted and measured steps")
    out: dict[str, Any] = {"steps": list(steps), "phases": {}}
    n = len(measured)
    for ph in (*PHASES, "total"):
        get = (lambda p, ph=ph: p.total) if ph == "total" else (lambda p, ph=ph: getattr(p, ph))
        m, p = [get(x) for x in measured], [get(x) for x in predicted]
        mean_m, mean_p = sum(m) / n, sum(p) / n
        out["phases"][ph] = {
            "measured_s": mean_m,
            "predicted_s": mean_p,
            "error": (mean_p - mean_m) / mean_m if mean_m > 0 else None,
            "per_step_error": [(b - a) / a if a > 0 else None for a, b in zip(m, p)],
        }
    return out


def fidelity(
    scenario: ScenarioSpec,
    ar_records: Sequence[Mapping[str, Any]],
    spec_records: Sequence[Mapping[str, Any]] | None = None,
    warmup: int = 1,
    n_fit: int | None = None,
    spec_scenario: ScenarioSpec | None = None,
    fit_records: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Fit on part of an AR run, predict its held-out steps (and a speculative run).

    1. Inputs per step: every timed record of ``metrics.jsonl`` is one step. Its own ``train/mean_response_length``
       (and, for a speculative run, ``vllm/spec_acceptance_length`` or the per-position rates
       ``vllm/spec_acceptance_rate_pos{i}``) become the simulator's inputs for that step; batch sizes, the response
       cap and k come from the recipe (:func:`scenario_from_recipe`).
    2. Split: the first ``warmup`` timed steps are dropped (engine warm-up, first optimizer step); of the rest the
       first ``n_fit`` steps are the *fit* set and the remaining ones the *held-out* set. No number of a held-out
       step is used for fitting.
    3. Fit (on the fit set only): for generation, log-probs and training one multiplicative correction each, the
       median over fit steps of measured / predicted, applied to the efficiencies as
       :func:`calibrate.fitted_efficiency` does (generation: every decode efficiency and overhead, so pass costs
       scale by r and their shape, fitted to docs/results/cpu_step_costs.md's micro-benchmarks, is kept; log-prob and training
       MFU); for refit an additive fixed cost per refit (:func:`refit_overhead`), the bandwidth kept from the prior.
       ``other`` (scoring, advantages, bookkeeping: not modelled) is predicted as the median of the fit steps'.
    4. Evaluate: every held-out AR step (and every speculative step after its warm-up, a run never used for
       fitting) is predicted from its own inputs with the fitted profile; per phase the mean predicted and mean
       measured seconds over those steps and the relative error (predicted - measured) / measured. The same steps
       are also predicted with the a-priori profile (``prior``: docs/results/cpu_step_costs.md's micro-benchmarks only, nothing
       from this run), an independent check that needs no split at all.

    Args:
        scenario: the AR recipe as a scenario (workload from the recipe, prior CPU profile).
        ar_records / spec_records: ``metrics.jsonl`` records of the AR and (optional) speculative runs.
        warmup: timed steps dropped at the start of each run.
        n_fit: AR steps (after warm-up) used for fitting; default half.
        spec_scenario: the speculative recipe as a scenario (k, draft); default ``scenario``.
        fit_records: another AR run to fit on (all its steps after warm-up); then every step of ``ar_records``
            after warm-up is held out (cross-run check) and ``n_fit`` is ignored.
    Returns a JSON-able report: ``fit`` (steps, ratios, refit_overhead_s, other_s, efficiency), ``ar_holdout``
    and ``ar_prior`` (:func:`compare` of the held-out AR steps with the fitted and the a-priori profile) and,
    with a speculative run, ``spec`` and ``spec_prior``.
    Raises ValueError when a run has too few steps for the split.
    """
    if fit_records is not None:
        fit_steps, held = timed_steps(fit_records)[warmup:], timed_steps(ar_records)[warmup:]
        if not fit_steps or not held:
            raise ValueError(f"need a timed step after a warm-up of {warmup} in both runs")
    else:
        fit_steps, held = split_fit_holdout(timed_steps(ar_records), warmup, n_fit)
    fitted, fit = fit_profile(scenario, fit_steps)
    other_s = fit["other_s"]
    steps = [int(r.get("step", i)) for i, r in enumerate(held)]
    meas = [measured_phases(r) for r in held]
    report: dict[str, Any] = {
        "method": "fit: median measured/predicted per phase over the fit steps; evaluate: held-out steps",
        "fit": {
            "steps": [int(r.get("step", i)) for i, r in enumerate(fit_steps)],
            **fit,
            "efficiency": fitted.efficiency,
        },
        "ar_holdout": compare(predict_steps(fitted, held, False, other_s), meas, steps),
        "ar_prior": compare(predict_steps(scenario, held, False, other_s), meas, steps),
    }
    if spec_records:
        sp = timed_steps(spec_records)[warmup:]
        if not sp:
            raise ValueError(f"speculative run: no timed step after a warm-up of {warmup}")
        base = spec_scenario or scenario
        sp_steps = [int(r.get("step", i)) for i, r in enumerate(sp)]
        sp_meas = [measured_phases(r) for r in sp]
        base_fitted = base.model_copy(update={"efficiency": fitted.efficiency})
        report["spec"] = compare(predict_steps(base_fitted, sp, True, other_s), sp_meas, sp_steps)
        report["spec_prior"] = compare(predict_steps(base, sp, True, other_s), sp_meas, sp_steps)
        report["spec"]["acceptance_length"] = [r.get(ACCEPTANCE_KEY) for r in sp]
    return report


def _get(cfg: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """``cfg["a"]["b"]`` for ``"a.b"``; ``default`` when a key is missing or a value is None on the way."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or node.get(part) is None:
            return default
        node = node[part]
    return node


def scenario_from_recipe(scenario: ScenarioSpec, recipe: Mapping[str, Any]) -> ScenarioSpec:
    """``scenario`` with a GRPO recipe's sizes: prompts per step, generations per prompt, response cap
    (``policy.generation.max_new_tokens``); with ``policy.generation.vllm_kwargs.speculative_config``: k
    (``num_speculative_tokens``), online draft training (``policy.draft.online``, formerly ``train``) with its
    training-time-test unroll (``policy.draft.ttt_steps``, default k) and, when
    the draft directory's config.json gives ``draft_vocab_size``, an EAGLE-3 draft of that vocabulary (without a
    directory: the scenario's draft, i.e. a fresh head with the policy's full vocabulary).

    Raises ValueError for a speculative method other than eagle3 (the simulator models EAGLE-3 drafts only)."""
    data = scenario.model_dump()
    w = data["workload"]
    w["num_prompts"] = int(_get(recipe, "grpo.num_prompts_per_step", w["num_prompts"]))
    w["generations_per_prompt"] = int(_get(recipe, "grpo.num_generations_per_prompt", w["generations_per_prompt"]))
    w["response"]["max_tokens"] = int(_get(recipe, "policy.generation.max_new_tokens", w["response"]["max_tokens"]))
    w["response"]["median_tokens"] = min(w["response"]["median_tokens"], w["response"]["max_tokens"])
    spec_cfg = _get(recipe, "policy.generation.vllm_kwargs.speculative_config")
    if spec_cfg:
        spec_cfg = SpeculativeConfig.model_validate(spec_cfg)
        if spec_cfg.method != "eagle3":
            raise ValueError(f"speculative method {spec_cfg.method!r}: the simulator models EAGLE-3 drafts only")
        k = spec_cfg.num_speculative_tokens
        online = bool(_get(recipe, "policy.draft.online", False) or _get(recipe, "policy.draft.train", False))
        spec = dict(
            data["speculative"],
            k=k,
            online_draft_training=online,
            ttt_steps=_get(recipe, "policy.draft.ttt_steps", None),
            draft_train_period=_get(recipe, "policy.draft.train_period", 1),
        )
        if spec.get("acceptance_length") is not None:
            spec["acceptance_length"] = min(spec["acceptance_length"], k + 1.0)
        if spec.get("per_position") is not None and len(spec["per_position"]) < k:
            spec.update(per_position=None, acceptance_length=1.0)
        vocab = _draft_vocab(spec_cfg.model or _get(recipe, "policy.draft.model_name"))
        if vocab is not None:
            spec["draft"] = eagle3_draft(resolve_model(scenario.model), draft_vocab=vocab).model_dump()
        data["speculative"] = spec
    return ScenarioSpec.model_validate(data)


def _draft_vocab(path: str | None) -> int | None:
    """``draft_vocab_size`` of a draft directory's config.json, or None when there is none."""
    cfg = Path(path) / "config.json" if path else None
    if cfg is None or not cfg.is_file():
        return None
    return json.loads(cfg.read_text()).get("draft_vocab_size")


def format_table(report: Mapping[str, Any], key: str) -> str:
    """Markdown table (phase, measured s, predicted s, error %) of ``report[key]`` (a :func:`compare` result);
    the error of a phase under 1% of the measured step is shown as "-"."""
    rows = ["| phase | measured (s) | predicted (s) | error |", "|---|---|---|---|"]
    total = report[key]["phases"]["total"]["measured_s"]
    for ph, v in report[key]["phases"].items():
        tiny = v["measured_s"] < 0.01 * total  # e.g. ``other``: milliseconds, a relative error means nothing
        err = "-" if v["error"] is None or tiny else f"{100 * v['error']:+.1f}%"
        rows.append(f"| {ph} | {v['measured_s']:.2f} | {v['predicted_s']:.2f} | {err} |")
    return "\n".join(rows)
