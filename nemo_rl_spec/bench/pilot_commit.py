"""Rollouts to a target validation accuracy: uniform GRPO vs DAPO dynamic sampling vs Pilot-Commit, real loop.

``python examples/bench_pilot_commit.py --out results/bench_pilot_commit.json [--seeds 0 1] [--steps 6]
[--target auto|0.3] [key=value ...]``

Every (method, seed) is one ``examples/run_grpo.py`` subprocess on the bench recipe (default
``configs/grpo_math_smollm2_135m_pilot_commit.yaml``) with its own log dir; methods differ only in the allocator
section they enable, and extra ``key=value`` arguments go to every run. Runs are ordered seed-major and the JSON is
rewritten after every run. Measured per run: the validation accuracy against ``rollout_alloc/cumulative_rollouts``
(every rollout generated: pilots, commits, discarded DAPO batches); ``rollouts_to_target[method][seed]`` = the
cumulative rollouts at the first validation that reaches the target (null if never). ``--target auto`` (default)
is the paper's protocol: uniform GRPO's mean final accuracy, at least one validation problem above the start.
Lower targets and paired ratios with intervals: :func:`gain_fraction_targets`, :func:`ratio_stats`. Writes
``--out`` (JSON), a PNG next to it and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from nemo_rl_spec.utils.bench_runs import (
    ROOT,
    finish_plot,
    mean_and_interval,
    read_metrics,
    result_paths,
    run_grpo_subprocess,
)
from nemo_rl_spec.utils.config import load_config
from nemo_rl_spec.utils.machine import write_bench_json

METHODS = {
    "uniform": [],
    "dapo": ["grpo.dynamic_sampling.enabled=true"],
    "pilot_commit": ["grpo.pilot_commit.enabled=true"],
}
CUM = "rollout_alloc/cumulative_rollouts"
ACC = "validation/accuracy"
VAR = "rollout_alloc/mean_group_reward_var"
GAIN_FRACTIONS = (0.5, 0.75, 0.9, 1.0)
"""Secondary targets: start + f * (target - start) for each f (f = 1 is the target itself), so that a comparison
does not hinge on one threshold that about half the uniform seeds themselves never reach."""


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="result JSON (the plot is written next to it as <stem>.png)")
    p.add_argument("--config", default="configs/grpo_math_smollm2_135m_pilot_commit.yaml", help="bench recipe")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", type=int, default=None, help="grpo.max_num_steps (default: the recipe's)")
    p.add_argument(
        "--method-steps",
        nargs="+",
        default=[],
        metavar="METHOD=N",
        help="grpo.max_num_steps of one method (over --steps): a method that spends more rollouts a step needs fewer",
    )
    p.add_argument("--target", default="auto", help="target validation accuracy in [0, 1], or 'auto'")
    p.add_argument("--work-dir", default=None, help="per-run log dirs (default: <out stem>_runs/ next to --out)")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--reuse", action="store_true", help="skip runs whose metrics.jsonl is complete (re-analysis)")
    return p.parse_known_args(argv)


def curve(records: list[dict]) -> list[tuple[int, float, float]]:
    """(step, cumulative rollouts, validation accuracy) of every validated step (step 0: no rollouts yet)."""
    cum, out = 0.0, []
    for r in sorted(records, key=lambda r: r["step"]):
        cum = r.get(CUM, cum)
        if ACC in r:
            out.append((int(r["step"]), float(cum), float(r[ACC])))
    return out


def time_curve(records: list[dict]) -> list[tuple[float, float]]:
    """(cumulative ``timing/train/total_step_time`` in seconds, validation accuracy) at every validated step: accuracy
    against the steps' wall time (validation time excluded)."""
    wall, out = 0.0, []
    for r in sorted(records, key=lambda r: r["step"]):
        wall += r.get("timing/train/total_step_time", 0.0)
        if ACC in r:
            out.append((round(wall, 3), float(r[ACC])))
    return out


def rollouts_to(points: list[tuple[int, float, float]], target: float) -> float | None:
    """Cumulative rollouts at the first validation with accuracy >= target (1e-9 slack for float noise)."""
    return next((c for _, c, a in points if a >= target - 1e-9), None)


