"""Pilot-Commit ablation table: one row per ablation (and uniform GRPO), from the benchmark JSONs that
``examples/bench_pilot_commit.py`` wrote, one file per ablation (``docs/results/pilot_commit/ablations/<name>.json``).

``python examples/pc_ablation_table.py docs/results/pilot_commit/ablations/{uniform,baseline,constant_norm}.json
[--out docs/results/pilot_commit/ablations/summary.json] [--plot docs/results/pilot_commit/ablations/curves.png]``

Per run (a method and seed of a file): final and peak validation accuracy, the peak-to-final drop, the step of the
peak, cumulative rollouts at the end, train rows per step, grad norm before clipping (mean and max), the largest
fall below the running peak over the last 10 steps (``dip_last10``, for the stability criterion "no fall of more
than 0.05 from the peak over the last 10 steps") and over the whole run (``max_drawdown``), mean times seen of the trained prompts and the
final distinct-prompt fraction. Per ablation: each per seed and their mean with a bootstrap 90% interval over seeds.
Prints a markdown table; ``--out`` writes the numbers. ``--reference FILE`` (a bench JSON with uniform GRPO runs):
every row's rollouts to start + f x (reference's mean final - start), f = 0.5 / 0.75 / 0.9 / 1, paired by seed,
and the ratios reference / row (:func:`reference_ratios`), as a second table and under ``"reference"``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nemo_rl_spec.bench.pilot_commit import final_accuracy, gain_fraction_targets
from nemo_rl_spec.utils.bench_runs import finish_plot, mean_and_interval

FIELDS = (
    "final",
    "peak",
    "drop",
    "dip_last10",
    "max_drawdown",
    "peak_step",
    "rollouts",
    "rows_per_step",
    "grad_norm",
    "grad_norm_max",
    "times_seen",
    "unique_frac",
)


def run_row(run: dict) -> dict:
    """The :data:`FIELDS` of one run record of a bench JSON (``runs[method][seed]``); None where the record lacks
    the data (no validation after step 0, or a run written before the diagnostics existed)."""
    pts = [p for p in run.get("curve", []) if p[0] > 0]
    final = pts[-1][2] if pts else None
    peak_pt = max(pts, key=lambda p: (p[2], -p[0])) if pts else None  # earliest step at the peak accuracy
    cum = run.get("cumulative_rollouts") or []
    running, drawdown, dip = 0.0, 0.0, 0.0
    for step, _, acc in run.get("curve", []):  # step 0 included in the running peak
        running = max(running, acc)
        drawdown = max(drawdown, running - acc)
        if pts and step >= pts[-1][0] - 10:
            dip = max(dip, running - acc)
    return {
        "final": final,
        "peak": peak_pt[2] if peak_pt else None,
        "drop": (peak_pt[2] - final) if pts else None,
        "dip_last10": dip if pts else None,
        "max_drawdown": drawdown if pts else None,
        "peak_step": peak_pt[0] if peak_pt else None,
        "rollouts": cum[-1][1] if cum else None,
        "rows_per_step": run.get("mean_train_rows"),
        "grad_norm": run.get("mean_grad_norm"),
        "grad_norm_max": run.get("max_grad_norm"),
        "times_seen": run.get("mean_trained_times_seen"),
        "unique_frac": run.get("final_trained_unique_frac"),
    }


def summarize_file(path: Path) -> dict[str, dict]:
    """``{label: {"file", "method", "overrides", "machine", "seeds": {seed: row}, "mean": {field: mean_and_interval}}}``
    for each method in the bench JSON at ``path``; the label is the file stem (``<stem>/<method>`` when it holds
    several). ``machine`` is the file's (None in files written before benchmarks recorded one): the summary is a map
    of labels, so the machine of each row sits in the row, next to its ``file``."""
    data = json.loads(path.read_text())
    out = {}
    methods = data["runs"]
    for method, by_seed in methods.items():
        label = path.stem if len(methods) == 1 else f"{path.stem}/{method}"
        rows = {s: run_row(r) for s, r in by_seed.items()}
        mean = {f: mean_and_interval([r[f] for r in rows.values() if r[f] is not None]) for f in FIELDS}
        out[label] = {
            "file": str(path),
            "method": method,
            "overrides": data.get("meta", {}).get("overrides", []),
            "machine": data.get("machine"),
            "seeds": rows,
            "mean": mean,
        }
    return out


def reference_ratios(reference: dict, by_seed: dict) -> dict:
    """Rollouts to f x the reference's gain for one row, against the reference's uniform runs.

    Args:
        reference: a bench JSON (``runs["uniform"][seed]`` records with ``curve``).
        by_seed: one method's ``runs[method]`` records of another bench JSON (any method).

    Returns:
        ``{f: {"accuracy", "rollouts_to_target": {"uniform": {seed: n}, "pilot_commit": {seed: n}}, "ratios":
        {"uniform_over_pilot_commit": ratio_stats}}}`` as :func:`nemo_rl_spec.bench.pilot_commit.gain_fraction_targets`
        computes it, the target being the reference's mean final accuracy ("pilot_commit" stands for the row).

    Raises:
        KeyError: the reference has no uniform runs.
    """
    uniform = reference["runs"]["uniform"]
    finals = [a for r in uniform.values() if (a := final_accuracy(r)) is not None]
    target = sum(finals) / len(finals) if finals else None
    return gain_fraction_targets({"uniform": uniform, "pilot_commit": by_seed}, target)


def reference_markdown(ratios: dict[str, dict]) -> str:
    """One markdown row per ablation: rollouts to each gain fraction per seed (reference / row) and the median
    ratio reference / row over the seeds where both reached it (``cens`` = seeds where one side never did)."""
    fracs = list(next(iter(ratios.values()), {}))
    head = "| ablation | " + " | ".join(f"to {float(f):.0%} of gain: ref / row per seed, median ratio" for f in fracs)
    lines = [head + " |", "|" + "---|" * (len(fracs) + 1)]
    for label, by_f in ratios.items():
        cells = []
        for f in fracs:
            rt, r = by_f[f]["rollouts_to_target"], by_f[f]["ratios"]["uniform_over_pilot_commit"]
            seeds = sorted(rt["pilot_commit"], key=int)
            pairs = " ".join(f"{_fmt(rt['uniform'].get(k), 0)}/{_fmt(rt['pilot_commit'][k], 0)}" for k in seeds)
            cells.append(
                f"{pairs}, {_fmt(r['median'], 2)}" + (f" (cens {len(r['censored'])})" if r["censored"] else "")
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(v, d=3) -> str:
    return "-" if v is None else f"{v:.{d}f}"


def markdown(summary: dict) -> str:
    """One markdown row per ablation: per-seed values (seed order) and the mean [90% interval] of final, peak, drop;
    means of rows per step, grad norm, times seen, distinct-prompt fraction."""
    head = (
        "| ablation | final, per seed | final mean [90%] | peak, per seed | peak mean | drop, per seed | "
        "drop mean [90%] | dip last 10 steps, per seed | rows/step | grad norm mean (max) | times seen | "
        "distinct frac |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label, s in summary.items():
        seeds = sorted(s["seeds"], key=int)
        per = lambda f: " ".join(_fmt(s["seeds"][k][f]) for k in seeds)  # noqa: E731, B023 (used in this iteration)
        m = s["mean"]
        ci = lambda f, m=m: (  # noqa: E731
            "-" if m[f]["interval90"] is None else f"[{m[f]['interval90'][0]:.3f}, {m[f]['interval90'][1]:.3f}]"
        )
        gmax = max((v for k in seeds if (v := s["seeds"][k]["grad_norm_max"]) is not None), default=None)
        lines.append(
            f"| {label} | {per('final')} | {_fmt(m['final']['mean'])} {ci('final')} | {per('peak')} | "
            f"{_fmt(m['peak']['mean'])} | {per('drop')} | {_fmt(m['drop']['mean'])} {ci('drop')} | "
            f"{per('dip_last10')} | "
            f"{_fmt(m['rows_per_step']['mean'], 1)} | {_fmt(m['grad_norm']['mean'], 2)} ({_fmt(gmax, 1)}) | "
            f"{_fmt(m['times_seen']['mean'], 2)} | {_fmt(m['unique_frac']['mean'], 2)} |"
        )
    return "\n".join(lines)


def mean_curve(runs: dict) -> list[tuple[int, float]]:
    """(step, validation accuracy averaged over the seeds that validated that step) for one method's
    ``runs[seed]`` records."""
    per: dict[int, list[float]] = {}
    for r in runs.values():
        for step, _, acc in r.get("curve", []):
            per.setdefault(int(step), []).append(float(acc))
    return [(k, sum(v) / len(v)) for k, v in sorted(per.items())]


def plot(files: list[Path], png: Path) -> None:
    """Mean-over-seeds validation accuracy against step (left) and each seed's train rows per step, smoothed over
    5 steps and averaged over seeds (right), one line per ablation file."""
    import matplotlib  # lazy: matplotlib only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot

    fig, (ax, ax_rows) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for f in files:
        data = json.loads(f.read_text())
        for method, runs in data["runs"].items():
            label = f.stem if len(data["runs"]) == 1 else f"{f.stem}/{method}"
            xs, ys = zip(*mean_curve(runs))
            ax.plot(xs, ys, "-o", ms=3, label=label)
            rows: dict[int, list[float]] = {}
            for r in runs.values():
                for step, v in r.get("train_rows_curve", []):
                    rows.setdefault(int(step), []).append(v)
            if rows:
                steps = sorted(rows)
                means = [sum(rows[k]) / len(rows[k]) for k in steps]
                smooth = [
                    sum(means[max(0, i - 4) : i + 1]) / len(means[max(0, i - 4) : i + 1]) for i in range(len(means))
                ]
                ax_rows.plot(steps, smooth, label=label)
    ax_rows.set_xlabel("step")
    ax_rows.set_ylabel("train rows per step (mean over seeds, 5-step mean)")
    ax_rows.grid(alpha=0.3)
    ax_rows.legend(fontsize=7)
    finish_plot(fig, ax, png, "step", "validation accuracy (mean over seeds)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="PNG of the mean accuracy curves and train rows")
    p.add_argument("--reference", type=Path, default=None, help="bench JSON whose uniform runs set the gain targets")
    args = p.parse_args(argv)
    summary: dict = {}
    for f in args.files:
        summary.update(summarize_file(f))
    print(markdown(summary))
    if args.reference:
        ref = json.loads(args.reference.read_text())
        ratios = {}
        for f in args.files:
            runs = json.loads(f.read_text())["runs"]
            for method, by_seed in runs.items():
                ratios[f.stem if len(runs) == 1 else f"{f.stem}/{method}"] = reference_ratios(ref, by_seed)
        print(f"\nreference: {args.reference}\n" + reference_markdown(ratios))
        reference = {"file": str(args.reference), "machine": ref.get("machine"), "gain_targets": ratios}
        summary = {"ablations": summary, "reference": reference}
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    if args.plot:
        plot(args.files, args.plot)
    return 0
