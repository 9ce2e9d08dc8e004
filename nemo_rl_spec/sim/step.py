"""One RL step, autoregressive vs speculative: generation + log-probs + training + refit, sync or async.

Sync (NeMo-RL colocated): step = generation + logprob + training + refit + other, phases in turn on all devices.
Async (non-colocated): generation devices and training devices work concurrently with policy lag <= L:
    step = max(generation per step, logprob + training) + refit + other,
and generation per step comes from L+1 steps of requests in flight (see ``simulate_generation``). When the split
of devices is not given, the best split (multiples of the engine size) is searched for each variant separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nemo_rl_spec.sim import model_math as mm
from nemo_rl_spec.sim.formulas import (
    alpha_for_acceptance_length,
    expected_tokens_per_pass,
    tokens_per_pass_per_position,
)
from nemo_rl_spec.sim.generation import (
    ar_pass_cost,
    max_concurrency,
    prefill_seconds,
    simulate_generation,
    spec_pass_cost,
)
from nemo_rl_spec.sim.interfaces import GenerationResult, ModelSpec, ScenarioSpec, SpeculativeSpec, SystemProfile
from nemo_rl_spec.sim.lengths import sample_lengths
from nemo_rl_spec.sim.phases import (
    draft_training_seconds,
    logprob_seconds,
    refit_fixed_seconds,
    refit_seconds,
    training_seconds,
)
from nemo_rl_spec.sim.presets import resolve_draft, resolve_model, resolve_profile


@dataclass(frozen=True)
class Resolved:
    """A scenario with presets looked up and the acceptance turned into tokens per pass."""

    scenario: ScenarioSpec
    model: ModelSpec
    draft: ModelSpec
    profile: SystemProfile
    tokens_per_pass: float
    alpha: float


def tokens_per_pass(spec: SpeculativeSpec) -> tuple[float, float]:
    """(E tokens per target pass, equivalent constant alpha) of a speculative spec."""
    if spec.acceptance_length is not None:
        return spec.acceptance_length, alpha_for_acceptance_length(spec.acceptance_length, spec.k)
    if spec.alpha is not None:
        return expected_tokens_per_pass(spec.alpha, spec.k), spec.alpha
    tpp = tokens_per_pass_per_position(spec.per_position[: spec.k])
    return tpp, alpha_for_acceptance_length(tpp, spec.k)


def resolve(scenario: ScenarioSpec) -> Resolved:
    """Look up presets and efficiency overrides of ``scenario``."""
    model = resolve_model(scenario.model)
    tpp, alpha = tokens_per_pass(scenario.speculative)
    return Resolved(
        scenario,
        model,
        resolve_draft(scenario.speculative.draft, model),
        resolve_profile(scenario.hardware, scenario.efficiency),
        tpp,
        alpha,
    )


def rollout_counts(scenario: ScenarioSpec) -> tuple[int, int]:
    """(rollouts generated, rollouts trained on) per step. Pilot-Commit: the pilot covers every sampled prompt,
    the commit only the selected ones, and only selected prompts' pilot + commit rollouts are trained on."""
    w = scenario.workload
    if w.pilot_commit is None:
        n = w.num_prompts * w.generations_per_prompt
        return n, n
    pc = w.pilot_commit
    selected = int(round(pc.sampling_prompts * pc.selected_fraction))
    return pc.sampling_prompts * pc.n_pilot + selected * pc.n_commit, selected * (pc.n_pilot + pc.n_commit)


