"""Batch-size-aware speculation: the number of draft tokens k chosen per *running* batch size, k = 0 included.

On a 2-core CPU one verification step of k + 1 tokens per request costs little more than a plain decode step at
batch 1 but several times more at batch 32-64, so speculation pays only while few sequences are still running: the
long tail of a rollout. vLLM 0.32 already implements the switch ("dynamic speculative decoding"):
``speculative_config.num_speculative_tokens_per_batch_size = [(first, last, k), ...]`` (inclusive batch-size
ranges, the first starting at 1; gaps and the tail carry the previous k; k is capped by ``num_speculative_tokens``);
each engine step its scheduler looks up k for the number of requests it scheduled, and with k = 0 the next step is
a plain decode step. Verification is unchanged, so outputs stay lossless (tests/functional/test_adaptive_k_engine.py).

This module builds that schedule from config (``policy.generation.dynamic_speculation``, see
:class:`DynamicSpeculationConfig`): either given explicitly in vLLM's format, or derived from measured step costs
(:func:`derive_schedule`), and :func:`apply_batch_size_schedule` puts it into the engine's ``speculative_config``
before ``vllm.LLM`` is built. Steps without drafts: :func:`install_plain_step_without_drafts`,
:func:`install_drafter_skip_at_k0`.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_rl_spec.speculative.drafter_catch_up import DrafterCatchUp
from nemo_rl_spec.utils.feature_configs import DynamicSpeculationConfig, Schedule, SpeculativeConfig, validate_schedule

logger = logging.getLogger(__name__)

VLLM_KEY = "num_speculative_tokens_per_batch_size"


def k_for_batch_size(schedule: Sequence[Sequence[int]], batch_size: int, max_k: int | None = None) -> int:
    """k the schedule gives a running batch of ``batch_size`` requests (vLLM's rule: gaps and the tail keep the
    previous range's k), capped at ``max_k`` (the engine's ``num_speculative_tokens``)."""
    k = 0
    for first, _last, range_k in validate_schedule(schedule):
        if first > batch_size:
            break
        k = range_k
    return k if max_k is None else min(k, max_k)


def expected_tokens_per_step(acceptance_rate: float, k: int) -> float:
    """E = (1 - a^(k+1)) / (1 - a): expected tokens one verification step emits when each of k proposals is
    accepted with probability a given its predecessors were (i.i.d. acceptance; Leviathan et al. 2023, eq. 1).
    E = k + 1 at a = 1, 1 at k = 0."""
    a = float(acceptance_rate)
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance rate {a} outside [0, 1]")
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def interpolate_cost(costs: Mapping[int, float], batch_size: float) -> float:
    """Step cost at ``batch_size`` from costs measured at some batch sizes: piecewise linear between measured
    points, the first point's cost below it, linear extrapolation of the last two points above (never below the
    last cost). Units as given (seconds). Raises ValueError with no points."""
    if not costs:
        raise ValueError("no measured step costs")
    pts = sorted((int(b), float(c)) for b, c in costs.items())
    if batch_size <= pts[0][0] or len(pts) == 1:
        return pts[0][1] if batch_size <= pts[0][0] else pts[0][1] * batch_size / pts[0][0]
    for (b0, c0), (b1, c1) in itertools.pairwise(pts):
        if batch_size <= b1:
            return c0 + (c1 - c0) * (batch_size - b0) / (b1 - b0)
    (b0, c0), (b1, c1) = pts[-2], pts[-1]
    return max(c1, c1 + (c1 - c0) * (batch_size - b1) / (b1 - b0))


def _acceptance_for(acceptance_rate: float | Mapping[int, float], k: int) -> float:
    if isinstance(acceptance_rate, Mapping):
        rates = {int(key): float(v) for key, v in acceptance_rate.items()}
        if k not in rates:
            raise ValueError(f"no acceptance rate for k={k} (have {sorted(rates)})")
        return rates[k]
    return float(acceptance_rate)


def predicted_speedups(
    ar_step_s: Mapping[int, float],
    spec_step_s: Mapping[int, Mapping[int, float]],
    acceptance_rate: float | Mapping[int, float],
    batch_size: int,
) -> dict[int, float]:
    """Predicted decode throughput over plain decoding at ``batch_size`` for each k: ``E_k(a) * c_AR / c_k``;
    k = 0 gives ``c_AR / c_0`` if a k = 0 cost (drafter prefill only) was measured, else 1. ``acceptance_rate``:
    one per-token a, or {k: a} (acceptance measured per draft length)."""
    c_ar = interpolate_cost(ar_step_s, batch_size)
    out = {0: c_ar / interpolate_cost(spec_step_s[0], batch_size) if 0 in spec_step_s else 1.0}
    for k, costs in spec_step_s.items():
        if int(k) > 0:
            a = _acceptance_for(acceptance_rate, int(k))
            out[int(k)] = expected_tokens_per_step(a, int(k)) * c_ar / interpolate_cost(costs, batch_size)
    return out


def best_k(speedups: Mapping[int, float], min_speedup: float = 1.0) -> int:
    """The k with the largest predicted speedup in ``speedups`` ({k: speedup}, k = 0 included; ties to the smaller
    k), or 0 unless it beats k = 0's by the factor ``min_speedup`` (the rule of :func:`derive_schedule`)."""
    best = max(sorted(speedups), key=lambda k: (speedups[k], -k))
    return best if best > 0 and speedups[best] >= min_speedup * speedups[0] else 0


