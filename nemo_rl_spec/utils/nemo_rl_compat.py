"""Loading NeMo-RL recipes (``nemo_rl_compat: true`` at the top of a recipe, or ``+nemo_rl_compat=true``).

Without the switch every key this project does not know is listed in one ConfigError. With it, a recipe in NeMo-RL's
layout is adapted before validation: keys with the same name and meaning are read as they are; :data:`RENAMED` and
:data:`SETS` keys move to this project's key (a conflict is an error for RENAMED, NeMo-RL's value wins for SETS);
:data:`MUST_MATCH` keys are dropped when they agree with the value they repeat, else an error; :data:`IGNORED` keys
(backends and features this project does not have) are removed and listed in ONE warning; :data:`OFF_ONLY` features
are accepted at their "off" value and refused by name when on. NeMo-RL's activation-recompute refinements
(``recompute_granularity`` / ``recompute_modules``) are schema keys, dropped where NeMo-RL ignores them
(:func:`_nemo_rl_recompute`). Keys in none of these tables stay unknown (a typo remains an error).
docs/guides/nemo_rl_recipes.md lists the classes.
"""

from __future__ import annotations

import warnings
from typing import Any

#: the top-level switch (consumed by the loader, never validated)
SWITCH = "nemo_rl_compat"

#: NeMo-RL key -> this project's key with the same meaning
RENAMED: dict[str, str] = {
    "policy.max_grad_norm": "policy.megatron_cfg.optimizer.clip_grad",
    "policy.draft.aux_layer_indices": "policy.draft.aux_layer_ids",
}

#: NeMo-RL's default weight of the online draft's loss (``policy.draft.loss_weight``; this project's own default is 1)
NEMO_RL_DRAFT_LOSS_WEIGHT = 0.1

#: NeMo-RL keys whose null means "the default": in a recipe file with the switch, a null is dropped before the
#: file is merged over its ``defaults:``, so the value there applies (:func:`drop_null_defaults`)
NULL_MEANS_DEFAULT: tuple[str, ...] = ("policy.tokenizer.chat_template_kwargs", "data.validation")

#: NeMo-RL key -> this project's key it sets, replacing the value the recipe's ``defaults:`` gave (the NeMo-RL
#: recipe states the user's intent; NeMo-RL validates at the rollout temperature unless told otherwise)
SETS: dict[str, str] = {
    "policy.generation.val_temperature": "grpo.val_temperature",
    "policy.generation.val_top_p": "grpo.val_top_p",
    "policy.generation.val_top_k": "grpo.val_top_k",
    "grpo.val_num_generations_per_prompt": "grpo.val_num_generations",
}

#: NeMo-RL dataset names (``dataset_name`` under ``data.train``, ``data.validation`` or, older layout, ``data``) that
#: this project has as a data source -> (the source key it sets, the source). Other names are ignored with their
#: reason (:data:`IGNORED`): the recipe's ``defaults:`` supply the data.
DATASETS: dict[str, dict[str, tuple[str, str]]] = {
    "data.train.dataset_name": {"DAPOMath17K": ("data.train.source", "dapo_math_17k")},
    "data.dataset_name": {"DAPOMath17K": ("data.train.source", "dapo_math_17k")},
    "data.validation.dataset_name": {"AIME2024": ("data.validation.source", "aime_2024")},
}

#: NeMo-RL key -> (a key whose value it must equal, or None) and the fixed value it must have otherwise
MUST_MATCH: dict[str, tuple[str | None, Any]] = {
    "policy.tokenizer.name": ("policy.model_name", None),  # the policy's own tokenizer only
    "policy.megatron_cfg.pipeline_dtype": ("policy.precision", None),
    "policy.megatron_cfg.optimizer.optimizer": (None, "adam"),
    "grpo.max_rollout_turns": (None, 1),  # single-turn math environment
}