def method_steps(args) -> dict[str, int]:
    """``--method-steps`` as {method: steps}.

    Raises:
        SystemExit: an entry is not METHOD=N with a known method and an integer N."""
    out = {}
    for item in args.method_steps:
        method, sep, n = item.partition("=")
        if not sep or method not in METHODS or not n.isdigit():
            raise SystemExit(f"--method-steps: {item!r} is not METHOD=N with METHOD in {list(METHODS)}")
        out[method] = int(n)
    return out


def run_one(args, extra: list[str], method: str, seed: int, run_dir: Path) -> dict:
    """Run one (method, seed) subprocess unless ``--reuse`` finds it complete; returns its record."""
    metrics = run_dir / "logs" / "metrics.jsonl"
    overrides = [
        *METHODS[method],
        f"grpo.seed={seed}",
        *([f"grpo.max_num_steps={steps}"] if (steps := method_steps(args).get(method, args.steps)) else []),
        *extra,
    ]
    info = run_grpo_subprocess(
        args.config, overrides, run_dir, label=f"{method} seed {seed}", timeout_s=args.run_timeout, reuse=args.reuse
    )
    records = read_metrics(metrics)
    steps = [r for r in records if r["step"] > 0]
    mean = lambda key: statistics.fmean(r[key] for r in steps if key in r) if any(key in r for r in steps) else None  # noqa: E731
    return {
        "returncode": info["returncode"],
        "wall_s": info["wall_s"],
        "steps_run": len(steps),
        "curve": curve(records),
        "time_curve": time_curve(records),
        "mean_step_time_s": mean("timing/train/total_step_time"),
        "mean_group_reward_var": mean(VAR),
        "group_reward_var_curve": [(int(r["step"]), r[VAR]) for r in steps if VAR in r],
        "zero_adv_group_frac": mean("rollout_alloc/zero_adv_group_frac"),
        "mean_train_reward": mean("train/reward"),
        "cumulative_rollouts": [(int(r["step"]), r[CUM]) for r in steps if CUM in r],
        "useful_rollout_frac": steps[-1].get("rollout_alloc/useful_rollout_frac") if steps else None,
        **training_diagnostics(steps),
        "allocation_per_epoch": allocation_per_epoch(steps),
        "log_dir": str(run_dir / "logs"),
    }


def allocation_per_epoch(steps: list[dict]) -> dict[str, dict[str, float]]:
    """Pilot-Commit's per-step counts summed per epoch of the prompt pool (the epoch a step ended in,
    ``rollout_alloc/epoch``): steps, ``evicted`` (solved prompts removed), ``deferred`` (too hard this time),
    ``selected``, ``short_groups``, rollouts generated; and ``pool_size`` (prompts left) at the epoch's last step.
    Empty for runs without Pilot-Commit's metrics."""
    out: dict[str, dict[str, float]] = {}
    for r in steps:
        if "pilot_commit/evicted" not in r:
            continue
        e = out.setdefault(str(int(r.get("rollout_alloc/epoch", 0))), {"steps": 0})
        e["steps"] += 1
        for key in ("evicted", "deferred", "selected", "short_groups"):
            e[key] = e.get(key, 0.0) + r.get(f"pilot_commit/{key}", 0.0)
        e["rollouts"] = e.get("rollouts", 0.0) + r.get("rollout_alloc/step_rollouts", 0.0)
        e["pool_size"] = r.get("pilot_commit/pool_size")
    return out


