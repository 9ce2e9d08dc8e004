"""The trunk's optimizer stack of the Megatron policy worker: megatron-core's ``DistributedDataParallel`` (contiguous
fp32 grad buffer, ``main_grad``, SUM all-reduce), its optimizer (Adam; the distributed optimizer when asked) and its
lr / weight-decay scheduler, from the ``policy.megatron_cfg`` section.
"""

from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig  # noqa: E402
from megatron.core.optimizer import get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402

from nemo_rl_spec.models.policy import megatron_model as _mm  # noqa: F401  (applies the CPU patches first)
from nemo_rl_spec.models.policy.cpu_compat import cuda_tensor_type_names
from nemo_rl_spec.utils.config_schema import MegatronConfig, OptimizerConfig


def wrap_ddp(module: torch.nn.Module, use_distributed_optimizer: bool) -> DistributedDataParallel:
    """``module`` in megatron's DDP: fp32 gradient reduction, no overlap, gradients summed (not averaged) over DP."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        average_in_collective=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)


def megatron_optimizer(model: DistributedDataParallel, opt: OptimizerConfig, dtype: torch.dtype):
    """megatron-core's Adam for ``model`` from ``policy.megatron_cfg.optimizer``; mixed precision (fp32 masters) when
    ``dtype`` (the parameters') is bf16 / fp16. The distributed optimizer's CUDA type checks pass on CPU through
    :func:`~.cpu_compat.cuda_tensor_type_names`."""
    config = MegatronOptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        params_dtype=dtype,
        use_distributed_optimizer=opt.use_distributed_optimizer,
    )
    with cuda_tensor_type_names():  # the distributed optimizer type-checks 'torch.cuda.*Tensor' (cpu_compat)
        return get_megatron_optimizer(config, [model])


def lr_scheduler(optimizer, mcfg: MegatronConfig) -> OptimizerParamScheduler:
    """megatron-core's lr / weight-decay scheduler from ``megatron_cfg.scheduler`` (formula in
    :class:`~nemo_rl_spec.utils.config_schema.SchedulerConfig`); without the section a constant ``lr``. It sets the lr
    of optimizer step 0 now; the worker's ``train`` advances it by one after every step."""
    opt, sched = mcfg.optimizer, mcfg.scheduler
    if sched is None:
        return OptimizerParamScheduler(
            optimizer,
            init_lr=opt.lr,
            max_lr=opt.lr,
            min_lr=opt.lr,
            lr_warmup_steps=0,
            lr_decay_steps=1,
            lr_decay_style="constant",
            start_wd=opt.weight_decay,
            end_wd=opt.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
    decay_iters = sched.lr_decay_iters or sched.lr_warmup_iters + 1  # unused by a constant schedule
    pick = lambda value: opt.weight_decay if value is None else value  # noqa: E731
    return OptimizerParamScheduler(
        optimizer,
        init_lr=sched.lr_warmup_init,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=sched.lr_warmup_iters,
        lr_decay_steps=decay_iters,
        lr_decay_style=sched.lr_decay_style,
        start_wd=pick(sched.start_weight_decay),
        end_wd=pick(sched.end_weight_decay),
        wd_incr_steps=decay_iters,
        wd_incr_style=sched.weight_decay_incr_style,
    )
