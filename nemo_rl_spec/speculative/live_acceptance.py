"""Live-acceptance speculation: k chosen every engine step from the schedule's step costs and the draft's acceptance
measured over the engine's last steps; k = 0 where drafting is predicted to cost more than it saves.

The batch-size-aware schedule (:func:`~nemo_rl_spec.speculative.adaptive_k.derive_schedule`) picks k per running
batch from measured step costs and one per-token acceptance rate a, fixed for the run (the draft's held-out
estimate); where the rows that run longest accept less than that estimate, drafting there loses time.
:class:`AcceptanceEstimate` measures a from the engine's own verification results, and :class:`LiveKLookup` puts
it into vLLM's choice of k: it stands in for the scheduler's ``dynamic_sd_lookup`` (vLLM's dense running-batch ->
k table, read once per scheduled step) and returns, at running batch b, the k in 0..schedule(b) that
:func:`~nemo_rl_spec.speculative.adaptive_k.predicted_speedups` ranks first with the live estimate in place of the
fixed a (draft only where that beats k = 0 by ``min_speedup``). Verification is untouched: every k gives the same
tokens (lossless; tests/functional/test_adaptive_k_engine.py). Measured negative: on the long-tail recipe (CPU)
its rollout phase trailed the fixed schedule's, so it stays off by default (docs/guides/speculation_schedule.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_rl_spec.speculative.adaptive_k import (
    best_k,
    configured_acceptance,
    expected_tokens_per_step,
    interpolate_cost,
    load_step_costs,
)

logger = logging.getLogger(__name__)


class AcceptanceEstimate:
    """Per-token acceptance rate of a draft, from decayed verification counts and a prior.

    A step that proposed ``k`` tokens for a request and accepted ``n`` of them tried ``n + 1`` proposals if
    ``n < k`` (vLLM verifies left to right; the first rejection ends the step) and ``k`` if ``n = k``. With
    i.i.d. acceptance a (the model behind ``E_k(a) = (1 - a^(k+1)) / (1 - a)``, Leviathan et al. 2023, eq. 1) the
    maximum-likelihood a is accepted / tried. The estimate adds ``prior_trials`` pseudo-trials at ``prior_rate``:

        a_hat = (prior_trials * prior_rate + S) / (prior_trials + T)

    where S and T are the accepted and tried counts, both multiplied by ``0.5 ** (1 / half_life)`` at every
    :meth:`step` (an engine step, drafting or not). Evidence halves every ``half_life`` steps: after a stretch
    without drafts a_hat returns to the prior, so a stopped engine drafts again (a probe), and a draft that
    improves (online training, refit) is picked up.

    Args:
        prior_rate: a before any evidence (the configured ``acceptance_rate``), in [0, 1].
        prior_trials: weight of the prior in proposals (>= 0; 0: the estimate is the decayed counts alone, the prior
            only when there are none).
        half_life: engine steps over which evidence halves (> 0).

    Raises:
        ValueError: an argument outside its range.
    """

    def __init__(self, prior_rate: float, prior_trials: float = 4.0, half_life: float = 16.0) -> None:
        if not 0.0 <= prior_rate <= 1.0:
            raise ValueError(f"prior_rate {prior_rate} outside [0, 1]")
        if prior_trials < 0 or half_life <= 0:
            raise ValueError(f"need prior_trials >= 0 and half_life > 0, got {prior_trials}, {half_life}")
        self.prior_rate, self.prior_trials = float(prior_rate), float(prior_trials)
        self.decay = 0.5 ** (1.0 / float(half_life))
        self.accepted = 0.0
        self.tried = 0.0

    def observe(self, proposed: int, accepted: int) -> None:
        """Count one request's verification: ``proposed`` draft tokens, the first ``accepted`` of them kept.

        Raises:
            ValueError: ``accepted`` outside 0..``proposed``.
        """
        if proposed <= 0:
            return
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted {accepted} outside 0..{proposed}")
        self.accepted += accepted
        self.tried += accepted + (1 if accepted < proposed else 0)

    def step(self) -> None:
        """One engine step passed: decay the evidence."""
        self.accepted *= self.decay
        self.tried *= self.decay

    @property
    def rate(self) -> float:
        """a_hat (see the class docstring); the prior when there is no evidence and no prior weight."""
        weight = self.prior_trials + self.tried
        if weight <= 0.0:
            return self.prior_rate
        return (self.prior_trials * self.prior_rate + self.accepted) / weight


class LiveKLookup:
    """vLLM scheduler's running-batch -> k lookup (``Scheduler.dynamic_sd_lookup``) with k chosen from live
    acceptance.

    ``lookup[b]`` (the scheduler reads it once per step that schedules ``b`` requests) advances the estimate by one
    step and returns the k in {0} and the measured k <= ``cap[b]`` (the static schedule's k) with the largest
    predicted speedup ``E_k(a_hat) * c_AR(b) / c_k(b)``, drafting only where that is at least ``min_speedup``
    times k = 0's (``c_AR(b) / c_0(b)`` if a k = 0 cost was measured, else 1); ties go to the smaller k.

    Args:
        cap: vLLM's dense lookup (index = running batch, index 0 unused): the most k the schedule allows.
        ar_step_s: {batch: seconds of a plain decode step}; spec_step_s: {k: {batch: seconds of a k-token
            speculative step that accepts nothing}} (the step-cost file the schedule was derived from).
        estimate: the :class:`AcceptanceEstimate` fed by :meth:`observe_step`.
        min_speedup: as in :func:`~nemo_rl_spec.speculative.adaptive_k.derive_schedule`.

    Attributes:
        counts: ``steps`` (lookups), ``capped`` (lookups where the schedule allowed k > 0), ``drafted`` (lookups
            that returned k > 0), ``k_sum`` (sum of k returned).

    Raises:
        ValueError: no k > 0 cost measured, or an empty ``cap``.
    """

    def __init__(
        self,
        cap: Sequence[int],
        ar_step_s: Mapping[Any, float],
        spec_step_s: Mapping[Any, Mapping[Any, float]],
        estimate: AcceptanceEstimate,
        min_speedup: float = 1.0,
    ) -> None:
        if len(cap) < 2:
            raise ValueError("cap: need vLLM's dense lookup (index 0 unused, then one k per running batch)")
        spec = {int(k): {int(b): float(c) for b, c in v.items()} for k, v in spec_step_s.items()}
        ar = {int(b): float(c) for b, c in ar_step_s.items()}
        if not any(k > 0 for k in spec):
            raise ValueError("spec_step_s: no k > 0 step cost measured")
        self.cap = [int(k) for k in cap]
        self.estimate, self.min_speedup = estimate, float(min_speedup)
        # c_AR(b) / c_k(b) for every running batch and measured k (k = 0: the k0 cost if measured, else 1)
        self._ratio = [self._ratios(ar, spec, b) for b in range(len(self.cap))]
        self.counts = {"steps": 0, "capped": 0, "drafted": 0, "k_sum": 0}

    @staticmethod
    def _ratios(ar: dict, spec: dict, b: int) -> dict[int, float]:
        b = max(b, 1)
        c_ar = interpolate_cost(ar, b)
        out = {k: c_ar / interpolate_cost(costs, b) for k, costs in spec.items()}
        out.setdefault(0, 1.0)
        return out

    def __len__(self) -> int:
        return len(self.cap)

    def choose(self, batch_size: int, rate: float) -> int:
        """k for a running batch of ``batch_size`` at per-token acceptance ``rate`` (no state change)."""
        b = min(int(batch_size), len(self.cap) - 1)
        cap, ratio = self.cap[b], self._ratio[b]
        return best_k(
            {k: expected_tokens_per_step(rate, k) * r for k, r in ratio.items() if k <= cap}, self.min_speedup
        )

    def __getitem__(self, batch_size: int) -> int:
        self.estimate.step()
        b = min(int(batch_size), len(self.cap) - 1)
        k = self.choose(b, self.estimate.rate) if self.cap[b] > 0 else 0
        self.counts["steps"] += 1
        self.counts["capped"] += int(self.cap[b] > 0)
        self.counts["drafted"] += int(k > 0)
        self.counts["k_sum"] += k
        return k

    def observe_step(self, scheduler_output, model_runner_output) -> None:
        """Feed one finished engine step's verification results to the estimate: for every request that carried
        draft tokens, the proposals (``scheduler_output.scheduled_spec_decode_tokens``) and how many were kept
        (tokens sampled for it in ``model_runner_output`` minus the one bonus/recovered token, vLLM's own count)."""
        drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        sampled = getattr(model_runner_output, "sampled_token_ids", None)
        index = getattr(model_runner_output, "req_id_to_index", None) or {}
        if not drafts or sampled is None or len(sampled) == 0:
            return
        for req_id, tokens in drafts.items():
            i = index.get(req_id)
            if i is None or len(sampled[i]) == 0:
                continue
            proposed = len(tokens)
            self.estimate.observe(proposed, min(max(len(sampled[i]) - 1, 0), proposed))


def prior_acceptance(dynamic, costs: Mapping[str, Any]) -> float:
    """The per-token acceptance rate the schedule was derived with: ``dynamic.acceptance_rate``, else the step-cost
    file's (a number, or {k: a}: the largest k's).

    Raises:
        ValueError: neither gives one (:func:`~nemo_rl_spec.speculative.adaptive_k.configured_acceptance`).
    """
    a = configured_acceptance(dynamic, costs)
    return float(a[max(a, key=int)] if isinstance(a, Mapping) else a)


def install_live_acceptance(llm, dynamic) -> LiveKLookup:
    """Replace the in-process engine's scheduler lookup (vLLM's ``Scheduler.dynamic_sd_lookup``) by a
    :class:`LiveKLookup` fed from every step's verification (``Scheduler.update_from_output`` wrapped).

    Args:
        llm: an in-process ``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) built with a batch-size schedule.
        dynamic: ``policy.generation.dynamic_speculation`` (:class:`~nemo_rl_spec.utils.feature_configs.
            DynamicSpeculationConfig`, ``step_costs`` resolved to a file; ``live_acceptance_half_life``,
            ``live_acceptance_prior_trials``, ``min_speedup``); the prior is :func:`prior_acceptance`.

    Returns:
        The installed lookup (its ``counts`` and ``estimate`` can be read while the engine runs).

    Raises:
        RuntimeError: the engine runs its scheduler in another process, or has no batch-size schedule.
        FileNotFoundError / ValueError: as :func:`~nemo_rl_spec.speculative.adaptive_k.load_step_costs`.
    """
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        raise RuntimeError("live_acceptance needs an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    if getattr(scheduler, "dynamic_sd_lookup", None) is None:
        raise RuntimeError("live_acceptance needs the engine's batch-size schedule (dynamic_speculation enabled)")
    if isinstance(scheduler.dynamic_sd_lookup, LiveKLookup):
        return scheduler.dynamic_sd_lookup
    costs = load_step_costs(Path(dynamic.step_costs))
    prior_rate = prior_acceptance(dynamic, costs)
    estimate = AcceptanceEstimate(prior_rate, dynamic.live_acceptance_prior_trials, dynamic.live_acceptance_half_life)
    lookup = LiveKLookup(
        scheduler.dynamic_sd_lookup, costs["ar_step_s"], costs["spec_step_s"], estimate, dynamic.min_speedup
    )
    update = scheduler.update_from_output

    def update_from_output_observed(scheduler_output, model_runner_output, *args, **kwargs):
        lookup.observe_step(scheduler_output, model_runner_output)
        return update(scheduler_output, model_runner_output, *args, **kwargs)

    scheduler.update_from_output = update_from_output_observed
    scheduler.dynamic_sd_lookup = lookup
    logger.info(
        "live acceptance: k per step from %s, prior a=%.3f (%.1f trials), half-life %d steps",
        dynamic.step_costs,
        prior_rate,
        dynamic.live_acceptance_prior_trials,
        dynamic.live_acceptance_half_life,
    )
    return lookup
