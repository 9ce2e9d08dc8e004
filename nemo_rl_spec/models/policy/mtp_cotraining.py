"""MTP co-training (``policy.megatron_cfg.mtp_num_layers`` > 0; docs/occ.md): the plug-in the Megatron policy worker
(:class:`~nemo_rl_spec.models.policy.megatron_worker.MegatronPolicyWorker`) calls for every training micro-batch
(:meth:`MTPCoTraining.micro_batch`) and once per optimizer step (:meth:`MTPCoTraining.step`).

Config: ``mtp_loss_mode`` (detach | ce | policy | occ), ``mtp_loss_scaling_factor`` (the fixed coefficient, or
lambda_plus for occ), ``mtp_occ_eps``, ``mtp_occ_lambda_max``, ``mtp_occ_proxy`` (occ's lambda from hidden-state
gradients, or the paper's observed log-prob changes) and ``mtp_occ_reference`` (also report c and v2 from full
parameter gradients, to validate the proxies; costs two extra trunk backwards). The MTP block's parameters are kept
out of Megatron's DDP buffer and optimizer and get their own torch AdamW here (same hyper-parameters, own grad
clipping, fp32 masters when the model is bf16: :mod:`~.mixed_precision`), so the trunk's grad-norm clipping never
sees them (needed for detach to leave the trunk bitwise unchanged); their gradients are summed over DP here. OCC's
lambda is computed per micro-batch, so DP=N equals DP=1 when the shard boundaries fall on micro-batch boundaries
(otherwise the micro-batches, and so the lambdas, differ, as with another micro-batch size).
"""

from __future__ import annotations

from typing import Callable

import torch

