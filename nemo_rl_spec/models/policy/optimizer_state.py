"""Adam state of a Megatron optimizer by parameter name, independent of the data-parallel layout (checkpoints).

``get_megatron_optimizer`` returns a ``ChainedOptimizer`` whose parts wrap a torch Adam(W):

- ``FP32Optimizer`` (plain): the torch optimizer steps the model parameters themselves; its state is the same
  on every data-parallel rank.
- ``DistributedOptimizer`` (``use_distributed_optimizer``): the torch optimizer steps 1-D views
  ``param.view(-1)[start:end]`` of the slice of each parameter that this DP rank owns (ZeRO-1); the moments of a
  parameter are spread over the DP ranks.

:func:`named_adam_state` returns, for every trained parameter, its moments at full parameter shape (this TP rank's
slice; distributed shards put together by an all-reduce over DP: each rank contributes zeros outside its range),
so a checkpoint written with one DP size (and either optimizer kind) loads with another (:func:`load_named_adam_state`).
Hyper-parameters are not stored: they come from the recipe (the learning rate is constant).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

STATE_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class _Slot:
    """One tensor the torch optimizer steps: ``key`` (its state key), the model parameter it belongs to and the
    flat range ``[start, stop)`` of that parameter it covers."""

    torch_optimizer: torch.optim.Optimizer
    key: torch.Tensor
    param: torch.nn.Parameter
    start: int
    stop: int


def _parts(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(part) -> bool:
    return hasattr(part, "shard_fp32_groups")


def _slots(optimizer) -> list[_Slot]:
    slots = []
    for part in _parts(optimizer):
        inner = part.optimizer
        if _is_distributed(part):
            for model_group, shard_group in zip(part.model_fp32_groups, part.shard_fp32_groups):
                for param, shard in zip(model_group, shard_group):
                    rng = part._get_model_param_range_map(param)["param"]
                    slots.append(_Slot(inner, shard, param, rng.start, rng.end))
        else:
            for group in inner.param_groups:
                slots.extend(_Slot(inner, p, p, 0, p.numel()) for p in group["params"])
    return slots


def uses_distributed_optimizer(optimizer) -> bool:
    """True when any part of ``optimizer`` is Megatron's ``DistributedOptimizer``."""
    return any(_is_distributed(part) for part in _parts(optimizer))


@torch.no_grad()
def named_adam_state(optimizer, module: torch.nn.Module, dp_group) -> dict[str, dict[str, torch.Tensor]]:
    """``{param name: {"exp_avg", "exp_avg_sq": [param shape], "step": scalar}}`` for the trained parameters of
    ``module`` that have optimizer state (none before the first step). Collective over ``dp_group`` with the
    distributed optimizer (every DP rank must call it)."""
    by_param = {id(s.param): s for s in _slots(optimizer)}
    distributed = uses_distributed_optimizer(optimizer)
    out = {}
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        slot = by_param.get(id(param))
        state = slot.torch_optimizer.state.get(slot.key, {}) if slot is not None else {}
        moments = torch.zeros(len(STATE_KEYS), param.numel(), dtype=torch.float32, device=param.device)
        step = torch.zeros(1, dtype=torch.float64, device=param.device)
        if state:
            for i, key in enumerate(STATE_KEYS):
                moments[i, slot.start: slot.stop] = state[key].reshape(-1).float()
            step[0] = float(state["step"])
        if distributed and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(moments, group=dp_group)
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=dp_group)
        if step[0] > 0:
            out[name] = {**{k: moments[i].view_as(param).to("cpu", copy=True) for i, k in enumerate(STATE_KEYS)},
                         "step": torch.tensor(float(step[0]))}
    return out


@torch.no_grad()
def load_named_adam_state(optimizer, module: torch.nn.Module, state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Install :func:`named_adam_state` output into ``optimizer`` (this rank's ranges of each parameter).

    Raises:
        KeyError: ``state`` names a parameter the module does not train.
        ValueError: a moment's shape differs from its parameter (another tensor-parallel layout).
    """
    names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
    unknown = set(state) - set(names.values())
    if unknown:
        raise KeyError(f"optimizer state for parameters the model does not train: {sorted(unknown)[:5]}")
    for slot in _slots(optimizer):
        entry = state.get(names[id(slot.param)])
        if entry is None:
            slot.torch_optimizer.state.pop(slot.key, None)
            continue
        if entry["exp_avg"].shape != slot.param.shape:
            raise ValueError(f"{names[id(slot.param)]}: optimizer state shape {tuple(entry['exp_avg'].shape)} != "
                             f"parameter {tuple(slot.param.shape)}")
        slot.torch_optimizer.state[slot.key] = {
            "step": entry["step"].clone(),
            **{k: entry[k].reshape(-1)[slot.start: slot.stop].view_as(slot.key).to(slot.key.device, slot.key.dtype,
                                                                                    copy=True)
               for k in STATE_KEYS}}
