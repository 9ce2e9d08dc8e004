"""Weights out of the Megatron policy worker: HF-named exports for refits, the drafter's weights (online EAGLE-3 head
or the MTP block under MiMo names), HF / MiMo / eagle3 checkpoints, and the worker's own resumable checkpoint.

:class:`WeightExportMixin` holds these methods of
:class:`~nemo_rl_spec.models.policy.megatron_worker.MegatronPolicyWorker` (they are its Ray-callable methods); the
training step stays in the worker. They read the worker's state: ``module`` (the unwrapped GPTModel), ``spec``,
``layout``, ``dp_group``, ``model_path``, ``optimizer`` / ``scheduler`` / ``mtp_optimizer`` (None without MTP),
``draft`` (the online EAGLE-3 head or None), ``reference_state``, ``step``, ``weight_version``, ``mtp_num_layers``,
``refit_group`` and ``sent_refit`` (the collective refit transport),
``cfg``; and call its ``advance_scheduler``.

Exports cast once, on the sender, to the dtype asked (:func:`~nemo_rl_spec.utils.dtypes.cast_state`). Checkpoints
hold the fp32 masters, so a resume is exact (docs/design/precision.md).
"""

from __future__ import annotations

import glob
import json
import os
import random

import numpy as np
import torch
from megatron.core import tensor_parallel  # noqa: E402  (after cpu_compat via megatron_model)

from nemo_rl_spec.distributed.weight_broadcast import WeightBroadcastGroup, node_address_and_free_port
from nemo_rl_spec.models.mtp_export import megatron_mtp_to_mimo, with_zero_qkv_bias, write_mimo_checkpoint
from nemo_rl_spec.models.policy import megatron_model as mm
from nemo_rl_spec.models.policy.optimizer_state import load_named_adam_state, named_adam_state
from nemo_rl_spec.models.policy.pipeline import gather_stages, stage_layer_offset, stage_state, to_global_names
from nemo_rl_spec.utils.dtypes import cast_state

CHECKPOINT_FILE = "megatron_policy_tp{tp_rank}.pt"  # one file per TP rank, written by DP rank 0
STAGE_CHECKPOINT_FILE = "megatron_policy_tp{tp_rank}_pp{pp_rank}.pt"  # with PP: one per TP rank and stage


