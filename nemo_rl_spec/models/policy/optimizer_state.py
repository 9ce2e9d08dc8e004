"""Adam state of a Megatron optimizer by parameter name, independent of the data-parallel layout (checkpoints).

``get_megatron_optimizer`` returns a ``ChainedOptimizer`` whose parts wrap a torch Adam(W): ``FP32Optimizer`` steps
the model parameters themselves (its state is the same on every DP rank); ``DistributedOptimizer`` steps 1-D views
of the slice of each parameter that this DP rank owns (ZeRO-1: a parameter's moments are spread over the DP ranks);
``Float16OptimizerWithFloat16Params`` (``policy.precision: bfloat16``) steps fp32 master copies of the bf16
parameters, and checkpoints keep the masters (``"master"``), so a resumed run continues from the fp32 weights.

:func:`named_adam_state` returns, for every trained parameter, its moments at full parameter shape (this TP rank's
slice; distributed shards put together by an all-reduce over DP: each rank contributes zeros outside its range),
so a checkpoint written with one DP size (and either optimizer kind) loads with another (:func:`load_named_adam_state`).
Hyper-parameters are not stored here: they come from the recipe (the lr schedule's state is checkpointed
beside it, :mod:`~.megatron_checkpoint`).
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


def _pairs(part) -> list[tuple[list, list]]:
    """(model parameter group, tensors the torch optimizer steps for them) pairs of one optimizer part: fp32
    parameters step themselves (or their DP shard), half-precision ones step fp32 master copies (or shards of them)."""
    if _is_distributed(part):
        return [
            *zip(part.model_fp32_groups, part.shard_fp32_groups),
            *zip(part.model_float16_groups, part.shard_fp32_from_float16_groups),
        ]
    if hasattr(part, "float16_groups"):  # Float16OptimizerWithFloat16Params (bf16 / fp16 model parameters)
        return [
            *zip(part.float16_groups, part.fp32_from_float16_groups),
            *((group, group) for group in part.fp32_from_fp32_groups),
        ]
    return [(group["params"], group["params"]) for group in part.optimizer.param_groups]


def _slots(optimizer) -> list[_Slot]:
    slots = []
    for part in _parts(optimizer):
        for model_group, stepped_group in _pairs(part):
            for param, stepped in zip(model_group, stepped_group):
                rng = part._get_model_param_range_map(param)["param"] if _is_distributed(part) else None
                slots.append(
                    _Slot(
                        part.optimizer,
                        stepped,
                        param,
                        0 if rng is None else rng.start,
                        param.numel() if rng is None else rng.end,
                    )
                )
    return slots


def uses_distributed_optimizer(optimizer) -> bool:
    """True when any part of ``optimizer`` is Megatron's ``DistributedOptimizer``."""
    return any(_is_distributed(part) for part in _parts(optimizer))


@torch.no_grad()
def named_adam_state(optimizer, module: torch.nn.Module, dp_group) -> dict[str, dict[str, torch.Tensor]]:
    """``{param name: {"exp_avg", "exp_avg_sq": [param shape], "step": scalar}}`` for the trained parameters of
    ``module`` that have optimizer state (none before the first step); a half-precision (bf16 / fp16) parameter also
    gets ``"master"``, its fp32 master weight [param shape] (mixed precision: the optimizer steps it, the parameter
    is its rounded copy). Collective over ``dp_group`` with the distributed optimizer (every DP rank must call it)."""
    by_param = {id(s.param): s for s in _slots(optimizer)}
    distributed = uses_distributed_optimizer(optimizer)
    out = {}
    for name, param in module.named_parameters():
        if not param.requires_grad:
            continue
        slot = by_param.get(id(param))
        state = slot.torch_optimizer.state.get(slot.key, {}) if slot is not None else {}
        keys = (*STATE_KEYS, "master") if param.dtype != torch.float32 else STATE_KEYS
        moments = torch.zeros(len(keys), param.numel(), dtype=torch.float32, device=param.device)
        step = torch.zeros(1, dtype=torch.float64, device=param.device)
        if state:
            for i, key in enumerate(STATE_KEYS):
                moments[i, slot.start : slot.stop] = state[key].reshape(-1).float()
            if len(keys) > len(STATE_KEYS):
                moments[-1, slot.start : slot.stop] = slot.key.detach().reshape(-1).float()
            step[0] = float(state["step"])
        if distributed and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(moments, group=dp_group)
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=dp_group)
        if step[0] > 0:
            out[name] = {
                **{k: moments[i].view_as(param).to("cpu", copy=True) for i, k in enumerate(keys)},
                "step": torch.tensor(float(step[0])),
            }
    return out


@torch.no_grad()
def load_named_adam_state(optimizer, module: torch.nn.Module, state: dict[str, dict[str, torch.Tensor]]) -> None:
    """Install :func:`named_adam_state` output into ``optimizer`` (this rank's ranges of each parameter). Call it after
    the model's parameters are loaded: fp32 masters of half-precision parameters come from ``"master"`` when saved,
    else from the (loaded) parameter.

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
        if entry is not None and entry["exp_avg"].shape != slot.param.shape:
            raise ValueError(
                f"{names[id(slot.param)]}: optimizer state shape {tuple(entry['exp_avg'].shape)} != "
                f"parameter {tuple(slot.param.shape)}"
            )
        if slot.key is not slot.param:  # mixed precision: the fp32 master (saved, else from the loaded parameter)
            master = entry["master"] if entry is not None and "master" in entry else slot.param.detach()
            slot.key.copy_(master.reshape(-1)[slot.start : slot.stop].view_as(slot.key))
        if entry is None:
            slot.torch_optimizer.state.pop(slot.key, None)
            continue
        slot.torch_optimizer.state[slot.key] = {
            "step": entry["step"].clone(),
            **{
                k: entry[k]
                .reshape(-1)[slot.start : slot.stop]
                .view_as(slot.key)
                .to(slot.key.device, slot.key.dtype, copy=True)
                for k in STATE_KEYS
            },
        }
