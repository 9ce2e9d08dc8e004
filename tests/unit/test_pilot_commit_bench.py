"""What the Pilot-Commit benchmark relies on, without a model: generator difficulty settings, the held-out
reasoning-gym validation set, the config-time Pilot-Commit budget check, and the benchmark's rollouts-to-target
arithmetic."""

import re
from pathlib import Path

import pytest

from nemo_rl_spec.bench import pilot_commit as bench_pilot_commit
from nemo_rl_spec.data.datasets import load_train_problems, parse_generator
from nemo_rl_spec.utils.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
BENCH_RECIPE = ROOT / "configs" / "grpo_math_smollm2_135m_pilot_commit.yaml"


def _bench_module():
    return bench_pilot_commit


def test_parse_generator():
    assert parse_generator("basic_arithmetic") == ("basic_arithmetic", {})
    assert parse_generator("chain_sum:min_terms=2, max_digits=1,p=0.5,flag=true,style=natural") == (
        "chain_sum",
        {"min_terms": 2, "max_digits": 1, "p": 0.5, "flag": True, "style": "natural"},
    )
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
    v, t = cfg.data.validation, cfg.data.train
    # validation = the generators' own draws at the validation seed (distribution-matched, repeats kept) ...
    assert val == load_train_problems(t.generators, v.max_samples, v.seed)
    questions = {p["question"] for p in val}
    # ... and the training pool = its draws minus the held-out questions, in order
    assert train == [p for p in load_train_problems(t.generators, t.size, t.seed) if p["question"] not in questions]
    assert not questions & {p["question"] for p in train} and 0 < len(train) <= t.size
    assert {p["source"] for p in val} == set(t.generators)  # generators: null -> the training ones


def test_held_out_set_has_the_training_distribution_on_a_small_family():
    """One-digit chain sums of 2-4 terms: the 2-term family (~200 questions) is nearly all inside a 2,048-problem
    pool, so removing training questions from the validation draws left 5 of 128 two-term problems (measured);
    the generator gives each term count about 1/3."""
    from nemo_rl_spec.algorithms.grpo_setup import load_datasets

    cfg = load_config(ROOT / "configs" / "grpo_math_testbed.yaml")
    _, val = load_datasets(cfg)
    terms = [len(re.findall(r"\d+", p["question"])) for p in val]
    for k in (2, 3, 4):  # binomial(128, 1/3): mean 42.7, sd 5.3; 4 sd either side
        assert abs(terms.count(k) - 128 / 3) < 4 * 5.34, (k, terms.count(k))


def test_pilot_commit_budget_without_commit_slot_fails_at_config_time():
    tiny = ROOT / "configs" / "grpo_math_tiny.yaml"  # budget 2 x 4 = 8 = the default pilot 4 x 2
    with pytest.raises(ConfigError, match="leaves no commit slot"):
        load_config(tiny, ["+grpo.pilot_commit.n_pilot=2", "loss_fn.use_importance_sampling_correction=true"])
    load_config(tiny, ["+grpo.pilot_commit.pilot_batch_size=2", "loss_fn.use_importance_sampling_correction=true"])


@pytest.mark.parametrize(
    "recipe",
    [BENCH_RECIPE, *(ROOT / "configs" / f"grpo_math_testbed{s}_pilot_commit.yaml" for s in ("", "_pool"))],
)
def test_bench_recipe_methods_differ_only_in_the_allocator(recipe):
    base = load_config(recipe).model_dump()
    for override in ("grpo.pilot_commit.enabled=true", "grpo.dynamic_sampling.enabled=true"):
        other = load_config(recipe, [override]).model_dump()
        key = override.split(".")[1]
        assert other["grpo"].pop(key) != base["grpo"][key]
        assert {**base["grpo"], key: None} == {**other["grpo"], key: None} and {
            k: v for k, v in base.items() if k != "grpo"
        } == {k: v for k, v in other.items() if k != "grpo"}


def test_testbed_bench_budget_matches_uniform_grpo():
    """Pilot-Commit on the testbed spends at most uniform GRPO's 8 x 8 = 64 rollouts: 8 x 2 pilots + K x 6
    commits, K = (64 - 16) // 6 = 8, i.e. 64; each committed group (2 + 6) is as large as a uniform group. Every
    method runs at the same lr (the recipe's, 2.5e-5); the wide pool pins its runs' P 16 (K 5, 62) and lr 5e-5."""
    for name, p, k, spend, lr in (("", 8, 8, 64, 2.5e-5), ("_wide", 16, 5, 62, 5e-5)):
        cfg = load_config(
            ROOT / "configs" / f"grpo_math_testbed_pilot_commit{name}.yaml", ["grpo.pilot_commit.enabled=true"]
        )
        pc, g = cfg.grpo.pilot_commit, cfg.grpo
        budget = g.num_prompts_per_step * g.num_generations_per_prompt
        assert budget == 64 and pc.pilot_batch_size == p and pc.commit_slots(budget) == k
        assert pc.pilot_batch_size * pc.n_pilot + pc.commit_slots(budget) * pc.n_commit == spend
        assert pc.n_pilot + pc.n_commit == g.num_generations_per_prompt
        assert cfg.policy.megatron_cfg.optimizer.lr == lr


