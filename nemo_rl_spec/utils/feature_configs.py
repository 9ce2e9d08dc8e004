"""Pydantic models of the optional feature sections that algorithm and speculative modules implement.

They live in ``utils`` so that the recipe schema (:mod:`nemo_rl_spec.utils.config_schema`) does not import upward
(imports run algorithms -> models -> distributed -> utils); the modules that implement the features import them
from here:

- :class:`PilotCommitConfig` (``grpo.pilot_commit``): :mod:`nemo_rl_spec.algorithms.pilot_commit`
- :class:`DynamicSamplingConfig` (``grpo.dynamic_sampling``): :mod:`nemo_rl_spec.algorithms.rollout_allocation`
- :class:`AdvEstimatorConfig`, :class:`RewardShapingConfig`, :class:`RewardScalingConfig` (``grpo.adv_estimator``,
  ``grpo.reward_shaping``, ``grpo.reward_scaling``): :mod:`nemo_rl_spec.algorithms.advantages` and
  :mod:`nemo_rl_spec.algorithms.reward_shaping`
- :class:`DynamicSpeculationConfig` (``policy.generation.dynamic_speculation``) and :func:`validate_schedule`:
  :mod:`nemo_rl_spec.speculative.adaptive_k`
- :class:`SpeculativeConfig` (``policy.generation.vllm_kwargs.speculative_config``): the vLLM generation worker,
  the Megatron worker (online draft unroll, MTP drafter export) and :mod:`nemo_rl_spec.speculative.adaptive_k`
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

Schedule = list[tuple[int, int, int]]


class PilotCommitConfig(BaseModel):
    """``grpo.pilot_commit``: Pilot-Commit rollout allocation. The section being present turns it on unless
    ``enabled: false``.

    Budget: a step pilots ``pilot_batch_size`` prompts (``pilot_batch_size * n_pilot`` rollouts) and commits
    K = (rollout_budget_per_step - pilot_batch_size * n_pilot) // n_commit prompts (``K * n_commit`` rollouts).
    ``rollout_budget_per_step`` None means the uniform-GRPO budget
    ``grpo.num_prompts_per_step * grpo.num_generations_per_prompt``.

    ``fill_commit_budget``: the budget is a cap by default, and a step that commits fewer than K prompts leaves
    commit rollouts unspent. With it on, the whole commit budget K * n_commit goes to the prompts committed this
    step, split as evenly as possible (the first ones get the remainder), so every step that commits anything spends
    its budget and trains on a larger batch (the paper's "the rest of the budget goes only to selected prompts").

    Thresholds, both edges inclusive: a prompt is selected iff ``p_lower <= p_hat <= p_upper``; ``p_hat < p_lower``
    is too hard (deferred), ``p_hat > p_upper`` too easy. ``p_hat`` (mean pilot reward, float64) is a multiple of
    1/n_pilot for 0/1 rewards, so a threshold written as k/n_pilot (0.125 = 1/8) is on the grid and selects that
    grid point. The defaults 0.1/0.9 select every pilot that is neither all-wrong nor all-right.

    Fixed training batch (``fixed_train_batch``, the paper's reference recipe; docs/guides/pilot_commit.md "Fixed training
    batch"): every step trains exactly K = ``grpo.num_prompts_per_step`` groups of ``grpo.num_generations_per_prompt``
    rollouts (n_pilot pilots reused + n_commit commits; n_commit defaults to their difference). Each pilot round
    pilots ceil(``pilot_oversampling`` x groups still missing) fresh prompts; up to ``max_pilot_rounds`` rounds,
    then the replay buffer fills what is missing. ``pilot_batch_size`` is not used in this mode; a
    ``rollout_budget_per_step``, ``fill_commit_budget`` or ``bind_pilot_to_commit`` with it is refused.

    ``buffer_order`` (both modes): the order in which the replay buffer fills commit slots, and which entries an
    overflow drops. ``oldest``: oldest pilot first, overflow drops the oldest. ``pilot_std``: highest pilot std
    sqrt(p_hat (1 - p_hat)) first (ties: the more recent pilot, then insertion order), overflow drops the lowest.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = True
    n_pilot: int = Field(default=2, description="pilot rollouts per prompt (>= 2)")
    n_commit: int = Field(default=4, ge=1, description="commit rollouts per selected prompt")
    pilot_batch_size: int = Field(default=4, ge=1, description="prompts piloted per step")
    rollout_budget_per_step: Optional[int] = Field(default=None, ge=1, description="rollouts per step (pilot+commit)")
    p_lower: float = Field(default=0.1, description="p_hat below it: too hard, deferred to the next epoch")
    p_upper: float = Field(default=0.9, description="p_hat above it: too easy, not committed")
    evict_after_consecutive_solved: int = Field(default=2, ge=1, description="all-solved pilots in a row -> evicted")
    bind_pilot_to_commit: bool = True
    max_off_steps: int = Field(default=2, ge=0, description="replay-buffer entries older than this (steps) expire")
    max_buffer_size: int = Field(default=64, ge=0, description="replay-buffer capacity (prompts); 0 disables it")
    all_too_hard_fallback: Literal["commit_top", "skip"] = "commit_top"
    fill_commit_budget: bool = Field(
        default=False,
        description="Measured negative (docs/results/pilot_commit_ablations.md: no accuracy gain, more rollouts): "
        "fewer than K prompts committed: spread the K*n_commit commit rollouts over them (larger groups)",
    )
    fixed_train_batch: bool = Field(
        default=False,
        description="train exactly grpo.num_prompts_per_step groups a step, re-piloting until enough prompts pass",
    )
    pilot_oversampling: float = Field(
        default=3.0, ge=1.0, description="fixed_train_batch: a pilot round pilots ceil(this x groups still missing)"
    )
    max_pilot_rounds: int = Field(default=10, ge=1, description="fixed_train_batch: pilot rounds per step, at most")
    repilot_within_step: bool = Field(
        default=True,
        description="fixed_train_batch: a later pilot round of a step may pilot a prompt piloted earlier in the step "
        "(the reference, whose pool is far larger than a step's pilots); false: each prompt at most once a step, and "
        "the pilot rounds end when every prompt of the pool was piloted this step",
    )
    buffer_order: Literal["oldest", "pilot_std"] = Field(
        default="oldest", description="replay-buffer commit order: oldest first, or highest pilot std first"
    )

    @field_validator("n_pilot")
    @classmethod
    def _pilot_spread(cls, v: int) -> int:
        if v < 2:
            raise ValueError(f"n_pilot={v}: need >= 2 pilot rollouts, one rollout cannot show a reward spread")
        return v

    @field_validator("p_lower", "p_upper")
    @classmethod
    def _unit_interval(cls, v: float, info) -> float:
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{info.field_name}={v} must lie in [0, 1] (a success rate)")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "PilotCommitConfig":
        if not self.p_lower < self.p_upper:
            raise ValueError(f"need 0 <= p_lower < p_upper <= 1, got p_lower={self.p_lower}, p_upper={self.p_upper}")
        if self.fixed_train_batch:
            self._check_fixed_train_batch()
        elif self.rollout_budget_per_step is not None:
            self.commit_slots(self.rollout_budget_per_step)
        return self

    def _check_fixed_train_batch(self) -> None:
        """Keys of the budget mode that have no meaning with ``fixed_train_batch`` (ValueError naming both keys)."""
        clashes = {
            "bind_pilot_to_commit": "the pilots of a step are generated in that step, no pilot is bound to a commit",
            "rollout_budget_per_step": "the batch is fixed, not the budget: re-pilot rounds spend what it takes",
            "fill_commit_budget": "every group has grpo.num_generations_per_prompt rollouts",
        }
        for key, reason in clashes.items():
            value = getattr(self, key)
            if value not in (None, False):
                raise ValueError(
                    f"grpo.pilot_commit.fixed_train_batch=true with grpo.pilot_commit.{key}={str(value).lower()}: "
                    f"{reason}; set {key}: {'null' if key == 'rollout_budget_per_step' else 'false'}"
                )

    def commit_slots(self, budget: int) -> int:
        """K, prompts committed per step under ``budget`` rollouts.

        Raises:
            ValueError: the budget does not cover the pilot plus one commit.
        """
        pilot = self.pilot_batch_size * self.n_pilot
        slots = (budget - pilot) // self.n_commit
        if slots < 1:
            raise ValueError(
                f"rollout_budget_per_step={budget} leaves no commit slot: the pilot costs "
                f"pilot_batch_size*n_pilot={pilot} and one commit n_commit={self.n_commit}"
            )
        return slots


class DynamicSamplingConfig(BaseModel):
    """``grpo.dynamic_sampling``: DAPO dynamic sampling (Yu et al. 2025, "DAPO", section 3.2).

    Each step generates batches of ``grpo.num_prompts_per_step`` prompts x ``grpo.num_generations_per_prompt``
    rollouts, keeps only groups whose rewards are not all equal, and generates another batch until the train
    batch is full or ``max_gen_batches`` batches were generated (then it trains on what it kept; possibly nothing).
    The section being present turns the feature on unless ``enabled: false``.

    ``batch_multiplier`` (NeMo-RL's ``grpo.batch_multiplier``): each generation batch holds
    floor(batch_multiplier x ``grpo.num_prompts_per_step``) prompts (the product rounded to 9 decimals first, so
    1.15 x 20 = 23); kept groups beyond the train batch are discarded and counted (``dynamic_sampling/surplus_groups``,
    their rollouts in ``rollout_alloc/step_rollouts``). NeMo-RL's spellings ``grpo.use_dynamic_sampling``,
    ``grpo.dynamic_sampling_max_gen_batches`` and ``grpo.batch_multiplier`` are read into this section
    (:class:`~nemo_rl_spec.utils.config_schema.GRPOConfig`).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = True
    max_gen_batches: int = Field(default=10, ge=1, description="generation batches per step, at most")
    batch_multiplier: float = Field(
        default=1.0, ge=1.0, description="a generation batch is floor(this x grpo.num_prompts_per_step) prompts"
    )


class AdvEstimatorConfig(BaseModel):
    """``grpo.adv_estimator``: NeMo-RL's advantage estimator (:func:`nemo_rl_spec.algorithms.advantages.
    estimate_advantages`). Per response i of prompt group g, scalar reward r_i, response tokens L_i (0 for a row out
    of the loss):

    - ``grpo``: A_i = (r_i - b_i) / (std_g + eps) (``normalize_rewards``; else r_i - b_i), b_i the group mean or the
      leave-one-out mean (``use_leave_one_out_baseline``), as in
      :func:`~nemo_rl_spec.algorithms.advantages.compute_grpo_advantages_by_group`.
    - ``reinforce_plus_plus`` (REINFORCE++, Hu 2025; ProRLv2's "REINFORCE++-baseline"): a_i = r_i - mean_g(r)
      (``minus_baseline``; else a_i = r_i), then normalised over every response token of the batch:
      A_i = (a_i - mu) / sqrt(max(var, 1e-8)), mu = sum_i L_i a_i / sum_i L_i, var = sum_i L_i (a_i - mu)^2 /
      sum_i L_i. ``normalize_rewards`` / ``use_leave_one_out_baseline`` are not used.

    ``normalize_rewards`` and ``use_leave_one_out_baseline`` are copies of ``grpo.normalize_rewards`` /
    ``grpo.use_leave_one_out_baseline`` (NeMo-RL's recipes interpolate them): null takes the top-level value, a
    value that differs from it is refused (:class:`~nemo_rl_spec.utils.config_schema.GRPOConfig`).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    name: Literal["grpo", "reinforce_plus_plus"] = "grpo"
    normalize_rewards: Optional[bool] = None
    use_leave_one_out_baseline: Optional[bool] = None
    minus_baseline: bool = True  # reinforce_plus_plus: subtract the group-mean reward before the global whitening


class RewardShapingConfig(BaseModel):
    """``grpo.reward_shaping``: NeMo-RL's reward shaping (DAPO, Yu et al. 2025, sec. 3.4), applied to each trained
    response's reward r (after ``grpo.reward_scaling``) before the advantages; L = response length in tokens.

    - DAPO overlong penalty (``stop_properly_penalty_coef`` null; needs the three lengths):
      r' = r + min(0, -(L - (max_response_length - overlong_buffer_length)) / overlong_buffer_length *
      overlong_buffer_penalty): 0 up to max_response_length - overlong_buffer_length tokens, then falling linearly,
      -overlong_buffer_penalty at L = max_response_length (not capped beyond it).
    - stop-properly penalty (``stop_properly_penalty_coef`` c set, in [0, 1]): r' = c * r for a truncated response
      (cut off by a length limit, :func:`~nemo_rl_spec.algorithms.overlong.truncated_rows`), r' = r otherwise; the
      DAPO penalty is then not applied (NeMo-RL warns that its lengths are ignored).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = False
    overlong_buffer_length: Optional[PositiveInt] = None  # tokens before max_response_length where the penalty ramps
    overlong_buffer_penalty: Optional[float] = Field(default=None, ge=0.0)  # penalty reached at max_response_length
    max_response_length: Optional[PositiveInt] = None  # tokens
    stop_properly_penalty_coef: Optional[float] = Field(default=None, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _dapo_lengths(self) -> "RewardShapingConfig":
        dapo = ("overlong_buffer_length", "overlong_buffer_penalty", "max_response_length")
        if not self.enabled:
            return self
        if self.stop_properly_penalty_coef is None and any(getattr(self, k) is None for k in dapo):
            raise ValueError(
                "grpo.reward_shaping.enabled=true needs stop_properly_penalty_coef or all of overlong_buffer_length, "
                "overlong_buffer_penalty and max_response_length (DAPO's overlong penalty)"
            )
        if self.stop_properly_penalty_coef is not None and any(getattr(self, k) is not None for k in dapo):
            warnings.warn(
                "grpo.reward_shaping.stop_properly_penalty_coef is set: the DAPO overlong penalty "
                f"({', '.join(k for k in dapo if getattr(self, k) is not None)}) is ignored, as in NeMo-RL",
                stacklevel=2,
            )
        return self


class RewardScalingConfig(BaseModel):
    """``grpo.reward_scaling``: NeMo-RL's linear reward scaling, applied to each trained response's reward r first
    (before ``grpo.reward_shaping`` and the advantages)::

        r' = target_min + (clamp(r, source_min, source_max) - source_min) / (source_max - source_min)
                          * (target_max - target_min)
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = False
    source_min: float = 0.0
    source_max: float = 1.0
    target_min: float = 0.0
    target_max: float = 1.0

    @model_validator(mode="after")
    def _source_range(self) -> "RewardScalingConfig":
        if self.source_max <= self.source_min:
            raise ValueError(
                f"grpo.reward_scaling: source_max={self.source_max} must exceed source_min={self.source_min}"
            )
        return self


class DynamicSpeculationConfig(BaseModel):
    """``policy.generation.dynamic_speculation``: k per running batch size (needs ``vllm_kwargs.speculative_config``).

    Exactly one of:

    - ``num_speculative_tokens_per_batch_size``: ``[[first, last, k], ...]`` inclusive batch-size ranges (vLLM's
      format; the first range starts at 1; k = 0 turns drafting off for that range);
    - ``step_costs``: a JSON file with measured step costs (``examples/bench_spec_rollouts.py --out FILE``
      writes them under ``"step_costs"``; see :func:`load_step_costs`), or ``auto``: the entry measured for this
      machine, engine dtype and model (:mod:`nemo_rl_spec.speculative.calibration`; written by
      ``examples/calibrate_spec_schedule.py``; resolved before any worker starts, a clear error when there is
      none); the schedule is :func:`derive_schedule` of it, with ``acceptance_rate`` (per-token acceptance a;
      None: the file's; an ``auto`` entry has none, so set it) and ``min_speedup``.

    ``max_batch_size``: largest running batch the derived schedule covers (larger ones keep the last k).
    ``drafter_pass_at_k0``: keep vLLM's drafter forward pass on k = 0 steps (its KV cache stays complete); false
    skips it (:func:`~nemo_rl_spec.speculative.adaptive_k.install_drafter_skip_at_k0`: cheaper k = 0 steps, stale
    drafter KV for those positions once drafting resumes; lossless either way).
    ``drafter_pass_max_batch`` (with ``drafter_pass_at_k0: true``): keep that pass only on k = 0 steps with at
    most this many running requests (None: on every k = 0 step); above it the pass and the target's auxiliary
    hidden states are skipped. Set it above the schedule's drafting range: requests reaching that range then have
    their recent positions in the drafter's cache, while large-batch steps cost what an autoregressive step costs.
    ``drafter_catch_up`` (with ``drafter_pass_at_k0: false`` or ``drafter_pass_max_batch``): record what each
    skipped decode step's drafter pass would have read and replay a request's skipped positions through the drafter
    right before its next pass (:mod:`~nemo_rl_spec.speculative.drafter_catch_up`), so its KV cache is complete when
    drafting resumes; the target's auxiliary hidden states stay on at every step.
    ``plain_step_at_k0``: engine steps that carry no draft token take vLLM's plain sampler (no rejection
    sampler), and a schedule with k = 0 at every batch size also skips the drafter's pass and the target's auxiliary
    hidden states (:func:`~nemo_rl_spec.speculative.adaptive_k.install_plain_step_without_drafts`); false keeps
    vLLM's own speculative path on those steps (whose k = 0 step costs more than a plain decode step).
    ``live_acceptance`` (measured negative: in long-tail rollouts on CPU it trailed the fixed schedule in every
    seed measured, docs/results/longtail.md; off by default; needs ``step_costs``): every engine step picks k in
    0..schedule(b) from the step costs and the draft's acceptance measured over the engine's recent steps instead of
    the fixed ``acceptance_rate`` (which becomes the prior): k = 0 where drafting is predicted not to pay
    (:mod:`~nemo_rl_spec.speculative.live_acceptance`). ``live_acceptance_half_life``: engine steps over which that
    evidence halves (after a stretch without drafts the estimate returns to the prior and the engine drafts again);
    ``live_acceptance_prior_trials``: the prior's weight, in proposals.
    """

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    num_speculative_tokens_per_batch_size: list[tuple[int, int, int]] | None = None
    step_costs: str | None = None
    acceptance_rate: float | None = Field(default=None, ge=0.0, le=1.0)
    min_speedup: float = Field(default=1.0, gt=0.0)
    max_batch_size: PositiveInt = 256
    drafter_pass_at_k0: bool = True
    drafter_pass_max_batch: PositiveInt | None = None
    drafter_catch_up: bool = False
    plain_step_at_k0: bool = True
    live_acceptance: bool = Field(
        default=False,
        description="Measured negative (docs/results/longtail.md): k from the acceptance the engine measures; it "
        "trailed the fixed schedule in the long-tail rollouts measured on CPU. Off by default.",
    )
    live_acceptance_half_life: PositiveInt = 16
    live_acceptance_prior_trials: float = Field(default=4.0, ge=0.0)

    @field_validator("step_costs")
    @classmethod
    def _step_costs_file(cls, value: str | None) -> str | None:
        """An existing file, made absolute here (Ray actors may run elsewhere than the driver's directory), or
        ``auto`` (kept; resolved by :func:`~nemo_rl_spec.speculative.calibration.resolve_step_costs`)."""
        if value is None or value == "auto":
            return value
        path = Path(value)
        if not path.is_file():
            raise ValueError(
                f"policy.generation.dynamic_speculation.step_costs: no file {value} (write one with "
                "examples/bench_spec_rollouts.py --out FILE, or set auto: the calibration table of this machine)"
            )
        return str(path.resolve())

    @model_validator(mode="after")
    def _one_source(self) -> DynamicSpeculationConfig:
        given = [self.num_speculative_tokens_per_batch_size is not None, self.step_costs is not None]
        if self.enabled and sum(given) != 1:
            raise ValueError(
                "policy.generation.dynamic_speculation: set exactly one of "
                "num_speculative_tokens_per_batch_size (explicit schedule) or step_costs (a JSON file "
                "of measured step costs)"
            )
        if self.drafter_pass_max_batch is not None and not self.drafter_pass_at_k0:
            raise ValueError(
                "policy.generation.dynamic_speculation.drafter_pass_max_batch="
                f"{self.drafter_pass_max_batch} needs drafter_pass_at_k0: true (false skips the pass on every "
                "k = 0 step; the limit would do nothing)"
            )
        if self.drafter_catch_up and self.drafter_pass_at_k0 and self.drafter_pass_max_batch is None:
            raise ValueError(
                "policy.generation.dynamic_speculation.drafter_catch_up=true needs a skipped drafter pass to catch "
                "up on: set drafter_pass_at_k0: false or drafter_pass_max_batch"
            )
        if self.live_acceptance and self.enabled and self.step_costs is None:
            raise ValueError(
                "policy.generation.dynamic_speculation.live_acceptance=true needs step_costs (a file or auto): k is "
                "chosen from measured step costs, which an explicit num_speculative_tokens_per_batch_size lacks"
            )
        if self.num_speculative_tokens_per_batch_size is not None:
            validate_schedule(self.num_speculative_tokens_per_batch_size)
        return self


# vLLM 0.32's SpeculativeConfig fields (vllm/config/speculative.py); a key outside this set is a typo here, not a
# vLLM option (tests/unit/test_speculative_config.py checks the set against the installed vLLM)
VLLM_SPECULATIVE_KEYS = frozenset(
    {
        "enforce_eager",
        "num_speculative_tokens",
        "model",
        "method",
        "draft_tensor_parallel_size",
        "tensor_parallel_size",
        "quantization",
        "moe_backend",
        "attention_backend",
        "kv_cache_dtype",
        "max_model_len",
        "revision",
        "code_revision",
        "index_share_for_mtp_iteration",
        "disable_padded_drafter_batch",
        "disable_eagle_block_drop",
        "use_local_argmax_reduction",
        "use_heterogeneous_vocab",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "parallel_drafting",
        "target_model_config",
        "target_parallel_config",
        "num_speculative_tokens_per_batch_size",
        "draft_model_config",
        "draft_parallel_config",
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
        "draft_load_config",
        "rejection_sample_method",
        "synthetic_acceptance_rates",
        "synthetic_acceptance_length",
        "enable_adaptive_verification",
        "draft_sample_method",
        "dspark_draft_topk",
    }
)


class SpeculativeConfig(BaseModel):
    """``policy.generation.vllm_kwargs.speculative_config``: vLLM's speculative decoding, passed to ``vllm.LLM`` as
    the validated dict (:meth:`engine_dict`) and read by the workers through this object (never with fallbacks of
    their own).

    Typed here, the keys the project reads: ``method`` (``eagle3`` | ``draft_model`` | ``mtp`` | another vLLM
    method), ``model`` (the draft directory; unset with ``mtp``), ``num_speculative_tokens`` (k, draft tokens per
    step; required: it is the online draft's default unroll ``policy.draft.ttt_steps`` and the cap of a dynamic
    speculation schedule), ``num_speculative_tokens_per_batch_size`` (vLLM's k per running batch size, or set from
    ``policy.generation.dynamic_speculation``). Any other vLLM ``SpeculativeConfig`` key
    (:data:`VLLM_SPECULATIVE_KEYS`, e.g. ``draft_sample_method``, ``draft_tensor_parallel_size``) passes through
    unchanged for vLLM to validate; a key vLLM does not have is an error.
    """

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    method: Optional[str] = Field(default=None, min_length=1)
    model: Optional[str] = None
    num_speculative_tokens: PositiveInt
    num_speculative_tokens_per_batch_size: Optional[list[tuple[int, int, int]]] = None

    @model_validator(mode="after")
    def _vllm_keys(self) -> SpeculativeConfig:
        unknown = sorted(set(self.model_extra or {}) - VLLM_SPECULATIVE_KEYS)
        if unknown:
            raise ValueError(f"{unknown} not among vLLM's SpeculativeConfig keys (misspelled?)")
        if self.num_speculative_tokens_per_batch_size is not None:
            validate_schedule(self.num_speculative_tokens_per_batch_size)
        return self

    def engine_dict(self) -> dict:
        """The keys the recipe set (validated; nothing defaulted here), JSON-like, for ``vllm.LLM``."""
        return self.model_dump(mode="json", exclude_unset=True)


def validate_schedule(schedule: Sequence[Sequence[int]]) -> Schedule:
    """Check a schedule in vLLM's format and return it sorted as tuples.

    Raises:
        ValueError: empty, an entry not ``(first, last, k)``, first > last, a batch size < 1, k < 0, overlapping
            ranges, or the first range not starting at 1 (the rules vLLM enforces at engine start).
    """
    if not schedule:
        raise ValueError("num_speculative_tokens_per_batch_size: empty schedule")
    out = []
    for entry in schedule:
        if len(entry) != 3:
            raise ValueError(f"num_speculative_tokens_per_batch_size entry {entry!r}: expected [first, last, k]")
        first, last, k = (int(x) for x in entry)
        if first < 1 or last < first or k < 0:
            raise ValueError(f"num_speculative_tokens_per_batch_size entry {entry!r}: need 1 <= first <= last, k >= 0")
        out.append((first, last, k))
    out.sort()
    if out[0][0] != 1:
        raise ValueError("num_speculative_tokens_per_batch_size: the first range must start at batch size 1")
    for (_, prev_last, _), (first, _, _) in itertools.pairwise(out):
        if first <= prev_last:
            raise ValueError(f"num_speculative_tokens_per_batch_size: overlapping ranges {out}")
    return out
