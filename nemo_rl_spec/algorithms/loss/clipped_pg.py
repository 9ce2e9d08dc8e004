"""Clipped policy-gradient loss for GRPO (NeMo-RL ``ClippedPGLossFn`` semantics). Per valid token t of sequence b
(``token_mask[b, t] * sample_mask[b] == 1``), curr / prev / gen / ref its log-probs under pi_theta, pi_old, the
generator and the reference policy::

    ratio   = exp(curr - prev)    (GSPO, ``sequence_level_importance_ratios``: exp of sequence b's mean of curr - prev)
    pg      = -min(ratio * A_b, clip(ratio, 1 - ratio_clip_min, 1 + ratio_clip_max) * A_b)
    w       = min(exp(prev - gen), truncated_importance_sampling_ratio), detached   (1 without IS correction)
    kl      = exp(ref - curr) - (ref - curr) - 1   k3 (use_on_policy_kl_approximation: x exp(curr - gen), detached)
    per_tok = w * pg + reference_policy_kl_penalty * kl
    loss    = sum_{b,t valid} per_tok / global_valid_toks                              (token_level_loss)
            = sum_{b: sample_mask=1} mean_{t valid in b} per_tok / global_valid_seqs   (otherwise)

Dual clip (``ratio_clip_c`` = c > 1): where A_b < 0, pg = min(pg, -c * A_b). ``loss_normalizer: constant`` (Dr.
GRPO) divides by ``loss_normalizer_constant`` instead, so a batch with fewer rows or valid tokens contributes a
proportionally smaller gradient (the metrics keep the batch mean). References: :class:`ClippedPGLossFn`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import ValidationError

from nemo_rl_spec.distributed.interfaces import TrainDatumSpec
from nemo_rl_spec.utils.config_schema import LossConfig


def _divide(numerator: torch.Tensor, normalizer: torch.Tensor | float) -> torch.Tensor:
    """numerator / normalizer, and 0 (keeping the graph) when the normaliser is 0 (everything masked)."""
    normalizer = torch.as_tensor(normalizer, dtype=numerator.dtype, device=numerator.device)
    if bool(normalizer < 0):
        raise ValueError(f"global normaliser must be >= 0, got {float(normalizer)}")
    return torch.where(normalizer > 0, numerator / normalizer.clamp(min=1e-30), numerator * 0.0)


def _masked_exp(log_value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(log_value) on valid positions and 1 on masked ones, so padding garbage cannot overflow into NaN."""
    return torch.exp(torch.where(mask > 0, log_value, torch.zeros_like(log_value)))


def _loss_error(err: dict) -> str:
    """One pydantic error of :class:`LossConfig` as ``loss_fn.<key>: <message>``."""
    key = "loss_fn." + ".".join(map(str, err["loc"]))
    if err["type"] == "literal_error":
        return f"{key} must be one of {err['ctx']['expected']}, got {err['input']!r}"
    return f"{key}: {err['msg'].removeprefix('Value error, ')}"


