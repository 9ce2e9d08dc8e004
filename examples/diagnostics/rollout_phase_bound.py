"""The most a long-tail rollout phase could gain, next to what it gained, from saved ``bench_spec_schedule.py`` JSON.

``python examples/diagnostics/rollout_phase_bound.py docs/results/longtail/*.json [--out JSON]``

Re-summarises each file (:func:`nemo_rl_spec.bench.spec_schedule.summarize`; other JSON files, such as loop
benchmarks, are skipped with a note) and prints, per speculative engine: the share of AR's rollout time at drafting
batches, the time-weighted acceptance length, the measured rollout phase and
:func:`~nemo_rl_spec.bench.spec_schedule.amdahl_bound`, the phase's speedup if drafting and verification cost
nothing; where the file has AR held to the engine's row lengths, the held phase and the bound from that held AR run
(``matched_amdahl_bound``). Reads files only; CPU results stay CPU results. Prints a markdown table; ``--out`` also
writes its rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from nemo_rl_spec.bench.spec_schedule import spec_names, summarize


def rows(path: str) -> list[dict]:
    """One row per speculative engine of the file at ``path``; none for a file that is not a long-tail benchmark."""
    res = json.loads(Path(path).read_text())
    if not isinstance(res, dict) or not {"schedule", "rollouts", "sweep"} <= res.keys():
        print(f"skipped {path}: not a bench_spec_schedule.py output", file=sys.stderr)
        return []
    s = summarize(res)
    ar, share = s["ar_seconds"], s["ar_share_at_drafting_batches"]
    drafting = sum(a * f for a, f in zip(ar, share))
    out = []
    for name in spec_names(res):
        e = s[name]
        accs = [1.0 if x is None or math.isnan(x) else x for x in e["acceptance_length"]]
        out.append(
            {
                "file": path,
                "engine": name,
                "share_at_drafting_batches": drafting / sum(ar),
                "acceptance_length": sum(a * f * x for a, f, x in zip(ar, share, accs)) / max(drafting, 1e-12),
                "rollout_phase_speedup": e["rollout_phase_speedup"],
                "amdahl_bound": e["amdahl_bound"],
                "matched_phase_speedup": e.get("matched_phase_speedup"),
                "matched_amdahl_bound": e.get("matched_amdahl_bound"),
            }
        )
    return out


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="bench_spec_schedule.py output JSON files (others are skipped)")
    p.add_argument("--out", help="also write the table's rows here (a JSON list, one object per file and engine)")
    args = p.parse_args()
    table = [r for f in args.files for r in rows(f)]
    print(
        "| file | engine | AR time at drafting batches | acceptance length | phase | bound | phase, AR held | bound, AR held |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(
            f"| {Path(r['file']).name} | {r['engine']} | {r['share_at_drafting_batches']:.0%} | "
            f"{r['acceptance_length']:.2f} | {_cell(r['rollout_phase_speedup'])} | {_cell(r['amdahl_bound'])} | "
            f"{_cell(r['matched_phase_speedup'])} | {_cell(r['matched_amdahl_bound'])} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
