"""float32 against bfloat16 GRPO: seconds per step of each phase, measured on this machine's CPU.

``python examples/bench_precision.py [--out docs/results/precision/bench_precision.json] [--config RECIPE] [--repeats 3] [--steps 3]
[--work-dir DIR] [--reuse] [key=value ...]``

A CPU measurement: the numbers are this machine's (its CPU model, native bf16 units -- ``amx_bf16`` /
``avx512_bf16`` -- and core count go into the JSON); they say nothing about a GPU. Run it alone on the machine
(``../shared/tools/heavy``). Each run is one ``examples/run_grpo.py`` subprocess with ``policy.precision=<p>`` (and
the vLLM engine's dtype where the schema has that key), no validation before or between steps and no checkpoints,
fp32 and bf16 runs interleaved (:func:`schedule`); extra ``key=value`` arguments go to every run, ``--reuse`` keeps
finished runs. Per phase (:data:`PHASES`): a run's mean over its steps after the warm-up step (:func:`run_summary`),
the mean over repeats and the bf16 / fp32 ratio beside :data:`GOALS`; also the numerics ``train/token_mult_prob_error``
and ``refit/logprob_mismatch``. Writes ``--out`` (every run's per-step values, the summary, the resolved configs, the
machine), ``<out stem>.png`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from nemo_rl_spec.utils.bench_runs import ROOT, finish_plot, read_metrics, run_grpo_subprocess
from nemo_rl_spec.utils.config import load_config
from nemo_rl_spec.utils.machine import machine_info as this_machine
from nemo_rl_spec.utils.machine import write_bench_json
from nemo_rl_spec.utils.precision import NATIVE_BF16_FLAGS, cpuinfo_value, read_cpuinfo

#: (short name, metrics.jsonl key) of the step phases, in the order of the table.
PHASES = [
    ("generation", "timing/train/generation"),
    ("logprobs", "timing/train/policy_and_reference_logprobs"),
    ("training", "timing/train/policy_training"),
    ("refit", "timing/train/weight_sync"),
    ("total_step", "timing/train/total_step_time"),
]
STEP_KEY = "timing/train/total_step_time"
#: numerics per step, averaged over every step of a run: (short name, metrics.jsonl key)
NUMERICS = [("token_mult_prob_error", "train/token_mult_prob_error"), ("logprob_mismatch", "refit/logprob_mismatch")]
#: the bf16 / fp32 ratios (at most) the bf16 path was built to reach, per phase, and the whole step's stretch goal.
GOALS = {"generation": 0.55, "training": 0.6, "total_step": 0.6}
MOONSHOT = {"total_step": 0.5}
PRECISIONS = ("float32", "bfloat16")
BF16_FLAGS = NATIVE_BF16_FLAGS


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    """The benchmark's options and the extra ``key=value`` overrides (passed to every run)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", default="docs/results/precision/bench_precision.json", help="result JSON (the plot goes to <stem>.png)"
    )
    p.add_argument("--config", default="configs/grpo_math_smollm2_135m.yaml", help="recipe")
    p.add_argument("--repeats", type=int, default=3, help="runs per precision, interleaved fp32, bf16, fp32, ...")
    p.add_argument("--steps", type=int, default=3, help="grpo.max_num_steps of each run (the first is warm-up if > 1)")
    p.add_argument(
        "--precisions",
        nargs="+",
        default=list(PRECISIONS),
        choices=PRECISIONS,
        help="precisions to run (both for the ratios)",
    )
    p.add_argument("--work-dir", default=None, help="per-run dirs (default: results/<out stem>_runs/)")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one run may take")
    p.add_argument("--reuse", action="store_true", help="skip runs that finished (resume / re-analysis)")
    args, extra = p.parse_known_args(argv)
    if args.repeats < 1 or args.steps < 1:
        p.error(f"--repeats and --steps must be >= 1 (got {args.repeats}, {args.steps})")
    if len(set(args.precisions)) != len(args.precisions):
        p.error(f"--precisions repeats a precision: {args.precisions}")
    bad = [o for o in extra if o.lstrip("+").startswith("policy.precision=") or "=" not in o]
    if bad:
        p.error(f"not a key=value override, or sets policy.precision (the benchmark sets it per run): {bad}")
    return args, extra


def schedule(precisions: list[str], repeats: int) -> list[tuple[int, str]]:
    """Run order: ``repeats`` passes over ``precisions``, each pass in the same order (fp32, bf16, fp32, bf16, ...)
    as ``(repeat index, precision)``.

    Raises:
        ValueError: ``repeats < 1``.
    """
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    return [(r, p) for r in range(repeats) for p in precisions]


def run_overrides(precision: str, steps: int, extra: list[str], engine_key: bool) -> list[str]:
    """The overrides of one run: short, no validation before or between steps, no checkpoints, the engine dtype
    (when the schema has ``policy.generation.vllm_cfg.precision``: ``engine_key``), then ``extra``, then
    ``policy.precision`` last."""
    engine = [f"policy.generation.vllm_cfg.precision={precision}"] if engine_key else []
    return [
        f"grpo.max_num_steps={steps}",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "checkpointing.enabled=false",
        *engine,
        *extra,
        f"policy.precision={precision}",
    ]


