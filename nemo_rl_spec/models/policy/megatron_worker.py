"""Megatron-core policy worker: log-probs and one optimizer step per ``train`` call (the training step). The MTP/OCC
co-training pass is a plug-in the step calls (:mod:`~.mtp_cotraining`); HF / drafter exports and checkpoints are
the worker's methods from :mod:`~.megatron_checkpoint`.

A plain class; :class:`~nemo_rl_spec.models.policy.lm_policy.Policy` runs N of them as a
:class:`~nemo_rl_spec.distributed.worker_group.RayWorkerGroup` (one ``torch.distributed`` world, gloo on CPU), ranks
in megatron's order (TP fastest, :class:`~.parallel.ParallelLayout`); with pipeline parallelism the steps and
log-probs run through megatron-core's pipeline schedules (:mod:`~.pipeline`; MTP, the online draft and THD packs are
refused there: :func:`_check_supported_layout`). ``train`` makes exactly one optimizer step over the rows it is given (the
controller calls it once per mini-batch of ``policy.train_global_batch_size`` rows) with Megatron's DDP and optimizer
(:mod:`~.megatron_optim`). Every micro-batch's loss is divided by GLOBAL counts summed over the DP group, so the
ranks' gradients add up to the global-batch gradient whatever the DP size or micro-batch plan (:mod:`~.dynamic_batching`).
Optional parts, each configured in ``policy``: vocab-parallel log-probs under TP (:mod:`~.vocab_parallel`),
activation checkpointing, the distributed optimizer, bf16 mixed precision with fp32 master weights
(:mod:`~.mixed_precision`), MTP co-training and the online EAGLE-3 draft (``speculative/online.py``).
"""

from __future__ import annotations

import contextlib
import random
from typing import Callable

import numpy as np
import torch
from megatron.core import parallel_state  # noqa: E402  (after cpu_compat via megatron_model)
from megatron.core.distributed.finalize_model_grads import finalize_model_grads  # noqa: E402

from nemo_rl_spec.distributed.interfaces import TrainDatumSpec
from nemo_rl_spec.models.policy import megatron_model as mm
from nemo_rl_spec.models.policy import mtp_loss as ml
from nemo_rl_spec.models.policy.cpu_compat import apply_cpu_compat
from nemo_rl_spec.models.policy.dynamic_batching import MicroBatch, fixed_size_plan, select_rows, token_budget_plan
from nemo_rl_spec.models.policy.interfaces import PolicyInterface
from nemo_rl_spec.models.policy.megatron_checkpoint import CHECKPOINT_FILE, WeightExportMixin
from nemo_rl_spec.models.policy.megatron_optim import lr_scheduler, megatron_optimizer, wrap_ddp
from nemo_rl_spec.models.policy.mixed_precision import MasterWeightAdamW
from nemo_rl_spec.models.policy.mtp_cotraining import MTPCoTraining
from nemo_rl_spec.models.policy.mtp_warm_start import ce_warm_start, reset_mtp_optimizer
from nemo_rl_spec.models.policy.optimizer_state import uses_distributed_optimizer
from nemo_rl_spec.models.policy.parallel import (
    GroupSync,
    ParallelLayout,
    all_reduce_sum,
    combine_metrics,
    reduce_metrics,
)
from nemo_rl_spec.models.policy.pipeline import broadcast_from_last_stage, run_schedule
from nemo_rl_spec.models.policy.sampling_filter import SamplingFilter
from nemo_rl_spec.models.policy.sequence_packing import (
    PackedMicroBatch,
    pack_rows,
    packed_plan,
    unpack_capture,
    unpack_logprobs,
    unpack_rows,
)
from nemo_rl_spec.models.policy.vocab_parallel import gather_vocab, token_logprobs
from nemo_rl_spec.speculative.online import OnlineDraft, build_draft_head
from nemo_rl_spec.utils.config_schema import PolicyConfig, pipeline_incompatible_keys
from nemo_rl_spec.utils.precision import choose_precision

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
__all__ = ["MegatronPolicyWorker", "token_logprobs", "CHECKPOINT_FILE"]  # the last two re-exported for callers


