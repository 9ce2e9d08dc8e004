"""Compare MTP co-training modes (detach, ce, policy, occ) on a GRPO recipe over several seeds.

    python examples/bench_occ.py --out results/bench_occ.json [--config configs/grpo_math_tiny_mtp.yaml]
        [--modes detach ce policy occ] [--seeds 0 1] [--steps 4] [--overhead-repeats N] [--work-dir DIR] [--reuse]
        [key=value ...]

Each (mode, seed) is one full GRPO run (``examples/run_grpo.py`` in a fresh process) with
``policy.megatron_cfg.mtp_loss_mode=<mode>`` and ``grpo.seed=<seed>``, logged in ``<work-dir>/<mode>_seed<seed>/``.
Mode syntax ``<loss mode>[@<coefficient>][+ref][+ratio]``: ``@c`` sets ``mtp_loss_scaling_factor``, ``+ref`` turns
on ``mtp_occ_reference`` (OCC's lambda checked against the full-gradient rule: ``proxy_validation_<mode>``),
``+ratio`` sets ``mtp_occ_proxy=logprob_delta_ratio``.
``--steps 0 --overhead-repeats N`` only times ``train()`` per mode; ``--proxy-steps N`` checks the proxy on random
batches. The JSON (per run, per mode with bootstrap intervals, paired against ``detach``, the overhead, the machine)
is rewritten after every run; ``--reuse`` reads finished runs back. Also prints a table and writes ``<out>.png``.
A failed run is listed in ``failed_runs`` and the exit code is 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from nemo_rl_spec.algorithms.loss import ClippedPGLossFn
from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.utils.bench_runs import mean_and_interval, read_metrics, result_paths, run_grpo_subprocess
from nemo_rl_spec.utils.config import load_config
from nemo_rl_spec.utils.machine import write_bench_json

SERIES = {
    "reward": "train/reward",
    "lambda": "train/mtp/lambda",
    "mtp_ce": "train/mtp/ce_0",
    "mtp_acceptance": "train/mtp/acceptance",
    "clip_fraction": "train/probs_ratio_clamped",
    "delta_mean": "train/mtp/delta_mean_0",
    "delta_mtp_mean": "train/mtp/delta_mtp_mean_0",
    "c_ref": "train/mtp/c_ref",
    "v2_ref": "train/mtp/v2_ref",
    "lambda_ref": "train/mtp/lambda_ref",
    "c_ref_decoder": "train/mtp/c_ref_decoder",
    "v2_ref_decoder": "train/mtp/v2_ref_decoder",
}
MINIBATCH_SERIES = (
    "lambda",
    "c_ref",
    "v2_ref",
    "lambda_ref",
)  # train/mtp/<name>/mb<i> (lm_policy.PER_MINIBATCH_METRICS)
PROXY_SERIES = ("lambda", "c_ref", "v2_ref", "lambda_ref", "c_ref_decoder", "v2_ref_decoder")
REFERENCE = "+ref"  # mode suffix: also compute the full-gradient reference (policy.megatron_cfg.mtp_occ_reference)
FLAGS = ("ref", "ratio")  # "+ratio": mtp_occ_proxy=logprob_delta_ratio (the ratio of the token means)


def parse_mode(mode: str) -> tuple[str, float | None, bool]:
    """``occ@0.1+ref`` -> (loss mode "occ", coefficient 0.1, reference on); ``policy`` -> ("policy", None, False)
    (None: the recipe's ``mtp_loss_scaling_factor``).

    Raises:
        ValueError: an unknown flag or a coefficient that is not a non-negative number.
    """
    head, *flags = mode.split("+")
    if set(flags) - set(FLAGS):
        raise ValueError(f"mode {mode!r}: unknown flag(s) {sorted(set(flags) - set(FLAGS))}; known: {list(FLAGS)}")
    base, _, coef = head.partition("@")
    try:
        value = float(coef) if coef else None
    except ValueError:
        value = None
    if coef and (value is None or value < 0):
        raise ValueError(f"mode {mode!r}: the coefficient after '@' must be a number >= 0")
    return base, value, "ref" in flags


def mode_overrides(mode: str) -> list[str]:
    """The config overrides of a mode (:func:`parse_mode`)."""
    base, coef, reference = parse_mode(mode)
    return (
        [f"policy.megatron_cfg.mtp_loss_mode={base}"]
        + ([f"policy.megatron_cfg.mtp_loss_scaling_factor={coef}"] if coef is not None else [])
        + (["+policy.megatron_cfg.mtp_occ_reference=true"] if reference else [])
        + (["+policy.megatron_cfg.mtp_occ_proxy=logprob_delta_ratio"] if "+ratio" in mode else [])
    )


def run_one(args, mode: str, seed: int, extra: list[str], run_dir: Path) -> tuple[dict, list[dict]]:
    """One GRPO run (``examples/run_grpo.py`` in a subprocess, logs in ``run_dir``; with ``--reuse`` a finished run is
    read back, not rerun). Returns its ``run.json`` record and its JSONL records (one per step, plus step 0)."""
    overrides = [
        *mode_overrides(mode),
        f"grpo.seed={seed}",
        f"grpo.max_num_steps={args.steps}",
        "checkpointing.enabled=false",
        *extra,
    ]
    info = run_grpo_subprocess(
        args.config,
        overrides,
        run_dir,
        label=f"{mode} seed {seed}",
        timeout_s=args.run_timeout,
        reuse=args.reuse or getattr(args, "analyse_only", False),
    )
    return info, read_metrics(run_dir / "logs" / "metrics.jsonl")


def _finished(run_dir: Path) -> bool:
    """True when ``run_dir/run.json`` records return code 0 (a finished run that ``--reuse`` reads back)."""
    info = run_dir / "run.json"
    return info.is_file() and json.loads(info.read_text()).get("returncode") == 0


def mode_stats(seeds: dict) -> dict:
    """Per mode, over its seeds: mean and bootstrap 90% interval (:func:`mean_and_interval`, None below 2 seeds) of
    the final accuracy, the MTP acceptance and the step time."""
    out = {}
    for key in ("final_accuracy", "peak_accuracy", "max_drawdown", "mtp_acceptance", "step_time_s", "train_time_s"):
        vals = [r[key] for r in seeds.values() if r.get(key) is not None and r[key] == r[key]]  # drop NaN
        out[key] = {"per_seed": {s: r.get(key) for s, r in seeds.items()}, **mean_and_interval(vals)}
    return out


def paired_vs(runs: dict, base: str = "detach") -> dict:
    """Per mode other than ``base``: the per-seed differences ``mode - base`` of the final and the peak accuracy over
    the seeds both finished (a seed draws the same prompts at each step in every mode), their mean and bootstrap
    90% interval (:func:`mean_and_interval`), and how many seeds are above / below ``base``."""
    out = {}
    for mode, seeds in runs.items():
        common = [s for s in seeds if s in runs.get(base, {}) and mode != base]
        if not common:
            continue
        out[mode] = {}
        for key in ("final_accuracy", "peak_accuracy"):
            diffs = {s: seeds[s][key] - runs[base][s][key] for s in common}
            out[mode][key] = {
                "per_seed": diffs,
                **mean_and_interval(list(diffs.values())),
                "above": sum(d > 0 for d in diffs.values()),
                "below": sum(d < 0 for d in diffs.values()),
            }
    return out


def summarise(records: list[dict]) -> dict:
    steps = [r for r in records if "timing/train/total_step_time" in r]
    later = steps[1:] or steps
    last_val = [r["validation/accuracy"] for r in records if "validation/accuracy" in r]
    trained_val = [r["validation/accuracy"] for r in records if "validation/accuracy" in r and r["step"] > 0]
    mean = lambda key: sum(r[key] for r in later) / len(later)  # noqa: E731
    return {
        "final_accuracy": last_val[-1] if last_val else float("nan"),
        "peak_accuracy": max(trained_val) if trained_val else float("nan"),
        "max_drawdown": max_drawdown(trained_val[-10:]),
        "validation": [(r["step"], r["validation/accuracy"]) for r in records if "validation/accuracy" in r],
        "mtp_acceptance": steps[-1].get("train/mtp/acceptance", float("nan")),
        "step_time_s": mean("timing/train/total_step_time"),
        "train_time_s": mean("timing/train/policy_training"),
        "series": {name: [r.get(key, float("nan")) for r in steps] for name, key in SERIES.items()},
        "minibatch_series": {
            name: [
                [r[k] for k in sorted((k for k in r if k.startswith(f"train/mtp/{name}/mb")), key=_mb_index)]
                for r in steps
            ]
            for name in MINIBATCH_SERIES
        },
    }


def max_drawdown(values: list[float]) -> float:
    """Largest fall below the running peak over ``values`` in order: ``max_i (max_{j <= i} v_j - v_i)``; 0.0 for a
    non-decreasing or empty list. Example: [0.5, 0.8, 0.7, 0.9, 0.85] -> 0.1."""
    peak, worst = float("-inf"), 0.0
    for v in values:
        peak = max(peak, v)
        worst = max(worst, peak - v)
    return worst


def _mb_index(key: str) -> int:
    return int(key.rsplit("/mb", 1)[1])


def proxy_points(seeds: dict) -> list[tuple[float, float, float]]:
    """``(lambda, lambda_ref, c_ref)`` of every optimizer step after a GRPO step's first (where the observed log-prob
    change, so the proxy, is defined) of every seed, from ``minibatch_series``. A run with one optimizer step per GRPO
    step has none (its lambda is recomputation noise)."""
    points = []
    for r in seeds.values():
        mb = r.get("minibatch_series", {})
        for lam, ref, c in zip(mb.get("lambda", []), mb.get("lambda_ref", []), mb.get("c_ref", [])):
            points.extend(zip(lam[1:], ref[1:], c[1:]))
    return [p for p in points if all(v == v for v in p)]  # drop NaN (absent metric)


def proxy_validation(seeds: dict) -> dict:
    """OCC's lambda against the rule on the full-gradient reference, ``lambda_ref = lambda_plus * c / (v2 + eps)``,
    per optimizer step (:func:`proxy_points`): ``sign_agreement`` = fraction with sign(lambda) == sign(c);
    ``sign_agreement_top_half_c`` the same over the steps whose |c| is in its upper half (the must-show: >= 0.8);
    ``spearman_lambda`` rank correlation of lambda with lambda_ref; ``scale_ratio_median`` the median of
    |lambda| / |lambda_ref| over the top-half steps (within 10x: between 0.1 and 10); ``n`` steps."""
    pts = proxy_points(seeds)
    if len(pts) < 3:
        return {"n": len(pts)}
    lam, ref, c = (np.array(x, dtype=float) for x in zip(*pts))
    top = np.abs(c) >= np.median(np.abs(c))
    rank = lambda x: np.argsort(np.argsort(x))  # noqa: E731
    ratio = np.abs(lam[top]) / np.maximum(np.abs(ref[top]), 1e-30)
    return {
        "n": len(pts),
        "n_top_half": int(top.sum()),
        "sign_agreement": float(np.mean(np.sign(lam) == np.sign(c))),
        "sign_agreement_top_half_c": float(np.mean(np.sign(lam[top]) == np.sign(c[top]))),
        "spearman_lambda": float(np.corrcoef(rank(lam), rank(ref))[0, 1]),
        "pearson_lambda": float(np.corrcoef(lam, ref)[0, 1]),
        "scale_ratio_median": float(np.median(ratio)),
        "scale_ratio_iqr": [float(np.quantile(ratio, 0.25)), float(np.quantile(ratio, 0.75))],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib  # lazy: matplotlib only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot

    fig, axes = plt.subplots(1, 4, figsize=(18, 3.8))
    for mode, seeds in result["runs"].items():
        for ax, name in zip(axes, ("reward", "mtp_acceptance", "mtp_ce", "lambda")):
            curves = [s["series"][name] for s in seeds.values()]
            n = min(len(c) for c in curves)
            ax.plot(
                range(1, n + 1), [sum(c[i] for c in curves) / len(curves) for i in range(n)], label=mode, marker="o"
            )
            ax.set_title(name), ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)


def _workers(config: str, modes: list[str], extra: list[str]) -> dict:
    """One ``MegatronPolicyWorker`` per mode (``occ+ref``: occ with the full-gradient reference), same init."""
    from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker  # lazy: loads ray or megatron-core

    cfg = load_config(config, extra)
    path = resolve_model(cfg.policy.model_name)
    workers = {}
    for mode in modes:
        pcfg = cfg.policy.model_copy(deep=True)
        base, coef, reference = parse_mode(mode)
        pcfg.megatron_cfg.mtp_loss_mode, pcfg.megatron_cfg.mtp_occ_reference = base, reference
        if coef is not None:
            pcfg.megatron_cfg.mtp_loss_scaling_factor = coef
        workers[mode] = MegatronPolicyWorker(pcfg, ClippedPGLossFn(cfg.loss_fn.model_dump()), path, seed=0)
    return workers


def random_train_batch(worker, seed: int, batch: int = 8, seq: int = 160, prompt: int = 32) -> dict:
    """Random tokens (prompt ``prompt`` tokens, response to ``seq``), advantages ~ N(0, 1) seeded by ``seed``, and
    on-policy ``prev_logprobs`` from ``worker``. Shapes: [batch, seq] and [batch]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, worker.spec.vocab_size, (batch, seq), generator=gen)
    mask = torch.zeros(batch, seq)
    mask[:, prompt:] = 1.0
    data = dict(
        input_ids=ids,
        input_lengths=torch.full((batch,), seq),
        token_mask=mask,
        sample_mask=torch.ones(batch),
        advantages=torch.randn(batch, generator=gen),
        generation_logprobs=torch.zeros(batch, seq),
    )
    data["prev_logprobs"] = worker.get_logprobs(data)
    return data


