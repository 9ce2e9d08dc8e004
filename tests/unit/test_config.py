"""Recipe loading and validation: every shipped YAML validates; bad input fails with the key or file named."""

from pathlib import Path

import pytest

from nemo_rl_spec.cli import run_grpo
from nemo_rl_spec.utils.config import ConfigError, load_config, load_yaml_with_defaults

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "grpo_math_tiny.yaml"
SPEC = CONFIGS / "grpo_math_tiny_spec.yaml"
RECIPES = sorted(p for p in CONFIGS.glob("*.yaml"))


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"grpo_math_base.yaml", "grpo_math_tiny.yaml", "grpo_math_smollm2_135m.yaml"} <= names


def _leaves(tree, prefix=""):
    """Flatten a nested mapping to {"a.b.c": value} (lists and scalars are leaves)."""
    if not isinstance(tree, dict):
        return {prefix.rstrip("."): tree}
    return (
        {k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{prefix}{key}.").items()}
        if tree
        else {prefix.rstrip("."): {}}
    )


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    """Every value the recipe (with its defaults chain) writes survives validation unchanged: read back from the
    validated model, key by key, it equals the merged YAML's (a key dropped, renamed or coerced fails here). The
    rewrites expected: a relative file path (step_costs; not ``auto``) is resolved against the repository root, and
    ``policy.precision: auto`` becomes the dtype chosen for this machine."""
    from omegaconf import OmegaConf

    written = _leaves(OmegaConf.to_container(load_yaml_with_defaults(path), resolve=True))
    written.pop("defaults", None)
    dumped = _leaves(load_config(path).model_dump(mode="json"))
    assert written, path
    resolved = {  # `auto` (the calibration table of the machine) stays until the driver resolves it
        k: str(CONFIGS.parent / v) for k, v in written.items() if k.endswith(".step_costs") and v and v != "auto"
    }
    if written.get("policy.precision") == "auto":  # resolved for this machine (utils/precision.py)
        from nemo_rl_spec.utils.precision import choose_precision

        resolved["policy.precision"] = choose_precision("auto", written["cluster.gpus_per_node"] > 0)[0]
    changed = {
        k: (v, dumped.get(k, "<missing>"))
        for k, v in written.items()
        if dumped.get(k, "<missing>") != resolved.get(k, v)
    }
    assert not changed, f"{path.name}: YAML value -> validated value: {changed}"


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


_AC = "policy.megatron_cfg.activation_checkpointing=true"
_SELECTIVE = "policy.megatron_cfg.recompute_granularity=selective"


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["policy.megatron_cfg.recompute_granularity=full"],
            r"recompute_granularity='full' needs policy.megatron_cfg.activation_checkpointing=true",
        ),
        (
            ["policy.megatron_cfg.recompute_modules=[mlp]"],
            r"recompute_modules=\['mlp'\] needs policy.megatron_cfg.activation_checkpointing=true",
        ),
        (
            [_AC, "policy.megatron_cfg.recompute_modules=[mlp]"],
            r"recompute_modules=\['mlp'\] needs policy.megatron_cfg.recompute_granularity='selective' \(got None",
        ),
        ([_AC, _SELECTIVE, "policy.megatron_cfg.recompute_modules=[]"], r"recompute_modules=\[\] recomputes nothing"),
        (
            [_AC, _SELECTIVE, "policy.megatron_cfg.recompute_modules=[core_attn,layernorm]"],
            r"recompute_modules: megatron-core's 'layernorm' is refused: .*fails without Transformer Engine"
            r".*; accepted: core_attn, mlp",
        ),
        (
            [_AC, _SELECTIVE, "policy.megatron_cfg.recompute_modules=[moe]"],
            r"recompute_modules: megatron-core's 'moe' is refused: .*dense models only",
        ),
        (
            [_AC, _SELECTIVE, "policy.megatron_cfg.recompute_modules=[attn]"],
            r"recompute_modules: unknown module 'attn'; accepted: core_attn, mlp",
        ),
        ([_AC, "policy.megatron_cfg.recompute_granularity=partial"], r"policy.megatron_cfg.recompute_granularity"),
        (
            [_AC, _SELECTIVE, "+policy.megatron_cfg.mtp_num_layers=1", "+policy.megatron_cfg.mtp_occ_reference=true"],
            r"mtp_occ_reference=true needs activation_checkpointing=false",
        ),
    ],
)
def test_recompute_settings_that_cannot_act_or_run_are_refused_by_key(overrides, match):
    """``recompute_granularity`` / ``recompute_modules`` refine ``activation_checkpointing`` (NeMo-RL's meaning):
    one that would change nothing, or a megatron-core module that cannot run on this build's layers, is refused
    with the key named."""
    with pytest.raises(ConfigError, match=match):
        load_config(TINY, overrides)


