"""Megatron-core policy worker: log-probs, one optimizer step per ``train`` call, HF export, checkpoints.

A plain class; :class:`~nemo_rl_spec.models.policy.lm_policy.Policy` runs N of them as a
:class:`~nemo_rl_spec.distributed.worker_group.RayWorkerGroup` (one ``torch.distributed`` world, gloo on CPU).
``__init__`` applies the CPU patches, joins the world (or makes a world of size 1 when created outside a worker
group) and initialises megatron ``parallel_state`` with TP x PP; DP = world / (TP * PP), ranks in megatron's order
(TP fastest, :class:`~.parallel.ParallelLayout`).

Training uses Megatron's ``DistributedDataParallel`` (contiguous fp32 grad buffer, ``main_grad``) and
``get_megatron_optimizer`` (Adam; torch's AdamW underneath when neither TE nor Apex is installed, with
Megatron's grad-norm clipping). Config (:class:`~nemo_rl_spec.utils.config_schema.PolicyConfig`, the ``policy``
section): ``precision``, ``train_micro_batch_size``, ``logprob_batch_size``, ``generation.temperature`` (logits are
divided by it in ``train``, as in ``get_logprobs``), ``megatron_cfg.{tensor,pipeline}_model_parallel_size``,
``megatron_cfg.num_threads``, ``megatron_cfg.activation_checkpointing``,
``megatron_cfg.optimizer.{lr, weight_decay, adam_beta1, adam_beta2, adam_eps, clip_grad, use_distributed_optimizer}``.

Data parallel: each DP rank gets a contiguous row shard of the global batch (the controller shards it; shards may
differ in size, even be empty). The loss of every micro-batch is divided by GLOBAL counts (valid tokens, valid
sequences, per-MTP-head targets: sums over the DP group), so the gradients of all ranks add up to the global-batch
gradient: Megatron DDP all-reduces with SUM (``calculate_per_token_loss``, gradient scaling 1). ``train`` returns
the same metrics on every rank (loss-type metrics combined over DP by the loss contract: sum, ``*_max`` by max).

Tensor parallel: megatron-core's own TP layers on gloo; HF weights are sliced per TP rank on import and gathered
back on export (:mod:`~.hf_weight_mapping`), log-probs are vocab-parallel (:mod:`~.vocab_parallel`).

Pipeline parallel is refused (``pipeline_model_parallel_size`` must be 1): the worker runs its own forward (trunk,
main head, MTP block on detached copies of trunk tensors, OCC's three backward calls, the online draft's capture
hooks) in one process, while PP needs megatron's pipeline schedules (``get_forward_backward_func``) with p2p
transfers between stages; the MTP block and the tied embedding would live on other stages than the trunk output
they read, and on CPU the schedules also allocate on "cuda" and call ``torch.cuda.synchronize``.

Micro-batches (:mod:`~.dynamic_batching`): consecutive chunks of ``train_micro_batch_size`` / ``logprob_batch_size``
rows, each trimmed to its longest row; with ``policy.dynamic_batching.enabled`` (NeMo-RL's dynamic batching) each rank
sorts its own shard by length and fills micro-batches up to ``train_mb_tokens`` / ``logprob_mb_tokens`` padded tokens
(per-row outputs return in the caller's row order). The global-count normalisation makes both give the same step.

Activation checkpointing (``megatron_cfg.activation_checkpointing``): megatron's full uniform recompute, one layer
per chunk; the step is the same as without it.

Distributed optimizer (``optimizer.use_distributed_optimizer``): megatron's ``DistributedOptimizer`` (Adam state
sharded over DP, gradients reduce-scattered, parameters all-gathered), on CPU through a type-name shim
(:func:`~.cpu_compat.cuda_tensor_type_names`).

MTP co-training (``megatron_cfg.mtp_num_layers`` > 0; docs/occ.md) also reads ``mtp_loss_mode`` (detach | ce |
policy | occ), ``mtp_loss_scaling_factor`` (the fixed coefficient, or lambda_plus for occ), ``mtp_occ_eps``,
``mtp_occ_lambda_max``, ``mtp_occ_proxy`` (occ's lambda from hidden-state gradients, or the paper's observed
log-prob changes) and ``mtp_occ_reference`` (also report c and v2 from full parameter gradients, to validate
the proxies; costs two extra trunk backwards). The MTP block's parameters are kept out of Megatron's DDP buffer and
optimizer and get their own torch AdamW (same hyper-parameters, own grad clipping), so the trunk's grad-norm
clipping never sees them (needed for detach to leave the trunk bitwise unchanged); their gradients are summed over
DP here. OCC's lambda is computed per micro-batch, so DP=N equals DP=1 when the shard boundaries fall on
micro-batch boundaries (otherwise the micro-batches, and so the lambdas, differ, as with another micro-batch size).

Online EAGLE-3 draft (``policy.draft.enabled`` and ``policy.draft.online``; docs/speculative.md): the training
forward runs under the draft's capture hooks and the head trains on the detached activations after the policy's
backward, with its own optimizer (``speculative/online.py``; gradients summed over DP); ``export_draft_weights`` /
``save_draft`` hand it to the generation worker.

``train`` makes exactly one optimizer step over all rows it is given: the controller
(:class:`~nemo_rl_spec.models.policy.lm_policy.Policy`) splits a GRPO step into mini-batches of
``policy.train_global_batch_size`` rows and calls it once per mini-batch. The learning rate follows
``megatron_cfg.scheduler`` (megatron-core's ``OptimizerParamScheduler``: linear warmup, constant / linear / cosine
decay to ``optimizer.min_lr``; constant ``optimizer.lr`` without the section), stepped once per optimizer step, the
MTP block's AdamW at the same lr, saved and restored with checkpoints.

Precision (``precision``; docs/precision.md): float32, or bfloat16 with Megatron's own mixed precision on CPU as on
GPU (``Float16OptimizerWithFloat16Params`` / the distributed optimizer: bf16 parameters, fp32 ``main_grad`` in the DDP
buffer, fp32 master weights and Adam state; log-probs, losses and the KL in fp32 from ``logits.float()``). The MTP
block's AdamW keeps its own fp32 masters (:mod:`~.mixed_precision`); the online EAGLE-3 head trains in fp32 on
activations cast up. Checkpoints hold the masters, so a resume is exact; exports cast once to the dtype asked.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
from typing import Callable

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel  # noqa: E402  (after cpu_compat via megatron_model)
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed.finalize_model_grads import finalize_model_grads  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402

from nemo_rl_spec.distributed.interfaces import TrainDatumSpec
from nemo_rl_spec.models.mtp_export import megatron_mtp_to_mimo, with_zero_qkv_bias, write_mimo_checkpoint
from nemo_rl_spec.models.policy import megatron_model as mm
from nemo_rl_spec.models.policy import mtp_loss as ml
from nemo_rl_spec.models.policy.cpu_compat import apply_cpu_compat, cuda_tensor_type_names
from nemo_rl_spec.models.policy.dynamic_batching import MicroBatch, fixed_size_plan, select_rows, token_budget_plan
from nemo_rl_spec.models.policy.interfaces import PolicyInterface
from nemo_rl_spec.models.policy.mixed_precision import MasterWeightAdamW
from nemo_rl_spec.models.policy.occ import MTPCoefficient, logprob_delta_lambda, occ_lambda, occ_proxies
from nemo_rl_spec.models.policy.optimizer_state import (
    load_named_adam_state,
    named_adam_state,
    uses_distributed_optimizer,
)
from nemo_rl_spec.models.policy.parallel import (
    GroupSync,
    ParallelLayout,
    all_reduce_grads,
    all_reduce_sum,
    clip_grads_,
    combine_metrics,
    reduce_metrics,
)
from nemo_rl_spec.models.policy.vocab_parallel import gather_vocab, target_logprobs
from nemo_rl_spec.speculative.online import OnlineDraft, build_draft_head
from nemo_rl_spec.utils.config_schema import MegatronConfig, PolicyConfig
from nemo_rl_spec.utils.precision import choose_precision

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
CHECKPOINT_FILE = "megatron_policy_tp{tp_rank}.pt"  # one file per TP rank, written by DP rank 0


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, input_lengths: torch.Tensor,
                   temperature: float = 1.0, tp_group=None) -> torch.Tensor:
    """Log-prob of each token given its prefix, aligned with ``input_ids``.

    ``out[b, s] = log_softmax(logits[b, s-1] / temperature)[input_ids[b, s]]`` for 1 <= s < input_lengths[b],
    0 at s = 0 and on padding. (``log_softmax`` then gather, the very ops of the usual reference; the
    cheaper ``gather - logsumexp`` differs from it by ~2e-5 at SmolLM2's logit scale.) With ``tp_group`` the
    logits are this rank's vocabulary shard and the softmax runs over all shards (:func:`target_logprobs`).

    Shape: logits [B, S, V] (or [B, S, V/T]), input_ids [B, S], input_lengths [B] -> [B, S] float32.
    """
    next_token = target_logprobs(logits[:, :-1], input_ids[:, 1:], temperature, tp_group)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    valid = positions[1:].unsqueeze(0) < input_lengths.unsqueeze(1)
    return torch.nn.functional.pad(torch.where(valid, next_token, 0.0), (1, 0))


def _cast_state(state: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """``state`` with every tensor in ``dtype`` (``float32`` | ``bfloat16``); tensors already in it are kept."""
    target = mm.PRECISIONS[dtype]
    return {k: v.to(target) for k, v in state.items()}


def _draft_loss_mask(data: TrainDatumSpec) -> torch.Tensor:
    """Tokens the online draft learns to predict: response tokens of valid samples. Shape: [B, S] bool."""
    return (data["token_mask"] * data["sample_mask"].unsqueeze(1)).bool()


def _check_supported_layout(mcfg: MegatronConfig) -> None:
    """Raise ValueError for pipeline parallelism (module docstring gives the reason)."""
    if mcfg.pipeline_model_parallel_size != 1:
        raise ValueError(
            f"policy.megatron_cfg.pipeline_model_parallel_size={mcfg.pipeline_model_parallel_size}: pipeline "
            "parallelism is not supported by this worker (its forward runs the trunk, the MTP block on detached trunk "
            "tensors, OCC's backward calls and the draft capture hooks in one process; PP would need megatron's "
            "pipeline schedules with p2p stages). Use tensor_model_parallel_size and data parallelism instead")


class MegatronPolicyWorker(PolicyInterface):
    """megatron-core GPTModel policy (Llama / Qwen3 HF checkpoints), see module docstring.

    Args:
        cfg: the ``policy`` section.
        loss_fn: the micro-batch loss (:class:`~nemo_rl_spec.algorithms.loss.interfaces.LossFunction` contract).
        model_path: local HF checkpoint directory.
        seed: the same on every rank (weights are initialised identically on all ranks).
        init_reference_model: keep a frozen copy of the initial weights (on CPU) for
            :meth:`get_reference_policy_logprobs` (the KL term, ``loss_fn.reference_policy_kl_penalty > 0``).
    Raises:
        ValueError: unsupported precision, pipeline parallelism, a TP size the model cannot be split by, or a
            TP x PP that does not divide the number of workers (each names its config key).
    """

    def __init__(self, cfg: PolicyConfig, loss_fn: LossFn, model_path: str, seed: int,
                 init_reference_model: bool = False):
        mcfg = cfg.megatron_cfg
        torch.set_num_threads(mcfg.num_threads)
        apply_cpu_compat()
        self.cfg, self.loss_fn, self.model_path = cfg, loss_fn, model_path
        self.dtype = self._param_dtype(cfg.precision)
        self.train_temperature = float(cfg.generation.temperature)
        self._seed_everything(seed)
        self.spec = mm.model_spec_from_hf_config(mm.load_hf_config(model_path))
        _check_supported_layout(mcfg)
        mm.initialize_distributed(mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size)
        self.layout = ParallelLayout.from_parallel_state()
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")  # batches arrive as CPU tensors; each micro-batch moves here, results go back
        self.dp_group, self.tp_group = parallel_state.get_data_parallel_group(), mm.tp_group()
        self.mtp_num_layers = mcfg.mtp_num_layers
        module = mm.build_gpt_model(self.spec, self.dtype, seed, self.mtp_num_layers, mcfg.activation_checkpointing)
        mm.import_hf_weights(module, model_path, self.spec)
        # NeMo-RL's reference policy: the initial weights (this rank's TP slice), kept on CPU and swapped in to score
        self.reference_state = ({k: v.detach().to("cpu", copy=True) for k, v in mm.megatron_param_state(module).items()}
                                if init_reference_model else None)
        self.mtp_params = [p for n, p in module.named_parameters() if n.startswith(mm.MTP_PREFIX)]
        for p in self.mtp_params:  # keep them out of DDP's buffer and Megatron's optimizer (own AdamW below)
            p.requires_grad_(False)
        self.model = self._wrap_ddp(module)
        with cuda_tensor_type_names():  # the distributed optimizer type-checks 'torch.cuda.*Tensor' (cpu_compat)
            self.optimizer = get_megatron_optimizer(self._optimizer_config(), [self.model])
        apply_cpu_compat()  # patch megatron modules imported lazily by DDP / optimizer construction
        self.scheduler = self._scheduler()
        self.mtp_optimizer = self._mtp_optimizer() if self.mtp_params else None
        self.mtp_coef = MTPCoefficient(mcfg.mtp_loss_mode, mcfg.mtp_loss_scaling_factor, mcfg.mtp_occ_eps,
                                       mcfg.mtp_occ_lambda_max)
        self.mtp_occ_reference = mcfg.mtp_occ_reference
        self.mtp_occ_proxy = mcfg.mtp_occ_proxy
        self.draft = self._online_draft(seed)
        self.step = 0
        self.weight_version = 0

    # ---- construction helpers -------------------------------------------------------------------
    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    @staticmethod
    def _param_dtype(precision: str) -> torch.dtype:
        """The parameters' dtype for ``policy.precision`` (``auto`` resolved here when the config did not:
        :func:`~nemo_rl_spec.utils.precision.choose_precision`). bfloat16 runs Megatron's mixed precision on CPU as
        on GPU: bf16 parameters, fp32 ``main_grad`` and fp32 master weights / Adam state (the optimizer's CUDA
        type checks pass through :func:`~.cpu_compat.cuda_tensor_type_names`).

        Raises:
            ValueError: unknown precision.
        """
        if precision == "auto":
            precision, _ = choose_precision(precision, torch.cuda.is_available())
        if precision not in mm.PRECISIONS:
            raise ValueError(f"policy.precision={precision!r}; expected one of {sorted(mm.PRECISIONS)}")
        return mm.PRECISIONS[precision]

    @property
    def _distributed_optimizer(self) -> bool:
        return self.cfg.megatron_cfg.optimizer.use_distributed_optimizer

    def _wrap_ddp(self, module: torch.nn.Module) -> DistributedDataParallel:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, average_in_collective=False,
            use_distributed_optimizer=self._distributed_optimizer,
        )
        return DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)

    def _optimizer_config(self) -> OptimizerConfig:
        opt = self.cfg.megatron_cfg.optimizer
        return OptimizerConfig(
            optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay, adam_beta1=opt.adam_beta1,
            adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps, clip_grad=opt.clip_grad,
            bf16=self.dtype == torch.bfloat16, fp16=self.dtype == torch.float16, params_dtype=self.dtype,
            use_distributed_optimizer=self._distributed_optimizer,
        )

    def _scheduler(self) -> OptimizerParamScheduler:
        """megatron-core's lr / weight-decay scheduler from ``megatron_cfg.scheduler`` (formula in
        :class:`~nemo_rl_spec.utils.config_schema.SchedulerConfig`); without the section a constant ``lr``. It
        sets the lr of optimizer step 0 now; :meth:`train` advances it by one after every step."""
        opt, sched = self.cfg.megatron_cfg.optimizer, self.cfg.megatron_cfg.scheduler
        if sched is None:
            return OptimizerParamScheduler(self.optimizer, init_lr=opt.lr, max_lr=opt.lr, min_lr=opt.lr,
                                           lr_warmup_steps=0, lr_decay_steps=1, lr_decay_style="constant",
                                           start_wd=opt.weight_decay, end_wd=opt.weight_decay, wd_incr_steps=1,
                                           wd_incr_style="constant")
        decay_iters = sched.lr_decay_iters or sched.lr_warmup_iters + 1  # unused by a constant schedule
        pick = lambda value: opt.weight_decay if value is None else value  # noqa: E731
        return OptimizerParamScheduler(
            self.optimizer, init_lr=sched.lr_warmup_init, max_lr=opt.lr, min_lr=opt.min_lr,
            lr_warmup_steps=sched.lr_warmup_iters, lr_decay_steps=decay_iters, lr_decay_style=sched.lr_decay_style,
            start_wd=pick(sched.start_weight_decay), end_wd=pick(sched.end_weight_decay), wd_incr_steps=decay_iters,
            wd_incr_style=sched.weight_decay_incr_style)

    def _current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _mtp_optimizer(self) -> MasterWeightAdamW:
        """AdamW for the MTP block, on fp32 master weights when the model is bf16 (:mod:`~.mixed_precision`)."""
        for p in self.mtp_params:
            p.requires_grad_(True)
        opt = self.cfg.megatron_cfg.optimizer
        return MasterWeightAdamW(self.mtp_params, lr=self._current_lr(), betas=(opt.adam_beta1, opt.adam_beta2),
                                 eps=opt.adam_eps, weight_decay=opt.weight_decay)

    def _online_draft(self, seed: int) -> OnlineDraft | None:
        """The EAGLE-3 head trained online (``policy.draft.enabled`` and ``online``), else None."""
        dcfg = self.cfg.draft
        if dcfg is None or not (dcfg.enabled and dcfg.online):
            return None
        # the schema requires speculative_config (method eagle3, num_speculative_tokens) with an online draft
        ttt = dcfg.ttt_steps or self.cfg.generation.speculative_config.num_speculative_tokens
        head = build_draft_head(dcfg, mm.load_hf_config(self.model_path), self._full_embedding(),
                                self._full_output_weight(), seed).to(self.device)
        return OnlineDraft(head, dcfg, int(ttt), self.train_temperature, sync=GroupSync(self.dp_group))

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped GPTModel."""
        return self.model.module

    def _full_embedding(self) -> torch.Tensor:
        """The full [V, H] input embedding (gathered over TP: a collective)."""
        name = "embedding.word_embeddings.weight"
        return mm.full_param_state(self.module, lambda n: n == name)[name]

    def _full_output_weight(self) -> torch.Tensor:
        """The full [V, H] output weight (the embedding when tied)."""
        if self.spec.tie_word_embeddings:
            return self._full_embedding()
        return mm.full_param_state(self.module, lambda n: n == "output_layer.weight")["output_layer.weight"]

    def get_model_config(self) -> dict:
        """Architecture facts the driver may need (vocab_size, num_layers, ...), as a plain dict."""
        return dict(vars(self.spec))

    def parallel_layout(self) -> dict[str, int]:
        """This rank's coordinates: ``rank, world_size, dp_rank, dp_size, tp_rank, tp_size, pp_rank, pp_size``, and
        ``distributed_optimizer`` (1 when the Adam state is sharded over DP)."""
        return {**vars(self.layout), "distributed_optimizer": int(uses_distributed_optimizer(self.optimizer))}

    # ---- log-probs -------------------------------------------------------------------------------
    def _forward_logprobs(self, mb: TrainDatumSpec, temperature: float) -> torch.Tensor:
        logits = mm.gpt_logits(self.model, mb["input_ids"])
        return token_logprobs(logits, mb["input_ids"], mb["input_lengths"], temperature, self.tp_group)

    def micro_batch_plan(self, data: TrainDatumSpec, phase: str) -> list[MicroBatch]:
        """The micro-batches of ``phase`` ("train" or "logprob") for this rank's ``data``: fixed row chunks of
        ``train_micro_batch_size`` / ``logprob_batch_size``, or with ``policy.dynamic_batching.enabled`` length-sorted
        micro-batches of ``train_mb_tokens`` / ``logprob_mb_tokens`` (:mod:`~.dynamic_batching`)."""
        dyn, lengths = self.cfg.dynamic_batching, data["input_lengths"]
        if dyn is not None and dyn.enabled:
            budget = dyn.train_mb_tokens if phase == "train" else dyn.logprob_mb_tokens
            return token_budget_plan(lengths, budget, dyn.sequence_length_round, int(data["input_ids"].shape[1]))
        return fixed_size_plan(lengths, self.cfg.train_micro_batch_size if phase == "train" else
                               self.cfg.logprob_batch_size)

    def _micro_batches(self, data: TrainDatumSpec, phase: str):
        """Yield (row indices, rows trimmed to the micro-batch's padded length, on the worker's device) per entry of
        :meth:`micro_batch_plan`."""
        for plan_mb in self.micro_batch_plan(data, phase):
            mb = select_rows(data, plan_mb)
            yield plan_mb.rows, {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}

    @torch.no_grad()
    def get_logprobs(self, data: TrainDatumSpec, temperature: float = 1.0) -> torch.Tensor:
        """See :meth:`PolicyInterface.get_logprobs`; batched by ``policy.logprob_batch_size`` (or by
        ``policy.dynamic_batching.logprob_mb_tokens``; rows come back in their order). Under DP, ``data`` is this
        rank's shard; TP peers compute the same rows together.

        Shape: input_ids [B, S] -> [B, S] float32 (0 at position 0 and on padding).
        """
        self.model.eval()
        out = torch.zeros(data["input_ids"].shape, dtype=torch.float32)
        for rows, mb in self._micro_batches(data, "logprob"):
            lp = self._forward_logprobs(mb, temperature)
            out[rows, : lp.shape[1]] = lp.cpu()
        return out

    @contextlib.contextmanager
    def _reference_weights(self):
        """Swap the frozen reference weights into the model for the body of the ``with``, then put the current
        weights back (bitwise: both are copied in place, so DDP buffers and the optimizer keep their tensors)."""
        current = {k: v.detach().clone() for k, v in mm.megatron_param_state(self.module).items()}
        mm.load_megatron_state(self.module, self.reference_state)
        try:
            yield
        finally:
            mm.load_megatron_state(self.module, current)

    @torch.no_grad()
    def get_reference_policy_logprobs(self, data: TrainDatumSpec, temperature: float = 1.0) -> torch.Tensor:
        """Per-token log-probs under the frozen reference policy (the weights the worker started from), for the KL
        penalty of the loss (k3 estimator, Schulman 2020; NeMo-RL's reference policy swapped in beside the policy).

        Shape: input_ids [B, S] -> [B, S] float32, as :meth:`get_logprobs`.
        Raises:
            RuntimeError: the worker was built without ``init_reference_model``.
        """
        if self.reference_state is None:
            raise RuntimeError("get_reference_policy_logprobs: the worker keeps no reference model (it is built with "
                               "init_reference_model=True when loss_fn.reference_policy_kl_penalty > 0)")
        with self._reference_weights():
            return self.get_logprobs(data, temperature)

    # ---- training --------------------------------------------------------------------------------
    def _global_counts(self, data: TrainDatumSpec) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(valid response tokens, valid sequences, per-MTP-head valid targets) over the GLOBAL batch: this shard's
        ``sum(token_mask * sample_mask)``, ``sum(sample_mask)`` and MTP masks, summed over the DP group."""
        sample_mask = data["sample_mask"].float()
        local = [(data["token_mask"].float() * sample_mask.unsqueeze(1)).sum(), sample_mask.sum()]
        local += [ml.mtp_valid_mask(data, k).sum() for k in range(self.mtp_num_layers)]
        total = all_reduce_sum(torch.stack(local), self.dp_group).to(self.device)
        return total[0], total[1], list(total[2:])

    def train(self, data: TrainDatumSpec) -> dict[str, float]:
        """One optimizer step over all rows of ``data`` (this rank's DP shard; micro-batches of
        ``train_micro_batch_size`` rows, or of ``policy.dynamic_batching.train_mb_tokens`` tokens, each rank binning
        its own shard); a collective over the whole worker group.

        Each micro-batch loss is already normalised by the global counts, so ``loss`` is the SUM of the
        micro-batch losses (over DP ranks too); loss metrics are combined by the loss contract (sum, ``*_max`` by
        max) over micro-batches and DP ranks, ``num_micro_batches`` is the total over DP ranks. Also returns
        ``grad_norm`` (before clipping), ``lr`` and ``update_successful``. With MTP, also the ``mtp/*`` metrics of
        :meth:`_mtp_step`; with an online draft the ``draft_*`` metrics. The same dict on every rank.
        """
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.mtp_optimizer is not None:
            self.mtp_optimizer.zero_grad(set_to_none=True)
        global_toks, global_seqs, global_mtp = self._global_counts(data)
        if self.draft is not None:
            self.draft.begin(self._full_embedding(), _draft_loss_mask(data))
        losses, per_mb_metrics, mtp_stats = [], [], []
        for _, mb in self._micro_batches(data, "train"):
            if self.mtp_num_layers:
                loss, metrics, stats = self._mtp_micro_batch(mb, global_toks, global_seqs, global_mtp)
                mtp_stats.append(stats)
            else:
                loss, metrics = self._rl_micro_batch(mb, global_toks, global_seqs)
            losses.append(float(loss.detach()))
            per_mb_metrics.append(metrics)
        finalize_model_grads([self.model])  # DP all-reduce (DDP), then TP sums of q/k-norm grads (per-head shards)
        update_ok, grad_norm, _ = self.optimizer.step()
        mtp_metrics = self._mtp_step(mtp_stats) if self.mtp_num_layers else {}
        draft_metrics = self.draft.finish() if self.draft is not None else {}
        lr = self._current_lr()  # the lr this step used
        self._advance_scheduler()
        self.step += 1
        local = {**(combine_metrics(per_mb_metrics) if per_mb_metrics else {}), "loss": sum(losses),
                 "num_micro_batches": float(len(losses))}
        return {**reduce_metrics(local, self.dp_group), **mtp_metrics, **draft_metrics,
                "grad_norm": float("nan") if grad_norm is None else float(grad_norm),
                "lr": lr, "update_successful": float(update_ok)}

    def _advance_scheduler(self, steps: int = 1) -> None:
        """Move the lr schedule ``steps`` optimizer steps on; the MTP AdamW follows the trunk's lr."""
        self.scheduler.step(increment=steps)
        if self.mtp_optimizer is not None:
            for group in self.mtp_optimizer.param_groups:
                group["lr"] = self._current_lr()

    def _rl_micro_batch(self, mb: TrainDatumSpec, global_toks, global_seqs):
        """Forward + backward of the RL loss on one micro-batch; with an online draft, the forward runs under the
        draft's capture hooks and, after the policy's backward, the draft trains on the detached activations."""
        capture = self.draft.capture(self.model) if self.draft is not None else contextlib.nullcontext()
        with capture as cap:
            logits = mm.gpt_logits(self.model, mb["input_ids"])
        curr_logprobs = token_logprobs(logits, mb["input_ids"], mb["input_lengths"], self.train_temperature,
                                       self.tp_group)
        loss, metrics = self.loss_fn(curr_logprobs, mb, global_toks, global_seqs)
        self.optimizer.scale_loss(loss).backward()  # x1 in fp32/bf16; the loss scale in fp16
        if self.draft is not None:
            self.draft.accumulate(cap, mb["input_ids"], _draft_loss_mask(mb), gather_vocab(logits, self.tp_group))
        return loss, metrics

    # ---- MTP co-training (docs/occ.md) -------------------------------------------------------------
    def _mtp_micro_batch(self, mb: TrainDatumSpec, global_toks, global_seqs, global_mtp):
        """Forward + backward of one micro-batch with the MTP block; returns (RL loss, its metrics, MTP stats).

        The MTP branch reads *detached copies* of the trunk tensors it shares with the main head: the trunk
        output h, the embeddings of the shifted tokens and the output weight W. Three autograd calls:
          1. ``L_MTP.backward()``: MTP parameters get their full gradient; the copies hold dL_MTP/dh, dL_MTP/dE,
             dL_MTP/dW.
          2. ``L_RL.backward()``; a hook on h sees g_RL = dL_RL/dh, computes c_hat / v2_hat over the
             micro-batch's non-padding positions, lambda from :class:`MTPCoefficient`, and passes
             ``g_RL + lambda * dL_MTP/dh`` into the trunk (g_RL unchanged when lambda = 0).
          3. if lambda != 0: lambda * dL_MTP/dE and lambda * dL_MTP/dW into the embedding table / output weight.
        The trunk backward runs once; with lambda = 0 (detach) the trunk sees exactly the no-MTP gradients.
        With ``mtp_occ_proxy: logprob_delta`` the heads' lambda_k come from the forward's log-probs before step 1
        (:meth:`_logprob_delta_lambdas`; lambda = sum_k lambda_k, or, when they differ, the copies' trunk-bound
        gradients are those of sum_k lambda_k L_k from one extra MTP-block backward); the hook only applies it and
        still reports c_hat / v2_hat.
        MTP loss per head: CE for detach / ce; the clipped PG loss (``loss_fn`` on the MTP log-probs, MTP mask,
        same advantages and ``prev_logprobs``) for policy / occ; heads averaged. Under TP, h and its gradients are
        full (replicated) on every TP rank, W and dL/dW are this rank's vocabulary rows.
        """
        mod, ids, temp = self.module, mb["input_ids"], self.train_temperature
        trunk = mm.gpt_trunk_forward(mod, ids)
        h = trunk.hidden
        h_copy = h.detach().requires_grad_(True)
        weight = mm.output_weight(mod)
        w_copy = weight.detach().requires_grad_(True)
        emb_pairs = []

        def embed_copy(input_ids, position_ids):
            out = mod.embedding(input_ids=input_ids, position_ids=position_ids)
            emb_pairs.append((out, out.detach().requires_grad_(True)))
            return emb_pairs[-1][1]

        main_logits = mm.output_logits(mod, h)
        curr = token_logprobs(main_logits, ids, mb["input_lengths"], temp, self.tp_group)
        rl_loss, metrics = self.loss_fn(curr, mb, global_toks, global_seqs)
        mtp_loss, stats = self._mtp_losses(mb, trunk, h_copy, w_copy, embed_copy, main_logits, global_seqs, global_mtp)
        head_lams = self._logprob_delta_lambdas(curr, mb, stats["heads"])
        stats.update(c_hat=0.0, v2_hat=0.0, lam=0.0 if head_lams is None else sum(head_lams))  # hook may overwrite
        copies = [h_copy, w_copy, *(c for _, c in emb_pairs)]
        # MTP-loss gradients of the copies meant for the trunk: per-head weighted when the heads' lambdas differ
        per_head = self._per_head_trunk_grads(stats["heads"], head_lams, copies)
        self.optimizer.scale_loss(mtp_loss).backward()  # 1. MTP params + the detached copies
        trunk_grads = [c.grad for c in copies] if per_head is None else per_head
        coef = lambda: stats["lam"] if per_head is None else 1.0  # noqa: E731  (per_head is already weighted)
        if self.mtp_occ_reference:
            stats.update(self._occ_reference(rl_loss, [h, weight, *(o for o, _ in emb_pairs)],
                                             [c.grad for c in copies]))

        valid = (torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) < mb["input_lengths"].unsqueeze(1)).float()
        valid = (valid * mb["sample_mask"].float().unsqueeze(1)).t()  # [S, B] like h
        mtp_grad_h = h_copy.grad

        def combine(rl_grad_h):
            c_hat, v2_hat = occ_proxies(rl_grad_h, mtp_grad_h, valid)
            lam_hidden = self.mtp_coef(float(c_hat), float(v2_hat))
            stats.update(c_hat=float(c_hat), v2_hat=float(v2_hat), lam_hidden_grad=lam_hidden)
            if head_lams is None:
                stats["lam"] = lam_hidden
            return None if stats["lam"] == 0.0 else rl_grad_h + coef() * trunk_grads[0]

        h.register_hook(combine)
        self.optimizer.scale_loss(rl_loss).backward()  # 2. main head + trunk (hook adds lambda * MTP part)
        if stats["lam"] != 0.0:  # 3. shared embedding table / output weight
            shared = [(o, g) for o, g in zip([weight, *(o for o, _ in emb_pairs)], trunk_grads[1:]) if g is not None]
            torch.autograd.backward([t for t, _ in shared], [coef() * g for _, g in shared])
        mask = mb["token_mask"].float() * mb["sample_mask"].float().unsqueeze(1)
        stats["delta_abs_sum"] = float(((curr.detach() - mb["prev_logprobs"]).abs() * mask).sum())
        stats["num_valid_tokens"] = float(mask.sum())
        return rl_loss, metrics, stats

    def _logprob_delta_lambdas(self, curr: torch.Tensor, mb: TrainDatumSpec, heads: list[dict]) -> list[float] | None:
        """Per-head lambda_k of the paper's proxy (``mtp_occ_proxy: logprob_delta``, :func:`logprob_delta_lambda`)
        from the main head's current log-probs ``curr`` [B, S], the heads' ``lp`` / ``valid`` [B, S] and
        ``prev_logprobs``; None for the hidden-state proxy or another mode. Pops the heads' tensors either way."""
        tensors = [(head.pop("lp"), head.pop("valid")) for head in heads]
        if self.mtp_coef.mode != "occ" or self.mtp_occ_proxy != "logprob_delta":
            return None
        coef, prev = self.mtp_coef, mb["prev_logprobs"]
        return [logprob_delta_lambda(lp, curr.detach(), prev, valid, coef.scaling_factor, len(heads), coef.eps,
                                     coef.lambda_max) for lp, valid in tensors]

    def _per_head_trunk_grads(self, heads: list[dict], head_lams: list[float] | None,
                              copies: list[torch.Tensor]) -> list[torch.Tensor | None] | None:
        """``d(sum_k lambda_k * L_k) / d copies`` (L_k head k's loss, un-averaged) when the heads' lambdas differ, else
        None (then ``sum_k lambda_k`` times the head-averaged gradient is the same thing). One extra backward through
        the MTP block; pops the heads' loss tensors."""
        losses = [head.pop("loss_t") for head in heads]
        if head_lams is None or all(lam == head_lams[0] for lam in head_lams):
            return None
        weighted = self.optimizer.scale_loss(sum(lam * loss for lam, loss in zip(head_lams, losses)))
        return list(torch.autograd.grad(weighted, copies, retain_graph=True, allow_unused=True))

    def _occ_reference(self, rl_loss: torch.Tensor, shared_outputs: list[torch.Tensor],
                       mtp_grads: list[torch.Tensor | None]) -> dict[str, float]:
        """The quantities the OCC proxies estimate, from full parameter gradients (``mtp_occ_reference``).

        ``g_RL = dL_RL/dtheta`` and ``g_MTP = dL_MTP/dtheta`` over every shared (non-MTP) parameter theta, the MTP
        one rebuilt by back-propagating the detached copies' gradients (``mtp_grads``, same order as
        ``shared_outputs``: trunk output h [S, B, H], output weight [V, H], shifted-token embeddings) into the
        trunk. Returns ``c_ref = <g_RL, g_MTP>``, ``v2_ref = ||g_MTP||^2`` (float64 sums), the same over the
        decoder layers only (``c_ref_decoder``, ``v2_ref_decoder``: the parameters the hidden-state proxies can see;
        the embedding table and output weight also take the MTP gradient directly) and ``lam_ref``, the OCC rule
        (:func:`occ_lambda`, this worker's lambda_plus / eps / clamp) applied to c_ref, v2_ref, in any mode. Under
        TP the sums of tensor-parallel slices are added over the TP group (replicated parameters count once; the
        per-head partial gradients of the q/k norms are summed over TP first, as ``finalize_model_grads`` does).
        ``torch.autograd.grad`` returns the gradients without accumulating them, so training is unchanged
        (bitwise); the cost is two extra trunk backwards per micro-batch.
        """
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad and not n.startswith(mm.MTP_PREFIX)]
        shared = [p for _, p in named]
        pairs = [(o, g) for o, g in zip(shared_outputs, mtp_grads) if g is not None]
        g_mtp = torch.autograd.grad([o for o, _ in pairs], shared, [g for _, g in pairs], retain_graph=True,
                                    allow_unused=True)
        g_rl = torch.autograd.grad(rl_loss, shared, retain_graph=True, allow_unused=True)
        sums = torch.zeros(2, 4, dtype=torch.float64)  # [replicated, tensor-parallel] x [c, v2, c_dec, v2_dec]
        for (name, param), gr, gm in zip(named, g_rl, g_mtp):
            if gm is None:
                continue
            if mm.tp_partial_grad(name, self.module.config):  # per-head shards of a replicated weight: sum them first
                gr, gm = (None if gr is None else all_reduce_sum(gr, self.tp_group)), all_reduce_sum(gm, self.tp_group)
            row = sums[int(bool(getattr(param, "tensor_model_parallel", False)))]
            dot = 0.0 if gr is None else float((gr.double() * gm.double()).sum())
            sq = float(gm.double().pow(2).sum())
            row[:2] += torch.tensor([dot, sq], dtype=torch.float64)
            if name.startswith(mm.DECODER_PREFIX):
                row[2:] += torch.tensor([dot, sq], dtype=torch.float64)
        c, v2, c_dec, v2_dec = (sums[0] + all_reduce_sum(sums[1], self.tp_group)).tolist()
        coef = self.mtp_coef
        return {"c_ref": c, "v2_ref": v2, "c_ref_decoder": c_dec, "v2_ref_decoder": v2_dec,
                "lam_ref": occ_lambda(c, v2, coef.scaling_factor, coef.eps, coef.lambda_max)}

    def _mtp_losses(self, mb, trunk, h_copy, w_copy, embed_copy, main_logits, global_seqs, global_mtp):
        """MTP loss of the mode (heads averaged) and per-head stats (loss, CE, acceptance counts)."""
        mod, ids, k_heads = self.module, mb["input_ids"], self.mtp_num_layers
        hidden = mm.mtp_hidden_states(mod, ids, trunk, h_copy, embed_copy)
        total, stats = 0.0, {"heads": []}
        for k, hk in enumerate(hidden):
            logits = mm.output_logits(mod, hk, weight=w_copy)
            lp = ml.mtp_token_logprobs(logits, ids, k, self.train_temperature, self.tp_group)
            valid = ml.mtp_valid_mask(mb, k)
            ce = ml.mtp_ce_loss(lp, valid, global_mtp[k])
            if self.mtp_coef.mode in ("policy", "occ"):
                head_loss, _ = self.loss_fn(lp, {**mb, "token_mask": valid}, global_mtp[k], global_seqs)
            else:
                head_loss = ce
            total = total + head_loss / k_heads
            agree, count = ml.mtp_acceptance_counts(logits.detach(), main_logits.detach(), valid, k, self.tp_group)
            stats["heads"].append({"loss": float(head_loss.detach()), "ce": float(ce.detach()), "agree": agree,
                                   "count": count, "loss_t": head_loss, "lp": lp.detach(), "valid": valid})
        return total, stats

    _REFERENCE_KEYS = ("c_ref", "v2_ref", "c_ref_decoder", "v2_ref_decoder")

    def _mtp_sums(self, mtp_stats: list[dict]) -> dict[str, float]:
        """This rank's sums over its micro-batches of everything the ``mtp/*`` metrics are built from (a fixed key
        set, also for a rank without rows, so the sums can be all-reduced over DP)."""
        sums = {"lam_toks": sum(s["lam"] * s["num_valid_tokens"] for s in mtp_stats),
                "toks": sum(s["num_valid_tokens"] for s in mtp_stats),
                "c_hat": sum(s["c_hat"] for s in mtp_stats), "v2_hat": sum(s["v2_hat"] for s in mtp_stats),
                "delta_abs_sum": sum(s["delta_abs_sum"] for s in mtp_stats)}
        if self.mtp_occ_proxy == "logprob_delta":  # the hidden-state rule on the same micro-batches, not applied
            sums["lam_hidden_grad_toks"] = sum(s["lam_hidden_grad"] * s["num_valid_tokens"] for s in mtp_stats)
        if self.mtp_occ_reference:
            sums.update({k: sum(s[k] for s in mtp_stats) for k in self._REFERENCE_KEYS})
            sums["lam_ref_toks"] = sum(s["lam_ref"] * s["num_valid_tokens"] for s in mtp_stats)
        for k in range(self.mtp_num_layers):
            for field in ("loss", "ce", "agree", "count"):
                sums[f"{field}_{k}"] = sum(s["heads"][k][field] for s in mtp_stats)
        return sums

    def _mtp_step(self, mtp_stats: list[dict]) -> dict[str, float]:
        """Sum the MTP gradients over DP, clip (TP-aware norm) and apply the MTP AdamW step; combine the
        micro-batch stats of all DP ranks into ``mtp/*`` metrics.

        ``mtp/lambda`` is the valid-token-weighted mean of the micro-batch coefficients (one per micro-batch; with
        ``mtp_occ_proxy: logprob_delta`` the sum over heads of lambda_k, and ``mtp/lambda_hidden_grad`` the
        hidden-state rule on the same micro-batches, for comparison, not applied);
        ``mtp/c_hat`` and ``mtp/v2_hat`` (and the reference ``mtp/c_ref``, ``mtp/v2_ref``, ``mtp/c_ref_decoder``,
        ``mtp/v2_ref_decoder``) are sums over micro-batches, ``mtp/lambda_ref`` is weighted like ``mtp/lambda``;
        ``mtp/loss_<k>`` and ``mtp/ce_<k>`` are sums of globally normalised micro-batch values; ``mtp/acceptance_<k>``
        = agreeing / valid targets, ``mtp/acceptance`` over all heads; ``mtp/delta_abs_mean``; ``mtp/grad_norm``.
        """
        local = self._mtp_sums(mtp_stats)
        total = dict(zip(local, all_reduce_sum(torch.tensor(list(local.values()), dtype=torch.float64),
                                               self.dp_group).tolist()))
        masters = self.mtp_optimizer.stage_grads()  # fp32 gradients (main_grad of bf16 parameters)
        all_reduce_grads(masters, self.dp_group)
        mtp_grad_norm = clip_grads_(masters, self.cfg.megatron_cfg.optimizer.clip_grad, self.tp_group)
        self.mtp_optimizer.step()
        toks = max(total["toks"], 1.0)
        out = {"mtp/lambda": total["lam_toks"] / toks, "mtp/c_hat": total["c_hat"], "mtp/v2_hat": total["v2_hat"],
               "mtp/grad_norm": float(mtp_grad_norm), "mtp/delta_abs_mean": total["delta_abs_sum"] / toks}
        if self.mtp_occ_proxy == "logprob_delta":
            out["mtp/lambda_hidden_grad"] = total["lam_hidden_grad_toks"] / toks
        if self.mtp_occ_reference:
            out.update({f"mtp/{k}": total[k] for k in self._REFERENCE_KEYS})
            out["mtp/lambda_ref"] = total["lam_ref_toks"] / toks
        agree_all = count_all = 0.0
        for k in range(self.mtp_num_layers):
            agree, count = total[f"agree_{k}"], total[f"count_{k}"]
            out[f"mtp/loss_{k}"], out[f"mtp/ce_{k}"] = total[f"loss_{k}"], total[f"ce_{k}"]
            out[f"mtp/acceptance_{k}"] = agree / count if count else float("nan")
            agree_all, count_all = agree_all + agree, count_all + count
        out["mtp/acceptance"] = agree_all / count_all if count_all else float("nan")
        return out

    # ---- weights and checkpoints ------------------------------------------------------------------
    @property
    def _is_rank_zero(self) -> bool:
        return self.layout.rank == 0

    def export_hf_weights(self, version: int | None = None, dtype: str | None = None) -> dict[str, torch.Tensor]:
        """HF-named CPU copies of the full current weights in ``dtype`` (``float32`` | ``bfloat16``, cast once here,
        the sender; None: the parameters' dtype), always with ``lm_head.weight``. ``version``: the
        weight version the caller will load them as (recorded; an online draft exported next is paired with it).

        A collective (TP slices are all-gathered): every rank calls it; rank 0 returns the tensors, the other ranks
        an empty dict (one copy in the object store)."""
        if version is not None:
            self.weight_version = int(version)
            if self.draft is not None:
                self.draft.policy_version = int(version)
        state = mm.export_hf_state(self.module, self.spec)
        if not self._is_rank_zero:
            return {}
        return state if dtype is None else _cast_state(state, dtype)

    def export_megatron_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter (MTP block included) under its Megatron name, full size (TP slices gathered: a
        collective), CPU fp32 copies on rank 0, an empty dict on the other ranks. For checks and debugging."""
        state = {k: v.to("cpu", torch.float32).clone() for k, v in mm.full_param_state(self.module).items()}
        return state if self._is_rank_zero else {}

    def export_draft_weights(self, dtype: str | None = None) -> dict:
        """The drafter's weights for the generation worker: ``{"weights", "draft_version", "policy_version"}``
        (every rank calls it; ranks other than 0 return an empty dict).

        Online EAGLE-3 head: :meth:`OnlineDraft.export`. MTP drafter (``speculative_config.method: mtp`` with
        ``mtp_num_layers`` >= 1): the MTP block under MiMo names with zero q/k/v biases
        (:meth:`mimo_mtp_weights`), ``draft_version`` = optimizer steps taken, ``policy_version`` = the version of
        the last :meth:`export_hf_weights`. Weights in ``dtype`` (the engines'; None: fp32). Raises RuntimeError with
        neither."""
        if self.draft is not None:
            return self.draft.export(dtype) if self._is_rank_zero else {}
        if self.serves_mtp_drafter:
            weights = _cast_state(self.mimo_mtp_weights(), dtype or "float32")
            return {"weights": weights, "draft_version": self.step, "policy_version": self.weight_version} \
                if self._is_rank_zero else {}
        raise RuntimeError("export_draft_weights: no online draft (policy.draft.online is false) and no MTP drafter "
                           "(speculative_config.method=mtp with policy.megatron_cfg.mtp_num_layers >= 1)")

    @property
    def serves_mtp_drafter(self) -> bool:
        """True when vLLM drafts with this policy's MTP block (``speculative_config.method: mtp``, MTP layers > 0)."""
        spec = self.cfg.generation.speculative_config
        return spec is not None and spec.method == "mtp" and self.mtp_num_layers > 0

    def mimo_mtp_weights(self) -> dict[str, torch.Tensor]:
        """CPU fp32 copies of the full MTP block under MiMo names (``model.mtp_layers.<k>.*``, q/k/v biases added as
        zeros), the set vLLM's MiMo MTP drafter reloads (a collective under TP). Raises RuntimeError without MTP
        layers."""
        if not self.mtp_num_layers:
            raise RuntimeError("mimo_mtp_weights: policy.megatron_cfg.mtp_num_layers is 0")
        full = mm.full_param_state(self.module)
        state = {k: v.detach().to("cpu", torch.float32).clone() for k, v in full.items()}
        return with_zero_qkv_bias(megatron_mtp_to_mimo(state, self.spec))

    def save_mimo_checkpoint(self, path: str) -> str:
        """Write the current policy (trunk + MTP layers) as a ``MiMoForCausalLM`` checkpoint with the tokenizer files
        of the policy's model directory, for vLLM's ``mtp`` method; returns ``path``. Every rank calls it (the
        weights are gathered over TP); rank 0 writes.

        Raises:
            RuntimeError: no MTP layers. ValueError: a trunk the MiMo/Qwen2 layer cannot express (see
            :func:`~nemo_rl_spec.models.mtp_export.write_mimo_checkpoint`).
        """
        mtp = self.mimo_mtp_weights()
        trunk = mm.export_hf_state(self.module, self.spec)
        if self._is_rank_zero:
            with open(os.path.join(self.model_path, "config.json")) as fh:
                trunk_cfg = json.load(fh)
            write_mimo_checkpoint(trunk, trunk_cfg, mtp, path, tokenizer_dir=self.model_path)
        return path

    def save_draft(self, path: str) -> str:
        """Write the draft head in vLLM's eagle3 format to ``path`` (the engine's initial draft; rank 0 writes, the
        replicas are identical); returns path."""
        if self.draft is None:
            raise RuntimeError("save_draft: no online draft (policy.draft.online is false)")
        if self._is_rank_zero:
            self.draft.head.save_pretrained(path)
        return path

    def _checkpoint_file(self, path: str) -> str:
        return os.path.join(path, CHECKPOINT_FILE.format(tp_rank=self.layout.tp_rank))

    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> None:
        """Write this TP rank's model slice, the Adam state by parameter name (DP-unsharded:
        :func:`~.optimizer_state.named_adam_state`), the MTP optimizer, the draft, the step counter and the RNG
        states to ``path/megatron_policy_tp<r>.pt``. A collective; the DP rank 0 of each TP rank writes (the model
        is DP-replicated), so the checkpoint loads with any DP size (and either optimizer kind), but the same TP
        size.

        ``save_optimizer=False`` (``checkpointing.save_optimizer``, NeMo-RL's key): no Adam moments, no fp32 master
        weights and no MTP optimizer (``"optimizer_saved": False``); loading it restarts the optimizer (moments at
        zero, masters from the saved weights). For bf16 SmolLM2-135M: 0.27 GB instead of 1.88 GB."""
        adam = named_adam_state(self.optimizer, self.module, self.dp_group) if save_optimizer else {}
        mtp_optimizer = self.mtp_optimizer.state_dict() if self.mtp_optimizer is not None and save_optimizer else None
        if self.layout.dp_rank != 0:
            return
        state = {
            "model": {k: v.detach().clone() for k, v in mm.megatron_param_state(self.module).items()},
            "adam": adam,
            "optimizer_saved": save_optimizer,
            "mtp_optimizer": mtp_optimizer,
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "weight_version": self.weight_version,
            "draft": None if self.draft is None else self.draft.state_dict(),
            "reference": self.reference_state,
            "tp_size": self.layout.tp_size,
            "rng": {
                "torch": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "python": random.getstate(),
                "megatron_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
            },
        }
        torch.save(state, self._checkpoint_file(path))

    def _restore_scheduler(self, saved: dict | None) -> None:
        """Put the lr schedule at the saved step count (a checkpoint from before schedulers: at ``self.step``). The
        schedule's shape comes from the config the run resumes with (megatron's override mode: a resumed run may
        change the schedule); only the step count is taken from the checkpoint."""
        steps = self.step if saved is None else int(saved["num_steps"])
        self.scheduler.num_steps = 0
        self._advance_scheduler(steps)

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (parameters are copied in place; without saved optimizer state
        the optimizer restarts: Adam moments at zero, fp32 masters from the loaded weights).

        Raises:
            FileNotFoundError: no file for this TP rank (the checkpoint has another TP layout).
            ValueError: the checkpoint was written with another ``policy.megatron_cfg.tensor_model_parallel_size``.
        """
        file = self._checkpoint_file(path)
        if not os.path.exists(file):
            raise FileNotFoundError(f"{file} missing: the checkpoint in {path} was not written with "
                                    f"policy.megatron_cfg.tensor_model_parallel_size={self.layout.tp_size}")
        state = torch.load(file, map_location="cpu", weights_only=False)
        if state["tp_size"] != self.layout.tp_size:
            raise ValueError(f"checkpoint {path} has TP={state['tp_size']}; resume with "
                             f"policy.megatron_cfg.tensor_model_parallel_size={state['tp_size']}")
        mm.load_megatron_state(self.module, state["model"])
        load_named_adam_state(self.optimizer, self.module, state["adam"])
        if self.mtp_optimizer is not None and state.get("mtp_optimizer") is not None:
            self.mtp_optimizer.load_state_dict(state["mtp_optimizer"])
        self.step, self.weight_version = state["step"], state["weight_version"]
        self._restore_scheduler(state.get("scheduler"))
        if self.draft is not None and state.get("draft") is not None:
            self.draft.load_state_dict(state["draft"])
        if self.reference_state is not None and state.get("reference") is not None:
            self.reference_state = state["reference"]
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["megatron_tracker"])
