"""Serving a policy with MTP layers as a MiMo checkpoint (``speculative_config.method: mtp``,
:mod:`nemo_rl_spec.models.mtp_export`): the model surgery on the generation side.

The checkpoint's MTP layers are the drafter's and arrive through the drafter refit, not the policy's; the q/k/v biases
its Qwen2 layers need but a Llama / Qwen3 trunk lacks were written as zeros, so a policy refit may omit them and
gets them added as zeros (:func:`with_zero_biases`); and a megatron-core MTP layer reads the final-normed hidden
state, which :func:`~nemo_rl_spec.models.mtp_export.install_post_norm_mtp_input` wires into vLLM's MiMo drafter.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from nemo_rl_spec.models.mtp_export import MIMO_MTP_PREFIX, MTP_POST_NORM_FLAG, install_post_norm_mtp_input
from nemo_rl_spec.utils.checkpoint import read_safetensors

MIMO_ARCHITECTURE = "MiMoForCausalLM"


def zero_tensor_names(model_path: str, names: set[str]) -> set[str]:
    """Those of ``names`` whose tensor in the safetensors checkpoint at ``model_path`` is all zeros."""
    return {name for name, tensor in read_safetensors(model_path, names).items() if not tensor.any()}


def serves_mimo(hf_config) -> bool:
    """True when the engine's model (its HF config) is a MiMo checkpoint."""
    return MIMO_ARCHITECTURE in (getattr(hf_config, "architectures", None) or [])


def mimo_refit_names(llm, model_path: str, weight_names: set[str], speculative: bool) -> tuple[set[str], set[str]]:
    """For an engine serving the MiMo checkpoint at ``model_path``: (the names a policy refit carries: ``weight_names``
    without the MTP layers, the q/k/v biases the checkpoint holds as zeros). With ``speculative`` and a checkpoint
    exported from megatron-core MTP layers, also installs the post-norm MTP input into the engine ``llm``."""
    names = {n for n in weight_names if not n.startswith(MIMO_MTP_PREFIX)}
    biases = {n for n in names if n.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias"))}
    zero_biases = zero_tensor_names(model_path, biases)
    exported = json.loads((Path(model_path) / "config.json").read_text()).get(MTP_POST_NORM_FLAG, False)
    if speculative and exported:  # a megatron-core MTP layer reads the final-normed hidden state
        install_post_norm_mtp_input(llm)
    return names, zero_biases


def with_zero_biases(weights: Mapping[str, torch.Tensor], zero_bias_names: set[str]) -> dict[str, torch.Tensor]:
    """``weights`` plus a zero bias (the dtype and device of its weight) for each name of ``zero_bias_names`` that
    ``weights`` lacks and whose ``.weight`` it has; a plain copy of the dict when ``zero_bias_names`` is empty."""
    weights = dict(weights)
    for name in zero_bias_names - set(weights):
        weight = weights.get(name[: -len("bias")] + "weight")
        if weight is not None:
            weights[name] = torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)
    return weights
