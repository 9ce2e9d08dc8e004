"""Calibrate the batch-size-aware speculation schedule for this machine, engine dtype and model:
``python examples/calibrate_spec_schedule.py --config RECIPE [key=value ...]``.

Measures, in one fresh process (the recipe's engine threads and dtype), the step costs
:func:`~nemo_rl_spec.speculative.adaptive_k.derive_schedule` needs: one plain decode step and one speculative step
at each candidate k (1..``num_speculative_tokens``; ``--ks``) at constant running batch sizes (``--batches``,
default 1 2 4 8 16 32), with :func:`~nemo_rl_spec.bench.engine_steps.profile_components` (the rollout benchmark's
measurement: engines interleaved over ``--repeats``, the median step of each run, the smallest over the repeats).
The drafter has the recipe's draft shape and its ``lm_head`` zeroed, so it is never accepted and every step
verifies k drafts per request: the cost of a step, whatever the draft's quality (its acceptance is
``dynamic_speculation.acceptance_rate``). The entry goes to the user cache or, with ``--shipped``, to
``configs/spec_step_costs/``, under the recipe's calibration key; ``step_costs: auto`` then finds it.
``--show-key`` prints the key and where an entry exists, without measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nemo_rl_spec.bench.engine_steps import (
    build_worker,
    never_matching_copy,
    never_matching_fresh_draft,
    profile_components,
)
from nemo_rl_spec.data.prompts import format_prompt
from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.speculative import calibration as cal
from nemo_rl_spec.speculative.adaptive_k import derive_schedule
from nemo_rl_spec.testing import checks
from nemo_rl_spec.utils.config import ConfigError, load_config
from nemo_rl_spec.utils.machine import machine_info

DEFAULT_RECIPE = "configs/grpo_math_smollm2_135m_spec.yaml"
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The options above; the rest of the command line are the recipe's ``key=value`` overrides."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=DEFAULT_RECIPE, help=f"recipe (default {DEFAULT_RECIPE})")
    p.add_argument("--ks", type=int, nargs="+", default=None, help="draft lengths (default 1..num_speculative_tokens)")
    p.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES), help="running batch sizes")
    p.add_argument("--step-tokens", type=int, default=12, help="decode steps per run (default 12)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats; the quietest counts (default 2)")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft dir whose shape to measure (default: the recipe's)")
    p.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="without a draft dir: rows of the stand-in head's output layer (default: the full vocabulary)",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--table", default=None, help="table directory to write (default: the user cache)")
    where.add_argument("--shipped", action="store_true", help=f"write into {cal.SHIPPED_TABLE_DIR}")
    p.add_argument("--show-key", action="store_true", help="print the key and any entry for it; measure nothing")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_known_args(argv)


def measure(opts: dict[str, Any]) -> dict[str, Any]:
    """Step costs of an autoregressive engine and one EAGLE engine per k (run in a fresh process, see :func:`main`).

    Args:
        opts: ``gen_cfg`` (``policy.generation`` dict), ``model_path``, ``precision``, ``draft_dir`` (None: a
            stand-in with ``draft_vocab_size`` rows), ``method``, ``draft_sample_method``, ``ks``, ``batches``,
            ``prompts`` (token ids, at least max(batches)), ``temperature``, ``step_cost_tokens``,
            ``step_cost_repeats``, ``seed``.

    Returns:
        ``{"runs": {engine: {b: [run summary]}}, "ks": {engine: k}, "seconds": float}`` (seconds per step in the
        summaries, :func:`profile_components`).
    """
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="spec_calibration_draft_")
    if opts["draft_dir"] is not None:
        draft = never_matching_copy(opts["draft_dir"], tmp)
    else:
        draft = never_matching_fresh_draft(opts["model_path"], tmp, opts["draft_vocab_size"])
    engines: dict[str, dict | None] = {"ar": None}
    for k in opts["ks"]:
        engines[f"k{k}"] = {
            "method": opts["method"],
            "model": draft,
            "num_speculative_tokens": k,
            "draft_sample_method": opts["draft_sample_method"],
        }
    workers = {
        name: build_worker(opts["gen_cfg"], opts["model_path"], opts["seed"], spec, None, precision=opts["precision"])
        for name, spec in engines.items()
    }
    ks = {"ar": 0} | {f"k{k}": k for k in opts["ks"]}
    try:
        runs, _ = profile_components(workers, ks, opts | {"logprobs": 0})
    finally:
        for w in workers.values():
            w.shutdown()
    return {"runs": runs, "ks": ks, "seconds": time.perf_counter() - t0}


def format_costs(step_costs: dict[str, Any]) -> str:
    """Markdown table: ms per step by batch, autoregressive and each k, and each k's step over the AR step."""
    ar, spec = step_costs["ar_step_s"], step_costs["spec_step_s"]
    ks = sorted(spec)
    lines = [
        "| batch | AR ms | " + " | ".join(f"k = {k} ms (x AR)" for k in ks) + " |",
        "|" + "---|" * (len(ks) + 2),
    ]
    for b in sorted(ar):
        cells = [f"{1e3 * spec[k][b]:.1f} ({spec[k][b] / ar[b]:.2f})" for k in ks]
        lines.append(f"| {b} | {1e3 * ar[b]:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _prompts(cfg, model_path: str, n: int) -> list[list[int]]:
    """``n`` chat-formatted prompts (token ids) from the end of the recipe's training set, as the benchmark takes."""
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    from nemo_rl_spec.algorithms.grpo_setup import load_datasets  # lazy: grpo_setup imports ray

    tok = AutoTokenizer.from_pretrained(model_path)
    train, _ = load_datasets(cfg)
    kw = cfg.policy.tokenizer.chat_template_kwargs
    pool = [format_prompt(tok, cfg.data.system_prompt, p["question"], **kw) for p in train[::-1][:n]]
    if len(pool) < n:
        raise ConfigError(f"data.train.size={len(train)} < {n} prompts needed (the largest --batches)")
    return pool


def main(argv: list[str] | None = None) -> int:
    """Calibrate (or ``--show-key``); 0, or 2 on a bad recipe, override or option."""
    args, overrides = parse_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        spec = cfg.policy.generation.speculative_config
        if spec is None:
            raise ConfigError(f"{args.config}: no policy.generation.vllm_kwargs.speculative_config to calibrate")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        model_path = resolve_model(cfg.policy.model_name)
        draft_dir = args.draft
        if draft_dir is None and cal.recipe_draft_config(cfg) is not None:
            d = cfg.policy.draft
            draft_dir = d.model_name if d is not None and d.enabled else spec.model
        if draft_dir is not None:
            if not (Path(draft_dir) / "config.json").is_file():
                raise ConfigError(f"--draft {draft_dir}: no config.json there")
            draft_config = json.loads((Path(draft_dir) / "config.json").read_text())
        else:
            vocab = cal.target_identity(json.loads((Path(model_path) / "config.json").read_text()))["vocab_size"]
            draft_config = {"vocab_size": vocab, "draft_vocab_size": args.draft_vocab_size or vocab}
        key = cal.recipe_key(cfg, model_path, draft_config)
        ks = sorted(set(args.ks or key["draft"]["ks"]))
        if ks != key["draft"]["ks"]:
            key = {**key, "draft": {**key["draft"], "ks": ks}}
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    digest = cal.key_digest(key)
    found = cal.find_entry(key)
    print(f"calibration key {digest}: {json.dumps(key, sort_keys=True)}")
    print(f"entry: {found if found is not None else 'none in ' + ', '.join(map(str, cal.table_dirs()))}")
    if args.show_key:
        return 0
    gen_cfg = cfg.policy.generation.model_dump()
    prompts = _prompts(cfg, model_path, max(args.batches))
    gen_cfg["vllm_cfg"]["max_model_len"] = max(
        gen_cfg["vllm_cfg"]["max_model_len"], max(len(p) for p in prompts) + args.step_tokens + max(ks) + 8
    )
    threads = int(gen_cfg["vllm_cfg"]["num_threads"])
    opts = {
        "gen_cfg": gen_cfg,
        "model_path": model_path,
        "precision": cfg.policy.engine_precision,
        "draft_dir": draft_dir,
        "draft_vocab_size": draft_config["draft_vocab_size"] if draft_dir is None else None,
        "method": spec.method,
        "draft_sample_method": key["draft"]["draft_sample_method"],
        "ks": ks,
        "batches": sorted(args.batches),
        "prompts": prompts,
        "temperature": cfg.policy.generation.temperature,
        "step_cost_tokens": args.step_tokens,
        "step_cost_repeats": args.repeats,
        "seed": args.seed,
    }
    res = checks.run_isolated(measure, opts, threads=threads)
    step_costs = cal.step_costs_from_runs(res["runs"], res["ks"])
    command = shlex.join(["python", "examples/calibrate_spec_schedule.py", *(sys.argv[1:] if argv is None else argv)])
    meta = cal.entry_meta(
        command,
        recipe=args.config,
        overrides=list(overrides),
        draft=draft_dir or f"stand-in EAGLE-3 head, {draft_config['draft_vocab_size']} rows, zero lm_head",
        batches=opts["batches"],
        step_tokens=args.step_tokens,
        repeats=args.repeats,
        seconds=res["seconds"],
        step_s_runs={n: {b: [r["step"] for r in rs] for b, rs in by_b.items()} for n, by_b in res["runs"].items()},
        machine=machine_info(),
    )
    table = Path(args.table) if args.table else cal.SHIPPED_TABLE_DIR if args.shipped else cal.user_table_dir()
    path = cal.write_entry(table, key, step_costs, meta)
    print(format_costs(step_costs))
    dyn = cfg.policy.generation.dynamic_speculation
    if dyn is not None and dyn.acceptance_rate is not None:
        schedule = derive_schedule(
            step_costs["ar_step_s"],
            step_costs["spec_step_s"],
            dyn.acceptance_rate,
            dyn.max_batch_size,
            dyn.min_speedup,
            spec.num_speculative_tokens,
        )
        print(f"schedule [first, last, k] at acceptance_rate {dyn.acceptance_rate}: {[list(r) for r in schedule]}")
    print(f"wrote {path} ({res['seconds']:.0f} s)")
    return 0
