"""One online EAGLE-3 draft training step (``OnlineDraft.begin`` / ``accumulate`` per micro-batch / ``finish``),
before and after its restriction to the scored tokens, at the default speculative recipe's shapes, interleaved,
side by side in one run (docs/results/draft_training_cost.md).

- "before": the full-position path the scored-token cut replaced, kept here (:func:`reference_accumulate`): soft
  targets ``log_softmax(logits)`` (temperature 1, as the online draft trains) in fp32 at every position [b, s, V],
  then ``Eagle3DraftHead.ttt_loss`` (output layer, log-softmax and loss at every position of every TTT step).
- "after": ``OnlineDraft.accumulate`` (nemo_rl_spec/speculative/ttt_scored.py): the same loss and gradients at the
  scored tokens only.
- "bf16": "after" with ``policy.draft.precision: bfloat16`` (fp32 weights, gradients and AdamW state); every
  variant's head takes the same steps on the same batch, so ``loss_at_last_step`` compares where they end.

Shapes: :class:`RecipeShapes`, with the recipe draft's 1,160-row vocabulary and the full 49,152 rows. Random
weights and inputs: no step here depends on the values. The policy's own training step is not re-measured: the
loop's logged ``training_s`` (:data:`LOOP_RUNS`) is printed next to it for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from nemo_rl_spec.models.policy.dynamic_batching import token_budget_plan
from nemo_rl_spec.speculative.draft_trainer import DraftTrainer
from nemo_rl_spec.speculative.eagle3 import Eagle3Config, Eagle3DraftHead
from nemo_rl_spec.speculative.online import OnlineDraft
from nemo_rl_spec.utils.config_schema import DraftConfig
from nemo_rl_spec.utils.machine import write_bench_json

VARIANTS = ("before", "after", "bf16")
LOOP_RUNS = {
    "vocab1160": [("docs/results/spec_loop_default/real_draft_5steps.json", "sync/speculative@ms13", "after")],
    "full": [
        (f"docs/results/spec_loop_default/default_rep{i}.json", "sync/speculative@after", "before") for i in (1, 2, 3)
    ],
}
"""In-loop runs (examples/bench_sync_vs_async.py: file, speculative mode, and the variant of this benchmark whose path
that run's draft trained with) whose logged phases give the policy's training time for scale: the default recipe with
its real 1,160-row draft (fp32 scored-token path) and the full-vocabulary head (before the scored-token
cut)."""


@dataclass
class RecipeShapes:
    """Model and batch shapes of one draft training step (defaults: the default speculative recipe).

    SmolLM2-135M (hidden 576, 9 heads / 3 KV heads of 64, MLP 1536, vocab 49,152, aux layers 2 / 15 / 27), the
    recipe's batch (configs/grpo_math_smollm2_135m.yaml: 8 prompts x 4 rollouts = 32 rows, dynamic batching with
    ``train_mb_tokens`` 768, T = 0.7, bf16 policy logits and hidden states, 2 threads), prompts of 45-53 tokens (the
    chat-formatted prompt is ~49) and responses of 12-32 tokens with 5 rows at the 80-token cap (~31 tokens a row on
    average: the rollout benchmark's 984 tokens for 32 rows).
    """

    vocab_size: int = 49152
    hidden_size: int = 576
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    prompts: int = 8
    rollouts_per_prompt: int = 4
    prompt_tokens: tuple[int, int] = (45, 53)
    response_tokens: tuple[int, int] = (12, 32)
    max_new_tokens: int = 80
    rows_at_cap: int = 5
    train_mb_tokens: int = 768
    temperature: float = 0.7
    ttt_steps: int = 3
    policy_dtype: str = "bfloat16"

    def target_config(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0,
        }


def recipe_batch(shapes: RecipeShapes, seed: int = 0) -> dict[str, torch.Tensor]:
    """A right-padded GRPO batch: ``input_ids`` [B, W], ``loss_mask`` [B, W] (response tokens), ``input_lengths`` [B]."""
    gen = torch.Generator().manual_seed(seed)
    rows = shapes.prompts * shapes.rollouts_per_prompt
    lo, hi = shapes.prompt_tokens
    prompt = torch.randint(lo, hi + 1, (shapes.prompts,), generator=gen).repeat_interleave(shapes.rollouts_per_prompt)
    response = torch.randint(shapes.response_tokens[0], shapes.response_tokens[1] + 1, (rows,), generator=gen)
    response[torch.randperm(rows, generator=gen)[: shapes.rows_at_cap]] = shapes.max_new_tokens
    lengths = prompt + response
    width = int(lengths.max())
    cols = torch.arange(width).unsqueeze(0)
    return {
        "input_ids": torch.randint(0, shapes.vocab_size, (rows, width), generator=gen),
        "loss_mask": (cols >= prompt.unsqueeze(1)) & (cols < lengths.unsqueeze(1)),
        "input_lengths": lengths,
    }


def micro_batches(shapes: RecipeShapes, batch: dict[str, torch.Tensor], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """The training micro-batches (the worker's ``token_budget_plan``) with random policy tensors: ``aux`` [b, s,
    3H] and ``logits`` [b, s, V] in the policy's dtype, ``input_ids`` and ``loss_mask`` [b, s]."""
    gen = torch.Generator().manual_seed(seed + 1)
    dtype = getattr(torch, shapes.policy_dtype)
    width = int(batch["input_ids"].shape[1])
    out = []
    for mb in token_budget_plan(batch["input_lengths"], shapes.train_mb_tokens, 1, width):
        ids = batch["input_ids"][mb.rows, : mb.seq_len]
        b, s = ids.shape
        out.append(
            {
                "input_ids": ids,
                "loss_mask": batch["loss_mask"][mb.rows, : mb.seq_len],
                "aux": torch.randn(b, s, 3 * shapes.hidden_size, generator=gen).to(dtype),
                "logits": (3.0 * torch.randn(b, s, shapes.vocab_size, generator=gen)).to(dtype),
            }
        )
    return out


def make_draft(
    shapes: RecipeShapes, draft_vocab_size: int | None, seed: int = 0, precision: str = "float32"
) -> OnlineDraft:
    """A fresh online draft of the recipe's shape (the recipe's optimizer settings: ``policy.draft`` lr 1e-4;
    ``precision``: ``policy.draft.precision``)."""
    cfg = Eagle3Config.from_target(shapes.target_config(), draft_vocab_size=draft_vocab_size)
    head = Eagle3DraftHead(cfg)
    head.reset_parameters(seed=seed)
    if draft_vocab_size is not None:
        ids = torch.randperm(shapes.vocab_size, generator=torch.Generator().manual_seed(seed))[:draft_vocab_size]
        head.set_draft_vocab(ids.sort().values)
    draft_cfg = DraftConfig(online=True, optimizer={"lr": 1e-4}, precision=precision)
    return OnlineDraft(head, draft_cfg, ttt_steps=shapes.ttt_steps, temperature=shapes.temperature)


def reference_accumulate(draft: OnlineDraft, aux, input_ids, loss_mask, logits) -> None:
    """The "before" of ``OnlineDraft.accumulate`` + ``DraftTrainer.accumulate``: soft targets at every position and
    the full-position ``ttt_loss``, with the same share weighting and metric sums."""
    t0 = time.perf_counter()
    target = torch.log_softmax(logits.detach().float(), dim=-1)  # temperature 1, as OnlineDraft.accumulate
    trainer = draft.trainer
    valid = DraftTrainer.scored_tokens(loss_mask)
    if valid:
        trainer.head.train()
        loss, metrics = trainer.head.ttt_loss(
            aux.float(), input_ids, loss_mask, trainer.ttt_steps, target, trainer.step_weights
        )
        share = valid / draft._total
        (loss * share * trainer.loss_weight).backward()
        trainer._loss_sum += float(loss.detach()) * share
        for key, value in metrics.items():
            trainer._metric_sums[key] = trainer._metric_sums.get(key, 0.0) + value * share
    draft._seconds += time.perf_counter() - t0


def draft_step(draft: OnlineDraft, variant: str, embedding, mask, mbs) -> tuple[float, dict[str, float]]:
    """One timed draft training step (begin, accumulate per micro-batch, finish); (seconds, finish's metrics)."""
    t0 = time.perf_counter()
    draft.begin(embedding, mask)
    for mb in mbs:
        if variant == "before":
            reference_accumulate(draft, mb["aux"], mb["input_ids"], mb["loss_mask"], mb["logits"])
        else:
            draft.accumulate(_Captured(mb["aux"]), mb["input_ids"], mb["loss_mask"], mb["logits"])
    metrics = draft.finish()
    return time.perf_counter() - t0, metrics


def loop_policy_seconds(root: Path, head: str) -> dict[str, Any]:
    """From the in-loop runs of ``head``: the AR mode's training phase (the policy's own step) and the speculative
    mode's draft seconds, whole step and step / AR (means over the files found)."""
    rows = []
    for name, mode, _ in LOOP_RUNS.get(head, []):
        path = root / name
        if path.is_file():
            modes = json.loads(path.read_text())["modes"]
            ar, spec = modes["sync/autoregressive"], modes[mode]
            rows.append((ar["training_s"], spec["draft_train_s"], spec["step_time_s"], ar["step_time_s"]))
    if not rows:
        return {}
    mean = [statistics.fmean(col) for col in zip(*rows, strict=True)]
    return {
        "files": [name for name, _, _ in LOOP_RUNS.get(head, [])],
        "draft_variant": LOOP_RUNS[head][0][2],
        "ar_policy_training_s": mean[0],
        "spec_draft_train_s": mean[1],
        "spec_step_s": mean[2],
        "ar_step_s": mean[3],
    }


def run(shapes: RecipeShapes, heads: dict[str, int | None], repeats: int, threads: int, root: Path) -> dict:
    """Interleaved repeats (order alternating per repeat) after one warm-up step per (head, variant) of
    :data:`VARIANTS`, every variant's head starting identical and stepping on the same batch.

    Returns ``{"settings": ..., "heads": {head: summary}}``; a summary holds per-variant ``seconds`` (per repeat) and
    ``median_s``, ``after_over_before`` and ``bf16_over_after`` (median ratios), the warm-up step's
    ``first_step_draft_loss`` / ``first_step_grad_norm`` per variant (the fp32 variants equal, bf16 within its
    rounding), ``loss_at_last_step`` (the loss logged by step ``repeats + 1``, after ``repeats`` updates), and with a
    loop file (:data:`LOOP_RUNS`) ``projected_step_over_ar``: the loop's step with its draft seconds scaled from the
    variant it ran to bf16."""
    torch.set_num_threads(threads)
    batch = recipe_batch(shapes)
    mbs = micro_batches(shapes, batch)
    embedding = torch.randn(shapes.vocab_size, shapes.hidden_size, generator=torch.Generator().manual_seed(7))
    result: dict[str, Any] = {"settings": {**asdict(shapes), "repeats": repeats, "threads": threads}, "heads": {}}
    result["settings"]["micro_batches"] = [list(mb["input_ids"].shape) for mb in mbs]
    result["settings"]["scored_tokens"] = DraftTrainer.scored_tokens(batch["loss_mask"])
    for head, vocab in heads.items():
        drafts = {v: make_draft(shapes, vocab, precision="bfloat16" if v == "bf16" else "float32") for v in VARIANTS}
        warm = {v: draft_step(drafts[v], v, embedding, batch["loss_mask"], mbs) for v in VARIANTS}
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        last: dict[str, float] = {}
        for rep in range(repeats):
            for v in VARIANTS if rep % 2 == 0 else VARIANTS[::-1]:
                seconds, metrics = draft_step(drafts[v], v, embedding, batch["loss_mask"], mbs)
                times[v].append(seconds)
                last[v] = metrics["draft_loss"]
        summary = _head_summary(vocab, shapes, times, warm, loop_policy_seconds(root, head))
        result["heads"][head] = {**summary, "loss_at_last_step": {"step": repeats + 1, **last}}
        print_row(head, result["heads"][head], flush=True)
    return result


def _head_summary(vocab, shapes, times, warm, loop) -> dict[str, Any]:
    median = {v: statistics.median(times[v]) for v in VARIANTS}
    summary = {
        "draft_vocab_size": vocab or shapes.vocab_size,
        "seconds": times,
        "median_s": median,
        "after_over_before": median["after"] / median["before"],
        "bf16_over_after": median["bf16"] / median["after"],
        "warmup_s": {v: warm[v][0] for v in VARIANTS},
        "first_step_draft_loss": {v: warm[v][1]["draft_loss"] for v in VARIANTS},
        "first_step_grad_norm": {v: warm[v][1]["draft_grad_norm"] for v in VARIANTS},
        "loop": loop,
    }
    if loop:
        # the loop file's draft trained on the variant LOOP_RUNS names: scale its draft seconds from there to bf16
        saved = loop["spec_draft_train_s"] * (1.0 - median["bf16"] / median[loop["draft_variant"]])
        summary["projected_step_over_ar"] = (loop["spec_step_s"] - saved) / loop["ar_step_s"]
        summary["loop_step_over_ar"] = loop["spec_step_s"] / loop["ar_step_s"]
    return summary


HEADER = (
    "| head | before s (per repeat) | after s (per repeat) | bf16 s (per repeat) | after / before | bf16 / after "
    "| first-step loss after / bf16 | loss at the last step, after / bf16 "
    "| policy training s (loop, AR) | loop step / AR | projected step / AR with bf16 |"
)


def print_row(head: str, s: dict[str, Any], flush: bool = False) -> str:
    def reps(v: str) -> str:
        return f"{s['median_s'][v]:.3f} ({' / '.join(f'{x:.2f}' for x in s['seconds'][v])})"

    loss, end = s["first_step_draft_loss"], s["loss_at_last_step"]
    loop = s["loop"]
    row = (
        f"| {head} ({s['draft_vocab_size']} rows) | {reps('before')} | {reps('after')} | {reps('bf16')} "
        f"| {s['after_over_before']:.3f} | {s['bf16_over_after']:.3f} | {loss['after']:.6f} / {loss['bf16']:.6f} "
        f"| {end['after']:.6f} / {end['bf16']:.6f} "
        f"| {loop.get('ar_policy_training_s', float('nan')):.2f} | {s.get('loop_step_over_ar', float('nan')):.3f} "
        f"| {s.get('projected_step_over_ar', float('nan')):.3f} |"
    )
    print(row, flush=flush)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads (the recipe's megatron_cfg.num_threads)")
    p.add_argument("--heads", nargs="+", default=["vocab1160", "full"], choices=["vocab1160", "full"])
    p.add_argument("--out", default="docs/results/draft_training_cost/bench_draft_training.json")
    args = p.parse_args(argv)
    heads = {"vocab1160": 1160, "full": None}
    print(HEADER, flush=True)
    result = run(RecipeShapes(), {h: heads[h] for h in args.heads}, args.repeats, args.threads, Path("."))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_bench_json(args.out, result, indent=2)
    print(f"wrote {args.out}")
    return 0


class _Captured:
    """Stands in for a HiddenStateCapture: one micro-batch's aux hidden states [b, s, 3H]."""

    def __init__(self, aux: torch.Tensor) -> None:
        self._aux = aux

    def aux_hidden(self) -> torch.Tensor:
        return self._aux
