"""MTP co-training (``policy.megatron_cfg.mtp_num_layers`` > 0; docs/guides/occ.md): the plug-in the Megatron policy worker
(:class:`~nemo_rl_spec.models.policy.megatron_worker.MegatronPolicyWorker`) calls for every training micro-batch
(:meth:`MTPCoTraining.micro_batch`) and once per optimizer step (:meth:`MTPCoTraining.step`).

Config: ``mtp_loss_mode`` (detach | ce | policy | occ; NeMo-RL's ``mtp_detach_heads`` picks detach / ce),
``mtp_loss_scaling_factor`` (the fixed coefficient, or lambda_plus for occ), ``mtp_occ_eps``, ``mtp_occ_lambda_max``
(optional clamp) and ``mtp_occ_reference`` (the full-gradient c and v2 per optimizer step,
:class:`~.occ_reference.OCCReference`). The MTP block's parameters are kept out of Megatron's DDP buffer and
optimizer and get their own torch AdamW here (same hyper-parameters, own grad clipping, fp32 masters when the model
is bf16: :mod:`~.mixed_precision`), so the trunk's grad-norm clipping never sees them (needed for detach to leave
the trunk bitwise unchanged); their gradients are summed over DP here. OCC's lambda is computed per micro-batch, so
DP=N equals DP=1 when the shard boundaries fall on micro-batch boundaries.
"""

from __future__ import annotations

from typing import Callable

import torch

from nemo_rl_spec.distributed.interfaces import TrainDatumSpec
from nemo_rl_spec.models.policy import megatron_model as mm
from nemo_rl_spec.models.policy import mtp_loss as ml
from nemo_rl_spec.models.policy.mixed_precision import MasterWeightAdamW
from nemo_rl_spec.models.policy.occ import MTPCoefficient
from nemo_rl_spec.models.policy.occ_reference import OCCReference
from nemo_rl_spec.models.policy.parallel import all_reduce_grads, all_reduce_sum, clip_grads_
from nemo_rl_spec.models.policy.sampling_filter import SamplingFilter
from nemo_rl_spec.models.policy.vocab_parallel import token_logprobs
from nemo_rl_spec.utils.config_schema import MegatronConfig

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]


