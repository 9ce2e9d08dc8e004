"""MTP-head log-probs, masks, losses and acceptance (OCC co-training; megatron-core MTP block conventions).

MTP layer k (0-based) reads the trunk output at position p plus the embeddings of tokens p+1..p+k+1 and predicts
token ``p + k + 2`` (the main head at p predicts p + 1). Everything here is aligned with ``input_ids`` like the
main head's log-probs: ``out[b, s]`` belongs to target token ``input_ids[b, s]``.

With tensor parallelism the logits are vocabulary shards ``[..., V/T]``: pass the TP group as ``tp_group`` (see
:mod:`~nemo_rl_spec.models.policy.vocab_parallel`); ``None`` means the whole vocabulary is local.
"""

from __future__ import annotations

import torch

from nemo_rl_spec.distributed.interfaces import TrainDatumSpec
from nemo_rl_spec.models.policy.vocab_parallel import target_logprobs, vocab_argmax


def mtp_offset(head: int) -> int:
    """Distance from the predicting position to the predicted token for MTP layer ``head`` (0-based): head + 2."""
    return head + 2


def mtp_token_logprobs(
    mtp_logits: torch.Tensor, input_ids: torch.Tensor, head: int, temperature: float = 1.0, tp_group=None
) -> torch.Tensor:
    """``out[b, s] = log_softmax(mtp_logits[b, s - head - 2] / temperature)[input_ids[b, s]]`` for
    s >= head + 2, else 0. Padding is not masked here (use :func:`mtp_valid_mask`).

    Shape: mtp_logits [B, S, V] (or [B, S, V/T] with ``tp_group``), input_ids [B, S] -> [B, S] float32.
    """
    off = mtp_offset(head)
    target = target_logprobs(mtp_logits[:, :-off], input_ids[:, off:], temperature, tp_group)
    return torch.nn.functional.pad(target, (off, 0))


def mtp_valid_mask(data: TrainDatumSpec, head: int) -> torch.Tensor:
    """1.0 where ``input_ids[b, s]`` is a valid MTP target: a response token (``token_mask``), of a valid sample
    (``sample_mask``), with s >= head + 2 and s < input_lengths[b]. Shape: [B, S] float32."""
    token_mask = data["token_mask"].float()
    pos = torch.arange(token_mask.shape[1], device=token_mask.device).unsqueeze(0)
    ok = (pos >= mtp_offset(head)) & (pos < data["input_lengths"].unsqueeze(1))
    return token_mask * data["sample_mask"].float().unsqueeze(1) * ok.float()


def mtp_ce_loss(mtp_logprobs: torch.Tensor, valid: torch.Tensor, global_valid: torch.Tensor | float) -> torch.Tensor:
    """Cross-entropy of the sampled tokens under the MTP head: ``-sum(valid * mtp_logprobs) / global_valid``
    (0 when global_valid is 0). Shape: [B, S] each -> scalar."""
    total = -(mtp_logprobs * valid).sum()
    global_valid = torch.as_tensor(global_valid, dtype=total.dtype)
    return torch.where(global_valid > 0, total / global_valid.clamp(min=1e-30), total * 0.0)


@torch.no_grad()
def mtp_acceptance_counts(
    mtp_logits: torch.Tensor, main_logits: torch.Tensor, valid: torch.Tensor, head: int, tp_group=None
) -> tuple[float, float]:
    """Top-1 agreement of MTP head ``head`` with the main head on the same target token.

    For target s (valid[b, s] = 1) the MTP head predicts from position s - head - 2 and the main head from
    s - 1 (given the true prefix); counts ``argmax(mtp_logits[b, s-head-2]) == argmax(main_logits[b, s-1])``.
    This is the greedy acceptance rate of the MTP head as a one-token drafter for token s.

    Shape: mtp_logits, main_logits [B, S, V] (or [B, S, V/T] with ``tp_group``); valid [B, S] -> (agreeing
    targets, valid targets).
    """
    off = mtp_offset(head)
    mtp_top = vocab_argmax(mtp_logits[:, :-off], tp_group)
    main_top = vocab_argmax(main_logits[:, off - 1 : -1], tp_group)
    mask = valid[:, off:] > 0
    return float(((mtp_top == main_top) & mask).sum()), float(mask.sum())