def test_recompute_settings_that_act_validate():
    mcfg = load_config(TINY, [_AC]).policy.megatron_cfg
    assert (mcfg.recompute_granularity, mcfg.recompute_modules) == (None, None)  # full, as before
    mcfg = load_config(TINY, [_AC, _SELECTIVE, "policy.megatron_cfg.recompute_modules=[core_attn,mlp]"]).policy
    assert (mcfg.megatron_cfg.recompute_granularity, mcfg.megatron_cfg.recompute_modules) == (
        "selective",
        ["core_attn", "mlp"],
    )
    assert load_config(TINY, [_AC, _SELECTIVE]).policy.megatron_cfg.recompute_modules is None  # megatron: core_attn


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


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_runs_on_this_build(path):
    from nemo_rl_spec.utils.config import check_runtime_support

    check_runtime_support(load_config(path))  # cluster recipes included: TP, split, several nodes, dist. optimizer


@pytest.mark.parametrize(
    "recipe, overrides, key",
    [
        (SPEC, ["policy.megatron_cfg.pipeline_model_parallel_size=2"], "> 1 with policy.draft.online=true"),
        (
            CONFIGS / "grpo_math_tiny_mtp.yaml",
            ["policy.megatron_cfg.pipeline_model_parallel_size=2"],
            "pipeline_model_parallel_size > 1 with policy.megatron_cfg.mtp_num_layers > 0",
        ),
        (
            CONFIGS / "grpo_gpu_base.yaml",
            [
                "policy.megatron_cfg.pipeline_model_parallel_size=2",
                "policy.sequence_packing.enabled=true",
                "policy.sequence_packing.train_mb_tokens=8704",
                "policy.sequence_packing.logprob_mb_tokens=8704",
            ],
            "pipeline_model_parallel_size > 1 with policy.sequence_packing.enabled=true",
        ),
        (SPEC, ["policy.generation.vllm_cfg.tensor_parallel_size=2"], "tensor_parallel_size > 1 with policy"),
        (
            CONFIGS / "grpo_math_tiny_async.yaml",
            ["grpo.async_grpo.in_flight_weight_updates=true"],
            "grpo.async_grpo.in_flight_weight_updates=true",
        ),
    ],
)
def test_refused_features_name_key_reason_and_platform(recipe, overrides, key):
    from nemo_rl_spec.utils.config import RUNTIME_REFUSALS, check_runtime_support

    with pytest.raises(ConfigError) as info:
        check_runtime_support(load_config(recipe, overrides))
    entry = next(r for r in RUNTIME_REFUSALS.values() if key in r.key)
    platform = "GPU" if "gpu" in recipe.name else "CPU"
    assert f"on {platform}" in str(info.value) and f"{entry.key}: {entry.reason}" in str(info.value)


def test_refusals_depend_on_the_platform():
    from nemo_rl_spec.utils.config import check_runtime_support, runtime_refusals

    gpu = load_config(CONFIGS / "grpo-qwen3-8b-4n8g-eagle3-sync.yaml")
    assert gpu.policy.generation.vllm_cfg.tensor_parallel_size == 2 and runtime_refusals(gpu) == []
    cpu = load_config(
        CONFIGS / "grpo-qwen3-8b-4n8g-eagle3-sync.yaml", ["cluster.gpus_per_node=0", "cluster.workers_per_node=8"]
    )
    assert [r.key for r in runtime_refusals(cpu)] == [
        "policy.generation.vllm_cfg.tensor_parallel_size > 1 with policy.generation.vllm_kwargs.speculative_config "
        "on CPU (cluster.gpus_per_node=0)"
    ]
    for lifted in (
        "policy.megatron_cfg.tensor_model_parallel_size=2",
        "policy.generation.vllm_cfg.tensor_parallel_size=2",
        "policy.megatron_cfg.activation_checkpointing=true",
        "policy.megatron_cfg.optimizer.use_distributed_optimizer=true",
        "cluster.num_nodes=2",
    ):
        check_runtime_support(load_config(TINY, [lifted]))


def test_workers_per_node_has_no_schema_default_and_must_be_positive():
    from omegaconf import OmegaConf

    from nemo_rl_spec.utils.config import validate_config

    raw = OmegaConf.to_container(load_yaml_with_defaults(TINY), resolve=True)
    del raw["cluster"]["workers_per_node"]
    with pytest.raises(ConfigError, match="cluster.workers_per_node: Field required"):
        validate_config(raw)
    with pytest.raises(ConfigError, match="cluster.workers_per_node: Input should be greater than 0"):
        load_config(TINY, ["cluster.workers_per_node=0"])


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_dry_run_prints_the_plan_of_every_recipe_without_ray(path, capsys, monkeypatch):
    import ray

    from nemo_rl_spec.distributed.placement import plan_placement

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started by --dry-run"))
    assert run_grpo.main(["--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr()
    assert out.err == "" and f"recipe {path}: valid" in out.out
    assert plan_placement(load_config(path)).table() in out.out


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["cluster.num_nodes=2"], "cluster.ray_address=null"),
        (
            ["cluster.workers_per_node=3", "cluster.num_cpus=3", "policy.megatron_cfg.tensor_model_parallel_size=2"],
            "policy.megatron_cfg.tensor_model_parallel_size=2",
        ),
        (
            ["policy.megatron_cfg.pipeline_model_parallel_size=2"],
            "policy.megatron_cfg.tensor_model_parallel_size=1 x pipeline_model_parallel_size=2 = 2 does not divide",
        ),
    ],
)
def test_dry_run_exits_2_naming_the_key_when_the_recipe_does_not_fit(overrides, key, capsys):
    assert run_grpo.main(["--config", str(TINY), "--dry-run", *overrides]) == 2
    out = capsys.readouterr()
    assert key in out.err and "placement:" not in out.out