_DTENSOR = "DTensor backend (this project trains with megatron-core only)"
_MOE = "MoE / expert parallelism (dense models only)"
_PAR = "parallelism this build does not run"
_PREC = "mixed-precision flags (the precision is policy.precision)"
_DATA = "NeMo-RL's data pipeline (this project: data.train / data.validation)"
_DATASET = (
    "a dataset this project has no copy of (mapped: DAPOMath17K -> data.train.source=dapo_math_17k, AIME2024 -> "
    "data.validation.source=aime_2024); the data comes from the recipe's defaults"
)
_LOG = "logger back-ends and GPU monitoring this project does not have"
_GPU = "GPU-only performance switches"
_OFFLOAD = "GPU memory offloading (CPU training keeps everything in host memory)"
_REFIT = "refit transport ports and tuning (refit goes through Ray's object store)"

#: NeMo-RL keys (a key or a whole section) without a counterpart here -> why
IGNORED: dict[str, str] = {
    "policy.dtensor_cfg": _DTENSOR,
    "policy.optimizer": _DTENSOR,
    "policy.scheduler": _DTENSOR,
    "policy.megatron_cfg.enabled": "the Megatron backend is always on here",
    "policy.generation_batch_size": "HF generation backend (vLLM only here)",
    "policy.logprob_chunk_size": _GPU,
    "policy.make_sequence_length_divisible_by": _PAR,
    "policy.megatron_cfg.empty_unused_memory_level": _GPU,
    "policy.megatron_cfg.converter_type": "HF <-> Megatron conversion is picked from the model's config.json",
    "policy.megatron_cfg.expert_tensor_parallel_size": _MOE,
    "policy.megatron_cfg.expert_model_parallel_size": _MOE,
    "policy.megatron_cfg.freeze_moe_router": _MOE,
    "policy.megatron_cfg.moe_router_dtype": _MOE,
    "policy.megatron_cfg.moe_router_load_balancing_type": _MOE,
    "policy.megatron_cfg.moe_router_bias_update_rate": _MOE,
    "policy.megatron_cfg.moe_permute_fusion": _MOE,
    "policy.megatron_cfg.num_layers_in_first_pipeline_stage": _PAR,
    "policy.megatron_cfg.num_layers_in_last_pipeline_stage": _PAR,
    "policy.megatron_cfg.context_parallel_size": _PAR,
    "policy.megatron_cfg.sequence_parallel": _PAR,
    "policy.megatron_cfg.apply_rope_fusion": _GPU,
    "policy.megatron_cfg.defer_fp32_logits": _GPU,
    "policy.megatron_cfg.distributed_data_parallel_config": _GPU,
    "policy.megatron_cfg.env_vars": _GPU,
    "policy.megatron_cfg.fp8_cfg": "FP8 training",
    "policy.megatron_cfg.optimizer.bf16": _PREC,
    "policy.megatron_cfg.optimizer.fp16": _PREC,
    "policy.megatron_cfg.optimizer.params_dtype": _PREC,
    "policy.megatron_cfg.optimizer.use_precision_aware_optimizer": _PREC,
    "policy.megatron_cfg.optimizer.sgd_momentum": "SGD (the optimizer is Adam)",
    "policy.generation.vllm_cfg.async_engine": "vLLM's async engine (the in-process engine is synchronous)",
    "policy.generation.vllm_cfg.pipeline_parallel_size": _PAR,
    "policy.generation.vllm_cfg.expert_parallel_size": _MOE,
    "policy.generation.vllm_cfg.use_deep_gemm": _GPU,
    "policy.generation.vllm_cfg.num_last_layers_in_bf16": _PREC,
    "policy.generation.vllm_cfg.num_first_layers_in_bf16": _PREC,
    "checkpointing.checkpoint_must_save_by": "Slurm time-limit saves",
    "checkpointing.model_save_format": "the worker checkpoint format is fixed (checkpointing.save_consolidated writes safetensors)",
    "data.max_input_seq_length": _DATA,
    "data.prompt_file": _DATA,
    "data.system_prompt_file": _DATA,
    "data.shuffle": _DATA,
    "data.dataset_name": _DATASET,
    "env.math.math_verify_impl": "the math verifier is fixed (environments/math_env.py)",
    "logger.num_val_samples_to_print": _LOG,
    "logger.swanlab_enabled": _LOG,
    "logger.monitor_gpus": _LOG,
    "logger.tensorboard": _LOG,
    "logger.gpu_monitoring": _LOG,
    "logger.wandb.entity": "W&B entity (set WANDB_ENTITY; logger.wandb has project and name)",
    "logger.wandb.log_nemo_gym_full_result_tables": "NeMo Gym (not in this project)",
    "logger.mlflow.run_id": "resuming an MLflow run (each launch starts a new run)",
    "logger.mlflow.artifact_location": "MLflow artifact location (the tracking server's or <log_dir>/mlartifacts)",
    "policy.tokenizer.use_fastokens": "the HF tokenizer of the model is used as it is",
    "policy.megatron_cfg.optimizer.optimizer_cpu_offload": _OFFLOAD,
    "policy.megatron_cfg.optimizer.optimizer_offload_fraction": _OFFLOAD,
    "policy.megatron_cfg.optimizer.overlap_cpu_optimizer_d2h_h2d": _OFFLOAD,
    "policy.megatron_cfg.checkpoint": "megatron-core's distributed-checkpoint options (checkpoints are torch files)",
    "policy.megatron_cfg.use_fused_linear_logprobs": _GPU,
    "policy.megatron_cfg.fused_linear_logprobs_chunk_size": _GPU,
    "policy.megatron_cfg.force_reconvert_from_hf": "the HF weights are converted on every start (no conversion cache)",
    "policy.megatron_cfg.cuda_graph_impl": _GPU,
    "policy.megatron_cfg.cuda_graph_modules": _GPU,
    "policy.megatron_cfg.cuda_graph_warmup_steps": _GPU,
    "policy.megatron_cfg.fine_grained_activation_offloading": _OFFLOAD,
    "policy.megatron_cfg.offload_modules": _OFFLOAD,
    "policy.megatron_cfg.bias_activation_fusion": _GPU,
    "policy.megatron_cfg.gradient_accumulation_fusion": _GPU,
    "policy.megatron_cfg.use_fused_weighted_squared_relu": _GPU,
    "policy.megatron_cfg.moe_per_layer_logging": _MOE,
    "policy.megatron_cfg.moe_enable_deepep": _MOE,
    "policy.megatron_cfg.moe_token_dispatcher_type": _MOE,
    "policy.megatron_cfg.moe_shared_expert_overlap": _MOE,
    "policy.megatron_cfg.use_gloo_process_groups": "the process-group backend follows the platform (gloo on CPU, NCCL on GPU)",
    "policy.offload_optimizer_for_logprob": _OFFLOAD,
    "policy.sequence_packing.microbatch_order": "packs run in the packer's order; losses use global counts, so the order does not change the step",
    "policy.generation.vllm_cfg.kv_cache_dtype": _GPU,
    "policy.generation.vllm_cfg.use_tqdm": _LOG,
    "policy.generation.vllm_cfg.enable_vllm_metrics_logger": _LOG,
    "policy.generation.vllm_cfg.vllm_metrics_logger_interval": _LOG,
    "policy.generation.vllm_cfg.http_refit_api_key_env_var": _REFIT,
    "policy.generation.vllm_cfg.http_refit_server_port": _REFIT,
    "policy.generation.vllm_cfg.zmq_refit_server_port": _REFIT,
    "policy.generation.vllm_cfg.reset_encoder_cache_after_weight_update": "multimodal encoders (text models only)",
    "policy.generation.port_range_low": _REFIT,
    "policy.generation.port_range_high": _REFIT,
    "policy.generation.refit_cfg": _REFIT,
    "policy.generation.real_quant_export_cpu_offload": "quantised weight export (the engines take full-precision weights)",
    "policy.generation.mcore_generation_config": "megatron-core's generation backend (vLLM only here)",
    "data.train.dataset_name": _DATASET,
    "data.validation.dataset_name": _DATASET,
    "data.train.split_validation_size": _DATA,
    "data.num_workers": _DATA,
    "data.use_multiple_dataloader": _DATA,
    "data.default": _DATA,
    "logger.swanlab": _LOG,
    "cluster.master_port_range_low": "torch.distributed ports are picked free by Ray's workers",
    "cluster.master_port_range_high": "torch.distributed ports are picked free by Ray's workers",
    "cluster.segment_size": "Slurm topology segments (the placement plan packs nodes itself)",
    "data_plane": "NeMo-RL's transfer-queue data plane (batches move through Ray's object store)",
}


