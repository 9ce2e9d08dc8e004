"""Does a recipe learn? Held-out validation accuracy before and after GRPO, over seeds, with an interval.

``python examples/bench_learning.py --out docs/results/grpo_learning/training_curves.json [--config RECIPE] [--seeds 42 1 2]
[--work-dir DIR] [--reuse] [--baseline OTHER.json] [key=value ...]``

Each seed is one subprocess of ``examples/run_grpo.py`` (the same command ``make run`` runs, plus ``grpo.seed=S``
and its own run dir ``--work-dir/seed<S>/``, default ``<out stem>_runs/``); extra ``key=value`` arguments go to every
run, ``--reuse`` keeps seeds whose run finished. Per seed: validation accuracy at step 0 and at the last step, the
gain, the mean ``train/reward`` of the first and last third of the steps, seconds per step and
``train/token_mult_prob_error`` (1.0 is perfect). Over seeds: mean gain and a percentile-bootstrap 90% interval.
Writes ``--out`` (JSON), ``<out stem>.png`` (every seed's ``train/reward`` and ``validation/accuracy`` against step)
and a table. ``--baseline OTHER.json`` (an earlier result of this script, e.g. the same seeds in fp32) adds
``comparison``: per seed present in both, final accuracy and gain minus the baseline's, and the mean final-accuracy
difference with its bootstrap 90% interval (paired by seed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from nemo_rl_spec.utils.bench_runs import (
    bootstrap_interval,
    finish_plot,
    read_metrics,
    result_paths,
    run_grpo_subprocess,
)
from nemo_rl_spec.utils.config import load_config
from nemo_rl_spec.utils.machine import write_bench_json

ACC, REWARD, TMPE = "validation/accuracy", "train/reward", "train/token_mult_prob_error"


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="result JSON (the plot is written next to it as <stem>.png)")
    p.add_argument("--config", default="configs/grpo_math_smollm2_135m.yaml", help="recipe")
    p.add_argument("--seeds", nargs="+", type=int, default=[42, 1, 2], help="grpo.seed of each run (42: make run's)")
    p.add_argument("--work-dir", default=None, help="per-seed run dirs (default: <out stem>_runs/ next to --out)")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one run may take")
    p.add_argument("--reuse", action="store_true", help="skip seeds whose run finished (resume / re-analysis)")
    p.add_argument("--baseline", default=None, help="an earlier result JSON: per-seed differences (this - baseline)")
    return p.parse_known_args(argv)


def third_means(values: list[float]) -> tuple[float | None, float | None]:
    """Mean of the first and of the last ceil(n/3) values (None, None when empty)."""
    if not values:
        return None, None
    k = -(-len(values) // 3)
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def seed_summary(records: list[dict]) -> dict:
    """Start/final validation accuracy, gain, reward trend and step time of one run's ``metrics.jsonl`` records."""
    val = [(int(r["step"]), float(r[ACC])) for r in records if ACC in r]
    steps = [r for r in records if r["step"] > 0 and REWARD in r]
    first, last = third_means([float(r[REWARD]) for r in steps])
    start = val[0][1] if val and val[0][0] == 0 else None
    final = val[-1][1] if val and val[-1][0] > 0 else None
    times = [r["timing/train/total_step_time"] for r in steps if "timing/train/total_step_time" in r]
    tmpe = [float(r[TMPE]) for r in steps if TMPE in r]
    return {
        "validation": val,
        "start_accuracy": start,
        "final_accuracy": final,
        "gain": None if start is None or final is None else final - start,
        "train_reward": [float(r[REWARD]) for r in steps],
        "reward_first_third": first,
        "reward_last_third": last,
        "steps_run": len(steps),
        "mean_step_time_s": statistics.fmean(times) if times else None,
        "token_mult_prob_error": tmpe,
        "mean_token_mult_prob_error": statistics.fmean(tmpe) if tmpe else None,
    }


def summarize(per_seed: dict[str, dict]) -> dict:
    """Mean gain over the seeds that finished, its bootstrap 90% interval, and the per-seed summaries."""
    gains = [s["gain"] for s in per_seed.values() if s["gain"] is not None]
    trend = [
        s["reward_last_third"] - s["reward_first_third"]
        for s in per_seed.values()
        if s["reward_first_third"] is not None
    ]
    tmpe = [
        s["mean_token_mult_prob_error"] for s in per_seed.values() if s.get("mean_token_mult_prob_error") is not None
    ]
    times = [s["mean_step_time_s"] for s in per_seed.values() if s["mean_step_time_s"] is not None]
    return {
        "mean_gain": statistics.fmean(gains) if gains else None,
        "gain_interval_90": bootstrap_interval(gains),
        "mean_reward_trend": statistics.fmean(trend) if trend else None,
        "mean_token_mult_prob_error": statistics.fmean(tmpe) if tmpe else None,
        "mean_step_time_s": statistics.fmean(times) if times else None,
        "seeds": per_seed,
    }