class ClippedPGLossFn:
    """GRPO clipped policy-gradient loss; implements :class:`~nemo_rl_spec.algorithms.loss.interfaces.LossFunction`.

    References: clipped surrogate, PPO (Schulman et al. 2017, eq. 7), with GRPO's per-sequence advantage
    (Shao et al. 2024); asymmetric clip range ("clip-higher", DAPO, Yu et al. 2025); k3 KL estimator
    (Schulman 2020, "Approximating KL Divergence"; GRPO eq. 4); truncated importance sampling for the
    generator/trainer mismatch (Espeholt et al. 2018 IMPALA; Yao et al. 2025 "TIS"); dual-clip PPO (Ye et al. 2020,
    "Mastering Complex Control in MOBA Games with Deep RL", eq. 5); GSPO (Zheng et al. 2025, "Group Sequence Policy
    Optimization", eq. 7: s_i = (pi_theta(y_i|x) / pi_old(y_i|x)) ** (1/|y_i|)), which needs the sequence-level
    reduction (``token_level_loss: false``: J = mean_i min(s_i A_i, clip(s_i) A_i)); the constant normaliser, Dr.
    GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", sec. 3.1; verl's loss_agg_mode
    "seq-mean-token-sum-norm"), e.g. the nominal batch's tokens (train_global_batch_size x max_new_tokens).

    Args:
        cfg: the ``loss_fn`` section, typed (:class:`~nemo_rl_spec.utils.config_schema.LossConfig`, its validators
            and defaults: the only ones) or a mapping validated into one: required ratio_clip_min, ratio_clip_max,
            token_level_loss, reference_policy_kl_penalty, reference_policy_kl_type ("k3"),
            use_importance_sampling_correction, truncated_importance_sampling_ratio (None or > 0); optional
            ratio_clip_c (None or > 1), sequence_level_importance_ratios, use_on_policy_kl_approximation,
            loss_normalizer ("batch": divide by the global valid tokens / sequences; "constant": divide by
            loss_normalizer_constant, a positive number of tokens / sequences).

    Raises:
        KeyError: a required key is missing from a mapping.
        ValueError: a value :class:`LossConfig` refuses (unsupported KL type, negative clip / penalty, a non-positive
            truncation ratio, ratio_clip_c <= 1, sequence-level ratios with ``token_level_loss``, ``loss_normalizer:
            constant`` without ``loss_normalizer_constant`` ...), each named ``loss_fn.<key>``.
    """

    def __init__(self, cfg: LossConfig | Mapping[str, Any]):
        if not isinstance(cfg, LossConfig):
            missing = [k for k, f in LossConfig.model_fields.items() if f.is_required() and k not in cfg]
            if missing:
                raise KeyError(f"loss_fn config is missing keys {missing}")
            try:
                cfg = LossConfig.model_validate(dict(cfg))
            except ValidationError as exc:
                raise ValueError("invalid loss_fn: " + "; ".join(map(_loss_error, exc.errors()))) from None
        self.cfg = cfg
        self.ratio_clip_min, self.ratio_clip_max = cfg.ratio_clip_min, cfg.ratio_clip_max
        self.token_level_loss = cfg.token_level_loss
        self.kl_penalty, self.kl_type = cfg.reference_policy_kl_penalty, cfg.reference_policy_kl_type
        self.use_is_correction = cfg.use_importance_sampling_correction
        self.truncated_is_ratio = cfg.truncated_importance_sampling_ratio
        self.ratio_clip_c = cfg.ratio_clip_c
        self.sequence_level = cfg.sequence_level_importance_ratios
        self.on_policy_kl = cfg.use_on_policy_kl_approximation
        self.loss_normalizer, self.loss_normalizer_constant = cfg.loss_normalizer, cfg.loss_normalizer_constant

    def __call__(
        self,
        curr_logprobs: torch.Tensor,
        mb_data: TrainDatumSpec,
        global_valid_toks: torch.Tensor,
        global_valid_seqs: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Micro-batch loss divided by the global normaliser (formula in the module docstring).

        Shape: curr_logprobs [mb, S] float32; mb_data: prev_logprobs [mb, S], token_mask [mb, S],
        sample_mask [mb], advantages [mb]; reference_policy_logprobs [mb, S] when the KL penalty is > 0;
        generation_logprobs [mb, S] with importance-sampling correction. global_valid_toks/seqs: scalars.

        Returns:
            (loss scalar, metrics). Metrics (python floats; sum across micro-batches, ``*_max`` by max):
            ``loss``; ``probs_ratio`` (token mean of ratio / global_valid_toks); ``probs_ratio_clamped``
            (fraction of valid tokens whose ratio lies outside [1 - clip_min, 1 + clip_max]);
            ``kl_penalty`` (penalty-weighted KL term, reduced like the loss); ``dual_clip_fraction`` (fraction of
            valid tokens where the dual clip bound -c * A acts); ``is_weight`` (token mean of w),
            ``is_weight_max``; ``num_valid_tokens``, ``num_valid_seqs`` (micro-batch counts).

        Raises:
            KeyError: a tensor required by the enabled branches is missing from mb_data.
            ValueError: shapes disagree, or a global normaliser is negative.
        """
        prev = mb_data["prev_logprobs"]
        if curr_logprobs.shape != prev.shape or curr_logprobs.dim() != 2:
            raise ValueError(f"curr_logprobs {tuple(curr_logprobs.shape)} vs prev_logprobs {tuple(prev.shape)}")
        token_mask = mb_data["token_mask"].to(curr_logprobs.dtype)
        sample_mask = mb_data["sample_mask"].to(curr_logprobs.dtype)
        mask = token_mask * sample_mask.unsqueeze(-1)
        advantages = mb_data["advantages"].to(curr_logprobs.dtype).unsqueeze(-1)

        ratio = self._ratio(curr_logprobs, prev, mask)
        clipped_ratio = ratio.clamp(1.0 - self.ratio_clip_min, 1.0 + self.ratio_clip_max)
        pg = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
        dual = torch.zeros_like(pg, dtype=torch.bool)
        if self.ratio_clip_c is not None:
            bound = -advantages * self.ratio_clip_c
            dual = (advantages < 0) & (pg > bound)
            pg = torch.where(dual, bound.expand_as(pg), pg)

        is_weight = torch.ones_like(pg)
        if self.use_is_correction:
            log_w = (prev - mb_data["generation_logprobs"]).detach()
            is_weight = _masked_exp(log_w, mask).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
            if self.truncated_is_ratio is not None:
                is_weight = is_weight.clamp(max=self.truncated_is_ratio)
        kl = torch.zeros_like(pg)
        if self.kl_penalty != 0.0:
            ref_minus_curr = torch.where(mask > 0, mb_data["reference_policy_logprobs"] - curr_logprobs, 0.0)
            kl = self.kl_penalty * (torch.exp(ref_minus_curr) - ref_minus_curr - 1.0)
            if self.on_policy_kl:
                weight = _masked_exp((curr_logprobs - mb_data["generation_logprobs"]).detach(), mask)
                kl = kl * weight.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

        if self.loss_normalizer == "constant":
            loss = self._reduce(
                is_weight * pg + kl,
                mask,
                token_mask,
                sample_mask,
                self.loss_normalizer_constant,
                self.loss_normalizer_constant,
            )
        else:
            loss = self._reduce(
                is_weight * pg + kl, mask, token_mask, sample_mask, global_valid_toks, global_valid_seqs
            )
        with torch.no_grad():
            outside = ((ratio < 1.0 - self.ratio_clip_min) | (ratio > 1.0 + self.ratio_clip_max)).to(mask.dtype)
            metrics = {
                "loss": float(loss),
                "probs_ratio": float(_divide((ratio * mask).sum(), global_valid_toks)),
                "probs_ratio_clamped": float(_divide((outside * mask).sum(), global_valid_toks)),
                "kl_penalty": float(
                    self._reduce(kl, mask, token_mask, sample_mask, global_valid_toks, global_valid_seqs)
                ),
                "is_weight": float(_divide((is_weight * mask).sum(), global_valid_toks)),
                "is_weight_max": float(is_weight[mask > 0].max()) if bool((mask > 0).any()) else 0.0,
                "dual_clip_fraction": float(_divide((dual.to(mask.dtype) * mask).sum(), global_valid_toks)),
                "num_valid_tokens": float(mask.sum()),
                "num_valid_seqs": float(sample_mask.sum()),
            }
        return loss, metrics

    def _ratio(self, curr: torch.Tensor, prev: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Per-token ratio [mb, S]: token-level exp(curr - prev), or GSPO's per-sequence exp of the mean log ratio
        over the sequence's valid tokens (1 for a sequence without any), broadcast over its tokens."""
        if not self.sequence_level:
            return _masked_exp(curr - prev, mask)
        log_ratio = torch.where(mask > 0, curr - prev, torch.zeros_like(curr))
        seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return torch.exp(seq_log_ratio).unsqueeze(-1).expand_as(curr)

    def _reduce(self, per_token, mask, token_mask, sample_mask, global_valid_toks, global_valid_seqs):
        """Token-level sum / global_valid_toks, or per-sequence token mean summed / global_valid_seqs."""
        if self.token_level_loss:
            return _divide((per_token * mask).sum(), global_valid_toks)
        seq_tokens = token_mask.sum(-1).clamp(min=1.0)
        seq_mean = (per_token * token_mask).sum(-1) / seq_tokens
        return _divide((seq_mean * sample_mask).sum(), global_valid_seqs)