def step_records(records: list[dict]) -> list[dict]:
    """The records of training steps (those with ``timing/train/total_step_time``), ordered by step."""
    return sorted((r for r in records if STEP_KEY in r), key=lambda r: r["step"])


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def run_summary(records: list[dict]) -> dict:
    """One run from its ``metrics.jsonl`` records: per-step values of every phase and numeric (``per_step``), the
    phases' means over the steps after the first (every step when only one ran: ``warmup_dropped`` says which) and
    the numerics' means over every step."""
    steps = step_records(records)
    per_step = [{"step": r["step"], **{n: r.get(k) for n, k in PHASES + NUMERICS}} for r in steps]
    drop = 1 if len(steps) > 1 else 0
    timed = per_step[drop:]
    phases = {n: _mean([s[n] for s in timed if s[n] is not None]) for n, _ in PHASES}
    numerics = {n: _mean([s[n] for s in per_step if s[n] is not None]) for n, _ in NUMERICS}
    return {"per_step": per_step, "warmup_dropped": drop, "phases": phases, "numerics": numerics}


def spread(values: list[float]) -> dict:
    """``{"mean", "min", "max", "values"}`` of ``values`` (None throughout when empty)."""
    if not values:
        return {"mean": None, "min": None, "max": None, "values": []}
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "values": values}


def summarize(runs: list[dict], precisions: list[str]) -> dict:
    """Per phase and per numeric: each precision's :func:`spread` over its successful runs (``returncode`` 0), and
    for phases the ratio bf16 / fp32 of the means with its goal (:data:`GOALS`) and whether it is met."""
    ok = {p: [r for r in runs if r["precision"] == p and r["returncode"] == 0] for p in precisions}
    phases = {}
    for name, _ in PHASES:
        by = {p: spread([r["phases"][name] for r in ok[p] if r["phases"][name] is not None]) for p in precisions}
        phases[name] = {**by, **ratio_entry(name, by)}
    numerics = {
        name: {p: spread([r["numerics"][name] for r in ok[p] if r["numerics"][name] is not None]) for p in precisions}
        for name, _ in NUMERICS
    }
    return {"phases": phases, "numerics": numerics, "runs_ok": {p: len(ok[p]) for p in precisions}}


def ratio_entry(phase: str, by: dict) -> dict:
    """``{"ratio": bf16 mean / fp32 mean or None, "goal", "meets_goal", "moonshot"}`` of one phase."""
    fp, bf = by.get("float32", {}).get("mean"), by.get("bfloat16", {}).get("mean")
    ratio = bf / fp if fp and bf is not None else None
    goal = GOALS.get(phase)
    return {
        "ratio": ratio,
        "goal": goal,
        "meets_goal": None if ratio is None or goal is None else ratio <= goal,
        "moonshot": MOONSHOT.get(phase),
    }


def parse_cpuinfo(text: str) -> dict:
    """CPU model name, the bf16-related flags present (:data:`BF16_FLAGS` and every ``amx*``) and the logical CPU
    count of a ``/proc/cpuinfo`` text (empty fields when a line is missing)."""
    model = cpuinfo_value(text, "model name")
    flags = set((cpuinfo_value(text, "flags") or "").split())
    wanted = sorted(f for f in flags if f in BF16_FLAGS or f.startswith("amx"))
    return {
        "cpu_model": model,
        "bf16_flags": wanted,
        "native_bf16": any(f in flags for f in BF16_FLAGS),
        "logical_cpus_listed": sum(1 for line in text.splitlines() if line.startswith("processor")),
    }


def machine_info() -> dict:
    """This machine: :func:`nemo_rl_spec.utils.machine.machine_info` (CPU model and ISA flags, ``nproc``, the load
    average now, torch's CPU capability, ...) and the bf16 fields of :func:`parse_cpuinfo` (``bf16_flags``,
    ``native_bf16``, ``logical_cpus_listed``)."""
    return {**parse_cpuinfo(read_cpuinfo() or ""), **this_machine()}


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def table(summary: dict, precisions: list[str], warmup: bool) -> str:
    """The printed table: per phase each precision's mean seconds with the repeats' values, the ratio and its goal;
    then the numerics per precision."""
    head = f"{'phase':<22}" + "".join(f"{p + ' s (repeats)':>34}" for p in precisions) + f"{'bf16/fp32':>11}  goal"
    lines = [head]
    for name, _ in PHASES:
        e = summary["phases"][name]
        cells = "".join(
            f"{_fmt(e[p]['mean']) + ' (' + ' '.join(_fmt(v) for v in e[p]['values']) + ')':>34}" for p in precisions
        )
        lines.append(f"{name:<22}{cells}{_fmt(e['ratio'], '.3f'):>11}  {goal_text(e)}")
    lines.append("numerics, mean over every step of every run (warm-up included):")
    for name, _ in NUMERICS:
        lines.append(
            f"{name:<22}" + "".join(f"{_fmt(summary['numerics'][name][p]['mean'], '.4g'):>34}" for p in precisions)
        )
    note = "first step of each run dropped as warm-up" if warmup else "every step timed (one-step runs: no warm-up)"
    lines.append(
        f"seconds per step, mean over repeats of each run's mean; {note}; successful runs {summary['runs_ok']}"
    )
    return "\n".join(lines)


