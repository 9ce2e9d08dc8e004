"""Is a pool batch-limited? Steps to the plateau of uniform GRPO with K and with 2K groups a step.

``python -m nemo_rl_spec.bench.batch_limited --pair SETTING K_JSON 2K_JSON [--pair ...] --out FILE.json``

Each JSON is an ``examples/bench_pilot_commit.py --methods uniform`` result (one recipe setting, K or 2K prompts a
step, any seeds). Per setting and seed: the plateau of a run is the mean of its last 3 validations; the target is
``start + f * (max(plateau_K, plateau_2K) - start)`` for f = 0.5 and 0.9 (one target for both runs of the seed);
steps_to = the first validated step at or above it (None: never, or neither run ends above its start). The setting is *batch-limited* when 2K reaches
the 0.9 target in at most 2/3 of K's steps on every seed (the paper's effect needs a full batch of informative
groups to beat a half-informative one; if doubling the batch does not shorten training, no allocator can).
Prints a table and writes ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from nemo_rl_spec.utils.machine import write_bench_json

FRACTIONS = (0.5, 0.9)
LIMITED_RATIO = 1.5
"""K's steps over 2K's steps to the 0.9 target at or above which a seed counts as batch-limited."""


def plateau(curve: list) -> float:
    """Mean accuracy of the last 3 validations of ``curve`` [(step, cumulative rollouts, accuracy)]."""
    return statistics.fmean(a for _, _, a in curve[-3:])


def steps_to(curve: list, target: float) -> int | None:
    """First validated step with accuracy >= target (1e-9 slack), None if none."""
    return next((s for s, _, a in curve if a >= target - 1e-9), None)


def compare_seed(k_curve: list, k2_curve: list) -> dict:
    """Targets and steps to them for one seed's K and 2K runs (curves share step 0's start)."""
    start = k_curve[0][2]
    top = max(plateau(k_curve), plateau(k2_curve))
    out = {"start": start, "plateau_K": plateau(k_curve), "plateau_2K": plateau(k2_curve)}
    for name, c in (("K", k_curve), ("2K", k2_curve)):
        best = max(c, key=lambda p: p[2])  # the first of equal maxima
        out[f"peak_{name}"], out[f"peak_step_{name}"] = best[2], best[0]
    for f in FRACTIONS:
        target = start + f * (top - start)
        # no gain over the start (both runs end at or below it): nothing to reach
        k, k2 = (steps_to(k_curve, target), steps_to(k2_curve, target)) if top > start else (None, None)
        out[f"target_{f}"] = target
        out[f"steps_K_{f}"], out[f"steps_2K_{f}"] = k, k2
        out[f"ratio_{f}"] = (k / k2) if k and k2 else None
    return out


def compare_setting(k_json: dict, k2_json: dict) -> dict:
    """Per seed :func:`compare_seed` and the verdict (batch-limited on every seed both ran)."""
    k_runs, k2_runs = k_json["runs"]["uniform"], k2_json["runs"]["uniform"]
    seeds = sorted(set(k_runs) & set(k2_runs), key=int)
    per_seed = {s: compare_seed(k_runs[s]["curve"], k2_runs[s]["curve"]) for s in seeds}
    ratios = [r["ratio_0.9"] for r in per_seed.values()]
    limited = bool(ratios) and all(r is not None and r >= LIMITED_RATIO for r in ratios)
    return {"per_seed": per_seed, "ratios_0.9": ratios, "batch_limited": limited}


def table(result: dict) -> str:
    head = (
        "| setting | seed | start | plateau K | plateau 2K | peak (step) K | peak (step) 2K | steps to 0.5 (K / 2K) "
        "| steps to 0.9 (K / 2K) | K/2K |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for name, setting in result["settings"].items():
        for seed, r in setting["per_seed"].items():
            ratio = f"{r['ratio_0.9']:.2f}" if r["ratio_0.9"] else "-"
            lines.append(
                f"| {name} | {seed} | {r['start']:.3f} | {r['plateau_K']:.3f} | {r['plateau_2K']:.3f} | "
                f"{r['peak_K']:.3f} ({r['peak_step_K']}) | {r['peak_2K']:.3f} ({r['peak_step_2K']}) | "
                f"{r['steps_K_0.5']} / {r['steps_2K_0.5']} | {r['steps_K_0.9']} / {r['steps_2K_0.9']} | {ratio} |"
            )
        lines.append(f"| {name} | batch-limited: **{'yes' if setting['batch_limited'] else 'no'}** |" + " |" * 8)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", nargs=3, action="append", required=True, metavar=("SETTING", "K_JSON", "2K_JSON"))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    settings = {
        name: {"K": k, "2K": k2, **compare_setting(json.loads(Path(k).read_text()), json.loads(Path(k2).read_text()))}
        for name, k, k2 in args.pair
    }
    result = {"settings": settings, "limited_ratio": LIMITED_RATIO, "fractions": FRACTIONS}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_bench_json(Path(args.out), result)
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
