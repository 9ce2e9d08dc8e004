"""Overlong filtering (NeMo-RL's ``grpo.overlong_filtering``; DAPO, Yu et al. 2025, sec. 3.4): responses that the
engine cut off (by ``policy.generation.max_new_tokens`` or the engine's ``max_model_len``) carry no end-of-sequence
token, so their reward judges an unfinished answer; their rows leave the loss (``sample_mask`` 0). They stay in
the batch and in the group baselines (advantages are computed before filtering, as NeMo-RL does).

A row is truncated when its response reached a length limit and does not end with EOS::

    response_len = input_lengths_total - prompt_len
    truncated    = (response_len >= max_new_tokens or input_lengths_total >= max_model_len)
                   and last_token != eos_token_id

(vLLM reports ``finish_reason == "length"`` exactly then; a response that ends with EOS at the limit is complete.)
"""
from __future__ import annotations

import torch

from nemo_rl_spec.distributed.interfaces import TrainDatumSpec


def truncated_rows(data: TrainDatumSpec, max_new_tokens: int, max_model_len: int, eos_token_id: int) -> torch.Tensor:
    """Rows whose response was cut off by a length limit (module docstring).

    Shape: data["input_ids"] [B, S], ``input_lengths`` [B] (prompt + response), ``token_mask`` [B, S] (response
    positions) -> [B] bool.
    """
    lengths = data["input_lengths"].long()
    response_len = data["token_mask"].sum(1).long()
    last = data["input_ids"].gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    at_limit = (response_len >= max_new_tokens) | (lengths >= max_model_len)
    return at_limit & (last != eos_token_id) & (response_len > 0)


def apply_overlong_filtering(data: TrainDatumSpec, truncated: torch.Tensor) -> dict[str, float]:
    """Set ``sample_mask`` to 0 on the ``truncated`` rows of ``data`` (in place); returns
    ``train/overlong_filtered`` (rows masked) and ``train/overlong_fraction`` (of all rows).

    Shape: truncated [B] bool, data["sample_mask"] [B]."""
    data["sample_mask"] = data["sample_mask"] * (~truncated).to(data["sample_mask"].dtype)
    rows = max(int(truncated.numel()), 1)
    return {"train/overlong_filtered": float(truncated.sum()), "train/overlong_fraction": float(truncated.sum()) / rows}