class MTPCoTraining:
    """The MTP block's training pass and optimizer, for one Megatron worker (module docstring).

    Args:
        mcfg: ``policy.megatron_cfg`` (``mtp_*`` keys; ``optimizer`` for the AdamW hyper-parameters and ``clip_grad``).
        module: the unwrapped GPTModel (trunk, main head and MTP block).
        params: the MTP block's parameters (kept out of the trunk's optimizer); made trainable here.
        lr: the learning rate of the first step (the trunk's; :meth:`set_lr` follows its schedule).
        loss_fn: the RL micro-batch loss (the heads' loss in the ``policy`` / ``occ`` modes).
        scale_loss: the trunk optimizer's ``scale_loss`` (x1 in fp32 / bf16, the loss scale in fp16).
        temperature: the sampling temperature the logits are divided by (``policy.generation.temperature``).
        tp_group, dp_group: the tensor- and data-parallel process groups.
        sampling_filter: the engine's top-k / top-p filter the main head's log-probs are taken under (None: off);
            the MTP heads' log-probs stay full-softmax.
    """

    def __init__(
        self,
        mcfg: MegatronConfig,
        module: torch.nn.Module,
        params: list[torch.nn.Parameter],
        lr: float,
        loss_fn: LossFn,
        scale_loss: Callable[[torch.Tensor], torch.Tensor],
        temperature: float,
        tp_group,
        dp_group,
        sampling_filter: SamplingFilter | None = None,
    ):
        self.sampling_filter = sampling_filter
        self.params = params
        for p in params:
            p.requires_grad_(True)
        opt = mcfg.optimizer
        self.optimizer = MasterWeightAdamW(
            params, lr=lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps, weight_decay=opt.weight_decay
        )
        self.clip_grad = opt.clip_grad
        self.num_layers = mcfg.mtp_num_layers
        self.coef = MTPCoefficient(
            mcfg.mtp_loss_mode,
            mcfg.mtp_loss_scaling_factor,
            mcfg.mtp_occ_eps,
            mcfg.mtp_occ_lambda_max,
            mcfg.mtp_occ_proxy,
        )
        self.reference = OCCReference(module, self.coef, tp_group, dp_group) if mcfg.mtp_occ_reference else None
        self.module, self.loss_fn, self.scale_loss = module, loss_fn, scale_loss
        self.train_temperature, self.tp_group, self.dp_group = temperature, tp_group, dp_group

    @property
    def occ_reference(self) -> bool:
        """Whether the full-gradient reference is computed (settable, for checks)."""
        return self.reference is not None

    @occ_reference.setter
    def occ_reference(self, value: bool) -> None:
        self.reference = OCCReference(self.module, self.coef, self.tp_group, self.dp_group) if value else None

    def zero_grad(self) -> None:
        """Drop the MTP gradients before a step."""
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        """Follow the trunk's learning-rate schedule."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def micro_batch(self, mb: TrainDatumSpec, global_toks, global_seqs, global_mtp):
        """Forward + backward of one micro-batch with the MTP block; returns (RL loss, its metrics, MTP stats).

        The MTP block reads the live trunk output h and the shared embedding / output weight. With per-head
        coefficients lambda_k (:class:`MTPCoefficient`) the loss is

            L = L_RL + sum_k L_k(lambda_k)

        where L_k is head k's CE times lambda_k (detach, ce) or head k's clipped PG loss (``loss_fn`` on the MTP
        log-probs vs ``prev_logprobs``, the head's MTP mask) with advantages A * lambda_k (policy, occ; the RL-MTP
        reference's form, equal to lambda_k * L_k(A) for lambda_k >= 0). One backward: the MTP layers, the trunk,
        the embedding and the output weight all see the same lambda_k. detach: the MTP block reads detached trunk
        output, embeddings and output weight, so ``sum_k L_k`` reaches the MTP parameters only and the trunk gets
        exactly the no-MTP gradient.
        ``mtp/lambda`` reports ``sum_k lambda_k`` (0 for detach: the trunk's coefficient).
        """
        mod, ids, temp = self.module, mb["input_ids"], self.train_temperature
        trunk = mm.gpt_trunk_forward(mod, ids)
        main_logits = mm.output_logits(mod, trunk.hidden)
        curr = token_logprobs(main_logits, ids, mb["input_lengths"], temp, self.tp_group, self.sampling_filter)
        rl_loss, metrics = self.loss_fn(curr, mb, global_toks, global_seqs)
        detach = self.coef.mode == "detach"
        heads = self._heads(mb, trunk, main_logits, global_mtp, detached=detach)
        lams = self._coefficients(curr, mb, heads)
        losses = [
            self._head_loss(mb, head, lam, global_mtp[k], global_seqs) for k, (head, lam) in enumerate(zip(heads, lams))
        ]
        if self.reference is not None:
            live = self._heads(mb, trunk, main_logits, global_mtp, detached=False) if detach else heads
            unit = [self._head_loss(mb, head, 1.0, global_mtp[k], global_seqs) for k, head in enumerate(live)]
            self.reference.accumulate(rl_loss, sum(unit) / len(unit))
        self.scale_loss(rl_loss + sum(losses)).backward()
        mask = mb["token_mask"].float() * mb["sample_mask"].float().unsqueeze(1)
        stats = {
            "lam": 0.0 if self.coef.mode == "detach" else float(sum(lams)),
            "delta_abs_sum": float(((curr.detach() - mb["prev_logprobs"]).abs() * mask).sum()),
            "num_valid_tokens": float(mask.sum()),
            "heads": [self._head_stats(loss, h, curr, mb["prev_logprobs"]) for loss, h in zip(losses, heads)],
        }
        return rl_loss, metrics, stats

    @staticmethod
    def _head_stats(loss: torch.Tensor, head: dict, curr: torch.Tensor, prev: torch.Tensor) -> dict[str, float]:
        """Floats of one head for :meth:`step`: loss, CE, acceptance counts, and the signed sums over the head's
        targets of OCC's two log-prob changes, d = curr - prev and d_mtp = lp - prev ([B, S] each)."""
        valid = head["valid"]
        return {
            "loss": float(loss.detach()),
            "ce": float(head["ce"].detach()),
            "agree": head["agree"],
            "count": head["count"],
            "d_sum": float(((curr.detach() - prev) * valid).sum()),
            "d_mtp_sum": float(((head["lp"].detach() - prev) * valid).sum()),
            "valid": float(valid.sum()),
        }

    def _heads(self, mb, trunk, main_logits, global_mtp, detached: bool) -> list[dict]:
        """Per head: MTP log-probs ``lp`` [B, S] of the targets, their mask ``valid``, the CE and acceptance counts.
        ``detached``: the MTP block reads detached trunk output, embeddings and output weight (detach mode: its
        loss reaches the MTP parameters only)."""
        mod, ids = self.module, mb["input_ids"]
        hidden, embed, weight = trunk.hidden, mod.embedding, None
        if detached:
            hidden, embed, weight = hidden.detach(), mm.detached_embedding(mod), mm.output_weight(mod).detach()
        out = []
        for k, hk in enumerate(mm.mtp_hidden_states(mod, ids, trunk, hidden, embed)):
            logits = mm.output_logits(mod, hk, weight=weight)
            lp = ml.mtp_token_logprobs(logits, ids, k, self.train_temperature, self.tp_group)
            valid = ml.mtp_valid_mask(mb, k)
            agree, count = ml.mtp_acceptance_counts(logits.detach(), main_logits.detach(), valid, k, self.tp_group)
            ce = ml.mtp_ce_loss(lp, valid, global_mtp[k])
            out.append({"lp": lp, "valid": valid, "ce": ce, "agree": agree, "count": count})
        return out

    def _coefficients(self, curr: torch.Tensor, mb: TrainDatumSpec, heads: list[dict]) -> list[float]:
        """lambda_k of every head: fixed, or OCC's from this micro-batch's forward (before any backward)."""
        if self.coef.mode != "occ":
            return self.coef.fixed(len(heads))
        pairs = [(h["lp"].detach(), h["valid"]) for h in heads]
        return self.coef.occ(pairs, curr.detach(), mb["prev_logprobs"])

    def _head_loss(self, mb: TrainDatumSpec, head: dict, lam: float, global_valid, global_seqs) -> torch.Tensor:
        """Head loss with coefficient ``lam``: ``lam * CE`` (detach / ce) or the PG loss with advantages * lam."""
        if self.coef.mode in ("detach", "ce"):
            return lam * head["ce"]
        rows = {**mb, "advantages": mb["advantages"] * lam, "token_mask": head["valid"]}
        loss, _ = self.loss_fn(head["lp"], rows, global_valid, global_seqs)
        return loss

    _REFERENCE_KEYS = ("c_ref", "v2_ref", "c_ref_decoder", "v2_ref_decoder")

    def _sums(self, mtp_stats: list[dict]) -> dict[str, float]:
        """This rank's sums over its micro-batches of everything the ``mtp/*`` metrics are built from (a fixed key
        set, also for a rank without rows, so the sums can be all-reduced over DP)."""
        sums = {
            "lam_toks": sum(s["lam"] * s["num_valid_tokens"] for s in mtp_stats),
            "toks": sum(s["num_valid_tokens"] for s in mtp_stats),
            "delta_abs_sum": sum(s["delta_abs_sum"] for s in mtp_stats),
        }
        for k in range(self.num_layers):
            for field in ("loss", "ce", "agree", "count", "d_sum", "d_mtp_sum", "valid"):
                sums[f"{field}_{k}"] = sum(s["heads"][k][field] for s in mtp_stats)
        return sums

    def step(self, mtp_stats: list[dict]) -> dict[str, float]:
        """Sum the MTP gradients over DP, clip (TP-aware norm) and apply the MTP AdamW step; combine the
        micro-batch stats of all DP ranks into ``mtp/*`` metrics.

        ``mtp/lambda`` is the valid-token-weighted mean of the micro-batch coefficients ``sum_k lambda_k``;
        with ``mtp_occ_reference`` also ``mtp/c_ref``, ``mtp/v2_ref``, ``mtp/c_ref_decoder``, ``mtp/v2_ref_decoder``
        and ``mtp/lambda_ref`` of this optimizer step (:class:`~.occ_reference.OCCReference`);
        ``mtp/loss_<k>`` (the coefficient-scaled head loss) and ``mtp/ce_<k>`` are sums of globally normalised
        micro-batch values; ``mtp/acceptance_<k>`` = agreeing / valid targets, ``mtp/acceptance`` over all heads;
        ``mtp/delta_abs_mean``; ``mtp/delta_mean_<k>`` and ``mtp/delta_mtp_mean_<k>`` (OCC's d = log pi_theta -
        log pi_old and d_mtp = log q_k - log pi_old, signed means over head k's targets); ``mtp/grad_norm``.
        """
        local = self._sums(mtp_stats)
        total = dict(
            zip(local, all_reduce_sum(torch.tensor(list(local.values()), dtype=torch.float64), self.dp_group).tolist())
        )
        masters = self.optimizer.stage_grads()  # fp32 gradients (main_grad of bf16 parameters)
        all_reduce_grads(masters, self.dp_group)
        mtp_grad_norm = clip_grads_(masters, self.clip_grad, self.tp_group)
        self.optimizer.step()
        toks = max(total["toks"], 1.0)
        out = {
            "mtp/lambda": total["lam_toks"] / toks,
            "mtp/grad_norm": float(mtp_grad_norm),
            "mtp/delta_abs_mean": total["delta_abs_sum"] / toks,
        }
        if self.reference is not None:
            ref = self.reference.finish()
            out.update({f"mtp/{k}": ref[k] for k in self._REFERENCE_KEYS}, **{"mtp/lambda_ref": ref["lam_ref"]})
        return {**out, **self._head_metrics(total)}

    def _head_metrics(self, total: dict[str, float]) -> dict[str, float]:
        out, agree_all, count_all = {}, 0.0, 0.0
        for k in range(self.num_layers):
            agree, count = total[f"agree_{k}"], total[f"count_{k}"]
            out[f"mtp/loss_{k}"], out[f"mtp/ce_{k}"] = total[f"loss_{k}"], total[f"ce_{k}"]
            out[f"mtp/acceptance_{k}"] = agree / count if count else float("nan")
            n = total[f"valid_{k}"]
            out[f"mtp/delta_mean_{k}"] = total[f"d_sum_{k}"] / n if n else float("nan")
            out[f"mtp/delta_mtp_mean_{k}"] = total[f"d_mtp_sum_{k}"] / n if n else float("nan")
            agree_all, count_all = agree_all + agree, count_all + count
        out["mtp/acceptance"] = agree_all / count_all if count_all else float("nan")
        return out
