"""Loss-function contract shared by the policy workers (NeMo-RL's ``LossFunction`` semantics).

A policy worker splits a global batch into micro-batches, calls the loss once per micro-batch, backpropagates
each micro-batch loss and sums the gradients. For the sum to be the full-batch loss, every micro-batch loss is
divided by a *global* normaliser computed once over the whole global batch (on every data-parallel rank)::

    global_valid_toks = sum over the global batch of token_mask[b, s] * sample_mask[b]
    global_valid_seqs = sum over the global batch of sample_mask[b]

    sum_k loss_fn(curr_logprobs_k, mb_k, global_valid_toks, global_valid_seqs)[0] == full-batch loss

Metrics follow the same rule so the caller can aggregate them without knowing their meaning: a key ending in
``_max`` is reduced with ``max`` over micro-batches, every other key with ``sum`` (means are already divided by
the global normaliser, counts are plain counts).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from nemo_rl_spec.distributed.interfaces import TrainDatumSpec
from nemo_rl_spec.models.policy.parallel import combine_metrics


@runtime_checkable
class LossFunction(Protocol):
    """A callable micro-batch loss.

    Call: ``loss, metrics = loss_fn(curr_logprobs, mb_data, global_valid_toks, global_valid_seqs)``

    Args:
        curr_logprobs: [mb, S] float32 log-probs of ``mb_data['input_ids']`` under the weights being trained,
            aligned with input_ids (position s holds log pi(token s | tokens < s)); carries the autograd graph.
        mb_data: the micro-batch, a :class:`TrainDatumSpec` with the same mb rows.
        global_valid_toks: scalar tensor, valid (masked-in) tokens in the whole global batch.
        global_valid_seqs: scalar tensor, valid sequences in the whole global batch.

    Returns:
        loss: scalar tensor (differentiable w.r.t. curr_logprobs), already divided by the global normaliser.
        metrics: dict of python floats, aggregated across micro-batches by sum (``*_max`` keys by max).
    """

    def __call__(
        self,
        curr_logprobs: torch.Tensor,
        mb_data: TrainDatumSpec,
        global_valid_toks: torch.Tensor,
        global_valid_seqs: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


def aggregate_microbatch_metrics(per_microbatch: list[dict[str, float]]) -> dict[str, float]:
    """Combine the metrics of several micro-batch calls: ``*_max`` keys by max, all others by sum.

    Raises:
        ValueError: the list is empty or the dicts have different keys.
    """
    if not per_microbatch:
        raise ValueError("no micro-batch metrics to aggregate")
    keys = set(per_microbatch[0])
    if any(set(m) != keys for m in per_microbatch):
        raise ValueError("micro-batch metrics have different keys")
    return combine_metrics(per_microbatch)
