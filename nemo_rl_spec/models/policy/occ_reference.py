"""OCC's full-gradient reference at optimizer-step level (``policy.megatron_cfg.mtp_occ_reference``).

For one optimizer step over micro-batches m, with G_RL = sum_m dL_RL,m/dtheta and G_MTP = sum_m dL_MTP,m/dtheta
over the shared (non-MTP) parameters theta, the quantities OCC's rule is about (docs/guides/occ.md section 3) are

    c = <G_RL, G_MTP>        v2 = ||G_MTP||^2        lambda_ref = lambda_plus * c / (v2 + eps)

L_MTP is the heads' mean loss *unscaled* (lambda = 1), so lambda_ref is the coefficient the rule would put on it.
The gradients come from ``torch.autograd.grad`` (no accumulation into ``.grad`` / ``main_grad``), so training is
bitwise unchanged; the cost is two extra trunk backwards per micro-batch, two float64 accumulators the size of the
shared parameters and one gradient set in the parameters' dtype at a time (a validation tool for small models: 16
bytes per parameter). ``torch.autograd.grad`` cannot pass through activation checkpointing, so the config refuses
``mtp_occ_reference`` with ``activation_checkpointing``. Only the shared parameters count: J does not depend on the MTP-only parameters, so their share of
||g_MTP||^2 does not enter the bound.
"""

from __future__ import annotations

import torch

from nemo_rl_spec.models.policy import megatron_model as mm
from nemo_rl_spec.models.policy.occ import MTPCoefficient, occ_lambda
from nemo_rl_spec.models.policy.parallel import all_reduce_sum


class OCCReference:
    """Accumulates G_RL and G_MTP over one optimizer step's micro-batches; :meth:`finish` returns c, v2 and
    lambda_ref (and the same over the decoder layers only, ``*_decoder``) and resets.

    Args:
        module: the unwrapped GPTModel. coef: the worker's :class:`MTPCoefficient` (lambda_plus, eps, clamp).
        tp_group, dp_group: G is summed over DP ranks; tensor-parallel slices' dot products over TP ranks
            (replicated parameters count once; the per-head partial gradients of q/k norms are summed over TP first).
    """

    def __init__(self, module: torch.nn.Module, coef: MTPCoefficient, tp_group, dp_group) -> None:
        self.module, self.coef, self.tp_group, self.dp_group = module, coef, tp_group, dp_group
        self.named = [
            (n, p) for n, p in module.named_parameters() if p.requires_grad and not n.startswith(mm.MTP_PREFIX)
        ]
        self._sums: list[list[torch.Tensor]] | None = None

    def accumulate(self, rl_loss: torch.Tensor, mtp_loss: torch.Tensor) -> None:
        """Add one micro-batch's dL_RL/dtheta and dL_MTP/dtheta (scalar losses; the graph is retained for the
        training backward). One loss's gradients at a time, added into two float64 accumulators."""
        params = [p for _, p in self.named]
        if self._sums is None:
            self._sums = [[torch.zeros_like(p, dtype=torch.float64) for p in params] for _ in range(2)]
        for acc, loss in zip(self._sums, (rl_loss, mtp_loss)):
            for a, g in zip(acc, torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)):
                if g is not None:
                    a += g.double()

    def finish(self) -> dict[str, float]:
        """``c_ref``, ``v2_ref``, ``c_ref_decoder``, ``v2_ref_decoder``, ``lam_ref`` of the step (floats; units of
        loss^2 per parameter^2 summed over parameters; lam_ref dimensionless); resets. A rank without micro-batches
        contributes zeros (the DP sums stay collectives on every rank); each parameter's sums are all-reduced over
        DP one at a time."""
        params = [p for _, p in self.named]
        sums = self._sums or [[torch.zeros_like(p, dtype=torch.float64) for p in params] for _ in range(2)]
        self._sums = None
        rows = torch.zeros(2, 4, dtype=torch.float64)  # [replicated, tensor-parallel] x [c, v2, c_dec, v2_dec]
        for (name, param), gr, gm in zip(self.named, *sums):
            gr, gm = all_reduce_sum(gr, self.dp_group), all_reduce_sum(gm, self.dp_group)
            if mm.tp_partial_grad(name, self.module.config):
                gr, gm = all_reduce_sum(gr, self.tp_group), all_reduce_sum(gm, self.tp_group)
            vals = torch.stack([(gr * gm).sum(), (gm * gm).sum()]).cpu()
            row = rows[int(bool(getattr(param, "tensor_model_parallel", False)))]
            row[:2] += vals
            if name.startswith(mm.DECODER_PREFIX):
                row[2:] += vals
        c, v2, c_dec, v2_dec = (rows[0] + all_reduce_sum(rows[1], self.tp_group).cpu()).tolist()
        coef = self.coef
        return {
            "c_ref": c,
            "v2_ref": v2,
            "c_ref_decoder": c_dec,
            "v2_ref_decoder": v2_dec,
            "lam_ref": occ_lambda(c, v2, coef.scaling_factor, coef.eps, coef.lambda_max),
        }
