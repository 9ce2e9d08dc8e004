"""Build a megatron-core ``GPTModel`` equivalent to an HF LlamaForCausalLM / Qwen3ForCausalLM.

Local (non-Transformer-Engine) layer spec, every fusion off, rotary embeddings, RMSNorm, SwiGLU, GQA,
no biases, Qwen3's per-head q/k RMSNorm (``qk_layernorm``), tied embeddings ->
``share_embeddings_and_output_weights``. On CPU, :func:`~.cpu_compat.apply_cpu_compat` runs first.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.nn.functional as F

from nemo_rl_spec.models.policy.cpu_compat import apply_cpu_compat
from nemo_rl_spec.models.policy.hf_weight_mapping import (
    ModelSpec,
    hf_to_megatron,
    load_hf_safetensors,
    megatron_to_hf,
    model_spec_from_hf_config,
)

apply_cpu_compat()  # before any megatron import (triton stub, torch proxies)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def initialize_distributed(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> None:
    """Initialise a world-size-1 gloo process group and megatron ``parallel_state`` if not yet done.

    Raises:
        ValueError: tensor/pipeline parallel size larger than the world size (1 here).
    """
    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1, timeout=timedelta(minutes=30))
    world = torch.distributed.get_world_size()
    if tensor_parallel_size * pipeline_parallel_size > world:
        raise ValueError(f"TP={tensor_parallel_size} x PP={pipeline_parallel_size} exceeds world size {world}")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_parallel_size, pipeline_parallel_size)


def load_hf_config(model_path: str):
    """The ``transformers`` config of a local HF checkpoint directory (no hub access)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path, local_files_only=True)


def transformer_config(spec: ModelSpec, dtype: torch.dtype = torch.float32) -> TransformerConfig:
    """Megatron ``TransformerConfig`` for ``spec``; dropout 0, all fusions off, CPU initialisation."""
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        qk_layernorm=spec.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
    )


def build_gpt_model(spec: ModelSpec, dtype: torch.dtype = torch.float32, seed: int = 0) -> GPTModel:
    """A randomly initialised ``GPTModel`` with ``spec``'s architecture (distributed must be initialised)."""
    model_parallel_cuda_manual_seed(seed)
    config = transformer_config(spec, dtype)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=spec.qk_layernorm, normalization="RMSNorm"),
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
        rotary_percent=1.0,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
    )
    apply_cpu_compat()  # patch megatron modules that the model build imported lazily
    return model.to(dtype)


def megatron_param_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Megatron-named parameter tensors of an (unwrapped) GPTModel, without ``_extra_state`` entries."""
    return {name: tensor for name, tensor in model.state_dict().items() if isinstance(tensor, torch.Tensor)}


@torch.no_grad()
def load_megatron_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model`` in place (keeps parameter identity, so DDP/optimizer stay valid).

    Raises:
        KeyError: ``state`` lacks a model tensor or has an unknown one; ValueError: a shape differs.
    """
    targets = megatron_param_state(model)
    if set(targets) != set(state):
        raise KeyError(f"missing {sorted(set(targets) - set(state))}, unexpected {sorted(set(state) - set(targets))}")
    for name, target in targets.items():
        if target.shape != state[name].shape:
            raise ValueError(f"{name}: shape {tuple(state[name].shape)} != model {tuple(target.shape)}")
        target.copy_(state[name])


def import_hf_weights(model: torch.nn.Module, model_dir: str, spec: ModelSpec) -> None:
    """Load an HF safetensors checkpoint directory into an unwrapped GPTModel."""
    load_megatron_state(model, hf_to_megatron(load_hf_safetensors(model_dir), spec))


@torch.no_grad()
def export_hf_state(model: torch.nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """HF-named CPU fp32 copies of the weights, always including ``lm_head.weight``."""
    hf_state = megatron_to_hf({k: v.detach() for k, v in megatron_param_state(model).items()}, spec)
    return {name: t.to("cpu", torch.float32).clone(memory_format=torch.contiguous_format) for name, t in hf_state.items()}


def build_from_hf(model_path: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[GPTModel, ModelSpec]:
    """Initialise distributed if needed, build the GPTModel for ``model_path`` and load its HF weights."""
    spec = model_spec_from_hf_config(load_hf_config(model_path))
    initialize_distributed()
    model = build_gpt_model(spec, dtype, seed)
    import_hf_weights(model, model_path, spec)
    return model, spec


def gpt_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Causal-LM logits. Shape: input_ids [B, S] int64 -> [B, S, V] (right padding needs no mask)."""
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
    return model(input_ids, position_ids, attention_mask=None)