def training_diagnostics(steps: list[dict]) -> dict:
    """What a run trained on and how hard it pushed, from its step records (step >= 1):
    ``mean_train_rows`` / ``train_rows_curve`` (``rollout_alloc/train_rollouts``), ``mean_grad_norm`` /
    ``max_grad_norm`` (``train/grad_norm``, before clipping), ``mean_trained_times_seen``, ``final_trained_unique_frac``
    (distinct prompts / train groups over the run), ``trained_bucket_share`` (each difficulty bucket's share of the
    train groups of the run, summed over steps), ``mean_train_group_reward``. A value is None when no step logged it
    (e.g. runs from before the metric existed)."""

    def mean(key):
        vals = [r[key] for r in steps if key in r and r[key] == r[key]]  # NaN (no update) left out
        return statistics.fmean(vals) if vals else None

    rows = "rollout_alloc/train_rollouts"
    buckets: dict[str, float] = {}
    for r in steps:
        for k, v in r.items():
            if k.startswith("rollout_alloc/trained_bucket/"):
                buckets[k.rsplit("/", 1)[1]] = buckets.get(k.rsplit("/", 1)[1], 0.0) + v
    total = sum(buckets.values())
    unique = [r["rollout_alloc/trained_unique_frac"] for r in steps if "rollout_alloc/trained_unique_frac" in r]
    return {
        "mean_train_rows": mean(rows),
        "train_rows_curve": [(int(r["step"]), r[rows]) for r in steps if rows in r],
        "mean_grad_norm": mean("train/grad_norm"),
        "max_grad_norm": max((r["train/grad_norm"] for r in steps if "train/grad_norm" in r), default=None),
        "mean_trained_times_seen": mean("rollout_alloc/trained_times_seen_mean"),
        "final_trained_unique_frac": unique[-1] if unique else None,
        "trained_bucket_share": {b: c / total for b, c in sorted(buckets.items())} if total else None,
        "mean_train_group_reward": mean("rollout_alloc/trained_group_reward_mean"),
    }


def start_accuracies(runs: dict) -> list[float]:
    """The step-0 validation accuracy of every run that has one (``runs[method][seed]`` records)."""
    return [pts[0][2] for by in runs.values() for r in by.values() if (pts := r["curve"]) and pts[0][0] == 0]


def final_accuracy(run: dict) -> float | None:
    """Validation accuracy at a run's last validated step, None if it never validated after step 0."""
    return run["curve"][-1][2] if run["curve"] and run["curve"][-1][0] > 0 else None


def choose_target(spec: str, runs: dict, n_val: int) -> tuple[float | None, str]:
    if spec != "auto":
        return float(spec), "given"
    starts = start_accuracies(runs)
    finals = [a for r in runs.get("uniform", {}).values() if (a := final_accuracy(r)) is not None]
    if not starts or not finals:
        return None, "auto: missing start or uniform final accuracy"
    floor = max(starts) + 1.0 / n_val
    return max(statistics.fmean(finals), floor), (
        f"auto: max(mean final accuracy of uniform GRPO = {statistics.fmean(finals):.4f}, "
        f"start accuracy {max(starts):.4f} + 1/{n_val} validation problems)"
    )


def summarize(runs: dict, target_spec: str, n_val: int) -> dict:
    target, how = choose_target(target_spec, runs, n_val)
    rtt = {
        m: {str(s): (rollouts_to(r["curve"], target) if target is not None else None) for s, r in by.items()}
        for m, by in runs.items()
    }
    final = {m: {str(s): final_accuracy(r) for s, r in by.items()} for m, by in runs.items()}
    ratios = {
        f"{base}_over_pilot_commit": ratio_stats(rtt.get(base, {}), rtt.get("pilot_commit", {}))
        for base in ("uniform", "dapo")
    }
    cumulative = {m: {str(s): r["cumulative_rollouts"] for s, r in by.items()} for m, by in runs.items()}
    accuracy = {m: {str(s): [[c, a] for _, c, a in r["curve"]] for s, r in by.items()} for m, by in runs.items()}
    return {
        "target_accuracy": target,
        "target_rule": how,
        "rollouts_to_target": rtt,
        "final_accuracy": final,
        "cumulative_rollouts": cumulative,
        "accuracy_vs_cumulative_rollouts": accuracy,
        "ratios": ratios,
        "paper_goal": {"uniform_over_pilot_commit": 1.5, "dapo_over_pilot_commit": 2.3},
        "gain_fraction_targets": gain_fraction_targets(runs, target),
        "per_method": {m: per_method_stats(by) for m, by in runs.items()},
        "runs": {m: {str(s): r for s, r in by.items()} for m, by in runs.items()},
    }


