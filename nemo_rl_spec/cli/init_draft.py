"""Offline EAGLE-3 draft initialisation: ``python examples/init_draft.py --config RECIPE.yaml --out DIR``.

Samples ``--samples-per-prompt`` responses from the recipe's policy (vLLM, the recipe's temperature and
max_new_tokens) to each of the first ``--num-prompts`` problems of the recipe's training set (chat-formatted as the
GRPO loop formats them), trains an EAGLE-3 head on them with the full training-time-test unroll, and writes ``DIR``
(vLLM's eagle3 format plus ``draft_trainer.pt``) and ``init_draft.json`` (arguments, the draft vocabulary, the
held-out acceptance-vs-steps curve and, with ``--data-sizes``, the acceptance-vs-data curve). Interrupted runs
resume from ``DIR/work/``: rerun the same command (stages: :mod:`nemo_rl_spec.algorithms.draft_init`). Start GRPO
from the result with::

    policy.draft.model_name: DIR
    policy.generation.vllm_kwargs.speculative_config: {method: eagle3, model: DIR, num_speculative_tokens: 3}

Extra ``key=value`` arguments override the recipe as in ``examples/run_grpo.py`` (e.g.
``policy.generation.temperature=0``). Exit status 2 with one message naming the flag or file on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from nemo_rl_spec.algorithms import draft_init
from nemo_rl_spec.data.prompts import format_prompt
from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.speculative.draft_trainer import DraftTrainer
from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead
from nemo_rl_spec.speculative.offline import build_policy_cache
from nemo_rl_spec.testing import checks
from nemo_rl_spec.utils.config import ConfigError, load_config

SUMMARY_FILE = "init_draft.json"
PROMPTS_PER_CALL = 16  # prompts per vLLM generate call while sampling (x --samples-per-prompt rows)


class UsageError(ValueError):
    """Bad command-line input; the message names the flag or file."""


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="recipe YAML (as for examples/run_grpo.py)")
    parser.add_argument("--out", required=True, help="output directory of the draft checkpoint")
    parser.add_argument("--num-prompts", type=int, default=64, help="training-set prompts to sample (default 64)")
    parser.add_argument("--samples-per-prompt", type=int, default=1, help="responses per prompt (default 1)")
    parser.add_argument(
        "--eval-prompts",
        type=int,
        default=0,
        help="of --num-prompts, the last N are held out for the acceptance curves (default 0: none)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="response cap (default: policy.generation.max_new_tokens)"
    )
    parser.add_argument("--steps", type=int, default=100, help="draft optimizer steps (default 100)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per draft step (default 8)")
    parser.add_argument("--lr", type=float, default=3e-3, help="draft AdamW learning rate (default 3e-3)")
    parser.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll length (default 3)")
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="reduced draft vocabulary: this many most frequent response tokens + EOS; 0: full "
        "vocabulary (default: sized by --vocab-coverage)",
    )
    parser.add_argument(
        "--vocab-coverage",
        type=float,
        default=0.999,
        help="without --draft-vocab-size: the smallest vocabulary covering this fraction of the "
        "sampled response tokens (default 0.999)",
    )
    parser.add_argument("--eval-every", type=int, default=50, help="held-out acceptance every N steps (default 50)")
    parser.add_argument("--save-every", type=int, default=50, help="training checkpoint every N steps (default 50)")
    parser.add_argument(
        "--data-sizes",
        type=int,
        nargs="*",
        default=[],
        help="also train heads on the first N training sequences (same steps) for the acceptance-vs-data curve",
    )
    parser.add_argument(
        "--data-curve-steps",
        type=int,
        default=None,
        help="steps of each --data-sizes head (default --steps; a multiple of --eval-every, so the "
        "full set's point is the main curve's at that step)",
    )
    parser.add_argument(
        "--precision",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the draft's forward while training, as policy.draft.precision (bfloat16: torch.autocast; "
        "the weights and AdamW state stay float32; default float32, the shipped draft's)",
    )
    parser.add_argument("--seed", type=int, default=None, help="sampling / init seed (default: grpo.seed)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for training (default 1: on this shared 2-core machine 2 threads ran "
        "up to 30x slower than 1; alone, use 2)",
    )
    return parser.parse_known_args(argv)


def validate_args(args: argparse.Namespace) -> None:
    """Raises UsageError naming the first bad flag."""
    for flag, value, low in (
        ("--num-prompts", args.num_prompts, 1),
        ("--steps", args.steps, 1),
        ("--batch-size", args.batch_size, 1),
        ("--ttt-steps", args.ttt_steps, 1),
        ("--draft-vocab-size", args.draft_vocab_size, 0),
        ("--samples-per-prompt", args.samples_per_prompt, 1),
        ("--eval-prompts", args.eval_prompts, 0),
        ("--eval-every", args.eval_every, 1),
        ("--save-every", args.save_every, 1),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--threads", args.threads, 1),
        *(("--data-sizes", n, 1) for n in args.data_sizes),
    ):
        if value is not None and value < low:
            raise UsageError(f"{flag}={value}: must be >= {low}")
    if not args.lr > 0:
        raise UsageError(f"--lr={args.lr}: must be > 0")
    if not 0 < args.vocab_coverage <= 1:
        raise UsageError(f"--vocab-coverage={args.vocab_coverage}: must be in (0, 1]")
    curve_steps = args.data_curve_steps or args.steps
    if args.data_sizes and (curve_steps > args.steps or (curve_steps != args.steps and curve_steps % args.eval_every)):
        raise UsageError(
            f"--data-curve-steps={curve_steps}: must be --steps or a multiple of --eval-every="
            f"{args.eval_every} up to --steps={args.steps}"
        )
    if args.eval_prompts >= args.num_prompts:
        raise UsageError(f"--eval-prompts={args.eval_prompts}: must be < --num-prompts={args.num_prompts}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")


def in_domain_prompts(cfg, tokenizer, num_prompts: int) -> list[list[int]]:
    """Chat-formatted token ids of the first ``num_prompts`` training problems (GRPOSetup.prompt_ids' formatting).

    Raises:
        UsageError: the training set has fewer problems.
    """
    from nemo_rl_spec.algorithms.grpo_setup import load_datasets  # lazy: loads ray or megatron-core

    train, _ = load_datasets(cfg)
    if num_prompts > len(train):
        raise UsageError(
            f"--num-prompts={num_prompts}: the recipe's training set (data.train.size) has only {len(train)} problems"
        )
    kwargs = cfg.policy.tokenizer.chat_template_kwargs
    return [format_prompt(tokenizer, cfg.data.system_prompt, p["question"], **kwargs) for p in train[:num_prompts]]


def _eos_ids(tokenizer, hf_config) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(int(i) for i in ids)


def _load(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """Recipe, tokenizer, prompts and sampling settings; raises UsageError / ConfigError before any engine starts."""
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    validate_args(args)
    cfg = load_config(args.config, overrides)
    model_path = resolve_model(cfg.policy.model_name)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = in_domain_prompts(cfg, tokenizer, args.num_prompts)
    gen_cfg = cfg.policy.generation.model_dump()
    gen_cfg["vllm_kwargs"] = {k: v for k, v in gen_cfg["vllm_kwargs"].items() if k != "speculative_config"}
    gen_cfg["dynamic_speculation"] = None
    max_new = args.max_new_tokens or gen_cfg["max_new_tokens"]
    longest = max(len(p) for p in prompts) + max_new
    if longest > gen_cfg["vllm_cfg"]["max_model_len"]:
        raise UsageError(
            f"--max-new-tokens={max_new}: the longest prompt ({longest - max_new} tokens) plus the "
            f"response exceeds policy.generation.vllm_cfg.max_model_len={gen_cfg['vllm_cfg']['max_model_len']}"
        )
    seed = cfg.grpo.seed if args.seed is None else args.seed
    return {
        "cfg": cfg,
        "model_path": model_path,
        "tokenizer": tokenizer,
        "prompts": prompts,
        "gen_cfg": gen_cfg,
        "max_new": max_new,
        "seed": seed,
    }


def _make_trainer(args, policy, vocab, aux, seed, num_layers: int = 1) -> DraftTrainer:
    """A fresh head from the HF ``policy`` (``num_layers`` decoder layers: ``policy.draft.num_layers``) and its
    trainer (``--lr``, ``--ttt-steps``, ``--precision``)."""
    head = Eagle3DraftHead.from_target(policy, aux_layer_ids=aux, draft_vocab=vocab, seed=seed, num_layers=num_layers)
    autocast = torch.bfloat16 if args.precision == "bfloat16" else None
    return DraftTrainer(head, lr=args.lr, ttt_steps=args.ttt_steps, autocast_dtype=autocast)


def init_draft(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """The whole command after argument parsing; returns the summary written to ``DIR/init_draft.json``.

    Raises:
        UsageError, ConfigError: bad flags, recipe or overrides.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run = _load(args, overrides)
    from transformers import AutoModelForCausalLM  # lazy: transformers is slow to import

    out, seed = Path(args.out), run["seed"]
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    samples_file = str(work / draft_init.SAMPLES_FILE)
    t0 = time.perf_counter()
    checks.run_isolated(
        draft_init.sample_to_file,
        run["gen_cfg"],
        run["model_path"],
        run["prompts"],
        args.samples_per_prompt,
        seed,
        run["max_new"],
        PROMPTS_PER_CALL,
        samples_file,
        threads=int(run["gen_cfg"]["vllm_cfg"]["num_threads"]),
    )
    generate_s = time.perf_counter() - t0
    samples = draft_init.read_samples(samples_file)
    n_train_prompts = args.num_prompts - args.eval_prompts
    train_rows = [i for i, p in enumerate(samples.prompt_index) if p < n_train_prompts]
    eval_rows = [i for i, p in enumerate(samples.prompt_index) if p >= n_train_prompts]

    torch.set_num_threads(args.threads)
    policy = AutoModelForCausalLM.from_pretrained(run["model_path"], dtype=torch.float32).eval()
    if args.draft_vocab_size == 0:  # the full vocabulary
        vocab, vocab_info = None, {"draft_vocab_size": policy.config.vocab_size, "coverage": 1.0}
    else:
        vocab, vocab_info = draft_init.measured_vocab(
            [samples.sequences[i] for i in train_rows],
            [samples.prompt_lengths[i] for i in train_rows],
            policy.config.vocab_size,
            _eos_ids(run["tokenizer"], policy.config),
            args.vocab_coverage,
            args.draft_vocab_size,
        )
    draft_cfg = run["cfg"].policy.draft
    aux = draft_cfg.aux_layer_ids if draft_cfg is not None and draft_cfg.aux_layer_ids else None
    num_layers = (draft_cfg.num_layers if draft_cfg is not None else None) or 1
    trainer = _make_trainer(args, policy, vocab, aux, seed, num_layers)
    temperature = run["gen_cfg"]["temperature"]
    bar = tqdm(total=len(samples.sequences), desc="policy outputs", unit="seq")
    cache = build_policy_cache(
        policy,
        trainer.head,
        samples.sequences,
        args.batch_size,
        True,
        temperature if temperature > 0 else 1.0,
        on_batch=bar.update,
    )
    bar.close()
    state = draft_init.load_state(work / draft_init.STATE_FILE, trainer)
    t1 = time.perf_counter()
    state = draft_init.train(
        trainer,
        cache,
        samples,
        train_rows,
        eval_rows or train_rows[:64],
        args.steps,
        args.batch_size,
        seed,
        args.eval_every,
        state,
        lambda st: draft_init.save_state(work / draft_init.STATE_FILE, trainer, st),
        args.save_every,
    )
    train_s = time.perf_counter() - t1
    trainer.save_checkpoint(out)
    data_curve = _data_curve(
        args, policy, vocab, aux, seed, cache, samples, train_rows, eval_rows, work, state, num_layers
    )
    history = state["history"]

    def window(rows: list[dict[str, float]]) -> dict[str, float]:
        keys = ("train/draft_loss", "train/draft_acc_step0", f"train/draft_acc_step{args.ttt_steps - 1}")
        return {k: sum(r.get(k, float("nan")) for r in rows) / len(rows) for k in keys}

    n = max(1, min(5, len(history) // 4))
    resp_lens = [len(q) - p for q, p in zip(samples.sequences, samples.prompt_lengths)]
    summary = {
        "config": str(args.config),
        "overrides": overrides,
        "model": run["cfg"].policy.model_name,
        "out": str(out),
        "num_prompts": args.num_prompts,
        "samples_per_prompt": args.samples_per_prompt,
        "eval_prompts": args.eval_prompts,
        "train_sequences": len(train_rows),
        "eval_sequences": len(eval_rows),
        "seed": seed,
        "temperature": temperature,
        "max_new_tokens": run["max_new"],
        "steps": args.steps,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "ttt_steps": args.ttt_steps,
        "precision": args.precision,
        **vocab_info,
        "aux_layer_ids": list(trainer.head.cfg.aux_layer_ids),
        "num_layers": trainer.head.cfg.num_layers,
        "response_tokens_mean": sum(resp_lens) / len(resp_lens),
        "response_tokens_max": max(resp_lens),
        "generate_s": generate_s,
        "train_s": train_s,
        "start": window(history[:n]),
        "end": window(history[-n:]),
        "acceptance_vs_steps": state["curve"],
        "acceptance_vs_data": data_curve,
        "prompt_lengths": samples.prompt_lengths,
        "sequences": samples.sequences,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary) + "\n")
    draft_init.plot_curves(summary, out / "acceptance_curves.png")
    return summary


def _data_curve(
    args, policy, vocab, aux, seed, cache, samples, train_rows, eval_rows, work, full_state, num_layers: int = 1
):
    """Held-out acceptance of heads trained on the first N training sequences for ``--data-curve-steps`` steps;
    the full set's point is the main run's at that step. Each finished point is kept in
    ``work/data_curve.json`` (resume skips it)."""
    steps = args.data_curve_steps or args.steps
    path = work / "data_curve.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    for n in sorted(set(args.data_sizes)):
        key = f"{n}@{steps}"
        if n >= len(train_rows) or key in done:
            continue
        trainer = _make_trainer(args, policy, vocab, aux, seed, num_layers)
        st = draft_init.train(
            trainer,
            cache,
            samples,
            train_rows[:n],
            eval_rows or train_rows[:64],
            steps,
            args.batch_size,
            seed,
            steps,
            {"step": 0, "history": [], "curve": []},
            desc=f"data curve: {n} sequences",
        )
        done[key] = st["curve"][-1]
        path.write_text(json.dumps(done))
    points = [{"train_sequences": int(k.split("@")[0]), **v} for k, v in done.items() if k.endswith(f"@{steps}")]
    points += [{"train_sequences": len(train_rows), **p} for p in full_state["curve"] if p["step"] == steps]
    return sorted(points, key=lambda p: p["train_sequences"])


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    try:
        s = init_draft(args, overrides)
    except (UsageError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    st, en = s["start"], s["end"]
    last = f"train/draft_acc_step{s['ttt_steps'] - 1}"
    print(
        f"sampled {s['train_sequences'] + s['eval_sequences']} responses (mean {s['response_tokens_mean']:.0f}, max "
        f"{s['response_tokens_max']} tokens, T={s['temperature']}) in {s['generate_s']:.0f} s; "
        f"trained {s['steps']} steps in {s['train_s']:.0f} s"
    )
    print(
        f"draft loss {st['train/draft_loss']:.3f} -> {en['train/draft_loss']:.3f}; "
        f"acc step0 {st['train/draft_acc_step0']:.3f} -> {en['train/draft_acc_step0']:.3f}; "
        f"acc step{s['ttt_steps'] - 1} {st[last]:.3f} -> {en[last]:.3f}"
    )
    print(f"draft vocabulary {s['draft_vocab_size']} (covers {s['coverage']:.4f} of the sampled response tokens)")
    for p in s["acceptance_vs_data"]:
        print(
            f"{p['train_sequences']} training sequences: held-out acceptance length (k={s['ttt_steps']}) greedy "
            f"{p['greedy/acceptance_length']:.3f}, probabilistic {p['probabilistic/acceptance_length']:.3f} "
            f"(greedy oracle {p['oracle_greedy/acceptance_length']:.3f})"
        )
    print(
        f"wrote {s['out']} (vLLM eagle3: config.json, model.safetensors; draft_trainer.pt; {SUMMARY_FILE}; "
        "acceptance_curves.png)"
    )
    return 0
