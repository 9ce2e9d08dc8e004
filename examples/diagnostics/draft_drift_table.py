"""Online draft against its frozen start over a run, from ``policy.draft.estimate_acceptance`` metrics.

``python examples/diagnostics/draft_drift_table.py LOG_DIR/metrics.jsonl [...] [--window 10] [--method greedy]
[--out JSON]``

Reads the metrics of runs made with the diagnostic-only key ``policy.draft.estimate_acceptance=true`` (files only).
Per window of ``--window`` steps that trained the draft (with ``policy.draft.train_period`` n > 1 a window spans n
times as many GRPO steps), and per run: the mean estimated acceptance length of the online head before each step's
update (``train/draft_est_acceptance_{method}``) and of the head the run started from, frozen
(``train/draft_ref_est_acceptance_{method}``), on the same rollouts; their paired difference with a bootstrap 90%
interval over the window's steps (steps are treated as independent; consecutive steps are not, so the interval is
optimistic: compare runs of several seeds); the engines' acceptance from the rollouts' own counts (1 + accepted /
drafts, over the steps that drafted); the mean reward. Prints one Markdown table per file; ``--out`` also writes the
rows as JSON. Exits with a message when a file has no estimate rows.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from nemo_rl_spec.utils.bench_runs import bootstrap_interval

METHODS = ("probabilistic", "greedy")


def read(path: str) -> list[dict]:
    """The metric rows of one run that carry the estimate (steps that trained the draft)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if "train/draft_est_acceptance_probabilistic" in r]


def window_row(rows: list[dict], method: str) -> dict:
    """Means, paired difference and interval, engine acceptance and reward over ``rows``."""
    est = [r[f"train/draft_est_acceptance_{method}"] for r in rows]
    ref = [r[f"train/draft_ref_est_acceptance_{method}"] for r in rows]
    diff = [a - b for a, b in zip(est, ref)]
    drafts = sum(r.get("vllm/spec_num_drafts", 0.0) for r in rows)
    accepted = sum(r.get("vllm/spec_num_accepted_tokens", 0.0) for r in rows)
    return {
        "steps": [int(r["step"]) for r in rows],
        "online": sum(est) / len(est),
        "frozen_start": sum(ref) / len(ref),
        "difference": sum(diff) / len(diff),
        "interval90": bootstrap_interval(diff) if len(diff) > 1 else None,
        "engine_acceptance": 1.0 + accepted / drafts if drafts else math.nan,
        "engine_drafts": drafts,
        "reward": sum(r["train/reward"] for r in rows) / len(rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="metrics.jsonl of runs with policy.draft.estimate_acceptance=true")
    p.add_argument("--window", type=int, default=10, help="steps that trained the draft, per row")
    p.add_argument("--method", choices=METHODS, default="probabilistic")
    p.add_argument("--out", help="also write the rows here")
    args = p.parse_args()
    out = {}
    for f in args.files:
        rows = read(f)
        if not rows:
            raise SystemExit(f"{f}: no train/draft_est_acceptance_* rows (run with policy.draft.estimate_acceptance)")
        windows = [rows[i : i + args.window] for i in range(0, len(rows), args.window)]
        out[f] = {"windows": [window_row(w, args.method) for w in windows], "all": window_row(rows, args.method)}
        print(f"\n{f} ({args.method} drafting)")
        print("| steps | online head | frozen start | online - frozen [90% interval] | engines (drafts) | reward |")
        print("|---|---|---|---|---|---|")
        for w in [*out[f]["windows"], out[f]["all"]]:
            ci = w["interval90"]
            ci_s = f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else ""
            print(
                f"| {w['steps'][0]}-{w['steps'][-1]} | {w['online']:.3f} | {w['frozen_start']:.3f} | "
                f"{w['difference']:+.3f}{ci_s} | {w['engine_acceptance']:.2f} ({w['engine_drafts']:.0f}) | "
                f"{w['reward']:.3f} |"
            )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