def generation(
    res: Resolved, lengths: np.ndarray, gen_devices: int, speculative: bool, steps_in_flight: int = 1
) -> GenerationResult:
    """Simulated generation phase on ``gen_devices`` devices (engines of ``gen_devices_per_engine``)."""
    lay, w = res.scenario.layout, res.scenario.workload
    d = lay.gen_devices_per_engine
    draft = res.draft if speculative else None
    conc = max_concurrency(
        res.model, res.profile, d, lay.max_num_seqs, lay.kv_cache_fraction, lengths, w.prompt_tokens, draft
    )
    k = res.scenario.speculative.k
    pp = lay.gen_pipeline_parallel
    cost = (
        spec_pass_cost(res.model, res.draft, res.profile, d, k, conc, pp)
        if speculative
        else ar_pass_cost(res.model, res.profile, d, conc, pp)
    )
    n_engines = max(1, gen_devices // d)
    seqs = len(lengths) / w.generations_per_prompt if lay.prefix_caching else len(lengths)
    prompts_per_engine = np.ceil(seqs / n_engines) * w.prompt_tokens
    prefill = prefill_seconds([res.model] + ([draft] if draft else []), res.profile, d, prompts_per_engine)
    tpp = res.tokens_per_pass if speculative else 1.0
    return simulate_generation(lengths, w.prompt_tokens, n_engines, tpp, conc, cost, prefill, steps_in_flight)


def trained_seq_tokens(res: Resolved, lengths: np.ndarray) -> np.ndarray:
    """Prompt + response tokens of the sequences trained on (the first ``trained`` rollouts). Shape: [n]."""
    _, trained = rollout_counts(res.scenario)
    return res.scenario.workload.prompt_tokens + lengths[:trained].astype(float)


def train_side(res: Resolved, lengths: np.ndarray, devices: int, speculative: bool) -> tuple[float, float, float]:
    """(logprob, training, refit) seconds predicted from FLOPs and bytes on ``devices`` training devices."""
    seqs = trained_seq_tokens(res, lengths)
    lp = logprob_seconds(res.model, res.profile, devices, seqs, res.scenario.workload.reference_logprobs)
    tr = training_seconds(res.model, res.profile, devices, seqs)
    gen = refit_gen_devices(res, devices)
    refit = refit_seconds(
        mm.total_params(res.model), res.model.bytes_per_param, res.profile, res.scenario.layout, res.scenario.refit, gen
    )
    if speculative:
        refit += draft_refit_seconds(res, res.model.bytes_per_param, gen)
        if res.scenario.speculative.online_draft_training:
            tr += online_draft_seconds(res, devices, seqs)
    return lp, tr, refit


def refit_gen_devices(res: Resolved, train_devices: int) -> int:
    """Generation devices a refit reaches when ``train_devices`` train: all devices when colocated, else the rest
    (``layout.gen_devices``, or half the devices, when every device is counted as training)."""
    lay = res.scenario.layout
    if lay.colocated:
        return lay.total_devices
    rest = lay.total_devices - train_devices
    return rest if rest > 0 else (lay.gen_devices or max(1, lay.total_devices // 2))


def draft_refit_seconds(res: Resolved, bytes_per_param: float, gen_devices: int | None = None) -> float:
    """The draft's share of a refit (its bytes, without the refit's fixed overhead) per step: over
    ``draft_train_period`` with online training (the draft is refit only after the steps that trained it).
    ``gen_devices``: devices the refit reaches (transport models only; default as :func:`refit_gen_devices`)."""
    spec, lay, refit = res.scenario.speculative, res.scenario.layout, res.scenario.refit
    gen = gen_devices or refit_gen_devices(res, lay.total_devices)
    seconds = refit_seconds(mm.total_params(res.draft), bytes_per_param, res.profile, lay, refit, gen)
    seconds -= refit_fixed_seconds(res.profile, refit)
    return seconds / (spec.draft_train_period if spec.online_draft_training else 1)


def online_draft_seconds(res: Resolved, devices: int, seqs: np.ndarray) -> float:
    """Online draft training per step: :func:`draft_training_seconds` with the unroll ``ttt_steps`` (default k), over
    ``draft_train_period`` (the mean over the steps when the draft trains on every n-th one)."""
    spec = res.scenario.speculative
    seconds = draft_training_seconds(res.draft, res.profile, devices, seqs, spec.ttt_steps or spec.k)
    return seconds / spec.draft_train_period


def speculative_overheads(res: Resolved, lengths: np.ndarray, devices: int) -> tuple[float, float]:
    """Extra (training, refit) seconds speculation adds to measured baseline phases: the draft's refit bytes and,
    with online draft training, its fwd+bwd; both per-step means over ``draft_train_period`` steps with online
    training (the draft is refit only after the steps that trained it)."""
    seqs = trained_seq_tokens(res, lengths)
    extra_train = online_draft_seconds(res, devices, seqs) if res.scenario.speculative.online_draft_training else 0.0
    return extra_train, draft_refit_seconds(res, res.draft.bytes_per_param)


def scenario_lengths(res: Resolved, median_scale: float = 1.0) -> np.ndarray:
    """Response lengths of the rollouts one step generates. Shape: [generated]."""
    generated, _ = rollout_counts(res.scenario)
    w = res.scenario.workload
    return sample_lengths(w.response, generated, w.seed, median_scale)


def fit_length_scale(res: Resolved, target_seconds: float, devices: int, iters: int = 40) -> float:
    """Median-length multiplier whose simulated autoregressive generation takes ``target_seconds`` (bisection on
    log scale; generation time rises monotonically with the median).

    Raises ValueError when no length distribution within [min_tokens, max_tokens] reaches the target (the
    workload is too small or too large for the measured time on this hardware)."""
    ar_time = lambda log_scale: (
        generation(
            res,
            scenario_lengths(res, float(np.exp(log_scale))),
            devices,  # noqa: E731
            False,
        ).seconds
    )
    lo, hi = np.log(1e-3), np.log(1e3)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ar_time(mid) < target_seconds else (lo, mid)
        if hi - lo < 1e-4:
            break
    scale = 0.5 * (lo + hi)
    reached = ar_time(scale)
    if abs(reached - target_seconds) > 0.01 * target_seconds:
        raise ValueError(
            f"{res.scenario.name}: no response-length scale makes autoregressive generation take "
            f"{target_seconds:.1f} s (closest {reached:.1f} s); resize the workload"
        )
    return float(np.exp(scale))