def test_bench_rollouts_to_target_and_auto_target():
    bench = _bench_module()
    records = [
        {"step": 0, "validation/accuracy": 0.25},
        {"step": 1, "rollout_alloc/cumulative_rollouts": 32.0},  # not validated
        {"step": 2, "rollout_alloc/cumulative_rollouts": 56.0, "validation/accuracy": 0.3},
        {"step": 3, "rollout_alloc/cumulative_rollouts": 80.0, "validation/accuracy": 0.4},
    ]
    points = bench.curve(records)
    assert points == [(0, 0.0, 0.25), (2, 56.0, 0.3), (3, 80.0, 0.4)]
    assert bench.rollouts_to(points, 0.3) == 56.0 and bench.rollouts_to(points, 0.25) == 0.0
    assert bench.rollouts_to(points, 0.5) is None
    run = lambda final: {"curve": [(0, 0.0, 0.25), (3, 72.0, final)]}  # noqa: E731
    target, _ = bench.choose_target("auto", {"uniform": {0: run(0.3), 1: run(0.4)}}, n_val=40)
    assert target == pytest.approx(0.35)
    target, _ = bench.choose_target("auto", {"uniform": {0: run(0.25)}}, n_val=40)  # no gain: one problem above
    assert target == pytest.approx(0.275)
    assert bench.choose_target("0.5", {}, n_val=40)[0] == 0.5


def test_bench_ratio_stats_pairs_seeds_and_lists_censored_ones():
    bench = _bench_module()
    base = {"0": 1200.0, "1": 900.0, "2": 640.0, "3": None, "4": 512.0}
    pc = {"0": 600.0, "1": 450.0, "2": None, "3": 300.0, "4": 512.0}
    st = bench.ratio_stats(base, pc)
    assert st["per_seed"] == {"0": 2.0, "1": 2.0, "4": 1.0} and st["n"] == 3
    assert st["censored"] == {"2": "pilot_commit missed", "3": "base missed"}
    assert st["mean"] == pytest.approx(5 / 3) and st["median"] == 2.0
    lo, hi = st["interval90"]  # resample means of {2, 2, 1}: between 1 and 2, the interval inside
    assert 1.0 <= lo <= st["mean"] <= hi <= 2.0
    empty = bench.ratio_stats({"0": None}, {"0": None})
    assert empty["n"] == 0 and empty["mean"] is None and empty["censored"] == {"0": "both missed"}


def test_bench_gain_fraction_targets_and_per_method_stats():
    bench = _bench_module()
    run = lambda pts, var: {
        "curve": pts,
        "group_reward_var_curve": var,
        "mean_step_time_s": 2.0,  # noqa: E731
        "mean_group_reward_var": 0.1,
        "zero_adv_group_frac": 0.5,
    }
    runs = {
        "uniform": {0: run([(0, 0.0, 0.2), (2, 128.0, 0.5), (4, 256.0, 0.6)], [(1, 0.2), (2, 0.1)])},
        "pilot_commit": {0: run([(0, 0.0, 0.2), (2, 64.0, 0.45), (4, 128.0, 0.55)], [(1, 0.3)])},
    }
    g = bench.gain_fraction_targets(runs, 0.6)
    assert g["0.5"]["accuracy"] == pytest.approx(0.4) and g["1"]["accuracy"] == pytest.approx(0.6)
    assert g["0.5"]["rollouts_to_target"] == {"uniform": {"0": 128.0}, "pilot_commit": {"0": 64.0}}
    assert g["0.5"]["ratios"]["uniform_over_pilot_commit"]["per_seed"] == {"0": 2.0}
    assert g["1"]["ratios"]["uniform_over_pilot_commit"]["censored"] == {"0": "pilot_commit missed"}
    assert bench.gain_fraction_targets(runs, None) == {}
    st = bench.per_method_stats(runs["uniform"])
    assert st["final_accuracy"]["mean"] == 0.6 and st["mean_step_time_s"]["interval90"] is None  # one seed
    assert st["group_reward_var_per_step"] == [(1, 0.2), (2, 0.1)]