def configured_acceptance(cfg: DynamicSpeculationConfig, data: Mapping[str, Any]) -> float | Mapping[int, float]:
    """The acceptance rate a derived schedule uses: ``cfg.acceptance_rate``, else the step-cost file's (``data``;
    a number, or {k: a}).

    Raises:
        ValueError: neither gives one.
    """
    a = cfg.acceptance_rate if cfg.acceptance_rate is not None else data.get("acceptance_rate")
    if a is None:
        raise ValueError("policy.generation.dynamic_speculation: set acceptance_rate (the step-cost file has none)")
    return a


def derive_schedule(
    ar_step_s: Mapping[int, float],
    spec_step_s: Mapping[int, Mapping[int, float]],
    acceptance_rate: float | Mapping[int, float],
    max_batch_size: int = 256,
    min_speedup: float = 1.0,
    max_k: int | None = None,
) -> Schedule:
    """Schedule (vLLM format) that picks, per running batch size 1..max_batch_size, the k with the largest
    :func:`predicted_speedups`, drafting (k > 0) only where that beats k = 0 by the factor ``min_speedup``.

    Args:
        ar_step_s: {batch size: seconds of one plain decode step}.
        spec_step_s: {k: {batch size: seconds of one speculative step that accepts nothing}} (k = 0 optional).
        acceptance_rate: per-token acceptance a of the draft (the a whose ``E_k(a)`` equals the measured
            acceptance length), or {k: a} per draft length.
        max_k: ignore measured k above it (the engine's ``num_speculative_tokens``).

    Returns:
        [(first, last, k), ...] covering 1..max_batch_size, adjacent equal k merged; ties go to the smaller k.
    """
    spec = {
        int(k): {int(b): float(c) for b, c in v.items()}
        for k, v in spec_step_s.items()
        if max_k is None or int(k) <= max_k
    }
    ar = {int(b): float(c) for b, c in ar_step_s.items()}
    schedule: Schedule = []
    for b in range(1, int(max_batch_size) + 1):
        s = predicted_speedups(ar, spec, acceptance_rate, b)
        k = best_k(s, min_speedup)
        if schedule and schedule[-1][2] == k:
            schedule[-1] = (schedule[-1][0], b, k)
        else:
            schedule.append((b, b, k))
    return schedule


