"""Data- and tensor-parallel bookkeeping of the Megatron policy worker: where this rank sits, global counts,
metric and gradient reductions for what lives outside Megatron's DDP (the MTP block's own AdamW, the online
EAGLE-3 head).

Conventions (every function here is a collective over the group it names; all ranks of it must call it, also
ranks whose data shard is empty):

- sums over data-parallel ranks give the global-batch quantity (losses are already divided by global counts,
  gradients of such losses add up);
- metric dicts follow the loss contract of :mod:`nemo_rl_spec.algorithms.loss.interfaces`: ``*_max`` keys
  combine by max, all others by sum, over micro-batches and then over DP ranks (:func:`combine_metrics`);
- results are identical on every rank (all-reduce / all-gather, then the same arithmetic in rank order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's coordinates in megatron's DP x TP x PP layout (rank order tp-cp-ep-dp-pp: TP fastest).

    Attributes:
        rank, world_size: global rank and world size.
        dp_rank, dp_size, tp_rank, tp_size, pp_rank, pp_size: coordinates and sizes per dimension.
    """

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int

    @classmethod
    def from_parallel_state(cls) -> "ParallelLayout":
        """Read megatron ``parallel_state`` (initialised)."""
        from megatron.core import parallel_state as ps  # lazy: megatron-core is slow to import

        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
        )

    @staticmethod
    def of_rank(rank: int, tp_size: int, pp_size: int, world_size: int) -> dict[str, int]:
        """Megatron's default coordinates of ``rank`` without asking it: ``{"dp_rank", "tp_rank", "pp_rank"}``
        (rank = pp * DP * TP + dp * TP + tp)."""
        dp_size = world_size // (tp_size * pp_size)
        return {"tp_rank": rank % tp_size, "dp_rank": rank // tp_size % dp_size, "pp_rank": rank // (tp_size * dp_size)}


def comm_device() -> torch.device:
    """Where collective inputs must live: the current CUDA device under NCCL, else the CPU (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``values`` over ``group`` (a new tensor on ``values``' device; a copy for a group of size 1). Shape
    preserved."""
    if dist.get_world_size(group) == 1:
        return values.clone()
    out = values.to(comm_device(), copy=True)
    dist.all_reduce(out, group=group)
    return out.to(values.device)


def combine_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine metric dicts (micro-batches, or DP ranks): ``*_max`` keys by max, all others by sum, in order.
    Keys missing from a part (a rank without rows) are skipped for that part.

    Raises:
        ValueError: no part holds any key (the whole global batch was empty).
    """
    keys = list(dict.fromkeys(k for part in parts for k in part))
    if not keys:
        raise ValueError("no metrics to combine (the global batch has no rows)")
    return {k: (max if k.endswith("_max") else sum)(p[k] for p in parts if k in p) for k in keys}


def reduce_metrics(local: dict[str, float], group) -> dict[str, float]:
    """:func:`combine_metrics` of every rank's ``local`` metrics over ``group`` (all-gather of the small dicts), the
    same dict on every rank."""
    if dist.get_world_size(group) == 1:
        return combine_metrics([local])
    parts: list[dict[str, float] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    return combine_metrics(parts)


def all_reduce_grads(params: Sequence[torch.nn.Parameter], group) -> None:
    """Sum ``.grad`` of ``params`` over ``group`` in one flat all-reduce; a missing gradient counts as zeros and is
    set afterwards, so every rank ends with the same gradients (and takes the same optimizer step)."""
    if dist.get_world_size(group) == 1 or not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in params:
        p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()


def tp_grad_norm(params: Iterable[torch.nn.Parameter], tp_group) -> float:
    """L2 norm of the gradients of the FULL parameters: tensor-parallel slices (``tensor_model_parallel`` set by
    megatron's TP layers) add their squares over ``tp_group``; replicated parameters count once."""
    sharded = replicated = 0.0
    for p in params:
        if p.grad is None:
            continue
        square = float(p.grad.double().pow(2).sum())
        if getattr(p, "tensor_model_parallel", False):
            sharded += square
        else:
            replicated += square
    if dist.get_world_size(tp_group) > 1:
        sharded = float(all_reduce_sum(torch.tensor([sharded], dtype=torch.float64), tp_group)[0])
    return math.sqrt(sharded + replicated)


def clip_grads_(params: Sequence[torch.nn.Parameter], max_norm: float, tp_group) -> float:
    """Scale gradients in place by ``min(1, max_norm / (norm + 1e-6))`` with the TP-aware :func:`tp_grad_norm`
    (torch's ``clip_grad_norm_`` rule, which it is without TP); returns the norm before clipping."""
    if dist.get_world_size(tp_group) == 1:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    norm = tp_grad_norm(params, tp_group)
    coeff = max_norm / (norm + 1e-6)
    if coeff < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coeff)
    return norm


class GroupSync:
    """:class:`~nemo_rl_spec.speculative.draft_trainer.DataParallelSync` over one process group (the DP group)."""

    def __init__(self, group) -> None:
        self.group = group

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(values, self.group)

    def sum_metrics(self, values: dict[str, float]) -> dict[str, float]:
        return reduce_metrics(values, self.group)

    def grads(self, params: list[torch.nn.Parameter]) -> None:
        all_reduce_grads(params, self.group)
