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
        ("grpo.invalid_tool_call_advantage=-5.0", "tool-call penalties"),
        ("grpo.malformed_thinking_advantage=-5.0", "thinking-tag penalties"),
        ("policy.generation.vllm_cfg.logprobs_mode=raw_logprobs", "raw log-probs"),
        ("policy.megatron_cfg.peft.enabled=true", "LoRA"),
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


def test_nemo_rl_mtp_use_repeated_layer_is_a_schema_key():
    """policy.megatron_cfg.mtp_use_repeated_layer is megatron-core's option under NeMo-RL's name: off in the fixture,
    on with MTP layers it loads; on without any, refused naming the key."""
    assert _load().policy.megatron_cfg.mtp_use_repeated_layer is False
    off = (
        "policy.draft.enabled=false",
        "policy.generation.vllm_kwargs.speculative_config=null",
        "policy.sequence_packing.enabled=false",
    )
    cfg = _load(*off, "policy.megatron_cfg.mtp_num_layers=2", "policy.megatron_cfg.mtp_use_repeated_layer=true")
    assert cfg.policy.megatron_cfg.mtp_use_repeated_layer and cfg.policy.megatron_cfg.mtp_num_layers == 2
    with pytest.raises(ConfigError, match="mtp_use_repeated_layer=true needs mtp_num_layers >= 1"):
        _load("policy.megatron_cfg.mtp_use_repeated_layer=true")


def test_nemo_rl_draft_num_layers_is_a_schema_key():
    """policy.draft.num_layers (NeMo-RL's key): null in the fixture (a fresh head has one layer), 2 loads into the
    schema instead of being refused, below 1 is refused naming the key."""
    assert _load().policy.draft.num_layers is None
    assert _load("policy.draft.num_layers=2").policy.draft.num_layers == 2
    with pytest.raises(
        ConfigError, match=r"policy\.draft\.num_layers: an EAGLE-3 draft has at least one decoder layer"
    ):
        _load("policy.draft.num_layers=0")


def test_nemo_rl_kl_in_reward_loads_with_the_estimator_that_reads_it():
    """loss_fn.use_kl_in_reward is a schema key: off in the fixture; on with NeMo-RL's reinforce_plus_plus estimator
    it loads; on with the fixture's grpo estimator (which NeMo-RL lets drop the KL entirely) it is refused by key."""
    assert _load().loss_fn.use_kl_in_reward is False
    cfg = _load("loss_fn.use_kl_in_reward=true", "grpo.adv_estimator.name=reinforce_plus_plus")
    assert cfg.loss_fn.use_kl_in_reward and cfg.loss_fn.reference_policy_kl_penalty == pytest.approx(0.01)
    with pytest.raises(ConfigError, match="loss_fn.use_kl_in_reward=true needs grpo.adv_estimator.name"):
        _load("loss_fn.use_kl_in_reward=true")


def test_nemo_rl_advantage_and_reward_options_load_as_schema_keys():
    """grpo.advantage_clip_low/high, reward_shaping, reward_scaling and adv_estimator are implemented: the fixture's
    values (adv_estimator's copies interpolated from grpo.normalize_rewards / use_leave_one_out_baseline) and
    turned-on values load into the schema instead of being refused."""
    g = _load().grpo
    assert (g.advantage_clip_low, g.advantage_clip_high) == (None, None)
    shaping = g.reward_shaping
    assert not shaping.enabled and shaping.stop_properly_penalty_coef is None
    assert (shaping.overlong_buffer_length, shaping.overlong_buffer_penalty, shaping.max_response_length) == (
        128,
        1,
        256,
    )
    assert (g.adv_estimator.name, g.adv_estimator.normalize_rewards, g.adv_estimator.use_leave_one_out_baseline) == (
        "grpo",
        True,
        True,
    )
    assert not g.reward_scaling.enabled and (g.reward_scaling.source_max, g.reward_scaling.target_max) == (1.0, 1.0)
    g = _load(
        "grpo.advantage_clip_low=-2.0",
        "grpo.advantage_clip_high=3.0",
        "grpo.reward_shaping.enabled=true",
        "grpo.reward_scaling.enabled=true",
        "grpo.reward_scaling.target_min=-1.0",
        "grpo.adv_estimator.name=reinforce_plus_plus",
        "grpo.adv_estimator.minus_baseline=false",
    ).grpo
    assert (g.advantage_clip_low, g.advantage_clip_high) == (-2.0, 3.0)
    assert g.reward_shaping.enabled and g.reward_scaling.enabled and g.reward_scaling.target_min == -1.0
    assert (g.adv_estimator.name, g.adv_estimator.minus_baseline) == ("reinforce_plus_plus", False)