def load_step_costs(path: str | Path) -> dict[str, Any]:
    """Read measured step costs: a JSON object with ``ar_step_s`` {batch: s}, ``spec_step_s`` {k: {batch: s}} and
    optionally ``acceptance_rate`` (a, or {k: a}), either at top level or under ``"step_costs"`` (the benchmark's output).

    Raises:
        FileNotFoundError: no such file; ValueError: the keys are missing.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"policy.generation.dynamic_speculation.step_costs: no file {path}")
    data = json.loads(path.read_text())
    data = data.get("step_costs", data)
    if "ar_step_s" not in data or "spec_step_s" not in data:
        raise ValueError(f"{path}: expected 'ar_step_s' and 'spec_step_s' (optionally under 'step_costs')")
    return data


def schedule_from_config(cfg: DynamicSpeculationConfig | Mapping[str, Any], max_k: int | None = None) -> Schedule:
    """The schedule a ``policy.generation.dynamic_speculation`` section describes (explicit or derived).

    Raises:
        ValueError: derivation without an acceptance rate (neither in the config nor in the file), or
            ``step_costs: auto`` not yet resolved to a table entry.
    """
    if not isinstance(cfg, DynamicSpeculationConfig):
        cfg = DynamicSpeculationConfig(**cfg)
    if cfg.num_speculative_tokens_per_batch_size is not None:
        return validate_schedule(cfg.num_speculative_tokens_per_batch_size)
    if cfg.step_costs == "auto":
        raise ValueError(
            "policy.generation.dynamic_speculation.step_costs=auto was not resolved: call "
            "nemo_rl_spec.speculative.calibration.resolve_step_costs(cfg, model_path) before building engines"
        )
    data = load_step_costs(cfg.step_costs)
    a = configured_acceptance(cfg, data)
    return derive_schedule(data["ar_step_s"], data["spec_step_s"], a, cfg.max_batch_size, cfg.min_speedup, max_k)


def never_drafts(schedule: Sequence[Sequence[int]], max_k: int | None = None, max_running: int | None = None) -> bool:
    """True when ``schedule`` (vLLM format) gives k = 0 at every running batch size 1..``max_running`` (None: every
    batch size; gaps and the tail keep the previous range's k, as in :func:`k_for_batch_size`), with k capped at
    ``max_k`` (the engine's ``num_speculative_tokens``). Such an engine never proposes a draft token.

    Args:
        schedule: ``[(first, last, k), ...]`` inclusive running-batch ranges, the first starting at 1.
        max_k: cap on k (None: uncapped); ``max_k = 0`` never drafts whatever the schedule.
        max_running: the largest running batch the engine can reach (its ``max_num_seqs``); None: unbounded.

    Raises:
        ValueError: an invalid schedule (:func:`~nemo_rl_spec.utils.feature_configs.validate_schedule`).
    """
    for first, _last, k in validate_schedule(schedule):
        if max_running is not None and first > max_running:
            break
        if (k if max_k is None else min(k, max_k)) > 0:
            return False
    return True


def engine_schedule(generation_cfg) -> Schedule | None:
    """The k-per-running-batch schedule a ``policy.generation`` section gives its engines: the one
    ``dynamic_speculation`` describes (explicit or derived, as :func:`apply_batch_size_schedule` builds it), else a
    ``num_speculative_tokens_per_batch_size`` set by hand in ``vllm_kwargs.speculative_config``, else None (no
    speculation, or a fixed k = ``num_speculative_tokens`` at every batch size).

    Args:
        generation_cfg: a :class:`~nemo_rl_spec.utils.config_schema.GenerationConfig` (``speculative_config`` and
            ``dynamic_speculation`` attributes).

    Raises:
        ValueError: as :func:`schedule_from_config` (e.g. ``step_costs: auto`` not yet resolved).
    """
    spec = generation_cfg.speculative_config
    if spec is None:
        return None
    dyn = generation_cfg.dynamic_speculation
    if dyn is not None and dyn.enabled:
        return schedule_from_config(dyn, spec.num_speculative_tokens)
    if spec.num_speculative_tokens_per_batch_size is not None:
        return validate_schedule(spec.num_speculative_tokens_per_batch_size)
    return None


def apply_batch_size_schedule(engine_kwargs: dict[str, Any], generation_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Engine kwargs with ``speculative_config.num_speculative_tokens_per_batch_size`` set from
    ``generation_cfg["dynamic_speculation"]`` (unchanged when that is absent or disabled). Call before
    ``vllm.LLM(**engine_kwargs)``; the input dicts are not modified.

    Raises:
        ValueError: dynamic speculation without ``speculative_config``, or with the vLLM key also set in
            ``vllm_kwargs.speculative_config`` (set one).
    """
    section = generation_cfg.get("dynamic_speculation")
    if not section or not (
        section.enabled if isinstance(section, DynamicSpeculationConfig) else section.get("enabled", True)
    ):
        return engine_kwargs
    if engine_kwargs.get("speculative_config") is None:
        raise ValueError("policy.generation.dynamic_speculation needs policy.generation.vllm_kwargs.speculative_config")
    spec = SpeculativeConfig.model_validate(engine_kwargs["speculative_config"])
    if spec.num_speculative_tokens_per_batch_size is not None:
        raise ValueError(
            f"both policy.generation.dynamic_speculation and speculative_config.{VLLM_KEY} are set; set one"
        )
    max_k = spec.num_speculative_tokens
    schedule = schedule_from_config(section, max_k)
    if max(k for _, _, k in schedule) > max_k:
        logger.warning(
            "dynamic speculation schedule %s has k above num_speculative_tokens=%d: vLLM caps it", schedule, max_k
        )
    logger.info("dynamic speculation: k per running batch size %s", schedule)
    spec.num_speculative_tokens_per_batch_size = schedule
    return {**engine_kwargs, "speculative_config": spec.engine_dict()}


def _no_drafts(cad, device):
    import torch  # lazy: this module imports without torch

    return torch.empty(cad.batch_size(), 0, dtype=torch.int64, device=device)


def _propose_or_skip(propose, keep_pass_up_to: int):
    def propose_or_skip(num_speculative_tokens, *args, **kwargs):
        cad = kwargs["common_attn_metadata"]
        if num_speculative_tokens == 0 and cad.batch_size() > keep_pass_up_to:
            return _no_drafts(cad, kwargs["target_positions"].device)
        return propose(num_speculative_tokens, *args, **kwargs)

    return propose_or_skip


def _propose_or_record(runner, propose, keep_pass_up_to: int, store: DrafterCatchUp):
    def propose_or_record(num_speculative_tokens, *args, **kwargs):
        cad = kwargs["common_attn_metadata"]
        store.forget_all_but(runner.requests)
        req_ids = runner.input_batch.req_ids
        # only pure decode steps (one token per request) are skipped and recorded: prefill chunks (possibly shared
        # through the prefix cache) and steps verifying drafts keep the pass
        if num_speculative_tokens == 0 and cad.batch_size() > keep_pass_up_to and cad.max_query_len == 1:
            store.record(req_ids, kwargs)
            return _no_drafts(cad, kwargs["target_positions"].device)
        if store.pending:
            store.replay(store.runs_for(req_ids, kwargs), propose, kwargs)
        return propose(num_speculative_tokens, *args, **kwargs)

    return propose_or_record


def _aux_only_when_drafter_runs(runner, keep_pass_up_to: int) -> None:
    # The drafter is the only reader of the target's auxiliary hidden states (EAGLE-3): on a step whose drafter
    # pass is skipped the target forward does not capture them either (vLLM's plain forward, one tensor out).
    model = runner.get_model()
    inner = getattr(model, "model", None)
    layers = getattr(inner, "aux_hidden_state_layers", None)
    if not runner.use_aux_hidden_state_outputs or layers is None:
        return
    execute_model = runner.execute_model

    def execute_model_aux_when_drafting(scheduler_output, *args, **kwargs):
        drafting = int(getattr(scheduler_output, "num_spec_tokens_to_schedule", 1) or 0) > 0
        drafter_runs = drafting or (
            keep_pass_up_to > 0 and len(scheduler_output.num_scheduled_tokens) <= keep_pass_up_to
        )
        # read again by sample_tokens -> propose_draft_token_ids of the same step: stays set until the next step
        runner.use_aux_hidden_state_outputs = drafter_runs
        inner.aux_hidden_state_layers = layers if drafter_runs else ()
        return execute_model(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model_aux_when_drafting


def _skip_drafter_at_k0(worker, keep_pass_up_to: int = 0, catch_up: bool = False) -> None:
    runner = worker.model_runner
    drafter = runner.drafter
    if getattr(drafter, "_nemo_rl_spec_skip_k0", False):
        return
    if catch_up:
        # the recorded steps need the target's auxiliary hidden states: they stay on
        store = DrafterCatchUp(int(getattr(drafter, "max_num_tokens", 0) or 8192))
        drafter.propose = _propose_or_record(runner, drafter.propose, keep_pass_up_to, store)
        drafter._nemo_rl_spec_catch_up = store
    else:
        drafter.propose = _propose_or_skip(drafter.propose, keep_pass_up_to)
        _aux_only_when_drafter_runs(runner, keep_pass_up_to)
    drafter._nemo_rl_spec_skip_k0 = True


def install_drafter_skip_at_k0(llm, keep_pass_up_to: int = 0, catch_up: bool = False) -> None:
    """Skip the EAGLE drafter's forward pass, and the target's auxiliary hidden-state capture, on engine steps
    whose proposals the schedule sets to k = 0 and whose running batch is above ``keep_pass_up_to`` (0: every
    k = 0 step).

    vLLM runs the drafter's first pass at k = 0 so that its KV cache holds every position when drafting resumes
    (``EagleProposer.propose``). Skipped, those positions' drafter KV slots are never written: when the batch
    shrinks and drafting resumes, the drafter attends to stale slots for them, which can only lower acceptance.
    ``keep_pass_up_to`` above the schedule's drafting range keeps the pass on the k = 0 steps just above it, so a
    request that reaches the drafting range has its most recent positions in the drafter's cache. Verification is
    untouched, so outputs stay lossless (the target decides every token). Trade measured by
    ``examples/bench_spec_rollouts.py`` (``batch_aware_skip_k0``) and ``examples/bench_spec_schedule.py``; turned on
    by ``policy.generation.dynamic_speculation.drafter_pass_at_k0: false`` (0) or ``drafter_pass_max_batch: N``
    (N), and always when the schedule gives k = 0 at every batch size (the drafter never proposes, so its KV cache
    is never read).

    ``catch_up`` (``dynamic_speculation.drafter_catch_up``): skip only pure decode steps, keep the target's auxiliary
    hidden states on, record what each skipped step's pass would have read, and replay a request's skipped
    positions through the drafter right before its next pass (:class:`~nemo_rl_spec.speculative.drafter_catch_up.
    DrafterCatchUp`): the drafter's KV cache is then complete when drafting resumes.

    Raises:
        AttributeError: the engine has no drafter (no model-based ``speculative_config``).
    """
    llm.collective_rpc(_skip_drafter_at_k0, args=(keep_pass_up_to, catch_up))


def _plain_step_when_not_drafting(worker) -> None:
    runner = worker.model_runner
    if getattr(runner, "_nemo_rl_spec_plain_k0", False):
        return
    prepare_inputs = runner._prepare_inputs

    def prepare_inputs_plain_without_drafts(*args, **kwargs):
        logits_indices, spec_decode_metadata, max_num_sampled_tokens = prepare_inputs(*args, **kwargs)
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0:
            # No request carries a draft token: logits_indices are already the plain ones (each request's last
            # scheduled token); None sends the step through vLLM's plain sampler instead of the rejection sampler
            # and the drafter's input preparation for a batch without rejections.
            spec_decode_metadata = None
        return logits_indices, spec_decode_metadata, max_num_sampled_tokens

    runner._prepare_inputs = prepare_inputs_plain_without_drafts
    runner._nemo_rl_spec_plain_k0 = True


def install_plain_step_without_drafts(llm) -> None:
    """Engine steps in which no request carries a draft token (k = 0 steps of a batch-size-aware schedule, and
    every prefill step) take vLLM's plain sampling path: the step's ``SpecDecodeMetadata`` (zero drafts) is dropped,
    so vLLM's ``Sampler`` samples each request's one token instead of ``RejectionSampler`` (which would sample the
    same bonus token through the same sampler after indexing and copying the logits, a float32 round trip and
    per-token expansions of the sampling parameters). The drafter still sees every token (its KV cache stays
    complete); steps that carry drafts are untouched. Lossless: with no draft, the rejection sampler's output is its
    bonus token, drawn by the same ``Sampler`` call with the same generators (tests/functional/
    test_adaptive_k_engine.py, test_speculative_sampling.py)."""
    llm.collective_rpc(_plain_step_when_not_drafting)


def install_k0_paths(
    llm,
    speculative_config: Mapping[str, Any],
    dynamic: DynamicSpeculationConfig | Mapping[str, Any] | None,
    max_running: int | None = None,
) -> None:
    """Install what a speculative engine runs on steps without drafts: vLLM's plain sampler on steps
    that carry no draft (:func:`install_plain_step_without_drafts`; unless ``dynamic_speculation.plain_step_at_k0``
    is false), and no drafter pass nor auxiliary hidden states on k = 0 steps (:func:`install_drafter_skip_at_k0`)
    when ``drafter_pass_at_k0`` is false or the engine's schedule gives k = 0 at every batch size it can reach (then
    nothing ever reads the drafter's KV cache), or on k = 0 steps above ``drafter_pass_max_batch`` running requests;
    with ``drafter_catch_up`` the skipped decode positions are replayed through the drafter when its pass next runs.

    Raises:
        ValueError: ``drafter_catch_up`` with a ``draft_model`` drafter (it reads no target hidden states).

    Args:
        speculative_config: the engine's ``speculative_config`` as passed to ``vllm.LLM`` (schedule applied).
        dynamic: ``policy.generation.dynamic_speculation`` (None: no schedule).
        max_running: the engine's ``max_num_seqs`` (the largest running batch it schedules; None: unbounded): a
            schedule whose k > 0 ranges all start above it never drafts (:func:`never_drafts`).
    """
    if dynamic is not None and not isinstance(dynamic, DynamicSpeculationConfig):
        dynamic = DynamicSpeculationConfig(**dynamic)
    on = dynamic is not None and dynamic.enabled
    plain = not on or dynamic.plain_step_at_k0
    if plain:
        install_plain_step_without_drafts(llm)
    spec = SpeculativeConfig.model_validate(dict(speculative_config))
    if not on or spec.method not in ("eagle", "eagle3", "draft_model", "mtp"):
        return
    schedule = spec.num_speculative_tokens_per_batch_size
    never = plain and bool(schedule) and never_drafts(schedule, spec.num_speculative_tokens, max_running)
    catch_up = dynamic.drafter_catch_up and not never
    if catch_up and spec.method == "draft_model":
        raise ValueError(
            "policy.generation.dynamic_speculation.drafter_catch_up needs a drafter fed the target's hidden states "
            "(speculative_config.method eagle, eagle3 or mtp), got draft_model"
        )
    if never or not dynamic.drafter_pass_at_k0:
        install_drafter_skip_at_k0(llm, 0, catch_up)
    elif dynamic.drafter_pass_max_batch is not None:
        install_drafter_skip_at_k0(llm, dynamic.drafter_pass_max_batch, catch_up)
