"""Held-out acceptance of a ``make draft`` head trained on for a few GRPO-sized steps, one change at a time.

``python examples/diagnostics/online_draft_targets.py [--draft DIR] [--steps 12] [--seeds 0 1 2] [--out JSON]``

Why: in the loop, the online draft (started from ``make draft``'s head) accepted less than the same head frozen in
its first steps (docs/results/online_draft_acceptance.md). This replays those first steps
offline on ``make draft``'s own samples (``DIR/work/samples.jsonl``: rollouts of the initial policy at the recipe's
temperature T) and measures the estimated acceptance length of probabilistic drafting at T on the held-out prompts
(:func:`~nemo_rl_spec.algorithms.draft_init.evaluate`; vLLM samples the draft token from ``softmax(z / T)``).

Variants (each from the same head and rows; one change from ``online``):

- ``online``: the online trainer's earlier settings: soft targets ``log_softmax(policy_logits / T)``, a
  fresh AdamW at ``policy.draft.optimizer.lr`` (``--lr``);
- ``t1_targets``: soft targets at temperature 1 (``log_softmax(policy_logits)``, what ``make draft`` trained on and,
  since this comparison, the online trainer too);
- ``carried_adam``: ``make draft``'s AdamW state (``DIR/draft_trainer.pt``) carried over, lr set to ``--lr``;
- ``lr_div10``: ``--lr`` / 10;
- ``frozen``: no training (the row every step is compared with);
- ``sharpened``: no training, the head's logits divided by T (``lm_head`` scaled by 1 / T): where the ``online``
  targets lead, since a head that fits ``log p_T = log p_1 / T + c`` has logits about ``z / T``.

The heads train in fp32 (the recipe's online draft autocasts its forward to bf16). Prints a table (estimated
acceptance length after each step, mean over seeds) and writes JSON with every point to ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from nemo_rl_spec.algorithms import draft_init
from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.speculative.draft_trainer import DraftTrainer
from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead
from nemo_rl_spec.speculative.offline import build_policy_cache

VARIANTS = ("frozen", "online", "t1_targets", "carried_adam", "lr_div10", "sharpened")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draft", default="results/drafts/smollm2_135m_arith", help="a make-draft output directory")
    p.add_argument("--steps", type=int, default=12, help="draft optimizer steps (GRPO steps of the loop)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (the recipe's rollouts a step)")
    p.add_argument("--lr", type=float, default=3e-4, help="the online draft's lr (policy.draft.optimizer.lr)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="row orders")
    p.add_argument("--train-rows", type=int, default=384, help="training sequences cached (first of make draft's)")
    p.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, help="which to run (default: all)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument(
        "--out",
        default="results/online_draft_targets.json",
        help="JSON written: the arguments, the held-out sequence count and every curve (variant -> seed -> points)",
    )
    return p.parse_args()


def load(args):
    """(summary, samples, policy, head, cache, train_rows, eval_rows) from ``args.draft``."""
    summary = json.loads((Path(args.draft) / "init_draft.json").read_text())
    samples = draft_init.read_samples(Path(args.draft) / "work" / draft_init.SAMPLES_FILE)
    n_train_prompts = summary["num_prompts"] - summary["eval_prompts"]
    train_rows = [i for i, p in enumerate(samples.prompt_index) if p < n_train_prompts][: args.train_rows]
    eval_rows = [i for i, p in enumerate(samples.prompt_index) if p >= n_train_prompts]
    policy = AutoModelForCausalLM.from_pretrained(resolve_model(summary["model"]), dtype=torch.float32).eval()
    head = Eagle3DraftHead.from_pretrained(args.draft, target_embeddings=policy.get_input_embeddings().weight)
    keep = train_rows + eval_rows  # only these are cached: renumber them 0..n-1
    samples = draft_init.Samples(
        [samples.prompt_index[i] for i in keep],
        [samples.sequences[i] for i in keep],
        [samples.prompt_lengths[i] for i in keep],
    )
    train_rows, eval_rows = list(range(len(train_rows))), list(range(len(train_rows), len(keep)))
    temperature = summary["temperature"] if summary["temperature"] > 0 else 1.0  # as make draft does
    cache = build_policy_cache(policy, head, samples.sequences, 16, True, temperature)
    return summary, samples, head, cache, train_rows, eval_rows


def make_trainer(variant: str, head: Eagle3DraftHead, args, summary) -> DraftTrainer:
    lr = args.lr / 10 if variant == "lr_div10" else args.lr
    trainer = DraftTrainer(copy.deepcopy(head), lr=lr, ttt_steps=summary["ttt_steps"])
    if variant == "carried_adam":
        saved = torch.load(Path(args.draft) / "draft_trainer.pt", weights_only=True)
        trainer.optimizer.load_state_dict(saved["optimizer"])
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr
    if variant == "sharpened":
        with torch.no_grad():
            trainer.head.lm_head.weight.div_(summary["temperature"])
    return trainer


def run_variant(variant, head, cache, samples, train_rows, eval_rows, args, summary, seed) -> list[float]:
    """Held-out probabilistic acceptance length before training and after each step."""
    trainer = make_trainer(variant, head, args, summary)
    k = summary["ttt_steps"]

    def acc() -> float:
        return draft_init.evaluate(trainer.head, cache, samples, eval_rows, k)["probabilistic/acceptance_length"]

    curve = [acc()]
    if variant in ("frozen", "sharpened"):
        return curve * (args.steps + 1)
    for step in range(args.steps):
        rows = draft_init.batch_rows(train_rows, args.batch_size, seed, step)
        aux, target, ids, mask = draft_init.padded_batch(cache, samples, rows)
        if variant != "t1_targets":
            target = cache.tempered_logprobs(rows)
        trainer.step(aux, ids, mask, target)
        curve.append(acc())
    return curve


def main() -> None:
    args = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    summary, samples, head, cache, train_rows, eval_rows = load(args)
    curves = {v: {} for v in args.variants}
    for seed in args.seeds:
        for v in args.variants:
            curves[v][seed] = run_variant(v, head, cache, samples, train_rows, eval_rows, args, summary, seed)
            print(f"seed {seed} {v:>12}: " + " ".join(f"{x:.3f}" for x in curves[v][seed]), flush=True)
    marks = sorted({0, 1, 2, 3, 6, args.steps} & set(range(args.steps + 1)))
    print(
        f"\nheld-out probabilistic acceptance length (k={summary['ttt_steps']}, T={summary['temperature']}), "
        f"mean over seeds {args.seeds}"
    )
    print("| variant | " + " | ".join(f"step {m}" for m in marks) + " |")
    print("|---|" + "---|" * len(marks))
    for v in args.variants:
        means = [sum(c[m] for c in curves[v].values()) / len(curves[v]) for m in marks]
        print(f"| {v} | " + " | ".join(f"{x:.3f}" for x in means) + " |")
    out = {"args": vars(args), "eval_sequences": len(eval_rows), "curves": curves}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