def _draft_loss_mask(data: TrainDatumSpec) -> torch.Tensor:
    """Tokens the online draft learns to predict: response tokens of valid samples. Shape: [B, S] bool."""
    return (data["token_mask"] * data["sample_mask"].unsqueeze(1)).bool()


def _check_supported_layout(cfg: PolicyConfig) -> None:
    """Raise ValueError for the parts that do not run under pipeline parallelism (the recipe check refuses them
    first: ``RUNTIME_REFUSALS`` in nemo_rl_spec/utils/config.py): the MTP/OCC co-training pass and the online
    EAGLE-3 head run their own forward passes beside the trunk's, and THD packs are not passed between stages."""
    refused = pipeline_incompatible_keys(cfg)
    if cfg.megatron_cfg.pipeline_model_parallel_size > 1 and refused:
        raise ValueError(
            f"policy.megatron_cfg.pipeline_model_parallel_size={cfg.megatron_cfg.pipeline_model_parallel_size} "
            f"cannot run with {', '.join(refused)} (see docs/design/megatron_worker.md, pipeline parallelism)"
        )


class MegatronPolicyWorker(WeightExportMixin, PolicyInterface):
    """megatron-core GPTModel policy (Llama / Qwen3 HF checkpoints), see module docstring.

    Data parallel: each DP rank gets a contiguous row shard of the global batch (the controller shards it; shards may
    differ in size, even be empty). The loss of every micro-batch is divided by GLOBAL counts (valid tokens, valid
    sequences, per-MTP-head targets: sums over the DP group), so the gradients of all ranks add up to the
    global-batch gradient: Megatron DDP all-reduces with SUM (``calculate_per_token_loss``, gradient scaling 1).
    ``train`` returns the same metrics on every rank (loss-type metrics combined over DP by the loss contract: sum,
    ``*_max`` by max); logits are divided by ``generation.temperature`` in ``train`` as in ``get_logprobs``.

    The learning rate follows ``megatron_cfg.scheduler`` (megatron-core's ``OptimizerParamScheduler``: linear warmup,
    constant / linear / cosine decay to ``optimizer.min_lr``; constant ``optimizer.lr`` without the section), stepped
    once per optimizer step, the MTP block's AdamW at the same lr, saved and restored with checkpoints.

    Precision (``policy.precision``): float32, or bfloat16 with Megatron's own mixed precision on CPU as on GPU (bf16
    parameters, fp32 ``main_grad`` in the DDP buffer, fp32 master weights and Adam state; log-probs, losses and the KL
    in fp32 from ``logits.float()``). The MTP block's AdamW keeps its own fp32 masters; the online EAGLE-3 head keeps
    fp32 weights and AdamW state, its forward in fp32 or under bf16 autocast (``policy.draft.precision``).

    Args:
        cfg: the ``policy`` section.
        loss_fn: the micro-batch loss (:class:`~nemo_rl_spec.algorithms.loss.interfaces.LossFunction` contract).
        model_path: local HF checkpoint directory.
        seed: the same on every rank (weights are initialised identically on all ranks).
        init_reference_model: keep a frozen copy of the initial weights (on CPU) for
            :meth:`get_reference_policy_logprobs` (the KL term, ``loss_fn.reference_policy_kl_penalty > 0``).
    Raises:
        ValueError: unsupported precision, pipeline parallelism with MTP / the online draft / sequence packing, a TP size the model cannot be split by, or a
            TP x PP that does not divide the number of workers (each names its config key).
    """

    def __init__(
        self, cfg: PolicyConfig, loss_fn: LossFn, model_path: str, seed: int, init_reference_model: bool = False
    ):
        mcfg = cfg.megatron_cfg
        torch.set_num_threads(mcfg.num_threads)
        apply_cpu_compat()
        self.cfg, self.loss_fn, self.model_path = cfg, loss_fn, model_path
        self.dtype = self._param_dtype(cfg.precision)
        self.train_temperature = float(cfg.generation.temperature)
        # the engine's top-k / top-p: the policy's current and previous log-probs are taken under it (not the
        # reference policy's, as in NeMo-RL); None when the engine samples from the full softmax
        self.sampling_filter = SamplingFilter.from_generation(cfg.generation)
        self._seed_everything(seed)
        self.spec = mm.model_spec_from_hf_config(mm.load_hf_config(model_path))
        _check_supported_layout(cfg)
        mm.initialize_distributed(mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size)
        self.layout = ParallelLayout.from_parallel_state()
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        )  # batches arrive as CPU tensors; each micro-batch moves here, results go back
        self.dp_group, self.tp_group = parallel_state.get_data_parallel_group(), mm.tp_group()
        self.mtp_num_layers = mcfg.mtp_num_layers
        module = mm.build_gpt_model(
            self.spec,
            self.dtype,
            seed,
            self.mtp_num_layers,
            mcfg.activation_checkpointing,
            mcfg.recompute_granularity,
            mcfg.recompute_modules,
            mcfg.mtp_use_repeated_layer,
        )
        mm.import_hf_weights(module, model_path, self.spec)
        # NeMo-RL's reference policy: the initial weights (this rank's TP slice), kept on CPU and swapped in to score
        self.reference_state = (
            {k: v.detach().to("cpu", copy=True) for k, v in mm.megatron_param_state(module).items()}
            if init_reference_model
            else None
        )
        mtp_params = [p for n, p in module.named_parameters() if n.startswith(mm.MTP_PREFIX)]
        for p in mtp_params:  # keep them out of DDP's buffer and Megatron's optimizer (own AdamW: MTPCoTraining)
            p.requires_grad_(False)
        self.model = wrap_ddp(module, mcfg.optimizer.use_distributed_optimizer)
        self.optimizer = megatron_optimizer(self.model, mcfg.optimizer, self.dtype)
        apply_cpu_compat()  # patch megatron modules imported lazily by DDP / optimizer construction
        self.scheduler = lr_scheduler(self.optimizer, mcfg)
        module.config.grad_scale_func = self.optimizer.scale_loss  # the pipeline schedule's backward scales by it
        # the MTP/OCC co-training pass (mtp_cotraining.py), a plug-in the training step calls; None without MTP
        self.mtp = (
            MTPCoTraining(
                mcfg,
                module,
                mtp_params,
                self._current_lr(),
                loss_fn,
                self.optimizer.scale_loss,
                self.train_temperature,
                self.tp_group,
                self.dp_group,
                self.sampling_filter,
            )
            if mtp_params
            else None
        )
        self.draft = self._online_draft(seed)
        self.refit_group = None  # the collective refit transport's group (rank 0, after init_refit_group)
        self.sent_refit: dict = {}  # rank 0: what it last broadcast with keep (a restarted engine is given it)
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

    def _current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _online_draft(self, seed: int) -> OnlineDraft | None:
        """The EAGLE-3 head trained online (``policy.draft.enabled`` and ``online``), else None."""
        dcfg = self.cfg.draft
        if dcfg is None or not (dcfg.enabled and dcfg.online):
            return None
        # the schema requires speculative_config (method eagle3, num_speculative_tokens) with an online draft
        ttt = dcfg.ttt_steps or self.cfg.generation.speculative_config.num_speculative_tokens
        head = build_draft_head(
            dcfg, mm.load_hf_config(self.model_path), self._full_embedding(), self._full_output_weight(), seed
        ).to(self.device)
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
    def _token_logprobs(
        self, mb: TrainDatumSpec, plan_mb: MicroBatch, temperature: float, sampling_filter
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(per-token log-probs [b, S] as :func:`token_logprobs`, main-head logits: [b, S, V], or the pack's
        [1, T, V] for a :class:`PackedMicroBatch`).

        A packed micro-batch runs packed (:mod:`~.sequence_packing`): the log-probs are taken on the pack's logits and
        only they are unpacked (:func:`unpack_logprobs`), so no [b, S, V] tensor is built for the policy."""
        if not isinstance(plan_mb, PackedMicroBatch):
            logits = mm.gpt_logits(self.model, mb["input_ids"])
            lp = token_logprobs(
                logits, mb["input_ids"], mb["input_lengths"], temperature, self.tp_group, sampling_filter
            )
            return lp, logits
        ids = pack_rows(mb["input_ids"], plan_mb.row_tokens)
        logits = mm.packed_gpt_logits(self.model, ids, plan_mb.row_tokens)
        lengths = torch.tensor([ids.shape[1]], device=ids.device)
        lp = token_logprobs(logits, ids, lengths, temperature, self.tp_group, sampling_filter)
        return unpack_logprobs(lp, plan_mb.row_tokens, mb["input_lengths"], int(mb["input_ids"].shape[1])), logits

    def micro_batch_plan(self, data: TrainDatumSpec, phase: str) -> list[MicroBatch]:
        """The micro-batches of ``phase`` ("train" or "logprob") for this rank's ``data``: fixed row chunks of
        ``train_micro_batch_size`` / ``logprob_batch_size``, with ``policy.dynamic_batching.enabled`` length-sorted
        micro-batches of ``train_mb_tokens`` / ``logprob_mb_tokens`` (:mod:`~.dynamic_batching`), with
        ``policy.sequence_packing.enabled`` packs of that many tokens (:mod:`~.sequence_packing`)."""
        dyn, pack, lengths = self.cfg.dynamic_batching, self.cfg.sequence_packing, data["input_lengths"]
        if pack is not None and pack.enabled:
            budget = pack.train_mb_tokens if phase == "train" else pack.logprob_mb_tokens
            width = int(data["input_ids"].shape[1])
            return packed_plan(lengths, budget, pack.sequence_length_round, width, pack.algorithm, self.step)
        if dyn is not None and dyn.enabled:
            budget = dyn.train_mb_tokens if phase == "train" else dyn.logprob_mb_tokens
            return token_budget_plan(lengths, budget, dyn.sequence_length_round, int(data["input_ids"].shape[1]))
        return fixed_size_plan(
            lengths, self.cfg.train_micro_batch_size if phase == "train" else self.cfg.logprob_batch_size
        )

    def _micro_batches(self, data: TrainDatumSpec, phase: str):
        """Yield (plan entry, its rows trimmed to the micro-batch's padded length, on the worker's device) per entry
        of :meth:`micro_batch_plan`."""
        for plan_mb in self.micro_batch_plan(data, phase):
            mb = select_rows(data, plan_mb)
            yield plan_mb, {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in mb.items()}

    @torch.no_grad()
    def get_logprobs(self, data: TrainDatumSpec, temperature: float = 1.0, filtered: bool = True) -> torch.Tensor:
        """See :meth:`PolicyInterface.get_logprobs`; batched by ``policy.logprob_batch_size`` (or by
        ``policy.dynamic_batching.logprob_mb_tokens``; rows come back in their order). Under DP, ``data`` is this
        rank's shard; TP peers compute the same rows together.

        With ``filtered`` the log-probs are under the engine's top-k / top-p filter (:attr:`sampling_filter`) when it
        samples with one.

        Shape: input_ids [B, S] -> [B, S] float32 (0 at position 0 and on padding).
        """
        return self._logprobs(data, temperature, self.sampling_filter if filtered else None)

    def _logprobs(self, data: TrainDatumSpec, temperature: float, sampling_filter) -> torch.Tensor:
        self.model.eval()
        out = torch.zeros(data["input_ids"].shape, dtype=torch.float32)
        if self.layout.pp_size > 1:
            return self._pipeline_logprobs(data, temperature, sampling_filter, out)
        for plan_mb, mb in self._micro_batches(data, "logprob"):
            lp, _ = self._token_logprobs(mb, plan_mb, temperature, sampling_filter)
            out[plan_mb.rows, : lp.shape[1]] = lp.cpu()
        return out

    def _pipeline_logprobs(self, data: TrainDatumSpec, temperature: float, sampling_filter, out) -> torch.Tensor:
        """:meth:`_logprobs` through megatron-core's forward-only pipeline schedule (:mod:`~.pipeline`): the last
        stage takes the log-probs, every stage returns them."""

        def stage_loss(logits, plan_mb, mb):
            lp = token_logprobs(
                logits, mb["input_ids"], mb["input_lengths"], temperature, self.tp_group, sampling_filter
            )
            return logits.new_zeros(()), {"rows": plan_mb.rows, "logprobs": lp.cpu()}

        for entry in run_schedule(self.model, list(self._micro_batches(data, "logprob")), stage_loss, True):
            out[entry["rows"], : entry["logprobs"].shape[1]] = entry["logprobs"]
        return broadcast_from_last_stage(out)

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
            raise RuntimeError(
                "get_reference_policy_logprobs: the worker keeps no reference model (it is built with "
                "init_reference_model=True when loss_fn.reference_policy_kl_penalty > 0)"
            )
        with self._reference_weights():
            return self._logprobs(data, temperature, None)  # unfiltered, as NeMo-RL's reference

    # ---- training --------------------------------------------------------------------------------
    def _global_counts(self, data: TrainDatumSpec) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """(valid response tokens, valid sequences, per-MTP-head valid targets) over the GLOBAL batch: this shard's
        ``sum(token_mask * sample_mask)``, ``sum(sample_mask)`` and MTP masks, summed over the DP group."""
        sample_mask = data["sample_mask"].float()
        local = [(data["token_mask"].float() * sample_mask.unsqueeze(1)).sum(), sample_mask.sum()]
        local += [ml.mtp_valid_mask(data, k).sum() for k in range(self.mtp_num_layers)]
        total = all_reduce_sum(torch.stack(local), self.dp_group).to(self.device)
        return total[0], total[1], list(total[2:])

    def train(self, data: TrainDatumSpec, train_draft: bool = True) -> dict[str, float]:
        """One optimizer step over all rows of ``data`` (this rank's DP shard; micro-batches of
        ``train_micro_batch_size`` rows, or of ``policy.dynamic_batching.train_mb_tokens`` tokens, each rank binning
        its own shard); a collective over the whole worker group.

        Each micro-batch loss is already normalised by the global counts, so ``loss`` is the SUM of the
        micro-batch losses (over DP ranks too); loss metrics are combined by the loss contract (sum, ``*_max`` by
        max) over micro-batches and DP ranks, ``num_micro_batches`` is the total over DP ranks. Also returns
        ``grad_norm`` (before clipping), ``lr`` and ``update_successful``. With MTP, also the ``mtp/*`` metrics of
        :meth:`.MTPCoTraining.step`; with an online draft and ``train_draft`` the ``draft_*`` metrics (False: the
        draft is not touched: no capture hooks, soft targets or draft step; the driver passes it from
        ``policy.draft.train_period``). The same dict on every rank (every rank gets the same ``train_draft``).
        """
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.mtp is not None:
            self.mtp.zero_grad()
        global_toks, global_seqs, global_mtp = self._global_counts(data)
        draft = self.draft if train_draft else None
        if draft is not None:
            draft.begin(self._full_embedding(), _draft_loss_mask(data))
        if self.layout.pp_size > 1:
            losses, per_mb_metrics = self._pipeline_micro_batches(data, global_toks, global_seqs)
            mtp_stats = []
        else:
            losses, per_mb_metrics, mtp_stats = self._micro_batch_loop(
                data, global_toks, global_seqs, global_mtp, draft
            )
        finalize_model_grads([self.model])  # DP all-reduce (DDP), then TP sums of q/k-norm grads (per-head shards)
        update_ok, grad_norm, _ = self.optimizer.step()
        mtp_metrics = self.mtp.step(mtp_stats) if self.mtp_num_layers else {}
        draft_metrics = draft.finish() if draft is not None else {}
        lr = self._current_lr()  # the lr this step used
        self.advance_scheduler()
        self.step += 1
        local = {
            **(combine_metrics(per_mb_metrics) if per_mb_metrics else {}),
            "loss": sum(losses),
            "num_micro_batches": float(len(losses)),
        }
        return {
            **reduce_metrics(local, self.dp_group),
            **mtp_metrics,
            **draft_metrics,
            "grad_norm": float("nan") if grad_norm is None else float(grad_norm),
            "lr": lr,
            "update_successful": float(update_ok),
        }

    def advance_scheduler(self, steps: int = 1) -> None:
        """Move the lr schedule ``steps`` optimizer steps on; the MTP AdamW follows the trunk's lr."""
        self.scheduler.step(increment=steps)
        if self.mtp is not None:
            self.mtp.set_lr(self._current_lr())

    def _micro_batch_loop(self, data: TrainDatumSpec, global_toks, global_seqs, global_mtp, draft):
        """Forward and backward of every micro-batch in turn (no pipeline): (losses, metrics, MTP stats) per
        micro-batch."""
        losses, per_mb_metrics, mtp_stats = [], [], []
        for plan_mb, mb in self._micro_batches(data, "train"):
            if self.mtp_num_layers:
                loss, metrics, stats = self.mtp.micro_batch(mb, global_toks, global_seqs, global_mtp)
                mtp_stats.append(stats)
            else:
                loss, metrics = self._rl_micro_batch(mb, plan_mb, global_toks, global_seqs, draft)
            losses.append(float(loss.detach()))
            per_mb_metrics.append(metrics)
        return losses, per_mb_metrics, mtp_stats

    def _pipeline_micro_batches(self, data: TrainDatumSpec, global_toks, global_seqs) -> tuple[list, list]:
        """Forward and backward of the RL loss over every micro-batch through megatron-core's 1F1B pipeline
        schedule (:mod:`~.pipeline`); (losses, metrics) per micro-batch, computed on the last stage and handed to
        every stage. Gradients are left for ``finalize_model_grads``."""

        def stage_loss(logits, plan_mb, mb):
            lp = token_logprobs(
                logits,
                mb["input_ids"],
                mb["input_lengths"],
                self.train_temperature,
                self.tp_group,
                self.sampling_filter,
            )
            loss, metrics = self.loss_fn(lp, mb, global_toks, global_seqs)
            return loss, {"loss": float(loss.detach()), "metrics": metrics}

        outs = run_schedule(self.model, list(self._micro_batches(data, "train")), stage_loss, False)
        outs = broadcast_from_last_stage(outs)
        return [o["loss"] for o in outs], [o["metrics"] for o in outs]

    def _rl_micro_batch(
        self, mb: TrainDatumSpec, plan_mb: MicroBatch, global_toks, global_seqs, draft: OnlineDraft | None = None
    ):
        """Forward + backward of the RL loss on one micro-batch; with ``draft`` (the online draft training in this
        step), the forward runs under the draft's capture hooks and, after the policy's backward, the draft trains on
        the detached activations."""
        capture = draft.capture(self.model) if draft is not None else contextlib.nullcontext()
        with capture as cap:
            curr_logprobs, logits = self._token_logprobs(mb, plan_mb, self.train_temperature, self.sampling_filter)
        loss, metrics = self.loss_fn(curr_logprobs, mb, global_toks, global_seqs)
        self.optimizer.scale_loss(loss).backward()  # x1 in fp32/bf16; the loss scale in fp16
        if draft is not None:
            if isinstance(plan_mb, PackedMicroBatch):  # the draft trains on rows: unpack its inputs
                seq_len = int(mb["input_ids"].shape[1])
                logits = unpack_rows(logits.detach(), plan_mb.row_tokens, seq_len)
                unpack_capture(cap, plan_mb.row_tokens, seq_len)
            draft.accumulate(cap, mb["input_ids"], _draft_loss_mask(mb), gather_vocab(logits, self.tp_group))
        return loss, metrics

    @property
    def mtp_optimizer(self) -> MasterWeightAdamW | None:
        """The MTP block's AdamW (:class:`~.mtp_cotraining.MTPCoTraining`), None without MTP layers."""
        return None if self.mtp is None else self.mtp.optimizer

    @property
    def mtp_occ_reference(self) -> bool:
        """The plug-in's ``mtp_occ_reference`` (OCC's reference c / v2; settable, for checks)."""
        return self.mtp is not None and self.mtp.occ_reference

    @mtp_occ_reference.setter
    def mtp_occ_reference(self, value: bool) -> None:
        self.mtp.occ_reference = bool(value)

    # ---- MTP warm start (mtp_warm_start.py) ---------------------------------------------------------------
    def _require_mtp(self, method: str) -> MTPCoTraining:
        if self.mtp is None:
            raise RuntimeError(f"{method}: the policy has no MTP layers (policy.megatron_cfg.mtp_num_layers=0)")
        return self.mtp

    def mtp_warm_start(
        self, train_data: TrainDatumSpec, eval_data: TrainDatumSpec, steps: int, batch_size: int, lr: float, seed: int
    ) -> dict[str, float]:
        """CE warm start of the MTP layers, trunk frozen (:func:`~.mtp_warm_start.ce_warm_start`); every rank gets
        the same whole batches (a collective over the worker group: TP peers compute together). Returns the
        ``mtp_warm_start/*`` metrics (the same on every rank).

        Shape: input_ids / token_mask [B, S], input_lengths / sample_mask [B] (each set).
        Raises:
            RuntimeError: no MTP layers. ValueError: ``train_data`` has no rows.
        """
        return ce_warm_start(self._require_mtp("mtp_warm_start"), train_data, eval_data, steps, batch_size, lr, seed)

    def mtp_state(self) -> dict[str, torch.Tensor]:
        """The MTP block's parameters by Megatron name (``mtp.layers.<k>.*``): CPU clones of this rank's TP slices.

        Raises:
            RuntimeError: no MTP layers.
        """
        self._require_mtp("mtp_state")
        return {
            n: p.detach().to("cpu", copy=True) for n, p in self.module.named_parameters() if n.startswith(mm.MTP_PREFIX)
        }

    @torch.no_grad()
    def load_mtp_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy :meth:`mtp_state` output (this rank's TP slices) into the MTP parameters, then give the MTP block a
        fresh optimizer (zero moments, fp32 masters from the loaded weights; same hyper-parameters and lr).

        Raises:
            RuntimeError: no MTP layers. ValueError: names or shapes differ from this rank's MTP parameters (nothing
            is loaded then).
        """
        mtp = self._require_mtp("load_mtp_state")
        params = {n: p for n, p in self.module.named_parameters() if n.startswith(mm.MTP_PREFIX)}
        bad = sorted(set(params) ^ set(state)) + [n for n in params if n in state and state[n].shape != params[n].shape]
        if bad:
            raise ValueError(f"load_mtp_state: names or shapes differ from this rank's MTP parameters: {bad[:8]}")
        for name, param in params.items():
            param.copy_(state[name])
        reset_mtp_optimizer(mtp)