def _section_off(value: Any) -> bool:
    """A NeMo-RL feature section that is off: null, or a mapping whose ``enabled`` is false."""
    return value is None or (isinstance(value, dict) and value.get("enabled") is False)


def _all_false(value: Any) -> bool:
    """A mapping of switches that are all off (null / false entries; non-bool entries are their parameters)."""
    return value is None or (isinstance(value, dict) and not any(v is True for v in value.values()))


#: NeMo-RL key -> (the values or the test that mean "off", the feature it turns on). Off: dropped; on: refused.
OFF_ONLY: dict[str, tuple[Any, str]] = {
    "grpo.async_grpo.recompute_kv_cache_after_weight_updates": ((False,), "KV-cache recompute after in-flight updates"),
    "grpo.invalid_tool_call_advantage": ((None,), "tool-call penalties (single-turn math only)"),
    "grpo.malformed_thinking_advantage": ((None,), "thinking-tag penalties"),
    "policy.megatron_cfg.model_overrides": ((None, {}), "Megatron model-config overrides"),
    "policy.megatron_cfg.peft": (_section_off, "LoRA / PEFT"),
    "policy.hf_config_overrides": ((None, {}), "HF config overrides"),
    "policy.generation.vllm_cfg.logprobs_mode": (("processed_logprobs",), "raw log-probs from the engine"),
    "reward_penalties": (_all_false, "NeMo-Gym reward penalties"),
    "on_policy_distillation": (_section_off, "on-policy distillation"),
}


