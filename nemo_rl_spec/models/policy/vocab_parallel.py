"""Log-probs and argmax over logits split by vocabulary across a tensor-parallel group (our own code, the
computation of NeMo-RL's ``from_parallel_logits_to_logprobs``).

With tensor parallelism megatron's output layer leaves each TP rank ``r`` of ``T`` the logits of vocabulary ids
``[r * V/T, (r + 1) * V/T)`` (megatron's ``VocabUtility`` partition; ``V`` divisible by ``T``). For each row::

    m        = max over all shards of the logits              (all-reduce MAX)
    Z        = sum over all shards of exp(logits - m)         (all-reduce SUM)
    z_target = logits[target] - m on the owning shard, 0 elsewhere   (all-reduce SUM)
    log p(target) = z_target - log Z

The backward needs no communication: ``d log p / d logits_local = onehot_local(target) - softmax_local``, with the
global ``m`` and ``Z`` saved by the forward. ``group=None`` (or a group of size 1) takes the single-device path
``log_softmax(x).gather(target)`` (the very ops of the unsharded reference, so TP=1 stays bitwise what it was).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nemo_rl_spec.models.policy.sampling_filter import SamplingFilter


def _is_sharded(group) -> bool:
    return group is not None and dist.get_world_size(group) > 1


class _VocabParallelLogprob(torch.autograd.Function):
    """log p(target) from vocab-sharded logits (module docstring). Shape: logits [N, V/T], target [N] -> [N]."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group) -> torch.Tensor:
        local_vocab = logits.shape[-1]
        start = dist.get_rank(group) * local_vocab
        row_max = logits.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        owned = (target >= start) & (target < start + local_vocab)
        local_target = (target - start).clamp(0, local_vocab - 1)
        target_logit = torch.where(owned, shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)
        dist.all_reduce(target_logit, group=group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, owned)
        return target_logit - sum_exp.log()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        softmax, local_target, owned = ctx.saved_tensors
        grad = -softmax
        grad.scatter_add_(-1, local_target.unsqueeze(-1), owned.to(grad.dtype).unsqueeze(-1))
        return grad * grad_out.unsqueeze(-1), None, None


def target_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    group=None,
    sampling_filter: SamplingFilter | None = None,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)[targets]`` over the full vocabulary, differentiable w.r.t. ``logits``.

    With ``sampling_filter`` the softmax runs over the entries the engine's sampler keeps (the others are ``-inf``;
    :mod:`~.sampling_filter`), so the log-prob is the engine's ``processed_logprobs`` one. The target itself is
    always kept: a sampled token the trainer's filter would drop (a rounding tie at the top-p boundary between the
    engine's and the trainer's logits) gets a finite log-prob instead of ``-inf``.

    Args:
        logits: this rank's vocabulary shard (the whole vocabulary when ``group`` is None / of size 1).
        targets: global vocabulary ids.
        group: the tensor-parallel group the vocabulary is split over, or None.
        sampling_filter: the engine's top-k / top-p filter, or None (full softmax).

    Shape: logits [..., V/T], targets [...] int64 -> [...] float32.
    """
    scaled = logits.float() / temperature
    if sampling_filter is not None and sampling_filter.active:
        scaled = _filtered(scaled, targets, sampling_filter, group)
    if not _is_sharded(group):
        return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    flat = _VocabParallelLogprob.apply(scaled.reshape(-1, scaled.shape[-1]), targets.reshape(-1), group)
    return flat.reshape(targets.shape)


@torch.no_grad()
def vocab_argmax(logits: torch.Tensor, group=None) -> torch.Tensor:
    """Global vocabulary id of the largest logit (the lowest id among equal maxima, as ``torch.argmax``).

    Shape: logits [..., V/T] -> [...] int64.
    """
    if not _is_sharded(group):
        return logits.argmax(-1)
    local_max, local_idx = logits.max(dim=-1)
    world = dist.get_world_size(group)
    maxima = [torch.empty_like(local_max) for _ in range(world)]
    dist.all_gather(maxima, local_max.contiguous(), group=group)
    indices = [torch.empty_like(local_idx) for _ in range(world)]
    dist.all_gather(indices, (local_idx + dist.get_rank(group) * logits.shape[-1]).contiguous(), group=group)
    best_shard = torch.stack(maxima).argmax(0)  # first shard holding the maximum = the lowest id
    return torch.stack(indices).gather(0, best_shard.unsqueeze(0)).squeeze(0)


@torch.no_grad()
def gather_vocab(logits: torch.Tensor, group=None) -> torch.Tensor:
    """The full-vocabulary logits from the shards (no gradient). Shape: [..., V/T] -> [..., V]."""
    if not _is_sharded(group):
        return logits
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _filtered(scaled: torch.Tensor, targets: torch.Tensor, sampling_filter: SamplingFilter, group) -> torch.Tensor:
    """``scaled`` (this rank's shard) with the entries ``sampling_filter`` drops set to ``-inf``; the mask is taken on
    the gathered full vocabulary, then sliced back to the shard. Shape: [..., V/T] -> [..., V/T]."""
    keep = sampling_filter.keep_mask(gather_vocab(scaled.detach(), group))
    keep.scatter_(-1, targets.unsqueeze(-1), True)
    if _is_sharded(group):
        local = scaled.shape[-1]
        start = dist.get_rank(group) * local
        keep = keep[..., start : start + local]
    return scaled.masked_fill(~keep, -float("inf"))


def token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    input_lengths: torch.Tensor,
    temperature: float = 1.0,
    tp_group=None,
    sampling_filter: SamplingFilter | None = None,
) -> torch.Tensor:
    """Log-prob of each token given its prefix, aligned with ``input_ids``.

    ``out[b, s] = log_softmax(logits[b, s-1] / temperature)[input_ids[b, s]]`` for 1 <= s < input_lengths[b],
    0 at s = 0 and on padding. (``log_softmax`` then gather, the very ops of the usual reference; the
    cheaper ``gather - logsumexp`` differs from it by ~2e-5 at SmolLM2's logit scale.) With ``tp_group`` the
    logits are this rank's vocabulary shard and the softmax runs over all shards (:func:`target_logprobs`). With
    ``sampling_filter`` the softmax is over the entries the engine's top-k / top-p sampler keeps.

    Shape: logits [B, S, V] (or [B, S, V/T]), input_ids [B, S], input_lengths [B] -> [B, S] float32.
    """
    next_token = target_logprobs(logits[:, :-1], input_ids[:, 1:], temperature, tp_group, sampling_filter)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    valid = positions[1:].unsqueeze(0) < input_lengths.unsqueeze(1)
    return torch.nn.functional.pad(torch.where(valid, next_token, 0.0), (1, 0))
