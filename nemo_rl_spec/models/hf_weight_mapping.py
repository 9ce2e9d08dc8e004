"""Hugging Face <-> megatron-core weight mapping for Llama and Qwen3 (dense, no biases).

A hand-written mapping (not Megatron-Bridge): it is ~100 lines, needs no extra packages or stubs on
Python 3.11 (Bridge needs ``--ignore-requires-python``, a ``typing.override`` shim and a transformer_engine
stub), and is exact (export -> import is bit-identical). This module imports no megatron code.

Names map one to one (:func:`hf_to_megatron`, Megatron names of ``GPTModel`` with the local layer spec) except the
fused ``linear_qkv`` (:func:`fuse_qkv`) and ``linear_fc1`` (``cat([gate_proj, up_proj])``). Export always includes
``lm_head.weight``: with tied embeddings it equals the embedding, and vLLM's refit stays stale without it
(docs/guides/install.md, "What the CPU stack needs"). Tensor parallelism: :func:`tp_partition`, :func:`tp_shard`,
:func:`tp_unshard` on Megatron names.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and options of a supported HF decoder, as Megatron needs them."""

    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    qk_layernorm: bool
    tie_word_embeddings: bool


def _rope_theta(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = scaling.get("rope_type", scaling.get("type", rope_type))
    if rope_type != "default":
        raise ValueError(f"Unsupported rope_type {rope_type!r} (only 'default' rotary embeddings)")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("HF config has no rope_theta")
    return float(theta)


def _check_supported(hf_config, architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"Unsupported architecture {architecture!r}; the Megatron policy supports {SUPPORTED_ARCHITECTURES}"
        )
    unsupported = {
        "attention_bias": getattr(hf_config, "attention_bias", False),
        "mlp_bias": getattr(hf_config, "mlp_bias", False),
        "use_sliding_window": getattr(hf_config, "use_sliding_window", False),
    }
    for key, value in unsupported.items():
        if value:
            raise ValueError(f"{architecture}: {key}=True is not supported")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"{architecture}: hidden_act={hf_config.hidden_act!r} is not supported (silu only)")


def model_spec_from_hf_config(hf_config) -> ModelSpec:
    """Read a ``transformers`` config of LlamaForCausalLM / Qwen3ForCausalLM.

    Raises:
        ValueError: unsupported architecture (named in the message) or unsupported option
            (biases, sliding window, non-silu activation, rope scaling).
    """
    architectures = getattr(hf_config, "architectures", None) or []
    by_type = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    architecture = architectures[0] if architectures else by_type.get(hf_config.model_type, hf_config.model_type)
    _check_supported(hf_config, architecture)
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    return ModelSpec(
        architecture=architecture,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=num_heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        rope_theta=_rope_theta(hf_config),
        qk_layernorm=architecture == "Qwen3ForCausalLM",
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


def _layer_names(spec: ModelSpec, i: int) -> list[tuple[str, str]]:
    """(HF name, Megatron name) pairs mapped one-to-one (no fusing) for layer ``i``."""
    hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
    pairs = [
        (hf + "input_layernorm.weight", mc + "input_layernorm.weight"),
        (hf + "self_attn.o_proj.weight", mc + "self_attention.linear_proj.weight"),
        (hf + "post_attention_layernorm.weight", mc + "pre_mlp_layernorm.weight"),
        (hf + "mlp.down_proj.weight", mc + "mlp.linear_fc2.weight"),
    ]
    if spec.qk_layernorm:
        pairs += [
            (hf + "self_attn.q_norm.weight", mc + "self_attention.q_layernorm.weight"),
            (hf + "self_attn.k_norm.weight", mc + "self_attention.k_layernorm.weight"),
        ]
    return pairs


def _global_names(spec: ModelSpec) -> list[tuple[str, str]]:
    pairs = [
        ("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
        ("model.norm.weight", "decoder.final_layernorm.weight"),
    ]
    if not spec.tie_word_embeddings:
        pairs.append(("lm_head.weight", "output_layer.weight"))
    return pairs


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """HF q/k/v projections -> Megatron ``linear_qkv``.

    ``linear_qkv`` rows are grouped per query group g = 0..G-1 (G = num_key_value_heads), each group holding its H/G
    query heads, then its key head, then its value head, every head ``head_dim`` rows:
    ``[q_g0h0 .. q_g0h(H/G-1), k_g0, v_g0, q_g1h0, ...]``. (``linear_fc1`` is simply ``cat([gate_proj, up_proj])``:
    Megatron's SwiGLU applies silu to the first half.)

    Shape: q [H*D, hidden], k and v [G*D, hidden] -> [(H + 2G)*D, hidden].
    """
    groups, dim = spec.num_query_groups, spec.head_dim
    heads_per_group = spec.num_attention_heads // groups
    q = q.reshape(groups, heads_per_group * dim, -1)
    k, v = k.reshape(groups, dim, -1), v.reshape(groups, dim, -1)
    return torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])


