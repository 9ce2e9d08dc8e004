"""Loading a recipe in NeMo-RL's layout (tests/fixtures/nemo_rl/grpo_math_1B_layout_tiny.yaml, the key set of NeMo-RL's
grpo_math_1B.yaml): strict by default (one error listing every unknown key, computed here independently by walking
the schema), and under ``nemo_rl_compat: true`` NeMo-RL's names are read and the rest ignored with one warning."""

from __future__ import annotations

import typing
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from pydantic import BaseModel

from nemo_rl_spec.utils.config import ConfigError, load_config, load_yaml_with_defaults
from nemo_rl_spec.utils.config_schema import MasterConfig
from nemo_rl_spec.utils.nemo_rl_compat import NemoRLCompatWarning

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "nemo_rl" / "grpo_math_1B_layout_tiny.yaml"
# NeMo-RL keys this project implements: none of them may be reported unknown
IMPLEMENTED = [
    "grpo.max_num_epochs",
    "grpo.max_val_samples",
    "grpo.val_batch_size",
    "grpo.overlong_filtering",
    "loss_fn.ratio_clip_c",
    "loss_fn.use_on_policy_kl_approximation",
    "loss_fn.sequence_level_importance_ratios",
    "checkpointing.metric_name",
    "checkpointing.higher_is_better",
    "checkpointing.save_consolidated",
    "policy.generation.top_k",
    "policy.generation.stop_token_ids",
    "policy.generation.stop_strings",
    "policy.megatron_cfg.scheduler",
    "policy.megatron_cfg.optimizer.min_lr",
    "policy.dynamic_batching",
    "policy.sequence_packing",
]


def _model_of(annotation):
    """The pydantic model inside ``annotation`` (``X``, ``Optional[X]``), else None."""
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _unknown(model: type[BaseModel], data: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            out.add(prefix + key)
        elif isinstance(value, dict) and (sub := _model_of(field.annotation)) is not None:
            out |= _unknown(sub, value, f"{prefix}{key}.")
    return out


def _merged() -> dict:
    raw = OmegaConf.to_container(load_yaml_with_defaults(FIXTURE), resolve=True)
    raw.pop("nemo_rl_compat")
    return raw


def test_without_the_switch_every_unknown_key_is_listed_at_once():
    expected = _unknown(MasterConfig, _merged())
    assert len(expected) >= 40 and "policy.dtensor_cfg" in expected and "policy.megatron_cfg.fp8_cfg" in expected
    with pytest.raises(ConfigError) as err:
        load_config(FIXTURE, ["nemo_rl_compat=false"])
    msg = str(err.value)
    listed = {line.split(":")[0].strip() for line in msg.splitlines() if "unknown key" in line}
    assert listed == expected
    assert not [k for k in IMPLEMENTED if k in listed or any(x.startswith(k + ".") for x in listed)]
    assert "nemo_rl_compat: true" in msg  # the hint


def test_under_the_switch_it_loads_with_one_warning_and_nemo_rl_meanings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(FIXTURE)
    compat = [w for w in caught if issubclass(w.category, NemoRLCompatWarning)]
    assert len(compat) == 1
    text = str(compat[0].message)
    ignored = _unknown(MasterConfig, _merged()) - {
        "policy.max_grad_norm",
        "policy.tokenizer.name",
        "policy.megatron_cfg.pipeline_dtype",
        "policy.megatron_cfg.optimizer.optimizer",
        "grpo.max_rollout_turns",
    }
    assert f"{len(ignored)} NeMo-RL keys ignored" in text and all(f"\n  {k}=" in text for k in ignored)
    g, p = cfg.grpo, cfg.policy
    assert (g.max_num_epochs, g.max_val_samples, g.val_batch_size, g.overlong_filtering) == (1, 2, 2, True)
    assert p.megatron_cfg.optimizer.clip_grad == 1.0  # policy.max_grad_norm
    assert p.megatron_cfg.scheduler.lr_warmup_iters == 2 and p.megatron_cfg.optimizer.min_lr == 1e-4
    assert (p.generation.top_k, p.generation.stop_strings) == (50, ["Question:"])
    assert (cfg.logger.wandb.project, cfg.logger.wandb.name) == ("grpo-dev", "nemo-rl-layout-tiny")  # logger.wandb
    assert (cfg.logger.mlflow.experiment_name, cfg.logger.mlflow.run_name) == ("grpo-dev", "nemo-rl-layout-tiny")
    assert cfg.checkpointing.save_consolidated and cfg.checkpointing.metric_name == "validation/accuracy"
    assert cfg.loss_fn.ratio_clip_c == 3.0 and p.dynamic_batching.train_mb_tokens == 256 * 4  # ${mul:...}


@pytest.mark.parametrize(
    "override, match",
    [
        (
            "policy.megatron_cfg.optimizer.clip_grad=0.5",
            r"policy.max_grad_norm=1.0 \(NeMo-RL's name of policy.megatron_cfg."
            r"optimizer.clip_grad\) conflicts with policy.megatron_cfg.optimizer."
            r"clip_grad=0.5",
        ),
        ("grpo.max_rollout_turns=2", r"grpo.max_rollout_turns=2 must equal 1"),
        ("+policy.megatron_cfg.optimizer.lr_typo=1", r"policy.megatron_cfg.optimizer.lr_typo: unknown key"),
        ("nemo_rl_compat=maybe", r"nemo_rl_compat must be true or false"),
    ],
)
def test_conflicts_and_typos_stay_errors_under_the_switch(override, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NemoRLCompatWarning)
        with pytest.raises(ConfigError, match=match):
            load_config(FIXTURE, [override])


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("data.dataset_name=DAPOMath17K", "train", "dapo_math_17k"),  # the 1B layout's key
        ("+data.train.dataset_name=DAPOMath17K", "train", "dapo_math_17k"),  # NeMo-RL main's key
        ("+data.validation.dataset_name=AIME2024", "validation", "aime_2024"),
        ("data.dataset_name=OpenMathInstruct-2", "train", "reasoning_gym"),  # no copy here: the defaults' source
    ],
)
def test_nemo_rl_dataset_names_map_onto_data_sources(override, key, expected):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(FIXTURE, [override])
    assert getattr(cfg.data, key).source == expected
    text = "".join(str(w.message) for w in caught if issubclass(w.category, NemoRLCompatWarning))
    name = override.split("=")[1]
    assert (f"dataset_name={name!r}: a dataset this project has no copy of" in text) == (name == "OpenMathInstruct-2")