def _is_off(value: Any, off: Any) -> bool:
    return off(value) if callable(off) else any(value == v and type(value) is type(v) or value is v for v in off)


def check_off_only(cfg: dict) -> None:
    """Drop every :data:`OFF_ONLY` key that is off; raise ValueError naming the key, its value and the feature for
    one that is on."""
    for key, (off, feature) in OFF_ONLY.items():
        value = _get(cfg, key)
        if value is _MISSING:
            continue
        if not _is_off(value, off):
            raise ValueError(
                f"{key}={value!r} turns on {feature}, which this project does not implement; "
                f"remove the key or set it off under {SWITCH}"
            )
        _pop(cfg, key)


def _nemo_rl_recompute(cfg: dict) -> None:
    """NeMo-RL reads ``policy.megatron_cfg.recompute_granularity`` / ``recompute_modules`` only with
    ``activation_checkpointing: true``, and ``recompute_modules`` only with ``recompute_granularity: selective``;
    otherwise they are inert there (its base recipe ships ``recompute_granularity: full`` with checkpointing off).
    This project's schema has the same keys with the same meaning but refuses an inert one, so under the switch the
    inert ones are dropped, as NeMo-RL ignores them; the ones that act are read as they are (and validated there)."""
    mcfg = _get(cfg, "policy.megatron_cfg")
    if not isinstance(mcfg, dict):
        return
    if mcfg.get("activation_checkpointing") is not True:
        mcfg.pop("recompute_granularity", None)
        mcfg.pop("recompute_modules", None)
    elif mcfg.get("recompute_granularity") != "selective":
        mcfg.pop("recompute_modules", None)


