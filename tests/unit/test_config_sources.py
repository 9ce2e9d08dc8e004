"""One source per default, every schema key settable as ``key=value``, and the typed ``speculative_config``.

- Defaults: the base recipe (configs/grpo_math_base.yaml) is the source of every key it writes; where the schema
  (nemo_rl_spec/utils/config_schema.py) also declares a default for such a key, the two must be equal. The walk here
  is written independently of the loader (pydantic field metadata and the raw YAML).
- Overrides: a key the schema knows is set with a plain ``key=value`` although the recipe omits it; '+' stays for keys
  the schema does not know.
- ``policy.generation.vllm_kwargs.speculative_config``: validated by :class:`SpeculativeConfig` (k required, vLLM keys
  only), kept as the validated dict; no module reads it with a fallback of its own.
"""

import re
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from pydantic_core import PydanticUndefined

from nemo_rl_spec.utils.config import (
    ConfigError,
    apply_overrides,
    load_config,
    load_yaml_with_defaults,
    schema_knows,
    section_model,
)
from nemo_rl_spec.utils.config_schema import GenerationConfig, MasterConfig
from nemo_rl_spec.utils.feature_configs import VLLM_SPECULATIVE_KEYS, SpeculativeConfig

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "configs" / "grpo_math_base.yaml"
TINY = ROOT / "configs" / "grpo_math_tiny.yaml"
SPEC = ROOT / "configs" / "grpo_math_tiny_spec.yaml"


def schema_defaults(model=MasterConfig, prefix=""):
    """{dotted key: default} of every leaf field that declares a default (sections walked, default or not)."""
    out = {}
    for name, field in model.model_fields.items():
        sub = section_model(field.annotation)
        if sub is not None:
            out.update(schema_defaults(sub, f"{prefix}{name}."))
        elif field.default is not PydanticUndefined or field.default_factory is not None:
            out[prefix + name] = field.get_default(call_default_factory=True)
    return out


def schema_leaf_keys(model=MasterConfig, prefix=""):
    """Every leaf field of the schema as a dotted key."""
    out = []
    for name, field in model.model_fields.items():
        sub = section_model(field.annotation)
        out += schema_leaf_keys(sub, f"{prefix}{name}.") if sub is not None else [prefix + name]
    return out