class WeightExportMixin:
    """HF / drafter exports and checkpoints of :class:`~.megatron_worker.MegatronPolicyWorker` (module docstring)."""

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
        return state if dtype is None else cast_state(state, dtype)

    def refit_group_address(self) -> tuple[str, int]:
        """(this node's IP, a free TCP port): where rank 0 will host the collective refit group's store."""
        return node_address_and_free_port()

    def init_refit_group(
        self, host: str, port: int, world_size: int, backend: str, timeout_s: float, algorithm: str
    ) -> None:
        """Join the collective refit group as its sender (rank 0 only; the other ranks do nothing): blocks until
        the ``world_size - 1`` engines have joined too (:class:`~nemo_rl_spec.distributed.weight_broadcast.
        WeightBroadcastGroup`)."""
        if self._is_rank_zero:
            self.refit_group = WeightBroadcastGroup(host, port, 0, world_size, backend, timeout_s, algorithm)

    def broadcast_hf_weights(
        self, version: int, dtype: str | None, bucket_bytes: int, keep: bool = False
    ) -> dict[str, float]:
        """:meth:`export_hf_weights` (a collective over the policy ranks), then rank 0 broadcasts the tensors with
        ``{"version": version}`` over the refit group in buckets of ``bucket_bytes``; returns rank 0's
        ``{"bytes", "buckets"}`` (empty on the other ranks). ``keep``: rank 0 holds on to the tensors it sent until
        the next broadcast (:meth:`sent_refit_weights`: what a restarted engine is given)."""
        state = self.export_hf_weights(version, dtype)
        if not self._is_rank_zero:
            return {}
        if keep:  # the draft kept stays: it is what the engines hold until the next draft push
            self.sent_refit["policy"] = state
        return self.refit_group.send(state, {"version": int(version)}, bucket_bytes)

    def sent_refit_weights(self, kind: str) -> dict:
        """What rank 0 last broadcast with ``keep``: ``kind`` ``policy`` (the HF tensors) or ``draft`` (the drafter
        export). Rank 0 only.

        Raises:
            RuntimeError: nothing of that kind was kept (no broadcast with ``keep`` yet).
        """
        kept = self.sent_refit.get(kind)
        if kept is None:
            raise RuntimeError(f"no {kind} weights kept: broadcast with keep=True first")
        return kept

    def broadcast_draft_weights(self, dtype: str | None, bucket_bytes: int, keep: bool = False) -> dict[str, float]:
        """:meth:`export_draft_weights`, broadcast over the refit group like :meth:`broadcast_hf_weights` (the
        versions travel in the header); returns rank 0's ``{"bytes", "buckets"}``."""
        draft = self.export_draft_weights(dtype)
        if not self._is_rank_zero:
            return {}
        if keep:
            self.sent_refit["draft"] = draft
        meta = {k: v for k, v in draft.items() if k != "weights"}
        return self.refit_group.send(draft["weights"], meta, bucket_bytes)

    def export_megatron_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter (MTP block included) under its Megatron name, full size (TP slices gathered: a
        collective), CPU fp32 copies on rank 0, an empty dict on the other ranks. For checks and debugging."""
        state = {k: v.to("cpu", torch.float32).clone() for k, v in mm.full_param_state(self.module).items()}
        state = gather_stages(self._to_global(state))  # under PP: every stage's layers, global names
        return state if self._is_rank_zero else {}

    def draft_version(self) -> int | None:
        """The ``draft_version`` :meth:`export_draft_weights` would report now: the online head's optimizer steps,
        the policy's for the MTP drafter (it trains with the policy), None without a drafter."""
        if self.draft is not None:
            return self.draft.trainer.draft_version
        return self.step if self.serves_mtp_drafter else None

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
            weights = cast_state(self.mimo_mtp_weights(), dtype or "float32")
            return (
                {"weights": weights, "draft_version": self.step, "policy_version": self.weight_version}
                if self._is_rank_zero
                else {}
            )
        raise RuntimeError(
            "export_draft_weights: no online draft (policy.draft.online is false) and no MTP drafter "
            "(speculative_config.method=mtp with policy.megatron_cfg.mtp_num_layers >= 1)"
        )

    @property
    def serves_mtp_drafter(self) -> bool:
        """True when vLLM drafts with this policy's MTP block (``speculative_config.method: mtp``, MTP layers > 0)."""
        spec = self.cfg.generation.speculative_config
        return spec is not None and spec.method == "mtp" and self.mtp_num_layers > 0

    def mimo_mtp_weights(self) -> dict[str, torch.Tensor]:
        """CPU fp32 copies of the full MTP block under MiMo names (``model.mtp_layers.<k>.*``, q/k/v biases added as
        zeros), the set vLLM's MiMo MTP drafter reloads (a collective under TP): one MiMo layer per MTP depth (a
        repeated MTP layer is written at each depth). Raises RuntimeError without MTP layers."""
        if not self.mtp_num_layers:
            raise RuntimeError("mimo_mtp_weights: policy.megatron_cfg.mtp_num_layers is 0")
        full = mm.full_param_state(self.module)
        state = {k: v.detach().to("cpu", torch.float32).clone() for k, v in full.items()}
        return with_zero_qkv_bias(megatron_mtp_to_mimo(state, self.spec, self.mtp_num_layers))

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
        tp, pp = self.layout.tp_rank, self.layout.pp_rank
        name = CHECKPOINT_FILE if self.layout.pp_size == 1 else STAGE_CHECKPOINT_FILE
        return os.path.join(path, name.format(tp_rank=tp, pp_rank=pp))

    def _to_global(self, state: dict | None) -> dict | None:
        """This stage's entries under global names (:func:`~.pipeline.to_global_names`); None passes."""
        if state is None:
            return None
        return to_global_names(state, stage_layer_offset(self.module), self.spec.tie_word_embeddings)

    def _to_stage(self, state: dict | None, names) -> dict | None:
        """The entries of a global-named ``state`` this stage holds, under its local names; None passes."""
        if state is None:
            return None
        return stage_state(state, names, stage_layer_offset(self.module), self.spec.tie_word_embeddings)

    def _read_stage_files(self, path: str) -> dict:
        """This TP rank's checkpoint, whatever PP size wrote it: its one file, or the files of every stage with the
        ``model`` / ``adam`` / ``reference`` entries merged (global names); the rest from the first stage's file.

        Raises:
            FileNotFoundError: no file for this TP rank (the checkpoint has another TP layout).
        """
        tp = self.layout.tp_rank
        files = [os.path.join(path, CHECKPOINT_FILE.format(tp_rank=tp))]
        if not os.path.exists(files[0]):
            files = sorted(
                glob.glob(os.path.join(path, STAGE_CHECKPOINT_FILE.format(tp_rank=tp, pp_rank="*"))),
                key=lambda f: int(f.rsplit("_pp", 1)[1].split(".")[0]),
            )
        if not files:
            raise FileNotFoundError(
                f"{os.path.join(path, CHECKPOINT_FILE.format(tp_rank=tp))} missing: the checkpoint in {path} was not "
                f"written with policy.megatron_cfg.tensor_model_parallel_size={self.layout.tp_size}"
            )
        states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
        merged = dict(states[0])
        for key in ("model", "adam", "reference"):
            parts = [s.get(key) for s in states]
            merged[key] = None if parts[0] is None else {k: v for part in parts for k, v in part.items()}
        return merged

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
        state = {  # model, Adam state and reference under global layer names: they load at any PP size
            "model": self._to_global({k: v.detach().clone() for k, v in mm.megatron_param_state(self.module).items()}),
            "adam": self._to_global(adam),
            "optimizer_saved": save_optimizer,
            "mtp_optimizer": mtp_optimizer,
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "weight_version": self.weight_version,
            "draft": None if self.draft is None else self.draft.state_dict(),
            "reference": self._to_global(self.reference_state),
            "tp_size": self.layout.tp_size,
            "pp_size": self.layout.pp_size,
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
        self.advance_scheduler(steps)

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (parameters are copied in place; without saved optimizer state
        the optimizer restarts: Adam moments at zero, fp32 masters from the loaded weights).

        Raises:
            FileNotFoundError: no file for this TP rank (the checkpoint has another TP layout).
            ValueError: the checkpoint was written with another ``policy.megatron_cfg.tensor_model_parallel_size``.
        """
        state = self._read_stage_files(path)
        if state["tp_size"] != self.layout.tp_size:
            raise ValueError(
                f"checkpoint {path} has TP={state['tp_size']}; resume with "
                f"policy.megatron_cfg.tensor_model_parallel_size={state['tp_size']}"
            )
        names = mm.megatron_param_state(self.module)
        mm.load_megatron_state(self.module, self._to_stage(state["model"], names))
        trained = [n for n, p in self.module.named_parameters() if p.requires_grad]
        load_named_adam_state(self.optimizer, self.module, self._to_stage(state["adam"], trained))
        if self.mtp_optimizer is not None and state.get("mtp_optimizer") is not None:
            self.mtp_optimizer.load_state_dict(state["mtp_optimizer"])
        self.step, self.weight_version = state["step"], state["weight_version"]
        self._restore_scheduler(state.get("scheduler"))
        if self.draft is not None and state.get("draft") is not None:
            self.draft.load_state_dict(state["draft"])
        if self.reference_state is not None and state.get("reference") is not None:
            self.reference_state = self._to_stage(state["reference"], self.reference_state)
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["megatron_tracker"])