def test_nemo_rl_loss_options_load_as_schema_keys():
    """NeMo-RL's loss options (tests/unit/test_nemo_rl_loss_options.py) load with the fixture's values and turned
    on, instead of being refused."""
    loss = _load().loss_fn
    assert (loss.kl_input_clamp_value, loss.kl_output_clamp_value) == (20.0, 10.0)
    assert loss.truncated_importance_sampling_type is None and loss.truncated_importance_sampling_ratio_min is None
    assert not (loss.force_on_policy_ratio or loss.use_cispo or loss.disable_ppo_ratio)
    assert loss.positive_example_nll_weight == 0.0
    loss = _load(
        "loss_fn.reference_policy_kl_type=k2",
        "loss_fn.kl_input_clamp_value=5.0",
        "loss_fn.kl_output_clamp_value=null",
        "loss_fn.use_importance_sampling_correction=true",
        "loss_fn.truncated_importance_sampling_type=icepop",
        "loss_fn.truncated_importance_sampling_ratio=2.0",
        "loss_fn.truncated_importance_sampling_ratio_min=0.5",
        "loss_fn.use_cispo=true",
        "loss_fn.positive_example_nll_weight=0.1",
    ).loss_fn
    assert (loss.reference_policy_kl_type, loss.kl_input_clamp_value, loss.kl_output_clamp_value) == ("k2", 5.0, None)
    assert (loss.truncated_importance_sampling_type, loss.truncated_importance_sampling_ratio_min) == ("icepop", 0.5)
    assert loss.use_cispo and loss.positive_example_nll_weight == 0.1
    assert _load("loss_fn.disable_ppo_ratio=true").loss_fn.disable_ppo_ratio


def test_off_values_are_judged_by_type_and_draft_keys_the_recipe_sets_stay():
    assert compat._is_off(0.0, (0, 0.0, None)) and compat._is_off(20, (None, 20, 20.0))
    assert not compat._is_off(True, (1,)) and not compat._is_off(False, (0,))  # bool is not an int here
    cfg = _load("+policy.draft.online=false", "+policy.draft.loss_weight=0.5")
    assert (cfg.policy.draft.online, cfg.policy.draft.loss_weight) == (False, 0.5)


_AC = "policy.megatron_cfg.activation_checkpointing=true"


@pytest.mark.parametrize(
    "overrides, granularity, modules",
    [
        ((), None, None),  # the fixture: NeMo-RL's recompute_granularity=full with checkpointing off, inert: dropped
        (
            ("policy.megatron_cfg.recompute_granularity=selective", "policy.megatron_cfg.recompute_modules=[mlp]"),
            None,
            None,
        ),
        ((_AC,), "full", None),
        ((_AC, "policy.megatron_cfg.recompute_modules=[core_attn]"), "full", None),  # modules unread with full
        ((_AC, "policy.megatron_cfg.recompute_granularity=selective"), "selective", None),  # megatron's core_attn
        (
            (
                _AC,
                "policy.megatron_cfg.recompute_granularity=selective",
                "policy.megatron_cfg.recompute_modules=[core_attn,mlp]",
            ),
            "selective",
            ["core_attn", "mlp"],
        ),
    ],
)
def test_nemo_rl_recompute_keys_load_with_nemo_rl_meaning(overrides, granularity, modules):
    """recompute_granularity / recompute_modules are schema keys: where NeMo-RL reads them (activation_checkpointing
    true; modules with selective only) they load as they are, where NeMo-RL ignores them they are dropped."""
    mcfg = _load(*overrides).policy.megatron_cfg
    assert (mcfg.recompute_granularity, mcfg.recompute_modules) == (granularity, modules)


def test_a_nemo_rl_recompute_module_this_build_cannot_run_is_refused_by_key():
    with pytest.raises(ConfigError, match=r"policy.megatron_cfg.recompute_modules: megatron-core's 'layernorm'"):
        _load(
            _AC,
            "policy.megatron_cfg.recompute_granularity=selective",
            "policy.megatron_cfg.recompute_modules=[layernorm]",
        )