def ratio_stats(base: dict, pc: dict) -> dict:
    """Paired-by-seed ratios ``base[s] / pc[s]`` of rollouts to target (>1: Pilot-Commit needed fewer).

    Seeds where both reached the target give a ratio; where only one did, the seed is *censored* and listed with
    the side that missed (the ratio is then only bounded, so it is left out of the mean, median and interval).
    The interval is :func:`mean_and_interval`'s bootstrap 90% over the uncensored seeds (None below 2)."""
    per_seed = {s: base[s] / pc[s] for s in pc if base.get(s) and pc[s]}
    censored = {
        s: ("pilot_commit missed" if base.get(s) else "both missed" if not pc[s] else "base missed")
        for s in pc
        if s in base and not (base.get(s) and pc[s])
    }
    values = list(per_seed.values())
    return {
        "per_seed": per_seed,
        "censored": censored,
        "n": len(values),
        **mean_and_interval(values),
        "median": statistics.median(values) if values else None,
        "note": "rollouts to target, base / pilot_commit per seed (>1: Pilot-Commit needed fewer)",
    }


def gain_fraction_targets(runs: dict, target: float | None) -> dict:
    """For each f in :data:`GAIN_FRACTIONS`: the accuracy start + f * (target - start), every run's rollouts to it,
    and the paired ratios (:func:`ratio_stats`). Empty without a target or a start accuracy."""
    starts = start_accuracies(runs)
    if target is None or not starts:
        return {}
    out = {}
    for f in GAIN_FRACTIONS:
        acc = max(starts) + f * (target - max(starts))
        rtt = {m: {str(s): rollouts_to(r["curve"], acc) for s, r in by.items()} for m, by in runs.items()}
        out[f"{f:g}"] = {
            "accuracy": acc,
            "rollouts_to_target": rtt,
            "ratios": {
                f"{b}_over_pilot_commit": ratio_stats(rtt.get(b, {}), rtt.get("pilot_commit", {}))
                for b in ("uniform", "dapo")
                if b in rtt and "pilot_commit" in rtt
            },
        }
    return out


def per_method_stats(by_seed: dict) -> dict:
    """Mean over seeds, with a 90% bootstrap interval, of each run's mean step time (s), mean within-group reward
    variance, zero-advantage group fraction and final accuracy; and the per-step group reward variance averaged
    over the seeds that logged that step."""
    out = {}
    for key in ("mean_step_time_s", "mean_group_reward_var", "zero_adv_group_frac"):
        out[key] = mean_and_interval([r[key] for r in by_seed.values() if r.get(key) is not None])
    out["final_accuracy"] = mean_and_interval([a for r in by_seed.values() if (a := final_accuracy(r)) is not None])
    per_step: dict[int, list[float]] = {}
    for r in by_seed.values():
        for step, v in r.get("group_reward_var_curve", []):
            per_step.setdefault(step, []).append(v)
    out["group_reward_var_per_step"] = [(s, statistics.fmean(v)) for s, v in sorted(per_step.items())]
    return out


def plot(result: dict, png: Path) -> None:
    """Left: validation accuracy vs cumulative rollouts, every run. Middle: the same vs the steps' wall time.
    Right: mean within-group reward variance per step, each method averaged over its seeds (``per_method``)."""
    import matplotlib  # lazy: matplotlib only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot

    colors = {"uniform": "tab:blue", "dapo": "tab:orange", "pilot_commit": "tab:green"}
    styles = ["-o", "--s", ":^", "-.d", "-x"]
    fig, (ax, ax_time, ax_var) = plt.subplots(1, 3, figsize=(17, 4.5), gridspec_kw={"width_ratios": [3, 3, 2]})
    for m, by in result["runs"].items():
        for i, (s, r) in enumerate(by.items()):
            style = dict(color=colors.get(m), alpha=0.85, ms=3)
            if r["curve"]:
                _, xs, ys = zip(*r["curve"])
                ax.plot(xs, ys, styles[i % len(styles)], label=f"{m} seed {s}", **style)
            if r.get("time_curve"):
                ts, ys = zip(*r["time_curve"])
                ax_time.plot(ts, ys, styles[i % len(styles)], **style)
    ax_time.set_xlabel("wall time of the steps (s, validation excluded)")
    ax_time.set_ylabel("validation accuracy")
    ax_time.grid(alpha=0.3)
    for m, st in result.get("per_method", {}).items():
        if st["group_reward_var_per_step"]:
            steps, var = zip(*st["group_reward_var_per_step"])
            ax_var.plot(steps, var, "-o", color=colors.get(m), label=m, ms=3)
    ax_var.set_xlabel("step")
    ax_var.set_ylabel("mean within-group reward variance (train batch)")
    ax_var.grid(alpha=0.3)
    ax_var.legend(fontsize=7)
    if result["target_accuracy"] is not None:
        ax.axhline(result["target_accuracy"], color="gray", lw=1, ls="--", label="target")
    finish_plot(fig, ax, png, "cumulative rollouts", "validation accuracy")