def goal_text(entry: dict) -> str:
    """``<= 0.6 met`` / ``<= 0.6 NOT met`` (with the moonshot if any) for a phase with a goal, else empty."""
    if entry["goal"] is None:
        return ""
    verdict = "" if entry["meets_goal"] is None else (" met" if entry["meets_goal"] else " NOT met")
    moon = f" (moonshot <= {entry['moonshot']})" if entry.get("moonshot") else ""
    return f"<= {entry['goal']}{verdict}{moon}"


def plot(summary: dict, precisions: list[str], png: Path) -> None:
    """Bars per phase, one per precision (mean over repeats), whiskers at the repeats' min / max, ratio on top."""
    import matplotlib  # lazy: matplotlib only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot

    names = [n for n, _ in PHASES]
    width = 0.8 / len(precisions)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, p in enumerate(precisions):
        entries = [summary["phases"][n][p] for n in names]
        means = [e["mean"] or 0.0 for e in entries]
        err = [
            [m - (e["min"] if e["min"] is not None else m) for m, e in zip(means, entries)],
            [(e["max"] if e["max"] is not None else m) - m for m, e in zip(means, entries)],
        ]
        xs = [k + (i - (len(precisions) - 1) / 2) * width for k in range(len(names))]
        ax.bar(xs, means, width, yerr=err, capsize=3, label=p, color=f"C{i}")
    for k, n in enumerate(names):
        e = summary["phases"][n]
        if e["ratio"] is not None:
            top = max((e[p]["max"] or 0.0) for p in precisions)
            ax.annotate(
                f"{e['ratio']:.2f}x" + (f" (goal {e['goal']})" if e["goal"] else ""),
                (k, top),
                ha="center",
                va="bottom",
                fontsize=7,
                xytext=(0, 3),
                textcoords="offset points",
            )
    ax.set_xticks(range(len(names)), names)
    ax.set_title("GRPO seconds per step by phase, fp32 vs bf16 (CPU)", fontsize=10)
    finish_plot(fig, ax, png, "phase (label: bf16 / fp32)", "seconds per step (mean over repeats)")


def resolved_configs(config: str, precisions: list[str], steps: int, extra: list[str]) -> tuple[dict, bool]:
    """Each precision's validated config (fails fast on a bad recipe or override, before any run) as JSON, and whether
    the schema has ``policy.generation.vllm_cfg.precision``."""
    engine_key = "precision" in type(load_config(config, extra).policy.generation.vllm_cfg).model_fields
    out = {}
    for p in precisions:
        cfg = load_config(config, run_overrides(p, steps, extra, engine_key))
        out[p] = {
            "trainer": cfg.policy.precision,
            "engine": getattr(cfg.policy, "engine_precision", cfg.policy.precision),
            "config": cfg.model_dump(mode="json"),
        }
    return out, engine_key


def one_run(args, extra: list[str], engine_key: bool, repeat: int, precision: str, work: Path) -> dict:
    """Run (or reuse) one benchmark run and summarise its metrics (``loadavg_before``: the load average when the
    benchmark reached the run; for a reused run, when it was reused)."""
    run_dir = work / f"{precision}_r{repeat}"
    load = list(os.getloadavg())
    info = run_grpo_subprocess(
        args.config,
        run_overrides(precision, args.steps, extra, engine_key),
        run_dir,
        label=f"{precision} repeat {repeat}",
        timeout_s=args.run_timeout,
        reuse=args.reuse,
    )
    return {
        "precision": precision,
        "repeat": repeat,
        "run_dir": str(run_dir),
        "returncode": info["returncode"],
        "wall_s": info["wall_s"],
        "loadavg_before": load,
        **run_summary(read_metrics(run_dir / "logs" / "metrics.jsonl")),
    }


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.work_dir).resolve() if args.work_dir else ROOT / "results" / f"{out.stem}_runs"
    configs, engine_key = resolved_configs(args.config, args.precisions, args.steps, extra)
    meta = {
        "command": [sys.executable, *sys.argv] if argv is None else ["bench_precision.py", *argv],
        "config": args.config,
        "overrides": extra,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup_dropped": args.steps > 1,
        "order": schedule(args.precisions, args.repeats),
        "resolved": configs,
    }
    t0, runs = time.time(), []
    for repeat, precision in meta["order"]:
        runs.append(one_run(args, extra, engine_key, repeat, precision, work))
        summary = summarize(runs, args.precisions)
        write_bench_json(
            out,
            {"summary": summary, "runs": runs, "meta": {**meta, "total_wall_s": round(time.time() - t0)}},
            machine=machine_info(),
        )
    plot(summary, args.precisions, out.with_suffix(".png"))
    print(table(summary, args.precisions, args.steps > 1))
    print(json.dumps({"json": str(out), "plot": str(out.with_suffix(".png"))}))
    return 0 if all(r["returncode"] == 0 for r in runs) else 1