def train_overhead(config: str, modes: list[str], repeats: int, extra: list[str]) -> dict:
    """Time ``MegatronPolicyWorker.train`` per mode in ONE process on one fixed random batch
    (:func:`random_train_batch`), modes interleaved ``repeats`` times after one warm-up each; returns median
    seconds."""
    workers = _workers(config, modes, extra)
    data = random_train_batch(workers[modes[0]], seed=0)
    times = {m: [] for m in modes}
    for rep in range(repeats + 1):
        for mode in modes:
            start = time.perf_counter()
            workers[mode].train(data)
            if rep:  # first round is warm-up
                times[mode].append(time.perf_counter() - start)
    return {m: statistics.median(t) for m, t in times.items()}


def proxy_steps(config: str, steps: int, extra: list[str], minibatches: int = 4) -> dict:
    """``steps`` GRPO-like steps of one occ+ref worker on fresh random batches with random advantages, each split
    into ``minibatches`` optimizer steps on the same ``prev_logprobs`` (so the proxy is defined after the first);
    returns ``{"0": {"minibatch_series": ...}}`` for :func:`proxy_validation`."""
    from nemo_rl_spec.models.policy.lm_policy import train_minibatches  # lazy: imports ray

    worker = _workers(config, ["occ" + REFERENCE], extra)["occ" + REFERENCE]
    series = {name: [] for name in MINIBATCH_SERIES}
    for step in range(steps):
        data = random_train_batch(worker, seed=1000 + step)
        parts = train_minibatches(worker.train, data, max(1, data["input_ids"].shape[0] // minibatches))
        for name in series:
            series[name].append([m[f"mtp/{name}"] for m in parts])
    return {"0": {"minibatch_series": series, "series": {}}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--overhead-repeats",
        type=int,
        default=0,
        help="also time worker.train per mode in one process (median of N rounds)",
    )
    parser.add_argument(
        "--proxy-steps",
        type=int,
        default=0,
        help="also validate the proxies: N occ+ref worker steps on random batches and advantages",
    )
    parser.add_argument("--config", default="configs/grpo_math_tiny_mtp.yaml")
    parser.add_argument("--modes", nargs="+", default=["detach", "ce", "policy", "occ"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--work-dir", default=None, help="per-run log dirs (default: <out stem>_runs/ next to --out)")
    parser.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one run may take")
    parser.add_argument("--reuse", action="store_true", help="skip runs that finished (re-analysis, resume)")
    parser.add_argument(
        "--analyse-only",
        action="store_true",
        help="read the finished runs back, start none (unfinished ones are listed in failed_runs)",
    )
    args, extra = parser.parse_known_args(argv)
    out, work = result_paths(args.out, args.work_dir)
    result = {"config": args.config, "steps": args.steps, "overrides": extra, "runs": {}}
    if args.overhead_repeats:
        med = train_overhead(args.config, args.modes, args.overhead_repeats, extra)
        result["train_step_median_s"] = med
        print("train() median seconds, one process:", json.dumps(med), flush=True)
        for num, den in (("occ", "detach"), ("occ" + REFERENCE, "occ")):
            if num in med and den in med:
                result.setdefault("train_step_ratio", {})[f"{num}_vs_{den}"] = med[num] / med[den]
                print(f"{num} / {den} train(): {med[num] / med[den]:.4f}", flush=True)
    if args.proxy_steps:
        result["proxy_steps"] = proxy_steps(args.config, args.proxy_steps, extra)
        result["proxy_validation_random_batches"] = proxy_validation(result["proxy_steps"])
        print("proxy validation (random batches):", json.dumps(result["proxy_validation_random_batches"]), flush=True)
    if args.steps == 0:
        write_bench_json(out, result)
        return 0
    failed = []
    for mode in args.modes:
        for seed in args.seeds:
            if args.analyse_only and not _finished(work / f"{mode}_seed{seed}"):
                failed.append(f"{mode} seed {seed}")
                continue
            info, records = run_one(args, mode, seed, extra, work / f"{mode}_seed{seed}")
            if info["returncode"] != 0:
                failed.append(f"{mode} seed {seed}")
                continue
            result["runs"].setdefault(mode, {})[str(seed)] = r = summarise(records)
            result["per_mode"] = {m: mode_stats(by) for m, by in result["runs"].items()}
            write_bench_json(out, result)  # after every run: an interrupted benchmark keeps them
            print(
                f"{mode:7s} seed {seed}: acc {r['final_accuracy']:.3f}  mtp_acc {r['mtp_acceptance']:.3f}  "
                f"step {r['step_time_s']:.2f}s  train {r['train_time_s']:.2f}s",
                flush=True,
            )
    runs = result["runs"]
    if "detach" in runs:
        result["vs_detach"] = paired_vs(runs)
    for mode in [m for m in runs if parse_mode(m)[2]]:
        result[f"proxy_validation_{mode}"] = proxy_validation(runs[mode])
        print(f"proxy validation {mode}:", json.dumps(result[f"proxy_validation_{mode}"]), flush=True)
    if "occ" in runs and "detach" in runs:
        mean = lambda mode, key: sum(s[key] for s in runs[mode].values()) / len(runs[mode])  # noqa: E731
        result["overhead"] = {
            f"occ_vs_detach_{k}": mean("occ", f"{k}_s") / mean("detach", f"{k}_s") for k in ("step_time", "train_time")
        }
    print(f"\n{'mode':8s} {'seed':>4s} {'final_acc':>9s} {'mtp_accept':>10s} {'step_s':>7s} {'train_s':>7s}")
    for mode, seeds in runs.items():
        for seed, r in seeds.items():
            print(
                f"{mode:8s} {seed:>4s} {r['final_accuracy']:9.3f} {r['mtp_acceptance']:10.3f} "
                f"{r['step_time_s']:7.2f} {r['train_time_s']:7.2f}"
            )
    for mode, st in result.get("per_mode", {}).items():
        acc = st["final_accuracy"]
        ci = acc["interval90"]
        print(
            f"{mode}: final accuracy mean {acc['mean']:.3f}, 90% CI "
            f"{'-' if ci is None else f'[{ci[0]:.3f}, {ci[1]:.3f}]'}"
        )
    result["failed_runs"] = failed
    write_bench_json(out, result)
    if runs:
        plot(result, out.with_suffix(".png"))
    print(
        json.dumps(
            {"out": str(out), "plot": str(out.with_suffix(".png")), **result.get("overhead", {}), "failed_runs": failed}
        )
    )
    return 1 if failed else 0