def yaml_leaves(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(yaml_leaves(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def disagreements(defaults: dict, written: dict) -> dict:
    return {k: (v, written[k]) for k, v in defaults.items() if k in written and written[k] != v}


def test_a_default_written_in_schema_and_base_yaml_has_one_value():
    defaults, written = schema_defaults(), yaml_leaves(yaml.safe_load(BASE.read_text()))
    both = set(defaults) & set(written)
    assert len(both) >= 25, sorted(both)  # the walk finds the shared keys (29 at the time of writing)
    assert {"policy.dynamic_batching.train_mb_tokens", "logger.verbose", "grpo.val_temperature"} <= both
    assert disagreements(defaults, written) == {}
    # the check can fail: a base YAML that writes one of them differently is reported with both values
    assert disagreements(defaults, {**written, "policy.dynamic_batching.sequence_length_round": 64}) == {
        "policy.dynamic_batching.sequence_length_round": (1, 64)
    }


def test_dynamic_batching_defaults_are_what_the_recipes_ran_with():
    """The three that disagreed (schema 1536 / 3072 / 64): every recipe inherits the base YAML's section, so runs
    used 768 / 1536 / 1; the section built from the schema alone now gives the same."""
    from nemo_rl_spec.utils.config_schema import DynamicBatchingConfig

    dyn = load_config(TINY, ["policy.dynamic_batching.enabled=true"]).policy.dynamic_batching
    assert (dyn.train_mb_tokens, dyn.logprob_mb_tokens, dyn.sequence_length_round) == (768, 1536, 1)
    assert DynamicBatchingConfig(enabled=True) == dyn


def test_nemo_rl_keys_the_schema_knows_take_no_plus():
    cfg = load_config(
        TINY,
        [
            "loss_fn.sequence_level_importance_ratios=true",
            "loss_fn.token_level_loss=false",
            "loss_fn.ratio_clip_c=3.0",
            "grpo.overlong_filtering=true",
        ],
    )
    assert cfg.loss_fn.sequence_level_importance_ratios and cfg.loss_fn.ratio_clip_c == 3.0
    assert cfg.grpo.overlong_filtering
    # '+' on them still works (recipes and docs written before)
    assert load_config(TINY, ["+loss_fn.ratio_clip_c=3.0"]).loss_fn.ratio_clip_c == 3.0
    # a section the base omits, and a key inside it
    pc = load_config(
        TINY, ["grpo.pilot_commit.pilot_batch_size=1", "loss_fn.use_importance_sampling_correction=true"]
    ).grpo.pilot_commit
    assert pc.enabled and pc.pilot_batch_size == 1 and pc.n_pilot == 2


def test_every_schema_key_is_accepted_without_plus():
    keys, tiny = schema_leaf_keys(), load_yaml_with_defaults(TINY)
    assert len(keys) > 150 and "loss_fn.ratio_clip_c" in keys
    for key in keys:
        assert schema_knows(key), key
        apply_overrides(tiny.copy(), [f"{key}=null"])  # accepted (whether the value validates is another matter)
    for key in (
        "policy.generation.vllm_kwargs.speculative_config.num_speculative_tokens",
        "policy.generation.vllm_kwargs.speculative_config.draft_sample_method",
    ):
        cfg = apply_overrides(load_yaml_with_defaults(TINY), [f"{key}=2"])
        assert OmegaConf.select(cfg, key) == 2


@pytest.mark.parametrize(
    "key",
    [
        "grpo.num_prompt_per_step",
        "loss_fn.ratio_clip_c.x",
        "policy.generation.vllm_kwargs.enable_prefix_caching",
        "policy.tokenizer.chat_template_kwargs.enable_thinking",
        "policy.generation.vllm_kwargs.speculative_config.num_speculativ_tokens",
    ],
)
def test_keys_the_schema_does_not_know_still_need_plus(key):
    assert not schema_knows(key)
    with pytest.raises(ConfigError, match=re.escape(f"unknown key '{key}'") + r".*\+" + re.escape(key)):
        apply_overrides(load_yaml_with_defaults(TINY), [f"{key}=1"])


def test_speculative_config_keys_are_vllms():
    vllm_spec = pytest.importorskip("vllm.config.speculative")
    import dataclasses

    assert VLLM_SPECULATIVE_KEYS == {f.name for f in dataclasses.fields(vllm_spec.SpeculativeConfig)}
    assert set(SpeculativeConfig.model_fields) <= VLLM_SPECULATIVE_KEYS


def test_speculative_config_is_validated_and_kept_as_written():
    gen = load_config(SPEC).policy.generation
    assert gen.vllm_kwargs["speculative_config"] == {"method": "eagle3", "num_speculative_tokens": 3}
    spec = gen.speculative_config
    assert isinstance(spec, SpeculativeConfig) and (spec.method, spec.num_speculative_tokens, spec.model) == (
        "eagle3",
        3,
        None,
    )
    extra = load_config(SPEC, ["+policy.generation.vllm_kwargs.speculative_config.draft_sample_method=probabilistic"])
    assert extra.policy.generation.vllm_kwargs["speculative_config"]["draft_sample_method"] == "probabilistic"
    assert load_config(TINY).policy.generation.speculative_config is None
    for overrides, match in [
        (
            ["policy.generation.vllm_kwargs.speculative_config.num_speculative_tokens=null"],
            "speculative_config.num_speculative_tokens",
        ),
        (
            ["policy.generation.vllm_kwargs.speculative_config.num_speculative_tokens=0"],
            "speculative_config.num_speculative_tokens",
        ),
        (
            ["+policy.generation.vllm_kwargs.speculative_config.num_speculativ_tokens=2"],
            r"\['num_speculativ_tokens'\] not among vLLM's SpeculativeConfig keys",
        ),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_config(SPEC, overrides)


def test_a_speculative_config_without_k_is_refused():
    """k has no default anywhere (it was 3 in the Megatron worker's draft unroll and 1 in the dynamic speculation
    cap); a recipe names it."""
    base = load_config(TINY).policy.generation.model_dump()
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        GenerationConfig.model_validate(
            {**base, "vllm_kwargs": {"speculative_config": {"method": "eagle3", "model": "/d"}}}
        )


def test_no_module_reads_speculative_keys_with_a_fallback():
    pattern = re.compile(r"""\.get\(\s*["'](speculative_config|num_speculative_tokens|method)["']""")
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in sorted((ROOT / "nemo_rl_spec").rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line) and "speculative" in p.read_text()
    ]
    allowed = {"nemo_rl_spec/utils/config_schema.py", "nemo_rl_spec/speculative/adaptive_k.py"}  # the typed readers
    assert [h for h in hits if h.split(":")[0] not in allowed] == []
