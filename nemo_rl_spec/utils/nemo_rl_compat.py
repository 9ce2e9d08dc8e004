"""Loading NeMo-RL recipes (``nemo_rl_compat: true`` at the top of a recipe, or ``+nemo_rl_compat=true``).

Without the switch a recipe is validated strictly: every key this project does not know is listed in one
ConfigError (:func:`~nemo_rl_spec.utils.config.validate_config`). With it, a recipe in NeMo-RL's layout (the key set
of NeMo-RL's ``examples/configs/grpo_math_1B.yaml``) is adapted before validation:

- keys with the same name and meaning are read as they are (``grpo.*``, ``loss_fn.*``, ``policy.generation.*`` ...);
- :data:`RENAMED`: NeMo-RL keys whose value lives under another key here are moved there (a conflicting value
  already there is a ConfigError naming both keys);
- :data:`MUST_MATCH`: NeMo-RL keys that repeat another key's value or name the only choice this build has are
  dropped when they agree, else a ConfigError;
- :data:`IGNORED`: keys of backends and features this project does not have (DTensor, FP8, MoE, context / sequence
  parallelism, NeMo-RL's data pipeline and logger back-ends) are removed, all listed in ONE warning with their values.

Keys in none of these tables stay unknown keys (a typo remains an error under the switch).
"""

from __future__ import annotations

import warnings
from typing import Any

#: the top-level switch (consumed by the loader, never validated)
SWITCH = "nemo_rl_compat"

#: NeMo-RL key -> this project's key with the same meaning
RENAMED: dict[str, str] = {
    "policy.max_grad_norm": "policy.megatron_cfg.optimizer.clip_grad",
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
_LOG = "logger back-ends and GPU monitoring this project does not have"
_GPU = "GPU-only performance switches"

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
    "data.dataset_name": _DATA,
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
}


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
    for key, (other, fixed) in MUST_MATCH.items():
        value = _get(cfg, key)
        if value is _MISSING:
            continue
        expected = _get(cfg, other) if other is not None else fixed
        if value != expected:
            what = f"{other}={expected!r}" if other is not None else f"{expected!r} (the only choice of this build)"
            raise ValueError(f"{key}={value!r} must equal {what} under {SWITCH}")
        _pop(cfg, key)
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
    return frozenset(RENAMED) | frozenset(MUST_MATCH) | frozenset(IGNORED)