def split_qkv(qkv: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`. Shape: [(H + 2G)*D, hidden] -> q [H*D, hidden], k, v [G*D, hidden]."""
    groups, dim = spec.num_query_groups, spec.head_dim
    q_rows = spec.num_attention_heads // groups * dim
    grouped = qkv.reshape(groups, q_rows + 2 * dim, -1)
    q, k, v = torch.split(grouped, [q_rows, dim, dim], dim=1)
    hidden = qkv.shape[-1]
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def hf_to_megatron(hf_state: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """HF-named tensors -> Megatron-named tensors (``lm_head.weight`` ignored when tied).

    Raises:
        KeyError: a tensor the model needs is missing from ``hf_state``.
    """
    out = {mc: hf_state[hf] for hf, mc in _global_names(spec)}
    for i in range(spec.num_layers):
        out.update({mc: hf_state[hf] for hf, mc in _layer_names(spec, i)})
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = fuse_qkv(
            hf_state[attn + "q_proj.weight"], hf_state[attn + "k_proj.weight"], hf_state[attn + "v_proj.weight"], spec
        )
        out[f"decoder.layers.{i}.mlp.linear_fc1.weight"] = torch.cat(
            [hf_state[mlp + "gate_proj.weight"], hf_state[mlp + "up_proj.weight"]], dim=0
        )
    return out


def megatron_to_hf(mcore_state: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Megatron-named tensors -> HF-named tensors, always with ``lm_head.weight`` (= embedding if tied)."""
    out = {hf: mcore_state[mc] for hf, mc in _global_names(spec)}
    if spec.tie_word_embeddings:
        out["lm_head.weight"] = mcore_state["embedding.word_embeddings.weight"]
    for i in range(spec.num_layers):
        out.update({hf: mcore_state[mc] for hf, mc in _layer_names(spec, i)})
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        q, k, v = split_qkv(mcore_state[f"decoder.layers.{i}.self_attention.linear_qkv.weight"], spec)
        out.update({attn + "q_proj.weight": q, attn + "k_proj.weight": k, attn + "v_proj.weight": v})
        gate, up = torch.chunk(mcore_state[f"decoder.layers.{i}.mlp.linear_fc1.weight"], 2, dim=0)
        out.update({mlp + "gate_proj.weight": gate, mlp + "up_proj.weight": up})
    return out


def load_hf_safetensors(model_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files (single or sharded) in an HF checkpoint directory.

    Raises:
        FileNotFoundError: the directory holds no safetensors file.
    """
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir!r} (save the HF model with safe_serialization)")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path))
    return state


_TP_COLUMN_PARALLEL = ("linear_qkv.weight", "eh_proj.weight", "word_embeddings.weight", "output_layer.weight")
_TP_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
_TP_GLU = ("linear_fc1.weight",)


def tp_partition(name: str) -> str | None:
    """How tensor parallelism splits the Megatron tensor ``name``: "rows" (dim 0), "cols" (dim 1), "glu" (each
    half of dim 0) or None (replicated), as megatron-core's TP layers hold them on T ranks::

        column-parallel  linear_qkv, eh_proj       rows split in T contiguous blocks (dim 0); for linear_qkv a block
                                                   is G/T whole query groups, since the fused rows are grouped per group
        column-parallel  linear_fc1 (SwiGLU)       gate and up halves each split in T blocks, rank r holds
                                                   cat([gate_r, up_r]) (megatron applies silu to its local first half)
        row-parallel     linear_proj, linear_fc2   columns split in T blocks (dim 1)
        vocab-parallel   word_embeddings, output_layer   vocabulary rows split in T blocks (dim 0)
        replicated       every norm weight
    """
    if name.endswith(_TP_COLUMN_PARALLEL):
        return "rows"
    if name.endswith(_TP_ROW_PARALLEL):
        return "cols"
    if name.endswith(_TP_GLU):
        return "glu"
    return None


def check_tp_size(spec: ModelSpec, tp_size: int) -> None:
    """Raise ValueError naming ``policy.megatron_cfg.tensor_model_parallel_size`` when ``spec`` cannot be split in
    ``tp_size`` ranks (heads, query groups, FFN width and vocabulary must all be divisible)."""
    sizes = {
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_query_groups,
        "intermediate_size": spec.ffn_hidden_size,
        "vocab_size": spec.vocab_size,
    }
    bad = {k: v for k, v in sizes.items() if v % tp_size}
    if bad:
        raise ValueError(
            f"policy.megatron_cfg.tensor_model_parallel_size={tp_size} does not divide the model's "
            f"{bad} ({spec.architecture})"
        )


def tp_shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """TP rank ``rank``'s part of the full Megatron tensor ``name`` (a view for rows / cols, replicated tensors
    unchanged). Shape: e.g. linear_proj [H, H*D] -> [H, H*D / size]."""
    rule = tp_partition(name)
    if rule is None or size == 1:
        return full
    if rule == "glu":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size, dim=0)[rank], torch.chunk(up, size, dim=0)[rank]], dim=0)
    return torch.chunk(full, size, dim=0 if rule == "rows" else 1)[rank]


def tp_unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`tp_shard`: the full tensor from every TP rank's part, in rank order."""
    rule = tp_partition(name)
    if rule is None or len(shards) == 1:
        return shards[0]
    if rule == "glu":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=0 if rule == "rows" else 1)