def table(result: dict) -> str:
    fmt = lambda v, d=3: (
        "-" if v is None else (f"{v:.{d}f}" if isinstance(v, float) and not v.is_integer() else f"{v:g}")
    )  # noqa: E731
    lines = [
        f"target accuracy {fmt(result['target_accuracy'])} ({result['target_rule']})",
        f"{'method':<13}{'seed':>5}{'to_target':>11}{'final_acc':>10}{'peak_acc':>9}{'rollouts':>9}"
        f"{'steps':>6}{'zero_adv':>9}{'grp_var':>8}{'s/step':>8}{'wall_s':>8}",
    ]
    for m, by in result["runs"].items():
        for s, r in by.items():
            peak = max((a for _, _, a in r["curve"]), default=None)
            total = r["cumulative_rollouts"][-1][1] if r["cumulative_rollouts"] else None
            lines.append(
                f"{m:<13}{s:>5}{fmt(result['rollouts_to_target'][m][s]):>11}"
                f"{fmt(result['final_accuracy'][m][s]):>10}{fmt(peak):>9}{fmt(total):>9}{r['steps_run']:>6}"
                f"{fmt(r['zero_adv_group_frac'], 2):>9}{fmt(r['mean_group_reward_var'], 3):>8}"
                f"{fmt(r['mean_step_time_s'], 0):>8}{fmt(r['wall_s'], 0):>8}"
            )
    for k, v in result["ratios"].items():
        ci = v.get("interval90")
        lines.append(
            f"{k}: mean {fmt(v['mean'], 2)} median {fmt(v.get('median'), 2)} 90% CI "
            f"{'-' if ci is None else f'[{ci[0]:.2f}, {ci[1]:.2f}]'} over {v.get('n', 0)} seeds; per seed "
            f"{json.dumps({s: round(x, 2) for s, x in v['per_seed'].items()})}; censored "
            f"{json.dumps(v.get('censored', {}))}"
        )
    for f, g in result.get("gain_fraction_targets", {}).items():
        parts = [f"{k} {fmt(v['mean'], 2)} (n={v['n']})" for k, v in g["ratios"].items()]
        lines.append(f"gain fraction {f} (accuracy {g['accuracy']:.3f}): mean ratio " + ", ".join(parts))
    for m, st in result.get("per_method", {}).items():
        lines.append(f"{m}: " + ", ".join(f"{k} {fmt(v['mean'], 3)}" for k, v in st.items() if isinstance(v, dict)))
    return "\n".join(lines)


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    out, work = result_paths(args.out, args.work_dir)
    for m in args.methods:
        cfg = load_config(ROOT / args.config, [*METHODS[m], *extra])
    from nemo_rl_spec.algorithms.grpo_setup import load_datasets  # lazy: loads ray or megatron-core

    train, val = load_datasets(cfg)
    t0, runs = time.time(), {m: {} for m in args.methods}
    meta = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
        "config": args.config,
        "overrides": extra,
        "methods": {m: METHODS[m] for m in args.methods},
        "seeds": args.seeds,
        "train_pool": {"size": len(train), "sources": sorted({p["source"] for p in train})},
        "validation_size": len(val),
    }
    result = {}
    for seed in args.seeds:
        for m in args.methods:
            run_dir = work / f"{m}_seed{seed}"
            runs[m][seed] = run_one(args, extra, m, seed, run_dir)
            result = {
                **summarize(runs, args.target, len(val)),
                "meta": {**meta, "total_wall_s": round(time.time() - t0)},
            }
            write_bench_json(out, result)
    plot(result, out.with_suffix(".png"))
    print(table(result))
    print(json.dumps({"json": str(out), "plot": str(out.with_suffix(".png")), "total_wall_s": round(time.time() - t0)}))
    return 0 if all(r["returncode"] == 0 for by in runs.values() for r in by.values()) else 1
