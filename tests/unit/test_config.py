"""Recipe loading and validation: every shipped YAML validates; bad input fails with the key or file named."""
from pathlib import Path

import pytest

from nemo_rl_spec.utils.config import ConfigError, load_config, load_yaml_with_defaults

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "grpo_math_tiny.yaml"
RECIPES = sorted(p for p in CONFIGS.glob("*.yaml"))


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"grpo_math_base.yaml", "grpo_math_tiny.yaml", "grpo_math_smollm2_135m.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    cfg = load_config(path)
    assert cfg.grpo.max_num_steps >= 1


def test_defaults_inheritance_and_override_precedence():
    cfg = load_config(TINY, ["grpo.max_num_steps=7", "loss_fn.ratio_clip_max=0.28"])
    assert cfg.grpo.max_num_steps == 7
    assert cfg.loss_fn.ratio_clip_max == 0.28
    assert cfg.grpo.num_prompts_per_step == 2  # from the tiny recipe
    assert cfg.loss_fn.reference_policy_kl_type == "k3"  # from the base


def test_plus_adds_new_key_under_free_mapping():
    cfg = load_config(TINY, ["+policy.generation.vllm_kwargs.seed=3"])
    assert cfg.policy.generation.vllm_kwargs == {"seed": 3}


@pytest.mark.parametrize(
    "override, key",
    [
        ("grpo.num_prompts_per_step=0", "grpo.num_prompts_per_step"),
        ("policy.train_global_batch_size=-8", "policy.train_global_batch_size"),
        ("policy.generation.backend=sglang", "policy.generation.backend"),
        ("+grpo.num_prompts_per_stepp=3", "grpo.num_prompts_per_stepp"),
        ("policy.model_name=/nonexistent/model", "policy.model_name"),
        ("policy.train_micro_batch_size=3", "policy.train_global_batch_size"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [override])
    assert key in str(info.value)


def test_misspelled_override_without_plus_is_rejected():
    with pytest.raises(ConfigError, match="unknown key 'grpo.num_prompt_per_step'.*\\+grpo.num_prompt_per_step"):
        load_config(TINY, ["grpo.num_prompt_per_step=3"])


def test_single_generation_with_std_normalization_is_rejected():
    with pytest.raises(ConfigError, match="num_generations_per_prompt=1 with grpo.normalize_rewards"):
        load_config(TINY, ["grpo.num_generations_per_prompt=1"])
    cfg = load_config(TINY, ["grpo.num_generations_per_prompt=1", "grpo.normalize_rewards=false"])
    assert cfg.grpo.num_generations_per_prompt == 1


def test_yaml_syntax_error_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  seed: [1, 2\n")
    with pytest.raises(ConfigError, match=f"YAML syntax error in {bad}"):
        load_config(bad)


def test_missing_parent_and_cycle(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle in defaults"):
        load_yaml_with_defaults(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("defaults: missing.yaml\n")
    with pytest.raises(ConfigError, match="config file not found: .*missing.yaml"):
        load_yaml_with_defaults(tmp_path / "c.yaml")


def test_misspelled_key_in_yaml_names_it(tmp_path):
    (tmp_path / "r.yaml").write_text(f"defaults: {TINY}\nloss_fn:\n  ratio_clip_mn: 0.1\n")
    with pytest.raises(ConfigError, match="loss_fn.ratio_clip_mn: unknown key"):
        load_config(tmp_path / "r.yaml")


def test_cluster_recipes_validate_but_unbuilt_features_are_refused_before_start():
    from nemo_rl_spec.utils.config import check_runtime_support

    cfg = load_config(CONFIGS / "grpo-qwen3-8b-8n4g-eagle3-async.yaml")
    with pytest.raises(ConfigError) as info:
        check_runtime_support(cfg)
    for key in ("policy.generation.colocated.enabled=false", "policy.megatron_cfg.activation_checkpointing",
                "cluster.num_nodes"):
        assert key in str(info.value)
    check_runtime_support(load_config(TINY))  # the CPU recipes run as written


def test_bad_config_exits_2_before_any_worker(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_grpo", CONFIGS.parent / "examples" / "run_grpo.py")
    run_grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_grpo)
    assert run_grpo.main(["--config", str(TINY), "grpo.num_prompts_per_step=-1"]) == 2
    assert "grpo.num_prompts_per_step" in capsys.readouterr().err


SPEC = CONFIGS / "grpo_math_tiny_spec.yaml"


@pytest.mark.parametrize("overrides,match", [
    (["policy.generation.vllm_kwargs.speculative_config=null"],
     "policy.draft.online=true trains an EAGLE-3 head online; it needs policy.generation.vllm_kwargs"),
    (["policy.generation.vllm_kwargs.speculative_config.method=draft_model"], "speculative_config.method=eagle3"),
    (["+policy.megatron_cfg.mtp_num_layers=1"], "train either an EAGLE-3 head or MTP heads"),
    (["policy.draft.enabled=false"], "needs speculative_config.model \\(a draft directory\\) or a policy.draft"),
    (["policy.draft.model_name=/a", "+policy.generation.vllm_kwargs.speculative_config.model=/b"],
     "policy.draft.model_name='/a' differs from policy.generation.vllm_kwargs.speculative_config.model='/b'"),
])
def test_draft_and_speculation_mismatches_are_rejected(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(SPEC, overrides)


def test_speculation_off_by_override_validates():
    cfg = load_config(SPEC, ["policy.draft.enabled=false", "policy.generation.vllm_kwargs.speculative_config=null"])
    assert cfg.policy.generation.vllm_kwargs["speculative_config"] is None


def test_missing_draft_directory_exits_2_before_ray(tmp_path, capsys, monkeypatch):
    """A recipe naming a draft directory that does not exist (``make draft`` not run) fails with the key named,
    before Ray or any worker starts."""
    import importlib.util

    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started before the draft check"))
    spec = importlib.util.spec_from_file_location("run_grpo", CONFIGS.parent / "examples" / "run_grpo.py")
    run_grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_grpo)
    missing = tmp_path / "no_draft"
    assert run_grpo.main(["--config", str(SPEC), f"policy.draft.model_name={missing}",
                          f"logger.log_dir={tmp_path}/logs"]) == 2
    err = capsys.readouterr().err
    assert f"policy.draft.model_name='{missing}': no draft there (config.json missing)" in err