from nemo_rl_spec.distributed.interfaces import TrainDatumSpec
from nemo_rl_spec.models.policy import megatron_model as mm
from nemo_rl_spec.models.policy import mtp_loss as ml
from nemo_rl_spec.models.policy.mixed_precision import MasterWeightAdamW
from nemo_rl_spec.models.policy.occ import MTPCoefficient, logprob_delta_lambda, occ_lambda, occ_proxies
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
        for p in params:
            p.requires_grad_(True)
        opt = mcfg.optimizer
        self.optimizer = MasterWeightAdamW(
            params, lr=lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps, weight_decay=opt.weight_decay
        )
        self.clip_grad = opt.clip_grad
        self.num_layers = mcfg.mtp_num_layers
        self.coef = MTPCoefficient(
            mcfg.mtp_loss_mode, mcfg.mtp_loss_scaling_factor, mcfg.mtp_occ_eps, mcfg.mtp_occ_lambda_max
        )
        self.occ_reference = mcfg.mtp_occ_reference
        self.occ_proxy = mcfg.mtp_occ_proxy
        self.module, self.loss_fn, self.scale_loss = module, loss_fn, scale_loss
        self.train_temperature, self.tp_group, self.dp_group = temperature, tp_group, dp_group

    def zero_grad(self) -> None:
        """Drop the MTP gradients before a step."""
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        """Follow the trunk's learning-rate schedule."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def micro_batch(self, mb: TrainDatumSpec, global_toks, global_seqs, global_mtp):
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
        curr = token_logprobs(main_logits, ids, mb["input_lengths"], temp, self.tp_group, self.sampling_filter)
        rl_loss, metrics = self.loss_fn(curr, mb, global_toks, global_seqs)
        mtp_loss, stats = self._losses(mb, trunk, h_copy, w_copy, embed_copy, main_logits, global_seqs, global_mtp)
        head_lams = self._logprob_delta_lambdas(curr, mb, stats["heads"])
        stats.update(c_hat=0.0, v2_hat=0.0, lam=0.0 if head_lams is None else sum(head_lams))  # hook may overwrite
        copies = [h_copy, w_copy, *(c for _, c in emb_pairs)]
        # MTP-loss gradients of the copies meant for the trunk: per-head weighted when the heads' lambdas differ
        per_head = self._per_head_trunk_grads(stats["heads"], head_lams, copies)
        self.scale_loss(mtp_loss).backward()  # 1. MTP params + the detached copies
        trunk_grads = [c.grad for c in copies] if per_head is None else per_head
        coef = lambda: stats["lam"] if per_head is None else 1.0  # noqa: E731  (per_head is already weighted)
        if self.occ_reference:
            stats.update(
                self._occ_reference(rl_loss, [h, weight, *(o for o, _ in emb_pairs)], [c.grad for c in copies])
            )

        valid = (torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) < mb["input_lengths"].unsqueeze(1)).float()
        valid = (valid * mb["sample_mask"].float().unsqueeze(1)).t()  # [S, B] like h
        mtp_grad_h = h_copy.grad

        def combine(rl_grad_h):
            c_hat, v2_hat = occ_proxies(rl_grad_h, mtp_grad_h, valid)
            lam_hidden = self.coef(float(c_hat), float(v2_hat))
            stats.update(c_hat=float(c_hat), v2_hat=float(v2_hat), lam_hidden_grad=lam_hidden)
            if head_lams is None:
                stats["lam"] = lam_hidden
            return None if stats["lam"] == 0.0 else rl_grad_h + coef() * trunk_grads[0]

        h.register_hook(combine)
        self.scale_loss(rl_loss).backward()  # 2. main head + trunk (hook adds lambda * MTP part)
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
        if self.coef.mode != "occ" or self.occ_proxy != "logprob_delta":
            return None
        coef, prev = self.coef, mb["prev_logprobs"]
        return [
            logprob_delta_lambda(
                lp, curr.detach(), prev, valid, coef.scaling_factor, len(heads), coef.eps, coef.lambda_max
            )
            for lp, valid in tensors
        ]

    def _per_head_trunk_grads(
        self, heads: list[dict], head_lams: list[float] | None, copies: list[torch.Tensor]
    ) -> list[torch.Tensor | None] | None:
        """``d(sum_k lambda_k * L_k) / d copies`` (L_k head k's loss, un-averaged) when the heads' lambdas differ, else
        None (then ``sum_k lambda_k`` times the head-averaged gradient is the same thing). One extra backward through
        the MTP block; pops the heads' loss tensors."""
        losses = [head.pop("loss_t") for head in heads]
        if head_lams is None or all(lam == head_lams[0] for lam in head_lams):
            return None
        weighted = self.scale_loss(sum(lam * loss for lam, loss in zip(head_lams, losses)))
        return list(torch.autograd.grad(weighted, copies, retain_graph=True, allow_unused=True))

    def _occ_reference(
        self, rl_loss: torch.Tensor, shared_outputs: list[torch.Tensor], mtp_grads: list[torch.Tensor | None]
    ) -> dict[str, float]:
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
        named = [
            (n, p) for n, p in self.module.named_parameters() if p.requires_grad and not n.startswith(mm.MTP_PREFIX)
        ]
        shared = [p for _, p in named]
        pairs = [(o, g) for o, g in zip(shared_outputs, mtp_grads) if g is not None]
        g_mtp = torch.autograd.grad(
            [o for o, _ in pairs], shared, [g for _, g in pairs], retain_graph=True, allow_unused=True
        )
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
        coef = self.coef
        return {
            "c_ref": c,
            "v2_ref": v2,
            "c_ref_decoder": c_dec,
            "v2_ref_decoder": v2_dec,
            "lam_ref": occ_lambda(c, v2, coef.scaling_factor, coef.eps, coef.lambda_max),
        }

    def _losses(self, mb, trunk, h_copy, w_copy, embed_copy, main_logits, global_seqs, global_mtp):
        """MTP loss of the mode (heads averaged) and per-head stats (loss, CE, acceptance counts)."""
        mod, ids, k_heads = self.module, mb["input_ids"], self.num_layers
        hidden = mm.mtp_hidden_states(mod, ids, trunk, h_copy, embed_copy)
        total, stats = 0.0, {"heads": []}
        for k, hk in enumerate(hidden):
            logits = mm.output_logits(mod, hk, weight=w_copy)
            lp = ml.mtp_token_logprobs(logits, ids, k, self.train_temperature, self.tp_group)
            valid = ml.mtp_valid_mask(mb, k)
            ce = ml.mtp_ce_loss(lp, valid, global_mtp[k])
            if self.coef.mode in ("policy", "occ"):
                head_loss, _ = self.loss_fn(lp, {**mb, "token_mask": valid}, global_mtp[k], global_seqs)
            else:
                head_loss = ce
            total = total + head_loss / k_heads
            agree, count = ml.mtp_acceptance_counts(logits.detach(), main_logits.detach(), valid, k, self.tp_group)
            stats["heads"].append(
                {
                    "loss": float(head_loss.detach()),
                    "ce": float(ce.detach()),
                    "agree": agree,
                    "count": count,
                    "loss_t": head_loss,
                    "lp": lp.detach(),
                    "valid": valid,
                }
            )
        return total, stats

    _REFERENCE_KEYS = ("c_ref", "v2_ref", "c_ref_decoder", "v2_ref_decoder")

    def _sums(self, mtp_stats: list[dict]) -> dict[str, float]:
        """This rank's sums over its micro-batches of everything the ``mtp/*`` metrics are built from (a fixed key
        set, also for a rank without rows, so the sums can be all-reduced over DP)."""
        sums = {
            "lam_toks": sum(s["lam"] * s["num_valid_tokens"] for s in mtp_stats),
            "toks": sum(s["num_valid_tokens"] for s in mtp_stats),
            "c_hat": sum(s["c_hat"] for s in mtp_stats),
            "v2_hat": sum(s["v2_hat"] for s in mtp_stats),
            "delta_abs_sum": sum(s["delta_abs_sum"] for s in mtp_stats),
        }
        if self.occ_proxy == "logprob_delta":  # the hidden-state rule on the same micro-batches, not applied
            sums["lam_hidden_grad_toks"] = sum(s["lam_hidden_grad"] * s["num_valid_tokens"] for s in mtp_stats)
        if self.occ_reference:
            sums.update({k: sum(s[k] for s in mtp_stats) for k in self._REFERENCE_KEYS})
            sums["lam_ref_toks"] = sum(s["lam_ref"] * s["num_valid_tokens"] for s in mtp_stats)
        for k in range(self.num_layers):
            for field in ("loss", "ce", "agree", "count"):
                sums[f"{field}_{k}"] = sum(s["heads"][k][field] for s in mtp_stats)
        return sums

    def step(self, mtp_stats: list[dict]) -> dict[str, float]:
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
            "mtp/c_hat": total["c_hat"],
            "mtp/v2_hat": total["v2_hat"],
            "mtp/grad_norm": float(mtp_grad_norm),
            "mtp/delta_abs_mean": total["delta_abs_sum"] / toks,
        }
        if self.occ_proxy == "logprob_delta":
            out["mtp/lambda_hidden_grad"] = total["lam_hidden_grad_toks"] / toks
        if self.occ_reference:
            out.update({f"mtp/{k}": total[k] for k in self._REFERENCE_KEYS})
            out["mtp/lambda_ref"] = total["lam_ref_toks"] / toks
        agree_all = count_all = 0.0
        for k in range(self.num_layers):
            agree, count = total[f"agree_{k}"], total[f"count_{k}"]
            out[f"mtp/loss_{k}"], out[f"mtp/ce_{k}"] = total[f"loss_{k}"], total[f"ce_{k}"]
            out[f"mtp/acceptance_{k}"] = agree / count if count else float("nan")
            agree_all, count_all = agree_all + agree, count_all + count
        out["mtp/acceptance"] = agree_all / count_all if count_all else float("nan")
        return out
