"""What the Pilot-Commit benchmark relies on, without a model: generator difficulty settings, the held-out
reasoning-gym validation set, the config-time Pilot-Commit budget check, and the benchmark's rollouts-to-target
arithmetic."""
import re
from pathlib import Path

import pytest
from examples_loader import load_example

from nemo_rl_spec.data.datasets import load_train_problems, parse_generator
from nemo_rl_spec.utils.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
BENCH_RECIPE = ROOT / "configs" / "grpo_math_smollm2_135m_pilot_commit.yaml"


def _bench_module():
    return load_example("bench_pilot_commit")


def test_parse_generator():
    assert parse_generator("basic_arithmetic") == ("basic_arithmetic", {})
    assert parse_generator("chain_sum:min_terms=2, max_digits=1,p=0.5,flag=true,style=natural") == (
        "chain_sum", {"min_terms": 2, "max_digits": 1, "p": 0.5, "flag": True, "style": "natural"})
    with pytest.raises(ValueError, match="not key=value"):
        parse_generator("chain_sum:min_terms")


def test_generator_settings_reach_reasoning_gym():
    problems = load_train_problems(["chain_sum:min_terms=2,max_terms=2,min_digits=1,max_digits=1"], 30, seed=0)
    for p in problems:
        numbers = re.findall(r"\d+", p["question"])
        assert len(numbers) == 2 and all(int(n) < 10 for n in numbers), p["question"]
    with pytest.raises(ValueError, match="unknown reasoning-gym generator"):
        load_train_problems(["no_such_generator:max_terms=2"], 4, seed=0)


def test_held_out_reasoning_gym_validation():
    from nemo_rl_spec.algorithms.grpo_setup import load_datasets

    cfg = load_config(BENCH_RECIPE)
    train, val = load_datasets(cfg)
    assert len(train) == cfg.data.train.size and len(val) == cfg.data.validation.max_samples
    questions = [p["question"] for p in val]
    assert len(set(questions)) == len(questions)                       # no repeats
    assert not set(questions) & {p["question"] for p in train}         # disjoint from the training pool
    assert {p["source"] for p in val} == set(cfg.data.train.generators)  # generators: null -> the training ones


def test_pilot_commit_budget_without_commit_slot_fails_at_config_time():
    tiny = ROOT / "configs" / "grpo_math_tiny.yaml"   # budget 2 x 4 = 8 = the default pilot 4 x 2
    with pytest.raises(ConfigError, match="leaves no commit slot"):
        load_config(tiny, ["+grpo.pilot_commit.n_pilot=2", "loss_fn.use_importance_sampling_correction=true"])
    load_config(tiny, ["+grpo.pilot_commit.pilot_batch_size=2", "loss_fn.use_importance_sampling_correction=true"])


def test_bench_recipe_methods_differ_only_in_the_allocator():
    base = load_config(BENCH_RECIPE).model_dump()
    for override in ("grpo.pilot_commit.enabled=true", "grpo.dynamic_sampling.enabled=true"):
        other = load_config(BENCH_RECIPE, [override]).model_dump()
        key = override.split(".")[1]
        assert other["grpo"].pop(key) != base["grpo"][key]
        assert {**base["grpo"], key: None} == {**other["grpo"], key: None} and \
            {k: v for k, v in base.items() if k != "grpo"} == {k: v for k, v in other.items() if k != "grpo"}


def test_bench_rollouts_to_target_and_auto_target():
    bench = _bench_module()
    records = [{"step": 0, "validation/accuracy": 0.25},
               {"step": 1, "rollout_alloc/cumulative_rollouts": 32.0},            # not validated
               {"step": 2, "rollout_alloc/cumulative_rollouts": 56.0, "validation/accuracy": 0.3},
               {"step": 3, "rollout_alloc/cumulative_rollouts": 80.0, "validation/accuracy": 0.4}]
    points = bench.curve(records)
    assert points == [(0, 0.0, 0.25), (2, 56.0, 0.3), (3, 80.0, 0.4)]
    assert bench.rollouts_to(points, 0.3) == 56.0 and bench.rollouts_to(points, 0.25) == 0.0
    assert bench.rollouts_to(points, 0.5) is None
    run = lambda final: {"curve": [(0, 0.0, 0.25), (3, 72.0, final)]}  # noqa: E731
    target, _ = bench.choose_target("auto", {"uniform": {0: run(0.3), 1: run(0.4)}}, n_val=40)
    assert target == pytest.approx(0.35)
    target, _ = bench.choose_target("auto", {"uniform": {0: run(0.25)}}, n_val=40)   # no gain: one problem above
    assert target == pytest.approx(0.275)
    assert bench.choose_target("0.5", {}, n_val=40)[0] == 0.5
