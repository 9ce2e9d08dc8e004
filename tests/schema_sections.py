"""The boolean and optional keys of the config schema, enumerated from the pydantic models.

Every field of :class:`~nemo_rl_spec.utils.config_schema.MasterConfig` (recursively, through nested models and the
models inside optional sections) whose annotation is ``bool`` or ``Optional[...]`` is a *switch*. For a recipe, each
switch gives one variant: the recipe with that one key changed as a user would change it from the command line:

* ``bool``: flipped (``key=true|false``; the field's default when the recipe leaves its section out);
* ``Optional[<section model>]``: absent/null -> ``+key={}`` (the section with its own defaults, i.e. the feature
  on), present -> ``key=null``;
* ``Optional[<scalar or list>]``: null -> the first candidate value the field accepts (see :data:`CANDIDATES`),
  set -> ``key=null``.

A key added to the schema is covered without editing this file. A switch that does nothing unless other keys are
set with it (and is refused alone as inert) is turned on together with them, as a user would: :data:`WITH`.
Import with ``sys.path.insert(0, <tests dir>)``.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "grpo_math_tiny.yaml"
# tried in order for an Optional scalar that the recipe leaves null; the first the field's type accepts is used
CANDIDATES = (2, 2.0, 0.5, "train/reward", [0], ["chain_sum"], [[1, 8, 1]], {})  # (a Literal: its first value)


@dataclass(frozen=True)
class Switch:
    """One boolean/optional schema key. ``kind``: "bool", "section" (Optional[BaseModel]) or "optional"."""

    path: str
    kind: str
    field: FieldInfo
    inner: typing.Any  # the annotation without None


def _strip_optional(ann) -> tuple[typing.Any, bool]:
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) < len(typing.get_args(ann)):
            return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), True
    return ann, False


def _is_model(t) -> bool:
    return isinstance(t, type) and issubclass(t, BaseModel)


def schema_switches(model: type[BaseModel] | None = None, prefix: str = "") -> list[Switch]:
    """Every bool / Optional field of ``model`` (default MasterConfig) and of the models nested in it, with dotted
    paths, in declaration order."""
    if model is None:
        from nemo_rl_spec.utils.config_schema import MasterConfig

        model = MasterConfig
    out: list[Switch] = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        inner, optional = _strip_optional(field.annotation)
        if inner is bool:
            out.append(Switch(path, "bool", field, inner))
        elif optional:
            out.append(Switch(path, "section" if _is_model(inner) else "optional", field, inner))
        if _is_model(inner):
            out += schema_switches(inner, path + ".")
    return out


def _select(raw: dict, path: str):
    """(found, value) of a dotted path in a plain dict; found False when a section on the way is absent/null."""
    node = raw
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _candidate(sw: Switch):
    from typing import Annotated, Literal

    if typing.get_origin(sw.inner) is Literal:
        return typing.get_args(sw.inner)[0]
    meta = tuple(sw.field.metadata)
    adapter = TypeAdapter(Annotated[(sw.inner, *meta)] if meta else sw.inner)
    for value in CANDIDATES:
        try:
            adapter.validate_python(value)
            return value
        except ValidationError:
            continue
    raise AssertionError(f"{sw.path}: no candidate in CANDIDATES fits {sw.inner!r}; add one")


def _yaml(value) -> str:
    import json

    return "null" if value is None else json.dumps(value)


def variant(sw: Switch, raw: dict) -> list[str]:
    """The override(s) that change switch ``sw`` on the recipe ``raw`` (the resolved YAML as a plain dict)."""
    found, current = _select(raw, sw.path)
    if sw.kind == "bool":
        if not found or current is None:
            default = sw.field.get_default()
            current = bool(default) if isinstance(default, bool) else False
        new = not current
    elif current is None:
        new = {} if sw.kind == "section" else _candidate(sw)
    else:
        new = None
    return [f"{'' if found else '+'}{sw.path}={_yaml(new)}", *(WITH.get(sw.path, ()) if new is True else ())]


def recipe_variants(recipe: Path = TINY) -> list[tuple[Switch, list[str]]]:
    """(switch, overrides) for every switch of the schema on ``recipe``."""
    from omegaconf import OmegaConf

    from nemo_rl_spec.utils.config import load_yaml_with_defaults

    raw = OmegaConf.to_container(load_yaml_with_defaults(recipe), resolve=True)
    return [(sw, variant(sw, raw)) for sw in schema_switches()]


def pre_ray_checks(overrides: list[str], recipe: Path = TINY):
    """Everything ``examples/run_grpo.py`` checks before Ray starts; returns the config. Raises ConfigError."""
    from nemo_rl_spec.algorithms.grpo_setup import preflight
    from nemo_rl_spec.utils.config import check_runtime_support, load_config

    cfg = load_config(recipe, overrides)
    check_runtime_support(cfg)
    preflight(cfg)
    return cfg


def pre_ray_outcome(overrides: list[str], recipe: Path = TINY) -> tuple[str, str | None]:
    """("ok", None) or ("refused", the ConfigError's message: what the CLI prints before exiting 2)."""
    from nemo_rl_spec.utils.config import ConfigError

    try:
        pre_ray_checks(overrides, recipe)
    except ConfigError as exc:
        return "refused", str(exc)
    return "ok", None


def names_key(message: str, path: str) -> bool:
    """True when ``message`` names the dotted key ``path`` or its section: the parent path, when it has at least
    two parts, as a whole dotted name (e.g. the pydantic location ``policy.megatron_cfg.scheduler: ...`` or a key
    ``policy.generation.colocated.resources.gpus_per_node`` of the same section)."""
    import re

    if path in message:
        return True
    parent = path.rpartition(".")[0]
    return parent.count(".") >= 1 and re.search(rf"(?<![\w.]){re.escape(parent)}(?!\w)", message) is not None


# The keys whose variant on the tiny recipe is refused before Ray on this CPU build, each with a fragment of the
# refusal it must print. Written by hand on purpose: every key not listed here must pass the pre-Ray checks (and, in
# tests/functional/test_schema_sections_run.py, complete a GRPO step), so a new schema key defaults to "must pass",
# and a key that starts or stops being refused fails the tests until this table is edited.
REFUSED_BEFORE_RAY: dict[str, str] = {
    "grpo.pilot_commit": "rollout_budget_per_step=8 leaves no commit slot",
    "grpo.pilot_commit.rollout_budget_per_step": "rollout_budget_per_step=2 leaves no commit slot",
    "grpo.pilot_commit.bind_pilot_to_commit": "rollout_budget_per_step=8 leaves no commit slot",
    "grpo.pilot_commit.fill_commit_budget": "rollout_budget_per_step=8 leaves no commit slot",
    "grpo.pilot_commit.fixed_train_batch": "fixed_train_batch=true with grpo.pilot_commit.bind_pilot_to_commit=true",
    "grpo.pilot_commit.repilot_within_step": "rollout_budget_per_step=8 leaves no commit slot",
    "grpo.batch_multiplier": "grpo.batch_multiplier=2.0 needs DAPO dynamic sampling",
    "grpo.stop_at_validation_metric": "needs grpo.stop_at_validation_threshold",
    "grpo.async_grpo.enabled": "set loss_fn.use_importance_sampling_correction=true",
    "loss_fn.sequence_level_importance_ratios": "(GSPO) needs loss_fn.token_level_loss=false",
    "grpo.reward_shaping.enabled": "needs stop_properly_penalty_coef or all of overlong_buffer_length",
    "grpo.adv_estimator.use_leave_one_out_baseline": "differs from grpo.use_leave_one_out_baseline=False",
    "loss_fn.truncated_importance_sampling_type": "needs loss_fn.use_importance_sampling_correction=true",
    "loss_fn.truncated_importance_sampling_ratio_min": "_ratio_min needs truncated_importance_sampling_ratio",
    "policy.megatron_cfg.scheduler.start_weight_decay": "start_weight_decay=2.0 / end_weight_decay=0.0 must satisfy",
    "policy.megatron_cfg.scheduler.end_weight_decay": "start_weight_decay=0.0 / end_weight_decay=2.0 must satisfy",
    "policy.generation.colocated.enabled": "split placement on one node needs the slots given to generation",
    "policy.generation.dynamic_speculation": "set exactly one of num_speculative_tokens_per_batch_size",
    "policy.generation.dynamic_speculation.num_speculative_tokens_per_batch_size": "dynamic_speculation needs policy.generation.vllm_kwargs.speculative_config",
    "policy.generation.dynamic_speculation.step_costs": "step_costs: no file train/reward",
    "policy.generation.dynamic_speculation.acceptance_rate": "set exactly one of num_speculative_tokens_per_batch_size",
    "policy.generation.dynamic_speculation.drafter_pass_at_k0": "set exactly one of num_speculative_tokens_per_batch_size",
    "policy.generation.dynamic_speculation.drafter_pass_max_batch": "set exactly one of num_speculative_tokens_per_batch_size",
    "policy.generation.dynamic_speculation.drafter_catch_up": "set exactly one of num_speculative_tokens_per_batch_size",
    "policy.generation.dynamic_speculation.plain_step_at_k0": "set exactly one of num_speculative_tokens_per_batch_size",
    "policy.generation.dynamic_speculation.live_acceptance": "set exactly one of num_speculative_tokens_per_batch_size",
    "policy.generation.debug_lossy_sampler": "needs policy.generation.vllm_kwargs.speculative_config",
    "policy.draft.model_name": "no draft there (config.json missing)",
    "policy.draft.online": "needs policy.generation.vllm_kwargs.speculative_config.method=eagle3",
    "policy.megatron_cfg.mtp_warm_start": "mtp_warm_start.enabled=true needs mtp_num_layers >= 1",
    "policy.megatron_cfg.mtp_use_repeated_layer": "mtp_use_repeated_layer=true needs mtp_num_layers >= 1",
    # the recompute refinements act only with activation_checkpointing=true, off in the tiny recipe
    "policy.megatron_cfg.recompute_granularity": "needs policy.megatron_cfg.activation_checkpointing=true",
    "policy.megatron_cfg.recompute_modules": "needs policy.megatron_cfg.activation_checkpointing=true",
    "logger.mlflow.tracking_uri": "expected a URI such as http://127.0.0.1:5000",
    "cluster.ray_address": "expected null, auto, host:port or ray://host:port",
}


# Switches that act only with other keys set (alone they are refused as inert, or act on nothing): turned on, their
# variant carries these overrides too. Packing treats the keys they set as the switch's own (:func:`conflicts`), and
# what they make inert is in HIDES.
WITH: dict[str, tuple[str, ...]] = {
    # the KL moved into the reward needs a KL coefficient and the estimator that reads it (NeMo-RL's REINFORCE++)
    "loss_fn.use_kl_in_reward": (
        "loss_fn.reference_policy_kl_penalty=0.01",
        "grpo.adv_estimator.name=reinforce_plus_plus",
    ),
}


def _with_keys(path: str) -> tuple[str, ...]:
    """The dotted keys the :data:`WITH` overrides of switch ``path`` set."""
    return tuple(o.split("=", 1)[0].lstrip("+") for o in WITH.get(path, ()))


def expected_refusal(path: str) -> str | None:
    """The message fragment the tiny recipe's variant of ``path`` must be refused with, or None: it must pass."""
    return REFUSED_BEFORE_RAY.get(path)


def _scope(sw: Switch) -> str:
    """The part of the config a switch's variant governs: a section switch (on/off) or an ``enabled`` flag governs
    the whole section (turning it off disables every key under it); any other switch only its own key."""
    if sw.kind == "section":
        return sw.path
    if sw.kind == "bool" and sw.path.endswith(".enabled"):
        return sw.path.rpartition(".")[0]
    return sw.path


def _under(path: str, scope: str) -> bool:
    return path == scope or path.startswith(scope + ".")


def conflicts(a: Switch, b: Switch) -> bool:
    """True when one switch's variant could disable (or redefine) the path the other's variant exercises, so they
    must not share one packed run: e.g. ``checkpointing.enabled=false`` with ``checkpointing.save_consolidated=true``,
    ``+grpo.dynamic_sampling={}`` with ``+grpo.dynamic_sampling.enabled=false``."""
    return (
        _under(b.path, _scope(a))
        or _under(a.path, _scope(b))
        or any(_under(k, _scope(a)) for k in _with_keys(b.path))
        or any(_under(k, _scope(b)) for k in _with_keys(a.path))
        or bool(set(_with_keys(a.path)) & set(_with_keys(b.path)))
        or any(b.path.startswith(h) for h in HIDES.get(a.path, ()))
        or any(a.path.startswith(h) for h in HIDES.get(b.path, ()))
    )


# Hand-written exclusions packing cannot see from the key paths: dynamic sampling on the random tiny model keeps no
# group (all rewards 0), so its step trains on nothing and would hide every training-side switch packed with it
# (grpo.use_dynamic_sampling is NeMo-RL's spelling of the same switch).
_TRAINING_SIDE = (
    "loss_fn.",
    "policy.megatron_cfg.",
    "policy.dynamic_batching",
    "policy.sequence_packing",
    "policy.draft",
    "grpo.normalize_rewards",
    "grpo.use_leave_one_out_baseline",
)
# loss_fn.use_kl_in_reward's WITH sets the reinforce_plus_plus estimator, which reads none of the grpo estimator's
# options.
_GRPO_ESTIMATOR = (
    "grpo.normalize_rewards",
    "grpo.use_leave_one_out_baseline",
    "grpo.adv_estimator.normalize_rewards",
    "grpo.adv_estimator.use_leave_one_out_baseline",
)
HIDES: dict[str, tuple[str, ...]] = {
    "grpo.dynamic_sampling": _TRAINING_SIDE,
    "grpo.use_dynamic_sampling": _TRAINING_SIDE,
    "loss_fn.use_kl_in_reward": _GRPO_ESTIMATOR,
}


def packed_groups(
    variants: list[tuple[Switch, list[str]]], outcome=pre_ray_outcome
) -> list[list[tuple[Switch, list[str]]]]:
    """The expected-to-pass switches packed greedily into groups for one run each. In schema order, a switch joins
    the first group whose switches it does not :func:`conflict <conflicts>` with and whose combined overrides plus
    its own still pass ``outcome`` (the pre-Ray checks); otherwise it opens a new group. A switch that fails
    ``outcome`` alone raises AssertionError (it belongs in :data:`REFUSED_BEFORE_RAY` or is a bug)."""
    groups: list[list[tuple[Switch, list[str]]]] = []
    for sw, overrides in variants:
        if expected_refusal(sw.path) is not None:
            continue
        for group in groups:
            if any(conflicts(sw, other) for other, _ in group):
                continue
            if outcome([o for _, os_ in group for o in os_] + overrides)[0] == "ok":
                group.append((sw, overrides))
                break
        else:
            assert outcome(overrides)[0] == "ok", f"{sw.path}: {overrides} is refused alone"
            groups.append([(sw, overrides)])
    return groups
