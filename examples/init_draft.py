"""Offline EAGLE-3 draft initialisation: ``python examples/init_draft.py --config RECIPE.yaml --out DIR``.

Samples responses from the recipe's policy (vLLM, the recipe's temperature and max_new_tokens, natural lengths)
on in-domain prompts (the first ``--num-prompts`` problems of the recipe's training set, chat-formatted as the
GRPO loop formats them), trains an EAGLE-3 head on them (transformers model of the policy, soft targets:
:func:`nemo_rl_spec.speculative.offline.train_draft_on_sequences`) and writes ``DIR`` with
``DraftTrainer.save_checkpoint`` (``config.json`` + ``model.safetensors`` in vLLM's eagle3 format, plus
``draft_trainer.pt``) and ``init_draft.json`` (arguments, sampled sequences, metrics). Start GRPO from it with::

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

SUMMARY_FILE = "init_draft.json"
MAX_ROWS_PER_CALL = 16  # keeps each vLLM prefill under its token budget (seeded requests + chunked prefill crash)


class UsageError(ValueError):
    """Bad command-line input; the message names the flag or file."""


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="recipe YAML (as for examples/run_grpo.py)")
    parser.add_argument("--out", required=True, help="output directory of the draft checkpoint")
    parser.add_argument("--num-prompts", type=int, default=64, help="training-set prompts to sample (default 64)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="response cap (default: policy.generation.max_new_tokens)")
    parser.add_argument("--steps", type=int, default=100, help="draft optimizer steps (default 100)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per draft step (default 8)")
    parser.add_argument("--lr", type=float, default=3e-3, help="draft AdamW learning rate (default 3e-3)")
    parser.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll length (default 3)")
    parser.add_argument("--draft-vocab-size", type=int, default=2048,
                        help="reduced draft vocabulary (most frequent response tokens + EOS); 0: full vocabulary")
    parser.add_argument("--seed", type=int, default=None, help="sampling / init seed (default: grpo.seed)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for training (default 1: on this shared 2-core machine 2 threads ran "
                             "up to 30x slower than 1)")
    return parser.parse_known_args(argv)


def validate_args(args: argparse.Namespace) -> None:
    """Raises UsageError naming the first bad flag."""
    for flag, value, low in (("--num-prompts", args.num_prompts, 1), ("--steps", args.steps, 1),
                             ("--batch-size", args.batch_size, 1), ("--ttt-steps", args.ttt_steps, 1),
                             ("--draft-vocab-size", args.draft_vocab_size, 0),
                             ("--max-new-tokens", args.max_new_tokens, 1), ("--threads", args.threads, 1)):
        if value is not None and value < low:
            raise UsageError(f"{flag}={value}: must be >= {low}")
    if not args.lr > 0:
        raise UsageError(f"--lr={args.lr}: must be > 0")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: exists and is not a directory")


def in_domain_prompts(cfg, tokenizer, num_prompts: int) -> list[list[int]]:
    """Chat-formatted token ids of the first ``num_prompts`` training problems (GRPOSetup.prompt_ids' formatting).

    Raises:
        UsageError: the training set has fewer problems.
    """
    from nemo_rl_spec.algorithms.grpo_setup import load_datasets
    from nemo_rl_spec.data.prompts import format_prompt

    train, _ = load_datasets(cfg)
    if num_prompts > len(train):
        raise UsageError(f"--num-prompts={num_prompts}: the recipe's training set (data.train.size) has only "
                         f"{len(train)} problems")
    kwargs = cfg.policy.tokenizer.chat_template_kwargs
    return [format_prompt(tokenizer, cfg.data.system_prompt, p["question"], **kwargs) for p in train[:num_prompts]]


def sample_responses(gen_cfg: dict[str, Any], model_path: str, prompts: list[list[int]], seed: int,
                     max_new_tokens: int) -> dict[str, Any]:
    """Sample one response per prompt with the rollout engine (:class:`VllmGenerationWorker`, no speculation).

    Runs in the calling process (use ``checks.run_isolated`` for a fresh engine process). Rows go in calls of at
    most ``MAX_ROWS_PER_CALL`` prompts, each with seed ``seed + call index``.

    Returns {"responses": list of token-id lists (EOS included when the model stopped), "generate_s": seconds}.
    """
    from nemo_rl_spec.models.generation.vllm_worker import VllmGenerationWorker

    worker = VllmGenerationWorker(gen_cfg, model_path, seed)
    responses: list[list[int]] = []
    start = time.perf_counter()
    try:
        for call, lo in enumerate(range(0, len(prompts), MAX_ROWS_PER_CALL)):
            chunk = prompts[lo:lo + MAX_ROWS_PER_CALL]
            out = worker.generate({"prompt_token_ids": chunk}, n=1, seed=seed + call, max_new_tokens=max_new_tokens)
            for r in range(len(chunk)):
                p, e = int(out["input_lengths"][r]), int(out["unpadded_sequence_lengths"][r])
                responses.append(out["output_ids"][r, p:e].tolist())
    finally:
        worker.shutdown()
    return {"responses": responses, "generate_s": time.perf_counter() - start}


def _eos_ids(tokenizer, hf_config) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(int(i) for i in ids)


def init_draft(args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """The whole command after argument parsing; returns the summary written to ``DIR/init_draft.json``.

    Raises:
        UsageError, ConfigError: bad flags, recipe or overrides.
    """
    import torch

    from nemo_rl_spec.models.hf_assets import resolve_model
    from nemo_rl_spec.speculative import checks
    from nemo_rl_spec.speculative.draft_trainer import DraftTrainer
    from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead, draft_vocab_from_counts
    from nemo_rl_spec.speculative.offline import pad_sequences, train_draft_on_sequences
    from nemo_rl_spec.utils.config import load_config

    validate_args(args)
    cfg = load_config(args.config, overrides)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = resolve_model(cfg.policy.model_name)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = in_domain_prompts(cfg, tokenizer, args.num_prompts)
    seed = cfg.grpo.seed if args.seed is None else args.seed
    gen_cfg = cfg.policy.generation.model_dump()
    gen_cfg["vllm_kwargs"] = {k: v for k, v in gen_cfg["vllm_kwargs"].items() if k != "speculative_config"}
    gen_cfg.pop("speculative_batch_schedule", None)
    max_new = args.max_new_tokens or gen_cfg["max_new_tokens"]
    longest = max(len(p) for p in prompts) + max_new
    if longest > gen_cfg["vllm_cfg"]["max_model_len"]:
        raise UsageError(f"--max-new-tokens={max_new}: the longest prompt ({longest - max_new} tokens) plus the "
                         f"response exceeds policy.generation.vllm_cfg.max_model_len={gen_cfg['vllm_cfg']['max_model_len']}")
    sampled = checks.run_isolated(sample_responses, gen_cfg, model_path, prompts, seed, max_new,
                                  threads=int(gen_cfg["vllm_cfg"]["num_threads"]))
    responses = sampled["responses"]
    sequences = [p + r for p, r in zip(prompts, responses)]
    prompt_lengths = [len(p) for p in prompts]

    torch.set_num_threads(args.threads)
    policy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    draft_cfg = cfg.policy.draft
    aux = draft_cfg.aux_layer_ids if draft_cfg is not None and draft_cfg.aux_layer_ids else None
    vocab = None
    if args.draft_vocab_size and args.draft_vocab_size < policy.config.vocab_size:
        ids, mask = pad_sequences(sequences, prompt_lengths)
        counts = torch.bincount(ids[mask], minlength=policy.config.vocab_size).float()
        vocab = draft_vocab_from_counts(counts, args.draft_vocab_size, _eos_ids(tokenizer, policy.config))
    head = Eagle3DraftHead.from_target(policy, aux_layer_ids=aux, draft_vocab=vocab, seed=seed)
    trainer = DraftTrainer(head, lr=args.lr, ttt_steps=args.ttt_steps)
    t0 = time.perf_counter()
    _, history = train_draft_on_sequences(policy, sequences, prompt_lengths, trainer=trainer, steps=args.steps,
                                          batch_size=args.batch_size, seed=seed, cache_policy_outputs=True)
    train_s = time.perf_counter() - t0
    out = Path(args.out)
    trainer.save_checkpoint(out)

    def window(rows: list[dict[str, float]]) -> dict[str, float]:
        keys = ("train/draft_loss", "train/draft_acc_step0", f"train/draft_acc_step{args.ttt_steps - 1}")
        return {k: sum(r.get(k, float("nan")) for r in rows) / len(rows) for k in keys}

    n = max(1, min(5, len(history) // 4))
    resp_lens = [len(r) for r in responses]
    summary = {
        "config": str(args.config), "overrides": overrides, "model": cfg.policy.model_name, "out": str(out),
        "num_prompts": len(prompts), "seed": seed, "temperature": gen_cfg["temperature"],
        "max_new_tokens": max_new, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
        "ttt_steps": args.ttt_steps, "draft_vocab_size": head.cfg.draft_vocab_size,
        "aux_layer_ids": list(head.cfg.aux_layer_ids),
        "response_tokens_mean": sum(resp_lens) / len(resp_lens), "response_tokens_max": max(resp_lens),
        "generate_s": sampled["generate_s"], "train_s": train_s,
        "start": window(history[:n]), "end": window(history[-n:]),
        "prompt_lengths": prompt_lengths, "sequences": sequences,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    from nemo_rl_spec.utils.config import ConfigError

    args, overrides = parse_args(argv)
    try:
        s = init_draft(args, overrides)
    except (UsageError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    st, en = s["start"], s["end"]
    last = f"train/draft_acc_step{s['ttt_steps'] - 1}"
    print(f"sampled {s['num_prompts']} responses (mean {s['response_tokens_mean']:.0f}, max "
          f"{s['response_tokens_max']} tokens, T={s['temperature']}) in {s['generate_s']:.0f} s; "
          f"trained {s['steps']} steps in {s['train_s']:.0f} s")
    print(f"draft loss {st['train/draft_loss']:.3f} -> {en['train/draft_loss']:.3f}; "
          f"acc step0 {st['train/draft_acc_step0']:.3f} -> {en['train/draft_acc_step0']:.3f}; "
          f"acc step{s['ttt_steps'] - 1} {st[last]:.3f} -> {en[last]:.3f}")
    print(f"wrote {s['out']} (vLLM eagle3: config.json, model.safetensors; draft_trainer.pt; {SUMMARY_FILE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
