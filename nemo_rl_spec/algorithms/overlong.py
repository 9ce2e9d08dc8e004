"""Overlong filtering (NeMo-RL's ``grpo.overlong_filtering``; DAPO, Yu et al. 2025, sec. 3.4): responses that the
engine cut off (by ``policy.generation.max_new_tokens`` or the engine's ``max_model_len``) carry no end-of-sequence
token, so their reward judges an unfinished answer; their rows leave the loss (``sample_mask`` 0). They stay in
the batch and in the group baselines (the GRPO baseline counts every response, as NeMo-RL's does; only
``grpo.adv_estimator.name=reinforce_plus_plus`` whitens over the rows left in the loss).

A row is truncated when its response reached a length limit and does not end with EOS::

    response_len = input_lengths_total - prompt_len
    truncated    = (response_len >= max_new_tokens or input_lengths_total >= max_model_len)
                   and last_token != eos_token_id

(vLLM reports ``finish_reason == "length"`` exactly then; a response that ends with EOS at the limit is complete.)
A stop token (``policy.generation.stop_token_ids``) ends a response like EOS, and so does a stop string
(``policy.generation.stop_strings``): vLLM keeps the token that completes it as the last one, so a row whose decoded
response contains a stop string ended there.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from nemo_rl_spec.distributed.interfaces import TrainDatumSpec


def truncated_rows(
    data: TrainDatumSpec,
    max_new_tokens: int,
    max_model_len: int,
    eos_token_id: int | Sequence[int],
    stop_strings: Sequence[str] = (),
    decode: Callable[[list[int]], str] | None = None,
) -> torch.Tensor:
    """Rows whose response was cut off by a length limit (module docstring).

    Args:
        eos_token_id: the end token id, or every id that ends a response normally (EOS + stop tokens).
        stop_strings, decode: a row at the limit whose ``decode(response token ids)`` contains a stop string ended
            normally (needs ``decode``, e.g. ``tokenizer.decode``).

    Shape: data["input_ids"] [B, S], ``input_lengths`` [B] (prompt + response), ``token_mask`` [B, S] (response
    positions) -> [B] bool.
    """
    lengths = data["input_lengths"].long()
    response_len = data["token_mask"].sum(1).long()
    last = data["input_ids"].gather(1, (lengths - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    at_limit = (response_len >= max_new_tokens) | (lengths >= max_model_len)
    ends = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), dtype=last.dtype)
    truncated = at_limit & ~torch.isin(last, ends) & (response_len > 0)
    if stop_strings and decode is not None:
        for r in truncated.nonzero().flatten().tolist():
            text = decode(data["input_ids"][r][data["token_mask"][r].bool()].tolist())
            truncated[r] = not any(s in text for s in stop_strings)
    return truncated


def apply_overlong_filtering(data: TrainDatumSpec, truncated: torch.Tensor) -> dict[str, float]:
    """Set ``sample_mask`` to 0 on the ``truncated`` rows of ``data`` (in place); returns
    ``train/overlong_filtered`` (rows masked) and ``train/overlong_fraction`` (of all rows).

    Shape: truncated [B] bool, data["sample_mask"] [B]."""
    data["sample_mask"] = data["sample_mask"] * (~truncated).to(data["sample_mask"].dtype)
    rows = max(int(truncated.numel()), 1)
    return {"train/overlong_filtered": float(truncated.sum()), "train/overlong_fraction": float(truncated.sum()) / rows}
