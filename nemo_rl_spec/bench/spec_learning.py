"""Is speculative GRPO indistinguishable from autoregressive GRPO on a policy that learns?

``python examples/bench_spec_learning.py --out docs/results/spec_learning_testbed/spec_learning_testbed.json
[--methods ar eagle3 eagle3_lossy mtp] [--seeds 42 1 2 3 4] [--steps 30] [--work-dir DIR] [--reuse] [key=value ...]``

Methods (:data:`METHODS`), each a recipe plus overrides: ``ar`` (configs/grpo_math_testbed.yaml), ``eagle3``
(configs/grpo_math_testbed_spec.yaml: online EAGLE-3, k = 3, fresh head), ``eagle3_lossy`` (the same with the
DEBUG-ONLY lossy sampler ``policy.generation.debug_lossy_sampler=resample_from_target``: the negative control) and
``mtp`` (one megatron-core MTP layer trained detached, as vLLM's ``mtp`` drafter, k = 1). Each (method, seed) is
one ``examples/run_grpo.py`` subprocess in ``<work-dir>/<method>_seed<seed>/``, methods interleaved seed by seed;
the JSON is rewritten after every run and ``--reuse`` keeps finished runs. :func:`analyse` compares every
speculative method with ``ar`` over the seeds both finished: per-step reward differences against 2 standard errors
(Welch, and paired by seed), the final held-out accuracy and each seed's mean reward (Welch t and exact
permutation tests), and the acceptance length per step and after every refit. Writes ``--out`` (JSON),
``<out stem>.png`` and a table.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
from pathlib import Path

from nemo_rl_spec.utils.bench_runs import bootstrap_interval, mean_and_interval, read_metrics, run_grpo_subprocess
from nemo_rl_spec.utils.machine import write_bench_json

REWARD, ACC, ACCEPT = "train/reward", "validation/accuracy", "vllm/spec_acceptance_length"
STEP_TIME, GEN_TIME = "timing/train/total_step_time", "timing/train/generation"
METHODS: dict[str, tuple[str, list[str]]] = {
    "ar": ("configs/grpo_math_testbed.yaml", []),
    "eagle3": ("configs/grpo_math_testbed_spec.yaml", []),
    "eagle3_lossy": (
        "configs/grpo_math_testbed_spec.yaml",
        ["+policy.generation.debug_lossy_sampler=resample_from_target"],
    ),
    "mtp": (
        "configs/grpo_math_testbed.yaml",
        [
            "+policy.megatron_cfg.mtp_num_layers=1",
            "+policy.megatron_cfg.mtp_loss_mode=detach",
            "+policy.generation.vllm_kwargs.speculative_config={method: mtp, num_speculative_tokens: 1}",
        ],
    ),
}


def run_summary(records: list[dict]) -> dict:
    """One run's ``metrics.jsonl`` records -> per-step reward / acceptance / step time (lists indexed by step - 1),
    the validation points [(step, accuracy)] and the final accuracy (last validation after step 0, else None)."""
    steps = sorted((r for r in records if r.get("step", 0) > 0 and REWARD in r), key=lambda r: r["step"])
    val = [(int(r["step"]), float(r[ACC])) for r in records if ACC in r]
    nan = float("nan")
    return {
        "reward": [float(r[REWARD]) for r in steps],
        "acceptance_length": [float(r.get(ACCEPT, nan)) for r in steps],
        "step_time_s": [float(r.get(STEP_TIME, nan)) for r in steps],
        "generation_time_s": [float(r.get(GEN_TIME, nan)) for r in steps],
        "validation": val,
        "final_accuracy": val[-1][1] if val and val[-1][0] > 0 else None,
    }


def welch_se(a: list[float], b: list[float]) -> float:
    """Standard error of mean(a) - mean(b): sqrt(var(a)/n_a + var(b)/n_b) (sample variances; needs n >= 2 each)."""
    return math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))


def welch_p(a: list[float], b: list[float]) -> float:
    """Two-sided Welch t-test p-value of mean(a) == mean(b) (scipy); 1.0 when both samples are constant and equal."""
    from scipy import stats  # lazy: scipy is slow to import

    if statistics.pvariance(a) == 0 and statistics.pvariance(b) == 0:
        return 1.0 if statistics.fmean(a) == statistics.fmean(b) else 0.0
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def permutation_p(a: list[float], b: list[float]) -> float:
    """Exact two-sided permutation p-value of |mean(a) - mean(b)| over every relabelling of the pooled values
    (C(n_a + n_b, n_a) splits; 252 for 5 + 5). The smallest possible value is 2 / C(n_a + n_b, n_a)."""
    pooled, na = a + b, len(a)
    observed = abs(statistics.fmean(a) - statistics.fmean(b))
    hits = total = 0
    for idx in itertools.combinations(range(len(pooled)), na):
        chosen = set(idx)
        x = [pooled[i] for i in idx]
        y = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        hits += abs(statistics.fmean(x) - statistics.fmean(y)) >= observed - 1e-12
        total += 1
    return hits / total


def sign_flip_p(diffs: list[float]) -> float:
    """Exact two-sided paired permutation (sign-flip) p-value of |mean(diffs)| over all 2^n sign patterns."""
    observed = abs(statistics.fmean(diffs))
    pats = list(itertools.product((1.0, -1.0), repeat=len(diffs)))
    return sum(abs(statistics.fmean([s * d for s, d in zip(pat, diffs)])) >= observed - 1e-12 for pat in pats) / len(
        pats
    )


def paired_t_p(diffs: list[float]) -> float:
    """Two-sided one-sample t-test p-value of mean(diffs) == 0 (scipy); 1.0 / 0.0 for constant diffs."""
    from scipy import stats  # lazy: scipy is slow to import

    if statistics.pvariance(diffs) == 0:
        return 1.0 if statistics.fmean(diffs) == 0 else 0.0
    return float(stats.ttest_1samp(diffs, 0.0).pvalue)


def _per_step(a_rows: list[list[float]], b_rows: list[list[float]], paired: bool) -> list[dict]:
    """Per step: mean difference of rows a - b, its SE (Welch unpaired, or sd(d)/sqrt(n) of per-seed differences
    when ``paired``), z and whether |diff| <= 2 SE."""
    out = []
    for i in range(len(a_rows[0])):
        a, b = [r[i] for r in a_rows], [r[i] for r in b_rows]
        if paired:
            d = [x - y for x, y in zip(a, b)]
            diff, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d))
        else:
            diff, se = statistics.fmean(a) - statistics.fmean(b), welch_se(a, b)
        out.append(
            {
                "step": i + 1,
                "diff": diff,
                "se": se,
                "z": diff / se if se > 0 else 0.0,
                "within_2se": abs(diff) <= 2 * se,
            }
        )
    return out


def compare(ref: dict[str, dict], other: dict[str, dict]) -> dict:
    """``other`` method vs ``ref`` (both {seed: :func:`run_summary`}, the same seeds), over the steps every run of
    both reached: per-step reward difference, SE and |z|, the steps outside 2 SE, and the final-accuracy /
    mean-reward tests; unpaired (seeds as independent samples) and, under ``paired``, paired by seed (the same seed
    draws the same prompts at every step in both methods, so per-seed differences remove the prompts' difficulty)."""
    n_steps = min(len(r["reward"]) for r in [*ref.values(), *other.values()])
    seeds = [s for s in other if s in ref]
    a_rows, b_rows = [other[s]["reward"][:n_steps] for s in seeds], [ref[s]["reward"][:n_steps] for s in seeds]
    per_step = _per_step(a_rows, b_rows, paired=False)
    pstep = _per_step(a_rows, b_rows, paired=True)
    fd = [
        other[s]["final_accuracy"] - ref[s]["final_accuracy"]
        for s in seeds
        if other[s]["final_accuracy"] is not None and ref[s]["final_accuracy"] is not None
    ]
    md = [statistics.fmean(x) - statistics.fmean(y) for x, y in zip(a_rows, b_rows)]
    paired = {
        "per_step": pstep,
        "steps_outside_2se": [s["step"] for s in pstep if not s["within_2se"]],
        "max_abs_z": max(abs(s["z"]) for s in pstep) if pstep else None,
        "final_accuracy_diff_per_seed": dict(zip(seeds, fd)),
        "final_accuracy_diff_interval90": bootstrap_interval(fd),
        "final_accuracy_t_p": paired_t_p(fd) if len(fd) > 1 else None,
        "final_accuracy_sign_flip_p": sign_flip_p(fd) if fd else None,
        "mean_reward_diff_per_seed": dict(zip(seeds, md)),
        "mean_reward_diff_interval90": bootstrap_interval(md),
        "mean_reward_t_p": paired_t_p(md) if len(md) > 1 else None,
        "mean_reward_sign_flip_p": sign_flip_p(md),
    }
    fa = [r["final_accuracy"] for r in other.values() if r["final_accuracy"] is not None]
    fb = [r["final_accuracy"] for r in ref.values() if r["final_accuracy"] is not None]
    ma = [statistics.fmean(r["reward"][:n_steps]) for r in other.values()]
    mb = [statistics.fmean(r["reward"][:n_steps]) for r in ref.values()]
    return {
        "steps": n_steps,
        "per_step": per_step,
        "steps_outside_2se": [s["step"] for s in per_step if not s["within_2se"]],
        "max_abs_z": max(abs(s["z"]) for s in per_step) if per_step else None,
        "final_accuracy_diff": statistics.fmean(fa) - statistics.fmean(fb) if fa and fb else None,
        "final_accuracy_welch_p": welch_p(fa, fb) if len(fa) > 1 and len(fb) > 1 else None,
        "final_accuracy_permutation_p": permutation_p(fa, fb) if fa and fb else None,
        "mean_reward_diff": statistics.fmean(ma) - statistics.fmean(mb),
        "mean_reward_welch_p": welch_p(ma, mb) if len(ma) > 1 and len(mb) > 1 else None,
        "mean_reward_permutation_p": permutation_p(ma, mb),
        "paired": paired,
    }


def acceptance_summary(runs: dict[str, dict], goal: float = 2.0, refit_floor: float = 0.8) -> dict:
    """Per seed: acceptance length over the last 5 steps (mean), and the ratios acc[t] / acc[t-1] (the step-t
    rollouts follow the refit after step t-1); over seeds: the mean late acceptance with its bootstrap 90% interval,
    the smallest ratio, and the fraction of refits with ratio >= ``refit_floor``."""
    per_seed, ratios = {}, []
    for seed, r in runs.items():
        acc = [a for a in r["acceptance_length"] if a == a]
        rs = [b / a for a, b in zip(acc, acc[1:]) if a > 0]
        ratios += rs
        per_seed[seed] = {
            "late_mean": statistics.fmean(acc[-5:]) if acc else None,
            "min_refit_ratio": min(rs) if rs else None,
        }
    late = [s["late_mean"] for s in per_seed.values() if s["late_mean"] is not None]
    return {
        "per_seed": per_seed,
        "late_mean": mean_and_interval(late),
        "goal": goal,
        "meets_goal": bool(late) and statistics.fmean(late) >= goal,
        "min_refit_ratio": min(ratios) if ratios else None,
        "refits_at_or_above_floor": sum(x >= refit_floor for x in ratios) / len(ratios) if ratios else None,
        "refits": len(ratios),
    }


def analyse(runs: dict[str, dict[str, dict]]) -> dict:
    """{method: {seed: run_summary}} -> per-method final accuracy (per seed, mean, bootstrap 90% interval) and step
    time, every other method vs ``ar`` (:func:`compare`) and acceptance (:func:`acceptance_summary`)."""
    out = {"per_method": {}, "vs_ar": {}, "acceptance": {}}
    for method, by_seed in runs.items():
        finals = {s: r["final_accuracy"] for s, r in by_seed.items()}
        times = [
            statistics.fmean(r["step_time_s"][1:] or r["step_time_s"]) for r in by_seed.values() if r["step_time_s"]
        ]
        out["per_method"][method] = {
            "final_accuracy": {"per_seed": finals, **mean_and_interval([v for v in finals.values() if v is not None])},
            "mean_step_time_s": mean_and_interval(times),
        }
        if method != "ar" and "ar" in runs:
            common = sorted(set(by_seed) & set(runs["ar"]))
            if len(common) >= 2:
                out["vs_ar"][method] = {
                    "seeds": common,
                    **compare({s: runs["ar"][s] for s in common}, {s: by_seed[s] for s in common}),
                }
        if any(a == a for r in by_seed.values() for a in r["acceptance_length"]):
            out["acceptance"][method] = acceptance_summary(by_seed)
    return out


def plot(runs: dict, analysis: dict, png: Path) -> None:
    import matplotlib  # lazy: matplotlib only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.5))
    for i, (method, by_seed) in enumerate(runs.items()):
        n = min(len(r["reward"]) for r in by_seed.values())
        mean = [statistics.fmean(r["reward"][k] for r in by_seed.values()) for k in range(n)]
        se = [
            statistics.stdev([r["reward"][k] for r in by_seed.values()]) / math.sqrt(len(by_seed))
            if len(by_seed) > 1
            else 0.0
            for k in range(n)
        ]
        steps = range(1, n + 1)
        ax1.plot(steps, mean, color=f"C{i}", label=f"{method} ({len(by_seed)} seeds)")
        ax1.fill_between(
            steps,
            [m - 2 * s for m, s in zip(mean, se)],
            [m + 2 * s for m, s in zip(mean, se)],
            color=f"C{i}",
            alpha=0.12,
        )
        for j, r in enumerate(by_seed.values()):
            if any(a == a for a in r["acceptance_length"]):
                ax3.plot(
                    range(1, len(r["acceptance_length"]) + 1),
                    r["acceptance_length"],
                    color=f"C{i}",
                    alpha=0.6,
                    label=method if j == 0 else None,
                )
    for method, c in analysis["vs_ar"].items():
        ps = c["per_step"]
        ax2.errorbar(
            [p["step"] for p in ps],
            [p["diff"] for p in ps],
            yerr=[2 * p["se"] for p in ps],
            color=f"C{list(runs).index(method)}",
            fmt="o-",
            ms=3,
            capsize=2,
            alpha=0.8,
            label=f"{method} - ar (+-2 SE)",
        )
    ax2.axhline(0, color="k", lw=0.8)
    ax1.set_title("train/reward, mean over seeds +-2 SE"), ax2.set_title("reward difference vs ar")
    ax3.axhline(2.0, color="k", ls="--", lw=0.8, label="goal 2.0 (k=3)")
    ax3.set_title("vLLM acceptance length per step")
    for ax, ylabel in ((ax1, "reward"), (ax2, "reward difference"), (ax3, "acceptance length")):
        ax.set_xlabel("GRPO step"), ax.set_ylabel(ylabel), ax.grid(alpha=0.3), ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def table(analysis: dict) -> str:
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    ci = lambda c: "-" if c is None else f"[{c[0]:.3f}, {c[1]:.3f}]"  # noqa: E731
    lines = ["method         final acc per seed                       mean  90% interval      s/step"]
    for m, st in analysis["per_method"].items():
        fa = st["final_accuracy"]
        lines.append(
            f"{m:14s} {' '.join(f(v) for v in fa['per_seed'].values()):40s} {f(fa['mean'])} "
            f"{ci(fa['interval90']):17s} {f(st['mean_step_time_s']['mean'])}"
        )
    for m, c in analysis["vs_ar"].items():
        lines.append(
            f"{m} vs ar ({len(c['seeds'])} seeds, {c['steps']} steps): steps outside 2 SE "
            f"{c['steps_outside_2se']} (max |z| {c['max_abs_z']:.2f}); final acc diff "
            f"{c['final_accuracy_diff']:+.3f} Welch p {f(c['final_accuracy_welch_p'])} permutation p "
            f"{f(c['final_accuracy_permutation_p'])}; mean reward diff {c['mean_reward_diff']:+.4f} "
            f"Welch p {f(c['mean_reward_welch_p'])} permutation p {f(c['mean_reward_permutation_p'])}"
        )
        q = c["paired"]
        lines.append(
            f"  paired by seed: steps outside 2 SE {q['steps_outside_2se']} (max |z| {q['max_abs_z']:.2f}); "
            f"final acc diff per seed {' '.join(f'{v:+.3f}' for v in q['final_accuracy_diff_per_seed'].values())}"
            f" {ci(q['final_accuracy_diff_interval90'])} t p {f(q['final_accuracy_t_p'])} sign-flip p "
            f"{f(q['final_accuracy_sign_flip_p'])}; mean reward diff {ci(q['mean_reward_diff_interval90'])} "
            f"t p {f(q['mean_reward_t_p'])} sign-flip p {f(q['mean_reward_sign_flip_p'])}"
        )
    for m, a in analysis["acceptance"].items():
        lines.append(
            f"{m} acceptance (last 5 steps) per seed "
            f"{' '.join(f(s['late_mean']) for s in a['per_seed'].values())}, mean {f(a['late_mean']['mean'])} "
            f"{ci(a['late_mean']['interval90'])} (goal {a['goal']}); min after-refit ratio "
            f"{f(a['min_refit_ratio'])}, refits >= 0.8: {f(a['refits_at_or_above_floor'])} of {a['refits']}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="result JSON (plot next to it as <stem>.png)")
    p.add_argument("--methods", nargs="+", default=["ar", "eagle3", "eagle3_lossy"], choices=sorted(METHODS))
    p.add_argument("--seeds", nargs="+", type=int, default=[42, 1, 2, 3, 4])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--work-dir", default=None, help="per-run dirs (default: results/<out stem>_runs)")
    p.add_argument("--run-timeout", type=float, default=3600.0)
    p.add_argument("--reuse", action="store_true", help="keep runs that finished (resume / re-analysis)")
    p.add_argument("--analyse-only", action="store_true", help="read finished runs back, run nothing")
    args, extra = p.parse_known_args(argv)
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir).resolve() if args.work_dir else Path("results").resolve() / f"{out.stem}_runs"
    runs: dict[str, dict[str, dict]] = {}
    infos, t0 = {}, time.time()
    for seed in args.seeds:
        for method in args.methods:
            config, overrides = METHODS[method]
            run_dir = work / f"{method}_seed{seed}"
            if args.analyse_only:
                ok = (run_dir / "run.json").is_file() and json.loads((run_dir / "run.json").read_text()).get(
                    "returncode"
                ) == 0
                info = {"returncode": 0 if ok else "missing"}
            else:
                info = run_grpo_subprocess(
                    config,
                    [
                        *overrides,
                        f"grpo.seed={seed}",
                        f"grpo.max_num_steps={args.steps}",
                        "checkpointing.enabled=false",
                        *extra,
                    ],
                    run_dir,
                    label=f"{method} seed {seed}",
                    timeout_s=args.run_timeout,
                    reuse=args.reuse,
                )
            infos[f"{method} seed {seed}"] = info
            if info["returncode"] == 0:
                runs.setdefault(method, {})[str(seed)] = {
                    **run_summary(read_metrics(run_dir / "logs" / "metrics.jsonl")),
                    "wall_s": info.get("wall_s"),
                }
            result = {
                "meta": {
                    "methods": {m: METHODS[m] for m in args.methods},
                    "seeds": args.seeds,
                    "steps": args.steps,
                    "overrides": extra,
                    "total_wall_s": round(time.time() - t0),
                    "failed": [k for k, i in infos.items() if i["returncode"] != 0],
                },
                "runs": runs,
                **analyse(runs),
            }
            write_bench_json(out, result)
    plot(runs, result, out.with_suffix(".png"))
    print(table(result))
    print(json.dumps({"json": str(out), "plot": str(out.with_suffix(".png")), "failed": result["meta"]["failed"]}))
    return 0 if not result["meta"]["failed"] else 1
