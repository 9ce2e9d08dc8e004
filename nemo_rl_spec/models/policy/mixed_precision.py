"""fp32 master weights for parameters that Megatron's mixed-precision optimizer does not hold (the MTP block).

Megatron's ``Float16OptimizerWithFloat16Params`` (bf16 model parameters, fp32 ``main_grad`` accumulation in the DDP
buffer, fp32 master weights and Adam state; Micikevicius et al. 2018, "Mixed Precision Training") trains the trunk.
The MTP block is kept out of Megatron's DDP buffer and optimizer (its own AdamW: megatron_worker.py's docstring),
so :class:`MasterWeightAdamW` gives it the same semantics: gradients accumulated in fp32 ``main_grad`` (a
post-accumulate hook adds each bf16 ``.grad`` into it and frees the bf16 one), AdamW on fp32 masters, the updated
masters cast into the bf16 parameters. With fp32 parameters it is exactly ``torch.optim.AdamW`` on them.
"""

from __future__ import annotations

from typing import Iterable

import torch

_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _master_of(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """An fp32 copy of ``param`` carrying megatron's tensor-parallel attributes (TP-aware grad norms read them)."""
    master = torch.nn.Parameter(param.detach().to(torch.float32, copy=True))
    for attr in _TP_ATTRS:
        if hasattr(param, attr):
            setattr(master, attr, getattr(param, attr))
    return master


def _accumulate_main_grad(param: torch.Tensor) -> None:
    """Post-accumulate hook: ``main_grad += grad`` in fp32, then drop the half-precision ``grad``."""
    param.main_grad.add_(param.grad.to(torch.float32))
    param.grad = None


class MasterWeightAdamW:
    """AdamW over fp32 master copies of ``params`` (each fp32 or bf16 / fp16).

    Use: ``zero_grad()``; backward passes (half parameters accumulate into ``main_grad``, fp32 into ``.grad``);
    ``grads = master_params()`` then reduce / clip their ``.grad`` (:meth:`stage_grads` first); ``step()``.
    A new optimizer may replace an old one over the same parameters (the MTP warm start's): the newest owns the
    ``main_grad`` buffers, and the accumulation hook is registered once per parameter.

    Args:
        params: the parameters to train (modified in place by :meth:`step`).
        **adamw: ``torch.optim.AdamW`` keyword arguments (lr, betas, eps, weight_decay).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **adamw) -> None:
        self.params = list(params)
        self.masters = []
        for p in self.params:
            if p.dtype == torch.float32:
                self.masters.append(p)
                continue
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            if not getattr(p, "_main_grad_hook", False):  # once per parameter: a later optimizer over it reuses it
                p.register_post_accumulate_grad_hook(_accumulate_main_grad)
                p._main_grad_hook = True
            self.masters.append(_master_of(p))
        self.optimizer = torch.optim.AdamW(self.masters, **adamw)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the parameters, the masters and the fp32 ``main_grad`` buffers."""
        for p, m in zip(self.params, self.masters):
            p.grad = None
            if m is not p:
                m.grad = None
                p.main_grad.zero_()

    def stage_grads(self) -> list[torch.nn.Parameter]:
        """Point each master's ``.grad`` at its parameter's fp32 gradient (``main_grad``, or ``.grad`` of an fp32
        parameter); returns the masters, whose ``.grad`` the caller may all-reduce and clip in place."""
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = p.main_grad
        return self.masters

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the masters (fp32 update), then copy each master into its parameter (one cast to its dtype)."""
        self.optimizer.step()
        for p, m in zip(self.params, self.masters):
            if m is not p:
                p.copy_(m)

    def state_dict(self) -> dict:
        """The AdamW state and the fp32 masters of the half-precision parameters (by position)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "masters": [m.detach().clone() if m is not p else None for p, m in zip(self.params, self.masters)],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (a pre-mixed-precision checkpoint: a bare AdamW state dict, masters from the
        parameters). Raises ValueError when the number of parameters differs."""
        masters = state.get("masters") if "optimizer" in state else None
        self.optimizer.load_state_dict(state["optimizer"] if "optimizer" in state else state)
        if masters is None:
            masters = [None] * len(self.params)
        if len(masters) != len(self.params):
            raise ValueError(f"MTP optimizer state holds {len(masters)} masters for {len(self.params)} parameters")
        for p, m, saved in zip(self.params, self.masters, masters):
            if m is not p:
                m.copy_(saved if saved is not None else p.detach().float())