def compare(result: dict, baseline: dict) -> dict:
    """This result minus ``baseline`` (both :func:`summarize` outputs), paired by seed over the seeds where both have a
    final accuracy: per-seed final / gain differences, the mean final-accuracy difference and its bootstrap 90%
    interval, and the mean gain difference."""
    pairs = {
        seed: {
            "final": s["final_accuracy"],
            "baseline_final": baseline["seeds"][seed]["final_accuracy"],
            "final_diff": s["final_accuracy"] - baseline["seeds"][seed]["final_accuracy"],
            "gain_diff": s["gain"] - baseline["seeds"][seed]["gain"],
        }
        for seed, s in result["seeds"].items()
        if s["final_accuracy"] is not None
        and s["gain"] is not None
        and (baseline["seeds"].get(seed) or {}).get("gain") is not None
    }
    diffs = [p["final_diff"] for p in pairs.values()]
    gain_diffs = [p["gain_diff"] for p in pairs.values()]
    return {
        "seeds": pairs,
        "mean_final_diff": statistics.fmean(diffs) if diffs else None,
        "final_diff_interval_90": bootstrap_interval(diffs),
        "mean_gain_diff": statistics.fmean(gain_diffs) if gain_diffs else None,
    }


def plot(per_seed: dict[str, dict], png: Path) -> None:
    import matplotlib  # lazy: matplotlib only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (seed, s) in enumerate(per_seed.items()):
        color = f"C{i}"
        ax.plot(
            range(1, len(s["train_reward"]) + 1),
            s["train_reward"],
            "-",
            color=color,
            alpha=0.5,
            label=f"train/reward seed {seed}",
        )
        if s["validation"]:
            ax.plot(*zip(*s["validation"]), "--s", color=color, label=f"held-out accuracy seed {seed}")
    finish_plot(fig, ax, png, "GRPO step", "reward / accuracy")


def table(result: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    fmt4 = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    lines = [
        f"{'seed':>5}{'start':>8}{'final':>8}{'gain':>8}{'reward 1st/3':>14}{'last/3':>8}{'steps':>6}{'s/step':>8}"
        f"{'tok_mult_err':>14}"
    ]
    for seed, s in result["seeds"].items():
        lines.append(
            f"{seed:>5}{fmt(s['start_accuracy']):>8}{fmt(s['final_accuracy']):>8}{fmt(s['gain']):>8}"
            f"{fmt(s['reward_first_third']):>14}{fmt(s['reward_last_third']):>8}{s['steps_run']:>6}"
            f"{fmt(s['mean_step_time_s']):>8}{fmt4(s.get('mean_token_mult_prob_error')):>14}"
        )
    ci = result["gain_interval_90"]
    lines.append(
        f"mean gain {fmt(result['mean_gain'])}, bootstrap 90% interval "
        f"{'-' if ci is None else f'[{ci[0]:.3f}, {ci[1]:.3f}]'}; mean reward trend (last - first third) "
        f"{fmt(result['mean_reward_trend'])}; mean token_mult_prob_error "
        f"{fmt4(result.get('mean_token_mult_prob_error'))}"
    )
    tmpe = {seed: s.get("token_mult_prob_error") or [] for seed, s in result["seeds"].items()}
    if any(tmpe.values()):
        lines.append(
            "token_mult_prob_error per step: "
            + "; ".join(f"seed {seed}: " + " ".join(f"{v:.4f}" for v in vals) for seed, vals in tmpe.items())
        )
    if result.get("comparison"):
        c = result["comparison"]
        lines.append(f"vs baseline {result['meta'].get('baseline')}:")
        lines.append(f"{'seed':>5}{'final':>8}{'base':>8}{'diff':>8}{'gain diff':>11}")
        for seed, p in c["seeds"].items():
            lines.append(
                f"{seed:>5}{fmt(p['final']):>8}{fmt(p['baseline_final']):>8}{p['final_diff']:>+8.3f}"
                f"{p['gain_diff']:>+11.3f}"
            )
        ci = c["final_diff_interval_90"]
        lines.append(
            f"mean final-accuracy difference {fmt(c['mean_final_diff'])}, bootstrap 90% interval "
            f"{'-' if ci is None else f'[{ci[0]:.3f}, {ci[1]:.3f}]'}; mean gain difference "
            f"{fmt(c['mean_gain_diff'])}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    out, work = result_paths(args.out, args.work_dir)
    load_config(args.config, extra)
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    t0, per_seed, infos = time.time(), {}, {}
    for seed in args.seeds:
        run_dir = work / f"seed{seed}"
        infos[str(seed)] = run_grpo_subprocess(
            args.config,
            [f"grpo.seed={seed}", *extra],
            run_dir,
            label=f"seed {seed}",
            timeout_s=args.run_timeout,
            reuse=args.reuse,
        )
        per_seed[str(seed)] = {
            **seed_summary(read_metrics(run_dir / "logs" / "metrics.jsonl")),
            "returncode": infos[str(seed)]["returncode"],
            "wall_s": infos[str(seed)]["wall_s"],
        }
        result = {
            **summarize(per_seed),
            "meta": {
                "config": args.config,
                "overrides": extra,
                "seeds": args.seeds,
                "total_wall_s": round(time.time() - t0),
                "baseline": args.baseline,
            },
        }
        if baseline is not None:
            result["comparison"] = compare(result, baseline)
        write_bench_json(out, result)
    plot(per_seed, out.with_suffix(".png"))
    print(table(result))
    print(json.dumps({"json": str(out), "plot": str(out.with_suffix(".png"))}))
    return 0 if all(i["returncode"] == 0 for i in infos.values()) else 1
