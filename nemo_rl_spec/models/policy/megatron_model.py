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

from nemo_rl_spec.models.hf_weight_mapping import (
    ModelSpec,
    check_tp_size,
    hf_to_megatron,
    load_hf_safetensors,
    megatron_to_hf,
    model_spec_from_hf_config,
    tp_shard,
    tp_unshard,
)
from nemo_rl_spec.models.policy.cpu_compat import apply_cpu_compat

apply_cpu_compat()  # before any megatron import (triton stub, torch proxies)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from nemo_rl_spec.models.policy.packed_attention import PackedDotProductAttention  # noqa: E402
from nemo_rl_spec.models.policy.pipeline import gather_stages, pp_size, stage_layer_offset, stage_state, to_global_names  # noqa: E402

PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def initialize_distributed(tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> None:
    """Join the ``torch.distributed`` world and initialise megatron ``parallel_state`` (TP x PP, DP = the rest) if
    not yet done.

    Inside a :class:`~nemo_rl_spec.distributed.worker_group.RayWorkerGroup` (``RANK`` / ``WORLD_SIZE`` set) the world
    is the group's (:func:`~nemo_rl_spec.distributed.worker_group.init_process_group_from_env`); a process created
    outside one (a test, a single actor) gets a world of size 1 on a free local port, without touching
    ``os.environ`` (a Ray cluster started later from this process would hand the variables on to its actors).
    Megatron's rank order is tp-cp-ep-dp-pp: rank = pp * (DP * TP) + dp * TP + tp.

    Raises:
        ValueError: ``policy.megatron_cfg.tensor_model_parallel_size`` x ``pipeline_model_parallel_size`` does not
            divide the world size, or ``parallel_state`` already holds other sizes (one layout per process).
    """
    if not torch.distributed.is_initialized():
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            from nemo_rl_spec.distributed.worker_group import init_process_group_from_env  # imports ray

            init_process_group_from_env()
        else:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            torch.distributed.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{_free_port()}",
                rank=0,
                world_size=1,
                timeout=timedelta(minutes=30),
            )
    world = torch.distributed.get_world_size()
    if world % (tensor_parallel_size * pipeline_parallel_size):
        raise ValueError(
            f"policy.megatron_cfg.tensor_model_parallel_size={tensor_parallel_size} x "
            f"pipeline_model_parallel_size={pipeline_parallel_size} does not divide the {world} policy "
            "workers"
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_parallel_size, pipeline_parallel_size)
    held = (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )
    if held != (tensor_parallel_size, pipeline_parallel_size):
        raise ValueError(
            f"this process already runs megatron with TP x PP = {held}; cannot also build "
            f"{(tensor_parallel_size, pipeline_parallel_size)}"
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tp_partial_grad(name: str, config: TransformerConfig) -> bool:
    """True for a replicated parameter whose gradient each TP rank only holds in part (megatron's
    ``finalize_model_grads`` sums it over TP): the q/k RMSNorm weights, applied to each rank's own heads."""
    return bool(config.qk_layernorm) and ("q_layernorm" in name or "k_layernorm" in name)


def tp_group():
    """The tensor-parallel process group of this rank (size 1 without TP)."""
    return parallel_state.get_tensor_model_parallel_group()


def load_hf_config(model_path: str):
    """The ``transformers`` config of a local HF checkpoint directory (no hub access)."""
    from transformers import AutoConfig  # lazy: transformers is slow to import

    return AutoConfig.from_pretrained(model_path, local_files_only=True)


MTP_PREFIX = "mtp."  # megatron-core names of the MTP block's parameters (``mtp.layers.<k>.*``)
DECODER_PREFIX = "decoder."  # the transformer layers and final norm (not the embedding or output layer)


def recompute_settings(
    activation_checkpointing: bool, recompute_granularity: str | None = None, recompute_modules: list[str] | None = None
) -> dict:
    """megatron-core ``TransformerConfig`` keyword arguments for NeMo-RL's activation-checkpointing keys
    (``policy.megatron_cfg.activation_checkpointing`` / ``recompute_granularity`` / ``recompute_modules``, validated
    by the schema's ``MegatronConfig``); megatron-core does the recompute itself.

    Off: {} (megatron's default, nothing recomputed). ``"full"`` (or None, NeMo-RL's default): every transformer
    layer is rerun in the backward from its checkpointed input (``recompute_method="uniform"``,
    ``recompute_num_layers=1``, as NeMo-RL sets it). ``"selective"``: only the named submodules of each layer are
    rerun (``recompute_modules``; None keeps megatron's default ``["core_attn"]``); the rest keep their activations.
    """
    if not activation_checkpointing:
        return {}
    if recompute_granularity == "selective":
        modules = list(recompute_modules) if recompute_modules is not None else None
        return dict(recompute_granularity="selective", recompute_modules=modules)
    if recompute_granularity not in (None, "full"):
        raise ValueError(f"recompute_granularity={recompute_granularity!r}: expected 'full', 'selective' or None")
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def transformer_config(
    spec: ModelSpec,
    dtype: torch.dtype = torch.float32,
    mtp_num_layers: int = 0,
    activation_checkpointing: bool = False,
    recompute_granularity: str | None = None,
    recompute_modules: list[str] | None = None,
    mtp_use_repeated_layer: bool = False,
) -> TransformerConfig:
    """Megatron ``TransformerConfig`` for ``spec``; dropout 0, all fusions off, CPU initialisation.

    ``mtp_num_layers`` > 0 adds megatron-core's multi-token-prediction block (``mtp_num_layers`` in the config,
    its loss scale left at megatron's default: the worker computes the MTP loss itself, see
    :func:`gpt_trunk_forward`); ``mtp_use_repeated_layer`` is megatron-core's option of the same name (one MTP
    layer built and applied at every depth, NeMo-RL's ``policy.megatron_cfg.mtp_use_repeated_layer``).
    ``activation_checkpointing`` recomputes activations in the backward, whole layers or the ``recompute_modules``
    of each layer (:func:`recompute_settings`).
    ``calculate_per_token_loss=True``: the worker's losses are already divided by global (all data-parallel ranks)
    token / sequence counts, so Megatron DDP must SUM gradients over DP (gradient_scaling_factor 1) instead of
    averaging them.
    """
    recompute = recompute_settings(activation_checkpointing, recompute_granularity, recompute_modules)
    return TransformerConfig(
        **recompute,
        calculate_per_token_loss=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        # PP: activations travel between stages in the parameters' dtype, each preceded by its shape (micro-batches
        # keep their own padded lengths: pipeline.py)
        pipeline_dtype=dtype,
        variable_seq_lengths=parallel_state.get_pipeline_model_parallel_world_size() > 1,
        moe_token_dispatcher_type="alltoall",  # dense models: unused, but megatron refuses "allgather" with the above
        mtp_num_layers=mtp_num_layers or None,
        mtp_use_repeated_layer=bool(mtp_use_repeated_layer and mtp_num_layers),
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


def build_gpt_model(
    spec: ModelSpec,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    mtp_num_layers: int = 0,
    activation_checkpointing: bool = False,
    recompute_granularity: str | None = None,
    recompute_modules: list[str] | None = None,
    mtp_use_repeated_layer: bool = False,
) -> GPTModel:
    """A randomly initialised ``GPTModel`` with ``spec``'s architecture (distributed must be initialised).

    With ``mtp_num_layers`` > 0 the model carries megatron-core's ``MultiTokenPredictionBlock``
    (``model.mtp``), built by ``get_gpt_mtp_block_spec`` from the local layer spec: per MTP layer k an
    ``enorm``/``hnorm`` RMSNorm pair, ``eh_proj`` [H, 2H], one transformer layer like the decoder's last, and a
    final RMSNorm; logits come from the shared output layer. With ``mtp_use_repeated_layer`` megatron-core builds
    that layer once (``mtp.layers.0.*``) and applies it at each of the ``mtp_num_layers`` depths: the parameters of
    one layer, the depths of ``mtp_num_layers``.

    With tensor parallelism every rank draws the full initial weights from the same CPU generator (seeded with
    ``seed`` on every rank) and keeps its slice, so the TP=T model equals the TP=1 one. The recompute arguments
    are :func:`recompute_settings`'s (selective ``core_attn`` reruns :class:`PackedDotProductAttention`, packs
    included).

    Raises:
        ValueError: the model cannot be split over the tensor-parallel size (:func:`check_tp_size`).
    """
    check_tp_size(spec, parallel_state.get_tensor_model_parallel_world_size())
    model_parallel_cuda_manual_seed(seed)
    config = transformer_config(
        spec,
        dtype,
        mtp_num_layers,
        activation_checkpointing,
        recompute_granularity,
        recompute_modules,
        mtp_use_repeated_layer,
    )
    layer_spec = get_gpt_layer_local_spec(qk_layernorm=spec.qk_layernorm, normalization="RMSNorm")
    layer_spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention  # + THD packs
    mtp_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False) if mtp_num_layers else None
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        mtp_block_spec=mtp_spec,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
        rotary_percent=1.0,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
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
    """Load an HF safetensors checkpoint directory into an unwrapped GPTModel (this TP rank's slices).

    The HF checkpoint has no MTP weights: each MTP layer's transformer layer starts as a copy of the last
    decoder layer and its norms as the final norm (DeepSeek-V3 / MiMo-style warm start), ``eh_proj`` keeps its
    random megatron initialisation.
    """
    full = hf_to_megatron(load_hf_safetensors(model_dir), spec)
    full.update(mtp_init_from_trunk(megatron_param_state(model), full, spec.num_layers))
    local = megatron_param_state(model)
    full = stage_state(full, local, stage_layer_offset(model), spec.tie_word_embeddings)
    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    state = {name: tp_shard(name, full[name], rank, size) if name in full else t for name, t in local.items()}
    load_megatron_state(model, state)


def mtp_init_from_trunk(
    model_state: dict[str, torch.Tensor], trunk_state: dict[str, torch.Tensor], num_layers: int
) -> dict[str, torch.Tensor]:
    """Initial MTP tensors (megatron names, full size) copied from the full trunk tensors; MTP tensors without a
    trunk counterpart (``eh_proj``) are left out (they keep the model's values). Empty without an MTP block."""
    last = f"decoder.layers.{num_layers - 1}."
    out = {}
    for name in model_state:
        if not name.startswith(MTP_PREFIX):
            continue
        _, _, k, rest = name.split(".", 3)  # mtp.layers.<k>.<rest>
        if rest.startswith("mtp_model_layer."):
            source = last + rest[len("mtp_model_layer.") :]
        elif rest.split(".")[0] in ("enorm", "hnorm", "final_layernorm"):
            source = "decoder.final_layernorm." + rest.split(".", 1)[1]
        else:
            continue
        out[name] = trunk_state[source].clone()
    return out


@torch.no_grad()
def full_param_state(model: torch.nn.Module, names=None) -> dict[str, torch.Tensor]:
    """Megatron-named full tensors: this rank's slices all-gathered over the tensor-parallel group and put back
    together (:func:`~nemo_rl_spec.models.hf_weight_mapping.tp_unshard`); every TP rank must call it (collective).
    ``names``: a filter (default: every parameter). Without TP, the model's own tensors (no copy)."""
    local = {k: v.detach() for k, v in megatron_param_state(model).items() if names is None or names(k)}
    group, size = tp_group(), parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return local
    out = {}
    for name, tensor in local.items():
        parts = [torch.empty_like(tensor) for _ in range(size)]
        torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
        out[name] = tp_unshard(name, parts)
    return out


@torch.no_grad()
def export_hf_state(model: torch.nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """HF-named CPU copies of the full trunk weights in the parameters' dtype (fp32 or bf16: no
    fp32 round trip), gathered over TP (a collective), always including ``lm_head.weight`` (MTP weights are not part
    of the HF Llama/Qwen3 layout and are left out). CPU because the refit transport is Ray's object store. With
    pipeline parallelism the stages' layers are gathered too (:func:`~.pipeline.gather_stages`, every rank gets
    the whole model)."""
    trunk = full_param_state(model, lambda name: not name.startswith(MTP_PREFIX))
    if pp_size() > 1:  # every stage's layers under global names, put together on every stage
        local = to_global_names(trunk, stage_layer_offset(model), spec.tie_word_embeddings)
        trunk = gather_stages({k: v.to("cpu") for k, v in local.items()})
    hf_state = megatron_to_hf(trunk, spec)
    return {name: t.to("cpu").clone(memory_format=torch.contiguous_format) for name, t in hf_state.items()}


def build_from_hf(
    model_path: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    mtp_num_layers: int = 0,
    mtp_use_repeated_layer: bool = False,
) -> tuple[GPTModel, ModelSpec]:
    """Initialise distributed if needed, build the GPTModel for ``model_path`` and load its HF weights."""
    spec = model_spec_from_hf_config(load_hf_config(model_path))
    initialize_distributed()
    model = build_gpt_model(spec, dtype, seed, mtp_num_layers, mtp_use_repeated_layer=mtp_use_repeated_layer)
    import_hf_weights(model, model_path, spec)
    return model, spec


def _position_ids(input_ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)


def gpt_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Causal-LM logits of the main head. Shape: input_ids [B, S] int64 -> [B, S, V] (right padding needs no
    mask). A model with an MTP block skips it (``GPTModel.forward`` would run it and its built-in loss)."""
    unwrapped = getattr(model, "module", model)
    if not unwrapped.config.mtp_num_layers:
        return model(input_ids, _position_ids(input_ids), attention_mask=None)
    trunk = gpt_trunk_forward(unwrapped, input_ids)
    return output_logits(unwrapped, trunk.hidden)


def packed_gpt_logits(model: torch.nn.Module, input_ids: torch.Tensor, row_tokens: tuple[int, ...]) -> torch.Tensor:
    """Main-head logits of a packed sequence (:mod:`~.sequence_packing`) through megatron-core's THD path: embedding,
    decoder with ``PackedSeqParams`` (``cu_seqlens`` from ``row_tokens``; the core attention,
    :class:`~.packed_attention.PackedDotProductAttention`, attends causally within each row), output layer. The rotary
    table is passed per token, read at each token's position in its row (0 .. row_tokens[b] - 1), which megatron
    applies in one call (``GPTModel.forward`` would pass the [max row, d] table and apply it row by row).

    Shape: input_ids [1, T] int64, T = sum(row_tokens) -> [1, T, V] (V / TP with tensor parallelism).
    Raises:
        ValueError: the model has an MTP block (its shifted inputs would cross row boundaries).
    """
    unwrapped = getattr(model, "module", model)
    if unwrapped.config.mtp_num_layers:
        raise ValueError("packed_gpt_logits: a model with an MTP block cannot run packed sequences")
    device = input_ids.device
    cu_seqlens = F.pad(torch.tensor(row_tokens, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0)).to(device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max(row_tokens),
        max_seqlen_kv=max(row_tokens),
    )
    positions = torch.cat([torch.arange(n, device=device) for n in row_tokens])
    table = unwrapped.rotary_pos_emb(max(row_tokens))  # [max row, 1, 1, d]
    hidden = unwrapped.embedding(input_ids=input_ids, position_ids=positions.unsqueeze(0))
    hidden = unwrapped.decoder(
        hidden_states=hidden, attention_mask=None, rotary_pos_emb=table[positions], packed_seq_params=params
    )
    return output_logits(unwrapped, hidden)


class TrunkOutput:
    """What the main and MTP heads consume: ``hidden`` [S, B, H] (decoder output after its final norm),
    ``position_ids`` [B, S], ``rotary_pos_emb`` (megatron RoPE table)."""

    def __init__(self, hidden, position_ids, rotary_pos_emb):
        self.hidden, self.position_ids, self.rotary_pos_emb = hidden, position_ids, rotary_pos_emb


def gpt_trunk_forward(model: GPTModel, input_ids: torch.Tensor) -> TrunkOutput:
    """Embedding + decoder of an unwrapped GPTModel (``GPTModel.forward`` up to ``_postprocess``), so the
    caller can attach the main head and the MTP block to the trunk output separately.

    Shape: input_ids [B, S] int64 -> hidden [S, B, H].
    """
    position_ids = _position_ids(input_ids)
    decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, seq_offset, _ = model._preprocess(
        input_ids=input_ids, position_ids=position_ids
    )[:6]
    hidden = model.decoder(
        hidden_states=decoder_input,
        attention_mask=None,
        rotary_pos_emb=rotary_pos_emb,
        rotary_pos_cos=rotary_pos_cos,
        rotary_pos_sin=rotary_pos_sin,
        sequence_len_offset=seq_offset,
    )
    return TrunkOutput(hidden, position_ids, rotary_pos_emb)


def output_weight(model: GPTModel) -> torch.Tensor:
    """The [V, H] output-projection weight (the embedding table when tied)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def output_logits(model: GPTModel, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Shared output layer: hidden [S, B, H] -> logits [B, S, V]; ``weight`` overrides the [V, H] matrix."""
    logits, _ = model.output_layer(hidden, weight=output_weight(model) if weight is None else weight)
    return logits.transpose(0, 1).contiguous()


def detached_embedding(model: GPTModel):
    """The model's embedding as the callable :func:`mtp_hidden_states` takes, its output detached: an MTP block fed
    through it sends no gradient into the embedding table. Shape: input_ids [B, S] -> [S, B, H]."""

    def embed(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return model.embedding(input_ids=input_ids, position_ids=position_ids).detach()

    return embed


def mtp_hidden_states(
    model: GPTModel, input_ids: torch.Tensor, trunk: TrunkOutput, hidden: torch.Tensor, embedding
) -> list[torch.Tensor]:
    """Run megatron-core's MTP block on trunk output ``hidden`` [S, B, H]; one [S, B, H] tensor per MTP layer.

    Layer k (0-based) at position p sees tokens <= p + k + 1 and predicts token p + k + 2 (the main head at p
    predicts p + 1). ``embedding(input_ids=, position_ids=)`` is the callable the block embeds the shifted
    tokens with (the model's embedding, or a wrapper that detaches / rescales its gradient).
    """
    out = model.mtp(
        input_ids=input_ids,
        position_ids=trunk.position_ids,
        hidden_states=hidden,
        attention_mask=None,
        rotary_pos_emb=trunk.rotary_pos_emb,
        embedding=embedding,
    )
    return list(torch.chunk(out, 1 + model.config.mtp_num_layers, dim=0))[1:]
