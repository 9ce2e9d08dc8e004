"""NeMo-RL main's key set (tests/fixtures/nemo_rl/grpo_math_main_layout_tiny.yaml: the math GRPO base config and the
online EAGLE-3 recipe of NVIDIA-NeMo/RL 7ea279ab, written for these tests) under ``nemo_rl_compat: true``: every
key of the fixture is classified (a key of this project's schema, or in one of nemo_rl_compat's tables), the recipe
validates with no unknown key, the off-only features are refused by name once turned on, and ``policy.draft`` takes
NeMo-RL's meaning."""

from __future__ import annotations

import typing
import warnings
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from nemo_rl_spec.utils import nemo_rl_compat as compat
from nemo_rl_spec.utils.config import ConfigError, load_config
from nemo_rl_spec.utils.config_schema import MasterConfig

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "nemo_rl" / "grpo_math_main_layout_tiny.yaml"


def _leaves(data: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append(prefix + key)
    return out


def _in_schema(key: str) -> bool:
    """``key`` names a field of :class:`MasterConfig` (a free-form dict field covers every key below it)."""
    model: typing.Any = MasterConfig
    for part in key.split("."):
        if model is None:
            return True  # below a dict-valued field (vllm_kwargs ...)
        field = model.model_fields.get(part)
        if field is None:
            return False
        model = next(
            (
                a
                for a in (field.annotation, *typing.get_args(field.annotation))
                if isinstance(a, type) and issubclass(a, BaseModel)
            ),
            None,
        )
    return True


def _classified(key: str) -> bool:
    tables = compat.known_nemo_rl_keys()
    parts = key.split(".")
    return _in_schema(key) or any(".".join(parts[:i]) in tables for i in range(1, len(parts) + 1))


def _load(*overrides: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", compat.NemoRLCompatWarning)
        return load_config(FIXTURE, list(overrides))


def test_every_key_of_nemo_rl_main_is_classified():
    raw = yaml.safe_load(FIXTURE.read_text())
    keys = _leaves({k: v for k, v in raw.items() if k not in ("defaults", compat.SWITCH)})
    assert len(keys) >= 300  # the whole key set, not a sample
    assert [k for k in keys if not _classified(k)] == []
    # the classifier can fail: a key in no table and not in the schema is reported
    assert not _classified("grpo.no_such_key") and not _classified("policy.megatron_cfg.not_a_field")


def test_the_recipe_validates_with_no_unknown_key_and_nemo_rl_meanings():
    cfg = _load()
    g, p = cfg.grpo, cfg.policy
    assert (g.num_prompts_per_step, g.max_num_steps, g.val_num_generations) == (2, 2, 1)
    # NeMo-RL validates at the rollout temperature: policy.generation.val_temperature (${.temperature}) sets it
    assert g.val_temperature == p.generation.temperature == 1.0
    # policy.draft: enabled -> trained online, NeMo-RL's loss weight 0.1 (the recipe sets neither)
    assert p.draft.enabled and p.draft.online and p.draft.loss_weight == pytest.approx(0.1)
    assert p.generation.speculative_config.method == "eagle3"
    # data.validation: null means "the default": the tiny recipe's validation set stays
    assert cfg.data.validation.max_samples == 4 and cfg.data.validation.source == "gsm8k_original"
    assert p.megatron_cfg.optimizer.clip_grad == 1.0  # policy.max_grad_norm


@pytest.mark.parametrize(
    "override, feature",
    [
        ("grpo.advantage_clip_low=0.2", "advantage clipping"),
        ("grpo.reward_shaping.enabled=true", "overlong reward shaping"),
        ("grpo.adv_estimator.name=reinforce_plus_plus", "Reinforce++"),
        ("grpo.async_grpo.max_generation_failures=2", "generation-worker failures"),
        ("loss_fn.truncated_importance_sampling_type=icepop", "ICEPOP"),
        ("loss_fn.use_cispo=true", "CISPO"),
        ("loss_fn.kl_input_clamp_value=5.0", "KL input clamp"),
        ("policy.megatron_cfg.recompute_granularity=selective", "selective activation recompute"),
        ("policy.megatron_cfg.peft.enabled=true", "LoRA"),
        ("policy.generation.refit_transport=nccl", "collective refit"),
        ("policy.draft.num_layers=2", "more than one layer"),
        ("reward_penalties.penalize_empty_final_answer=true", "NeMo-Gym"),
    ],
)
def test_an_off_only_feature_turned_on_is_refused_by_name(override, feature):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as err:
        _load(override)
    msg = str(err.value)
    assert feature in msg and msg.count("does not implement") == 1
    assert key.rsplit(".", 1)[0] in msg  # names the key (or its section)


def test_off_values_are_judged_by_type_and_draft_keys_the_recipe_sets_stay():
    assert compat._is_off(0.0, (0, 0.0, None)) and compat._is_off(20, (None, 20, 20.0))
    assert not compat._is_off(True, (1,)) and not compat._is_off(False, (0,))  # bool is not an int here
    cfg = _load("+policy.draft.online=false", "+policy.draft.loss_weight=0.5")
    assert (cfg.policy.draft.online, cfg.policy.draft.loss_weight) == (False, 0.5)
