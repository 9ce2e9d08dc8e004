"""Sequence-level log-prob error masking (NeMo-RL's ``grpo.seq_logprob_error_threshold``): a response whose trainer
log-probs (``prev_logprobs``) stray too far from the sampler's (``generation_logprobs``) leaves the loss
(``sample_mask`` 0), as NeMo-RL's ``compute_and_apply_seq_logprob_error_masking`` does. The per-sequence error is
``train/token_mult_prob_error`` taken over one sequence's response tokens::

    err_i = sum_t m_it exp(|gen_it - prev_it|) / sum_t m_it,    m_it = token_mask_it * sample_mask_i
    masked_i = sample_mask_i = 1 and err_i > threshold

Rows already out of the loss (``sample_mask`` 0: a masked non-finite reward, overlong filtering) are neither
counted nor measured. The metrics are logged on every step, threshold or not (they tell which threshold to pick).
"""

from __future__ import annotations

import torch

from nemo_rl_spec.distributed.interfaces import TrainDatumSpec


def seq_mult_prob_error(
    prev_logprobs: torch.Tensor, generation_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-sequence multiplicative probability error ``err_i`` (module docstring); 0 on a row with no mask.

    Shape: [B, S] each (mask float 0/1) -> [B]."""
    count = mask.sum(1)
    total = (torch.exp((generation_logprobs - prev_logprobs).abs() * mask) * mask).sum(1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def _stats(suffix: str, errors: torch.Tensor) -> dict[str, float]:
    """max / mean / min of ``errors`` as NeMo-RL names them (``train/max_seq_mult_prob_error<suffix>``); 0 when
    empty."""
    empty = errors.numel() == 0
    return {
        f"train/{op}_seq_mult_prob_error{suffix}": 0.0 if empty else float(getattr(errors, op)())
        for op in ("max", "mean", "min")
    }


def apply_seq_logprob_error_masking(
    data: TrainDatumSpec, rewards: torch.Tensor, threshold: float | None
) -> dict[str, float]:
    """Measure ``err_i`` of every row of ``data`` and, with a ``threshold``, set ``sample_mask`` 0 (in place) on the
    rows above it. Needs ``prev_logprobs`` and ``generation_logprobs`` in ``data``.

    Returns NeMo-RL's metrics: ``train/{max,mean,min}_seq_mult_prob_error`` (rows in the loss before masking),
    the same with ``_after_mask`` (rows kept), ``train/num_masked_seqs_by_logprob_error`` and
    ``train/masked_correct_pct`` (the fraction of the masked rows with reward 1).

    Shape: rewards [B] (row order of ``data``), data["sample_mask"] [B], the log-probs and token_mask [B, S].
    """
    sample_mask = data["sample_mask"].float()
    mask = data["token_mask"].float() * sample_mask.unsqueeze(1)
    err = seq_mult_prob_error(data["prev_logprobs"].float(), data["generation_logprobs"].float(), mask)
    measured = mask.sum(1) > 0
    masked = measured & (err > threshold) if threshold is not None else torch.zeros_like(measured)
    kept = measured & ~masked
    if threshold is not None:
        data["sample_mask"] = data["sample_mask"] * (~masked).to(data["sample_mask"].dtype)
    n_masked = int(masked.sum())
    correct = float((rewards[masked] == 1).sum()) / n_masked if n_masked else 0.0
    return {
        **_stats("", err[measured]),
        **_stats("_after_mask", err[kept]),
        "train/num_masked_seqs_by_logprob_error": float(n_masked),
        "train/masked_correct_pct": correct,
    }