def test_bad_config_exits_2_before_any_worker(tmp_path, capsys):
    assert run_grpo.main(["--config", str(TINY), "grpo.num_prompts_per_step=-1"]) == 2
    assert "grpo.num_prompts_per_step" in capsys.readouterr().err


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            ["policy.generation.vllm_kwargs.speculative_config=null"],
            "policy.draft.online=true trains an EAGLE-3 head online; it needs policy.generation.vllm_kwargs",
        ),
        (["policy.generation.vllm_kwargs.speculative_config.method=draft_model"], "speculative_config.method=eagle3"),
        (["+policy.megatron_cfg.mtp_num_layers=1"], "train either an EAGLE-3 head or MTP heads"),
        (["policy.draft.enabled=false"], "needs speculative_config.model \\(a draft directory\\) or a policy.draft"),
        (
            ["policy.draft.model_name=/a", "+policy.generation.vllm_kwargs.speculative_config.model=/b"],
            "policy.draft.model_name='/a' differs from policy.generation.vllm_kwargs.speculative_config.model='/b'",
        ),
    ],
)
def test_draft_and_speculation_mismatches_are_rejected(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(SPEC, overrides)


def test_speculation_off_by_override_validates():
    cfg = load_config(SPEC, ["policy.draft.enabled=false", "policy.generation.vllm_kwargs.speculative_config=null"])
    assert cfg.policy.generation.vllm_kwargs["speculative_config"] is None


def test_missing_draft_directory_exits_2_before_ray(tmp_path, capsys, monkeypatch):
    """A recipe naming a draft directory that does not exist (``make draft`` not run) fails with the key named,
    before Ray or any worker starts."""
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started before the draft check"))
    missing = tmp_path / "no_draft"
    assert (
        run_grpo.main(["--config", str(SPEC), f"policy.draft.model_name={missing}", f"logger.log_dir={tmp_path}/logs"])
        == 2
    )
    err = capsys.readouterr().err
    assert f"policy.draft.model_name='{missing}': no draft there (config.json missing)" in err


def test_every_override_in_the_deploy_doc_names_an_existing_key():
    """docs/guides/scale_out.md shows overrides (``a.b=value``): each key must exist in a shipped recipe (a doc showing a
    key that was renamed or never existed fails here)."""
    import re

    from omegaconf import OmegaConf

    doc = (CONFIGS.parent / "docs" / "guides" / "scale_out.md").read_text()
    keys = set(re.findall(r"(?<![\w.$+])((?:grpo|loss_fn|policy|data|env|logger|checkpointing|cluster)\.[\w.]+)=", doc))
    assert {"policy.draft.online", "policy.megatron_cfg.mtp_loss_mode", "cluster.ray_address"} <= keys
    merged = [load_yaml_with_defaults(p) for p in RECIPES]
    missing = [
        k for k in sorted(keys) if all(OmegaConf.select(c, k, default="__missing__") == "__missing__" for c in merged)
    ]
    assert missing == []


def test_utils_import_nothing_above_them_and_builtin_names_agree():
    """Imports run algorithms -> models -> distributed -> utils: a fresh interpreter that imports the config layer
    loads no other nemo_rl_spec package; the built-in model names the loader accepts are the ones hf_assets builds."""
    import subprocess
    import sys

    from nemo_rl_spec.models.hf_assets import BUILTIN_MODELS
    from nemo_rl_spec.utils.config import BUILTIN_MODEL_NAMES

    assert BUILTIN_MODEL_NAMES == set(BUILTIN_MODELS)
    code = (
        "import sys; import nemo_rl_spec.utils.config, nemo_rl_spec.utils.config_schema; "
        "from nemo_rl_spec.utils.config import load_config; load_config(sys.argv[1]); "
        "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('nemo_rl_spec.')}))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(SPEC)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['utils']", out.stdout + out.stderr


def test_a_model_that_tensor_parallel_cannot_split_is_a_config_error_before_ray():
    """tiny-qwen3 has 4 heads and 2 KV heads: TP=2 splits it, TP=4 does not (named key and model, from setup's check,
    which runs before Ray starts)."""
    from nemo_rl_spec.algorithms.grpo_setup import check_tensor_parallel_model
    from nemo_rl_spec.models.hf_assets import resolve_model

    path = resolve_model("tiny-qwen3")
    check_tensor_parallel_model(load_config(TINY, ["policy.megatron_cfg.tensor_model_parallel_size=2"]), path)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=4 does not divide .*num_key_value_heads"):
        check_tensor_parallel_model(load_config(TINY, ["policy.megatron_cfg.tensor_model_parallel_size=4"]), path)