def test_bench_reanalysis_of_finished_runs_writes_json_table_and_plot(tmp_path, capsys):
    """``--reuse`` on finished run dirs (hand-written metrics): the JSON carries the paired ratios worked by hand,
    the per-step group variance averaged over seeds, and the two-panel plot is written."""
    import json

    bench = _bench_module()

    def write(method, seed, cum_acc, var):
        d = tmp_path / "runs" / f"{method}_seed{seed}"
        (d / "logs").mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"returncode": 0, "wall_s": 1.0}))
        rows = [{"step": 0, "validation/accuracy": 0.3}] + [
            {
                "step": i + 1,
                "rollout_alloc/cumulative_rollouts": c,
                "validation/accuracy": a,
                "rollout_alloc/mean_group_reward_var": v,
                "timing/train/total_step_time": 2.0,
            }
            for i, ((c, a), v) in enumerate(zip(cum_acc, var))
        ]
        (d / "logs" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))

    write("uniform", 0, [(64, 0.5), (128, 0.7)], [0.1, 0.2])
    write("uniform", 1, [(64, 0.6), (128, 0.7)], [0.3, 0.2])
    write("pilot_commit", 0, [(40, 0.7), (80, 0.7)], [0.2, 0.2])
    write("pilot_commit", 1, [(32, 0.6), (64, 0.75)], [0.2, 0.2])
    out = tmp_path / "bench.json"
    rc = bench.main(
        [
            "--out",
            str(out),
            "--config",
            "configs/grpo_math_testbed_pilot_commit.yaml",
            "--methods",
            "uniform",
            "pilot_commit",
            "--seeds",
            "0",
            "1",
            "--work-dir",
            str(tmp_path / "runs"),
            "--reuse",
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["target_accuracy"] == pytest.approx(0.7)  # uniform's mean final accuracy
    assert result["rollouts_to_target"] == {"uniform": {"0": 128.0, "1": 128.0}, "pilot_commit": {"0": 40.0, "1": 64.0}}
    ratio = result["ratios"]["uniform_over_pilot_commit"]
    assert ratio["per_seed"] == {"0": 3.2, "1": 2.0} and ratio["median"] == pytest.approx(2.6)
    assert result["per_method"]["uniform"]["group_reward_var_per_step"] == [
        [1, pytest.approx(0.2)],
        [2, pytest.approx(0.2)],
    ]
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "uniform_over_pilot_commit: mean 2.60 median 2.60" in capsys.readouterr().out


def test_method_steps_override_steps_per_method():
    args, _ = bench_pilot_commit.parse_args(["--out", "x.json", "--steps", "84", "--method-steps", "pilot_commit=30"])
    assert bench_pilot_commit.method_steps(args) == {"pilot_commit": 30}
    for bad in ("pilot_commit", "grpo=3", "dapo=x"):
        args, _ = bench_pilot_commit.parse_args(["--out", "x.json", "--method-steps", bad])
        with pytest.raises(SystemExit, match="METHOD=N"):
            bench_pilot_commit.method_steps(args)


def test_allocation_per_epoch_sums_each_epochs_steps():
    step = lambda epoch, ev, de, pool: {  # noqa: E731
        "rollout_alloc/epoch": epoch,
        "pilot_commit/evicted": ev,
        "pilot_commit/deferred": de,
        "pilot_commit/selected": 1.0,
        "pilot_commit/short_groups": 0.0,
        "rollout_alloc/step_rollouts": 100.0,
        "pilot_commit/pool_size": pool,
    }
    steps = [step(0, 2.0, 5.0, 30), step(0, 1.0, 4.0, 29), step(1, 0.0, 7.0, 29), {"rollout_alloc/epoch": 1}]
    out = bench_pilot_commit.allocation_per_epoch(steps)
    assert out == {
        "0": {
            "steps": 2,
            "evicted": 3.0,
            "deferred": 9.0,
            "selected": 2.0,
            "short_groups": 0.0,
            "rollouts": 200.0,
            "pool_size": 29,
        },
        "1": {
            "steps": 1,
            "evicted": 0.0,
            "deferred": 7.0,
            "selected": 1.0,
            "short_groups": 0.0,
            "rollouts": 100.0,
            "pool_size": 29,
        },
    }
    assert bench_pilot_commit.allocation_per_epoch([{"rollout_alloc/epoch": 0}]) == {}


def test_time_curve_sums_step_times_up_to_each_validation():
    records = [
        {"step": 0, "validation/accuracy": 0.5},
        {"step": 2, "timing/train/total_step_time": 2.5, "validation/accuracy": 0.7},
        {"step": 1, "timing/train/total_step_time": 1.5},
    ]
    assert bench_pilot_commit.time_curve(records) == [(0.0, 0.5), (4.0, 0.7)]
