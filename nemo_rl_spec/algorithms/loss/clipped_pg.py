"""Clipped policy-gradient loss for GRPO (NeMo-RL ``ClippedPGLossFn`` semantics, NVIDIA-NeMo/RL 7ea279ab).

Per valid token t of sequence b (``token_mask[b, t] * sample_mask[b] == 1``), with curr / prev / gen / ref its
log-probs under pi_theta, pi_old, the generator and the reference policy::

    per_tok = w * pg + beta * kl            (w: importance weight, pg: policy term, kl: reference KL estimate)
    loss    = sum_{b,t valid} per_tok / global_valid_toks                              (token_level_loss)
            = sum_{b: sample_mask=1} mean_{t valid in b} per_tok / global_valid_seqs   (otherwise)
            (+ positive_example_nll_weight * mean_{t valid, reward_b > 0} -curr)

pg, w and kl for each ``loss_fn`` option are in :class:`ClippedPGLossFn`; the KL estimators and their clamps in
:func:`reference_kl`. ``loss_normalizer: constant`` (Dr. GRPO) divides by ``loss_normalizer_constant`` instead.
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


def _finite(x: torch.Tensor) -> torch.Tensor:
    return x.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _loss_error(err: dict) -> str:
    """One pydantic error of :class:`LossConfig` as ``loss_fn.<key>: <message>``."""
    key = "loss_fn." + ".".join(map(str, err["loc"]))
    if err["type"] == "literal_error":
        return f"{key} must be one of {err['ctx']['expected']}, got {err['input']!r}"
    return f"{key}: {err['msg'].removeprefix('Value error, ')}"


def reference_kl(
    log_ratio: torch.Tensor,
    weight: torch.Tensor,
    kl_type: str,
    input_clamp: float | None,
    output_clamp: float | None,
) -> torch.Tensor:
    """Per-token KL(pi_theta || pi_ref) estimate, as NeMo-RL's ``calculate_kl`` with importance weights (Schulman
    2020, "Approximating KL Divergence"). Shapes: log_ratio = ref - curr [B, S], weight [B, S] -> [B, S]::

        d  = clamp(ref - curr, -input_clamp, input_clamp)
        k1 = -d      k2 = d^2 / 2      k3 = e^d - d - 1
        kl = clamp(weight * k(d), -output_clamp, output_clamp)

    ``weight`` carries the score-function gradient (see :meth:`ClippedPGLossFn._kl`); where the input clamp acts it
    is detached, so a clamped token contributes no gradient at all. A None clamp is no clamp.
    """
    d = log_ratio
    if input_clamp is not None:
        d = log_ratio.clamp(-input_clamp, input_clamp)
        weight = torch.where(d == log_ratio, weight, weight.detach())
    if kl_type == "k1":
        k = -d
    elif kl_type == "k2":
        k = d.square() / 2
    elif kl_type == "k3":
        k = torch.exp(d) - d - 1
    else:
        raise ValueError(f"loss_fn.reference_policy_kl_type must be k1, k2 or k3, got {kl_type!r}")
    kl = weight * k
    return kl if output_clamp is None else kl.clamp(-output_clamp, output_clamp)


class ClippedPGLossFn:
    """GRPO clipped policy-gradient loss; implements :class:`~nemo_rl_spec.algorithms.loss.interfaces.LossFunction`.

    The policy term pg per token (A: the row's advantage, or the token's for [mb, S] advantages; eps_lo / eps_hi:
    ratio_clip_min / max; sg: stop-gradient)::

        r  = exp(curr - prev)   (GSPO, sequence_level_importance_ratios: exp of the row's mean of curr - prev)
        pg = max(-A r, -A clip(r, 1 - eps_lo, 1 + eps_hi))           PPO / GRPO (default)
        pg = -A sg(clip(r, 1 - eps_lo, 1 + eps_hi)) curr             use_cispo (CISPO, MiniMax-M1 2025)
        pg = -A curr                                                 disable_ppo_ratio (REINFORCE / RLOO)
        r  = exp(curr - sg(curr)) = 1, unclipped; prev := sg(curr)   force_on_policy_ratio
        dual clip (ratio_clip_c = c > 1): where A < 0, pg = min(pg, -c A)

    The importance weight w (use_importance_sampling_correction; else 1), detached, u = exp(prev - gen), with
    hi / lo = truncated_importance_sampling_ratio / _ratio_min::

        none:          w = u
        tis:           w = clamp(u, lo or 0, hi)      (also a set ratio with type null: this project's default)
        icepop:        w = u if lo <= u <= hi else 0
        seq-mask-tis:  w = u * [lo <= exp(mean_{t in row} (prev - gen)) <= hi]   (whole rows kept or dropped)

    The KL term (:func:`reference_kl`, reference_policy_kl_penalty = beta; 0 with use_kl_in_reward, whose KL is in
    the per-token advantages instead: :func:`~nemo_rl_spec.algorithms.advantages.reward_kl_penalty`) and the
    positive-example NLL (positive_example_nll_weight = mu > 0, VAPO eq. 10): mu * sum(-curr over valid tokens of
    rows with reward > 0) / (their count in this micro-batch), a per-micro-batch mean as NeMo-RL computes it.

    References: PPO (Schulman et al. 2017, eq. 7); GRPO (Shao et al. 2024); clip-higher (DAPO, Yu et al. 2025);
    dual clip (Ye et al. 2020, eq. 5); GSPO (Zheng et al. 2025, eq. 7); CISPO (MiniMax-M1, arXiv:2506.13585);
    TIS (Yao et al. 2025), ICEPOP and seq-mask-tis ("When Speed Kills Stability", Liu et al. 2025); VAPO
    (arXiv:2504.05118); the constant normaliser of Dr. GRPO (Liu et al. 2025, sec. 3.1).

    Args:
        cfg: the ``loss_fn`` section, typed (:class:`~nemo_rl_spec.utils.config_schema.LossConfig`, its validators
            and defaults: the only ones) or a mapping validated into one.

    Raises:
        KeyError: a required key is missing from a mapping.
        ValueError: a value or combination :class:`LossConfig` refuses, named ``loss_fn.<key>``.
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
        # use_kl_in_reward: the KL is in the advantages (algorithms/advantages.py reward_kl_penalty), not here
        self.kl_penalty = 0.0 if cfg.use_kl_in_reward else cfg.reference_policy_kl_penalty
        self.kl_type = cfg.reference_policy_kl_type
        self.use_is_correction = cfg.use_importance_sampling_correction
        self.truncated_is_ratio = cfg.truncated_importance_sampling_ratio
        self.truncated_is_type = cfg.truncated_importance_sampling_type or (
            "tis" if cfg.truncated_importance_sampling_ratio is not None else None
        )
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
        """Micro-batch loss divided by the global normaliser (formulas in the class docstring).

        Shape: curr_logprobs [mb, S] float32; mb_data: prev_logprobs [mb, S], token_mask [mb, S],
        sample_mask [mb], advantages [mb] (or [mb, S], per token); reference_policy_logprobs [mb, S] when the KL
        penalty is > 0; generation_logprobs [mb, S] with importance-sampling correction or the on-policy KL;
        rewards [mb] with positive_example_nll_weight > 0. global_valid_toks/seqs: scalars.

        Returns:
            (loss scalar, metrics). Metrics (python floats; sum across micro-batches, ``*_max`` by max):
            ``loss``; ``probs_ratio`` (token mean of the ratio r / global_valid_toks; exp(curr - prev) with
            disable_ppo_ratio); ``probs_ratio_clamped`` (fraction of valid tokens whose clipped ratio differs from r;
            0 without a clip); ``kl_penalty`` (beta-weighted KL term, reduced like the loss);
            ``dual_clip_fraction``; ``is_weight`` (token mean of w), ``is_weight_max``; ``num_valid_tokens``,
            ``num_valid_seqs`` (micro-batch counts); with a truncation type, NeMo-RL's ``is_oob_ratio`` (fraction
            of valid tokens, or of valid sequences for seq-mask-tis, outside [lo, hi]); with
            positive_example_nll_weight > 0, NeMo-RL's ``positive_nll_loss`` (the NLL mean, before mu).

        Raises:
            KeyError: a tensor required by the enabled branches is missing from mb_data.
            ValueError: shapes disagree, or a global normaliser is negative.
        """
        prev = mb_data["prev_logprobs"]
        if curr_logprobs.shape != prev.shape or curr_logprobs.dim() != 2:
            raise ValueError(f"curr_logprobs {tuple(curr_logprobs.shape)} vs prev_logprobs {tuple(prev.shape)}")
        if self.cfg.force_on_policy_ratio:
            prev = curr_logprobs.detach()
        token_mask = mb_data["token_mask"].to(curr_logprobs.dtype)
        sample_mask = mb_data["sample_mask"].to(curr_logprobs.dtype)
        mask = token_mask * sample_mask.unsqueeze(-1)
        advantages = mb_data["advantages"].to(curr_logprobs.dtype)
        if advantages.shape not in (curr_logprobs.shape[:1], curr_logprobs.shape):
            raise ValueError(
                f"advantages {tuple(advantages.shape)} must be [mb] (per sequence) or [mb, S] (per token) for "
                f"curr_logprobs {tuple(curr_logprobs.shape)}"
            )
        advantages = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages

        ratio, clipped = self._ratios(curr_logprobs, prev, mask)
        pg, dual = self._policy_term(curr_logprobs, ratio, clipped, advantages, mask)
        is_weight, is_metrics = self._is_weight(prev, mb_data, mask, global_valid_toks, global_valid_seqs)
        kl = self._kl(curr_logprobs, mb_data, mask)
        per_token = is_weight * pg + kl
        if self.loss_normalizer == "constant":
            const = self.loss_normalizer_constant
            loss = self._reduce(per_token, mask, token_mask, sample_mask, const, const)
        else:
            loss = self._reduce(per_token, mask, token_mask, sample_mask, global_valid_toks, global_valid_seqs)
        nll = self._positive_nll(curr_logprobs, mb_data, mask)
        if nll is not None:
            loss = loss + self.cfg.positive_example_nll_weight * nll

        with torch.no_grad():
            metrics = {
                "loss": float(loss),
                "probs_ratio": float(_divide((ratio * mask).sum(), global_valid_toks)),
                "probs_ratio_clamped": float(
                    _divide(((clipped != ratio).to(mask.dtype) * mask).sum(), global_valid_toks)
                ),
                "kl_penalty": float(
                    self._reduce(kl, mask, token_mask, sample_mask, global_valid_toks, global_valid_seqs)
                ),
                "is_weight": float(_divide((is_weight * mask).sum(), global_valid_toks)),
                "is_weight_max": float(is_weight[mask > 0].max()) if bool((mask > 0).any()) else 0.0,
                "dual_clip_fraction": float(_divide((dual.to(mask.dtype) * mask).sum(), global_valid_toks)),
                "num_valid_tokens": float(mask.sum()),
                "num_valid_seqs": float(sample_mask.sum()),
                **is_metrics,
                **({"positive_nll_loss": float(nll)} if nll is not None else {}),
            }
        return loss, metrics

    def _ratios(self, curr: torch.Tensor, prev: torch.Tensor, mask: torch.Tensor):
        """(r, clip(r)) [mb, S]: token-level exp(curr - prev), or GSPO's per-sequence exp of the mean log ratio over
        the sequence's valid tokens (1 for a sequence without any); force_on_policy_ratio: exp(curr - sg(curr)) = 1,
        not clipped. With disable_ppo_ratio, r is only a metric (the loss uses curr)."""
        if self.cfg.force_on_policy_ratio:
            ratio = _masked_exp(curr - prev, mask)
            return ratio, ratio
        if self.sequence_level:
            log_ratio = torch.where(mask > 0, curr - prev, torch.zeros_like(curr))
            seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1.0)
            ratio = torch.exp(seq_log_ratio).unsqueeze(-1).expand_as(curr)
        else:
            ratio = _masked_exp(curr - prev, mask)
        if self.cfg.disable_ppo_ratio:
            return ratio, ratio
        return ratio, ratio.clamp(1.0 - self.ratio_clip_min, 1.0 + self.ratio_clip_max)

    def _policy_term(self, curr, ratio, clipped, advantages, mask):
        """(pg [mb, S], dual-clip mask [mb, S] bool): the policy term of the class docstring."""
        if self.cfg.disable_ppo_ratio:
            pg = -advantages * torch.where(mask > 0, curr, torch.zeros_like(curr))
        elif self.cfg.use_cispo:
            pg = -advantages * clipped.detach() * torch.where(mask > 0, curr, torch.zeros_like(curr))
        else:
            pg = torch.maximum(-advantages * ratio, -advantages * clipped)
        dual = torch.zeros_like(pg, dtype=torch.bool)
        if self.ratio_clip_c is not None:
            bound = -advantages * self.ratio_clip_c
            dual = (advantages < 0) & (pg > bound)
            pg = torch.where(dual, bound.expand_as(pg), pg)
        return pg, dual

    def _is_weight(self, prev, mb_data, mask, global_valid_toks, global_valid_seqs):
        """(w [mb, S] detached, metrics): the importance weight of the class docstring (1 without correction)."""
        if not self.use_is_correction:
            return torch.ones_like(mask), {}
        log_u = _finite((prev - mb_data["generation_logprobs"]).detach())
        u = _finite(_masked_exp(log_u, mask))
        kind, hi = self.truncated_is_type, self.truncated_is_ratio
        lo = self.cfg.truncated_importance_sampling_ratio_min
        if kind is None:
            return u, {}
        if kind == "seq-mask-tis":
            token_mask = mb_data["token_mask"].to(mask.dtype)
            seq_log_u = (log_u * token_mask).sum(-1) / token_mask.sum(-1).clamp(min=1.0)
            kept = ((seq_log_u.exp() >= lo) & (seq_log_u.exp() <= hi)).to(mask.dtype)
            sample_mask = mb_data["sample_mask"].to(mask.dtype)
            oob = _divide(((1.0 - kept) * sample_mask).sum(), global_valid_seqs)
            return u * kept.unsqueeze(-1), {"is_oob_ratio": float(oob)}
        lo = 0.0 if lo is None else lo
        inside = (u >= lo) & (u <= hi)
        oob = _divide(((~inside).to(mask.dtype) * mask).sum(), global_valid_toks)
        w = u.clamp(lo, hi) if kind == "tis" else torch.where(inside, u, torch.zeros_like(u))
        return w, {"is_oob_ratio": float(oob)}

    def _kl(self, curr, mb_data, mask):
        """beta * :func:`reference_kl` [mb, S] (0 on masked positions and with beta = 0). Its weight, as NeMo-RL's:
        exp(curr - sg(curr)) (value 1) or, with use_on_policy_kl_approximation, exp(curr - gen); both keep the
        gradient through curr, so d/dcurr (w k) = w (k + dk/dcurr): the score-function term of the KL's gradient
        (samples come from the policy being optimised)."""
        if self.kl_penalty == 0.0:
            return torch.zeros_like(curr)
        log_ratio = torch.where(mask > 0, mb_data["reference_policy_logprobs"] - curr, torch.zeros_like(curr))
        base = mb_data["generation_logprobs"] if self.on_policy_kl else curr.detach()
        weight = _finite(_masked_exp(curr - base, mask))
        cfg = self.cfg
        kl = reference_kl(log_ratio, weight, self.kl_type, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value)
        return self.kl_penalty * kl

    def _positive_nll(self, curr, mb_data, mask):
        """VAPO's NLL on the valid tokens of rows with reward > 0, their mean in this micro-batch (None when
        positive_example_nll_weight is 0; 0 with the graph when no such token)."""
        if self.cfg.positive_example_nll_weight == 0.0:
            return None
        correct = mask * (mb_data["rewards"] > 0).to(mask.dtype).unsqueeze(-1)
        nll = -torch.where(correct > 0, curr, torch.zeros_like(curr)).sum()
        count = correct.sum()
        return nll / count if bool(count > 0) else nll * 0.0

    def _reduce(self, per_token, mask, token_mask, sample_mask, global_valid_toks, global_valid_seqs):
        """Token-level sum / global_valid_toks, or per-sequence token mean summed / global_valid_seqs."""
        if self.token_level_loss:
            return _divide((per_token * mask).sum(), global_valid_toks)
        seq_tokens = token_mask.sum(-1).clamp(min=1.0)
        seq_mean = (per_token * token_mask).sum(-1) / seq_tokens
        return _divide((seq_mean * sample_mask).sum(), global_valid_seqs)