def _nemo_rl_draft_semantics(cfg: dict) -> None:
    """NeMo-RL's ``policy.draft``: ``enabled: true`` means the trainer owns the draft and trains it online, with loss
    weight 0.1 unless the recipe says otherwise. Here the same section defaults to a frozen draft (``online:
    false``) with weight 1, so under the switch a section without ``online`` / ``loss_weight`` gets NeMo-RL's."""
    draft = _get(cfg, "policy.draft")
    if not isinstance(draft, dict):
        return
    if draft.get("enabled") is True:
        draft.setdefault("online", True)
    draft.setdefault("loss_weight", NEMO_RL_DRAFT_LOSS_WEIGHT)


def _nemo_rl_datasets(cfg: dict) -> None:
    """Map the :data:`DATASETS` names onto this project's data sources (the key popped, the source set); other names
    stay for :data:`IGNORED`."""
    for key, names in DATASETS.items():
        value = _get(cfg, key)
        if value in names:
            target, source = names[value]
            _pop(cfg, key)
            _set(cfg, target, source)


def drop_null_defaults(data: dict) -> dict:
    """Remove the :data:`NULL_MEANS_DEFAULT` keys that are null from one recipe file's dict (in place; returned)."""
    for key in NULL_MEANS_DEFAULT:
        if _get(data, key) is None:
            _pop(data, key)
    return data


class NemoRLCompatWarning(UserWarning):
    """Keys of a NeMo-RL recipe ignored under ``nemo_rl_compat: true`` (one warning per load, listing all)."""


_MISSING = object()


def _get(cfg: dict, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _pop(cfg: dict, key: str) -> None:
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    del node[leaf]


def _set(cfg: dict, key: str, value: Any) -> None:
    *parents, leaf = key.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def adapt_nemo_rl_recipe(cfg: dict) -> tuple[dict, list[str]]:
    """Adapt a resolved NeMo-RL-layout recipe (plain dict, switch already removed) in place (module docstring).

    Returns (the recipe, ``"key=value (reason)"`` of every ignored key). Raises ValueError naming both keys for a
    renamed key that conflicts with its target, or a :data:`MUST_MATCH` key with another value.
    """
    for src, dst in RENAMED.items():
        value = _get(cfg, src)
        if value is _MISSING:
            continue
        there = _get(cfg, dst)
        if there is not _MISSING and there != value:
            raise ValueError(f"{src}={value!r} (NeMo-RL's name of {dst}) conflicts with {dst}={there!r}; set one")
        _pop(cfg, src)
        _set(cfg, dst, value)
    for src, dst in SETS.items():
        value = _get(cfg, src)
        if value is not _MISSING:
            _pop(cfg, src)
            _set(cfg, dst, value)
    for key, (other, fixed) in MUST_MATCH.items():
        value = _get(cfg, key)
        if value is _MISSING:
            continue
        expected = _get(cfg, other) if other is not None else fixed
        if value != expected:
            what = f"{other}={expected!r}" if other is not None else f"{expected!r} (the only choice of this build)"
            raise ValueError(f"{key}={value!r} must equal {what} under {SWITCH}")
        _pop(cfg, key)
    check_off_only(cfg)
    _nemo_rl_recompute(cfg)
    _nemo_rl_draft_semantics(cfg)
    _nemo_rl_datasets(cfg)
    ignored = []
    for key, reason in IGNORED.items():
        value = _get(cfg, key)
        if value is not _MISSING:
            ignored.append(f"{key}={value!r}: {reason}")
            _pop(cfg, key)
    if ignored:
        warnings.warn(
            f"{SWITCH}: {len(ignored)} NeMo-RL keys ignored (no counterpart in this build):\n  " + "\n  ".join(ignored),
            NemoRLCompatWarning,
            stacklevel=3,
        )
    return cfg, ignored


def known_nemo_rl_keys() -> frozenset[str]:
    """Every NeMo-RL key the compatibility switch handles (renamed, checked or ignored), for the strict error's hint."""
    keys = (RENAMED, SETS, MUST_MATCH, IGNORED, OFF_ONLY, DATASETS)
    return frozenset(k for table in keys for k in table)
