"""A recipe's own speculative engine against autoregressive decoding (issue 35 item 4): the rollout phase and a
running-batch sweep, ``python examples/bench_spec_schedule.py --config RECIPE --out FILE.json``.

Two engines in one fresh process, both :class:`~nemo_rl_spec.models.generation.vllm_worker.VllmGenerationWorker`
(the rollout path) in the recipe's engine dtype and threads: the recipe's speculative engine exactly as the GRPO loop
builds it (``speculative_config``, the draft in ``policy.draft.model_name``, ``dynamic_speculation`` with its
``step_costs`` resolved as the loop resolves them, e.g. ``auto`` -> this machine's calibration entry), and the same
engine without speculation: the *batch-aware autoregressive baseline* (vLLM's continuous batching at the same
admission limit, so both run the same running batch at every step).

Measured, every pair interleaved and its order alternated:

- **Rollout phase**: the GRPO rollout call ``generate(P prompts, n=G)`` (the recipe's P x G rows, temperature and
  ``max_new_tokens``, natural lengths) on ``--groups`` prompt groups from the end of the training set, the same
  prompts and seed for both engines. ``speedup`` = AR seconds / speculative seconds, per group and over all groups
  (total over total). Also: each engine's seconds by running batch size (where a rollout spends its time) and the
  response lengths.
- **Running-batch sweep**: at each b in ``--batches`` (default 1-64), b requests of ``--sweep-tokens`` tokens with
  ``ignore_eos`` and at most b running, so the running batch is b for the whole run; tokens/s of each engine,
  ``--sweep-repeats`` interleaved pairs, speedup = the median over pairs of spec tokens/s / AR tokens/s, with the
  k the schedule gives at b and the acceptance length.

CPU numbers from this machine; nothing here is a GPU result (``meta.device``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from nemo_rl_spec.bench.engine_steps import build_worker, run_requests, time_rollout
from nemo_rl_spec.data.prompts import format_prompt
from nemo_rl_spec.models.generation.vllm_worker import derive_row_seeds
from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.speculative import calibration as cal
from nemo_rl_spec.speculative.adaptive_k import k_for_batch_size
from nemo_rl_spec.testing import checks
from nemo_rl_spec.utils.config import ConfigError, load_config

DEFAULT_RECIPE = "configs/grpo_math_smollm2_135m_longtail_spec.yaml"
DEFAULT_BATCHES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The options above; the rest of the command line are the recipe's ``key=value`` overrides."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--config", default=DEFAULT_RECIPE, help=f"speculative recipe (default {DEFAULT_RECIPE})")
    p.add_argument("--groups", type=int, default=4, help="rollout-phase prompt groups (default 4)")
    p.add_argument("--batches", type=int, nargs="*", default=list(DEFAULT_BATCHES), help="sweep's running batches")
    p.add_argument("--sweep-tokens", type=int, default=32, help="tokens per request in the sweep (default 32)")
    p.add_argument("--sweep-repeats", type=int, default=3, help="interleaved pairs per sweep point (default 3)")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_known_args(argv)


def _pair_order(i: int) -> tuple[str, str]:
    """Engine order of the i-th interleaved pair: AR first on even pairs, speculative first on odd ones."""
    return ("ar", "spec") if i % 2 == 0 else ("spec", "ar")


def measure(opts: dict[str, Any]) -> dict[str, Any]:
    """The rollout phase and the sweep (run in a fresh process, see :func:`main`).

    Args:
        opts: ``gen_cfg`` (``policy.generation`` dict with ``step_costs`` resolved), ``model_path``, ``precision``,
            ``spec`` (the engine's ``speculative_config`` dict, ``model`` set), ``groups`` (lists of P prompts as
            token ids), ``generations`` (G), ``prompts`` (at least max(batches)), ``batches``, ``sweep_tokens``,
            ``sweep_repeats``, ``temperature``, ``seed``.

    Returns:
        ``{"schedule", "rollouts": [{"ar": ..., "spec": ..., "order"}], "sweep": {b: {...}}, "seconds"}``.

    Raises:
        RuntimeError: the speculative engine has no batch-size schedule (the recipe's dynamic_speculation is off).
    """
    t0 = time.perf_counter()
    gen_cfg, path, seed, prec = opts["gen_cfg"], opts["model_path"], opts["seed"], opts["precision"]
    engines = {
        "ar": build_worker(gen_cfg, path, seed, None, None, precision=prec),
        "spec": build_worker(gen_cfg, path, seed, opts["spec"], gen_cfg["dynamic_speculation"], precision=prec),
    }
    try:
        sched = engines["spec"].llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens_per_batch_size
        if not sched:
            raise RuntimeError("the speculative engine has no batch-size schedule (dynamic_speculation is off)")
        schedule = [list(x) for x in sched]
        for name in _pair_order(0):  # warm-up: first calls pay one-off costs
            run_requests(engines[name], opts["prompts"][:2], [seed, seed + 1], opts["temperature"], 8)
        rollouts = []
        for g, group in enumerate(opts["groups"]):
            order = _pair_order(g)
            pair = {n: time_rollout(engines[n], group, opts["generations"], seed + 1000 + g) for n in order}
            rollouts.append({**pair, "order": list(order)})
        sweep = {b: _sweep_point(engines, opts, b, schedule) for b in opts["batches"]}
    finally:
        for w in engines.values():
            w.shutdown()
    return {"schedule": schedule, "rollouts": rollouts, "sweep": sweep, "seconds": time.perf_counter() - t0}


def _sweep_point(engines: dict, opts: dict[str, Any], b: int, schedule: list[list[int]]) -> dict[str, Any]:
    """``--sweep-repeats`` interleaved AR / speculative runs at constant running batch ``b``."""
    runs: dict[str, list[dict[str, float]]] = {"ar": [], "spec": []}
    for i in range(opts["sweep_repeats"]):
        seeds = derive_row_seeds(opts["seed"] + 97 * b + i, b)
        for name in _pair_order(i):
            res = run_requests(
                engines[name],
                opts["prompts"][:b],
                seeds,
                opts["temperature"],
                opts["sweep_tokens"],
                cap=b,
                ignore_eos=True,
                logprobs=0,
            )
            runs[name].append(
                {"tokens_per_s": res["tokens"] / res["seconds"], "acceptance_length": res["counters"].acceptance_length}
            )
    ratios = [s["tokens_per_s"] / a["tokens_per_s"] for a, s in zip(runs["ar"], runs["spec"])]
    return {
        "k": k_for_batch_size(schedule, b),
        "speedup": statistics.median(ratios),
        "speedup_runs": ratios,
        "ar_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs["ar"]),
        "spec_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs["spec"]),
        "acceptance_length": statistics.median(r["acceptance_length"] for r in runs["spec"]),
    }


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Rollout-phase ratios (per group, total AR seconds / total speculative seconds) and the sweep's minimum.

    Returns:
        ``rollout_phase_speedup``, ``rollout_speedups`` (per group), ``ar_seconds`` / ``spec_seconds`` (per group),
        ``acceptance_length`` (per group), ``ar_share_at_drafting_batches`` (share of the AR rollout's engine-step
        time at running batches where the schedule gives k > 0), ``sweep_min_speedup`` and its batch.
    """
    sched, rolls = res["schedule"], res["rollouts"]
    ar_s = [r["ar"]["seconds"] for r in rolls]
    sp_s = [r["spec"]["seconds"] for r in rolls]
    drafting = [
        sum(s for b, s in r["ar"]["seconds_by_batch"].items() if k_for_batch_size(sched, int(b)) > 0)
        / sum(r["ar"]["seconds_by_batch"].values())
        for r in rolls
    ]
    sweep = res["sweep"]
    worst = min(sweep, key=lambda b: sweep[b]["speedup"]) if sweep else None
    return {
        "rollout_phase_speedup": sum(ar_s) / sum(sp_s),
        "rollout_speedups": [a / s for a, s in zip(ar_s, sp_s)],
        "ar_seconds": ar_s,
        "spec_seconds": sp_s,
        "acceptance_length": [r["spec"]["acceptance_length"] for r in rolls],
        "ar_share_at_drafting_batches": drafting,
        "sweep_min_speedup": sweep[worst]["speedup"] if worst is not None else None,
        "sweep_min_batch": worst,
    }


def format_tables(res: dict[str, Any]) -> str:
    """Markdown: the rollout phase per group, then the sweep."""
    s = res["summary"]
    lines = [
        f"schedule [first, last, k]: {res['schedule']}",
        "| group | AR s | spec s | speedup | acceptance length | AR time at drafting batches | AR tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for g, r in enumerate(res["rollouts"]):
        lines.append(
            f"| {g} | {r['ar']['seconds']:.1f} | {r['spec']['seconds']:.1f} | {s['rollout_speedups'][g]:.3f} | "
            f"{r['spec']['acceptance_length']:.2f} | {s['ar_share_at_drafting_batches'][g]:.0%} | "
            f"{r['ar']['tokens']} |"
        )
    lines += [
        f"rollout phase: {s['rollout_phase_speedup']:.3f}x (total AR seconds / total speculative seconds)",
        "",
        "| running batch | k | AR tok/s | spec tok/s | speedup (median) | per pair | acceptance length |",
        "|---|---|---|---|---|---|---|",
    ]
    for b, p in res["sweep"].items():
        lines.append(
            f"| {b} | {p['k']} | {p['ar_tokens_per_s']:.1f} | {p['spec_tokens_per_s']:.1f} | {p['speedup']:.3f} | "
            + " ".join(f"{x:.3f}" for x in p["speedup_runs"])
            + f" | {p['acceptance_length']:.2f} |"
        )
    if s["sweep_min_batch"] is not None:
        lines.append(f"sweep minimum: {s['sweep_min_speedup']:.3f}x at b = {s['sweep_min_batch']}")
    return "\n".join(lines)


def _opts(args: argparse.Namespace, cfg, model_path: str) -> dict[str, Any]:
    """The measurement's inputs from the recipe: prompts from the end of the training set, the engine config."""
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    from nemo_rl_spec.algorithms.grpo_setup import load_datasets  # lazy: grpo_setup imports ray

    G, P = cfg.grpo.num_generations_per_prompt, cfg.grpo.num_prompts_per_step
    tok = AutoTokenizer.from_pretrained(model_path)
    train, _ = load_datasets(cfg)
    n = max(P * args.groups, max(args.batches, default=1))
    kw = cfg.policy.tokenizer.chat_template_kwargs
    pool = [format_prompt(tok, cfg.data.system_prompt, p["question"], **kw) for p in train[::-1][:n]]
    if len(pool) < n:
        raise ConfigError(f"data.train.size={len(train)} < {n} prompts needed (--groups x P, the largest --batches)")
    gen_cfg = cfg.policy.generation.model_dump()
    spec = dict(gen_cfg["vllm_kwargs"]["speculative_config"])
    spec.setdefault("model", cfg.policy.draft.model_name if cfg.policy.draft is not None else None)
    if not spec.get("model") or not (Path(spec["model"]) / "config.json").is_file():
        raise ConfigError(f"policy.draft.model_name={spec.get('model')}: no draft there (make it: see the recipe)")
    gen_cfg["dynamic_speculation"]["max_batch_size"] = max(
        gen_cfg["dynamic_speculation"]["max_batch_size"], max(args.batches, default=1)
    )
    return {
        "gen_cfg": gen_cfg,
        "model_path": model_path,
        "precision": cfg.policy.engine_precision,
        "spec": spec,
        "groups": [pool[g * P : (g + 1) * P] for g in range(args.groups)],
        "generations": G,
        "prompts": pool,
        "batches": list(args.batches),
        "sweep_tokens": args.sweep_tokens,
        "sweep_repeats": args.sweep_repeats,
        "temperature": cfg.policy.generation.temperature,
        "seed": args.seed,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0, or 2 on a bad recipe, override, option or missing draft / calibration entry."""
    args, overrides = parse_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        if cfg.policy.generation.speculative_config is None or cfg.policy.generation.dynamic_speculation is None:
            raise ConfigError(f"{args.config}: needs speculative_config and dynamic_speculation (a speculative recipe)")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        model_path = resolve_model(cfg.policy.model_name)
        step_costs = cal.resolve_step_costs(cfg, model_path)
        opts = _opts(args, cfg, model_path)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    threads = int(opts["gen_cfg"]["vllm_cfg"]["num_threads"])
    res = checks.run_isolated(measure, opts, threads=threads)
    res["summary"] = summarize(res)
    res["meta"] = {
        "command": shlex.join(["python", "examples/bench_spec_schedule.py", *(sys.argv[1:] if argv is None else argv)]),
        "config": args.config,
        "overrides": list(overrides),
        "draft": opts["spec"]["model"],
        "step_costs": step_costs,
        "engine_dtype": opts["precision"],
        "num_threads": threads,
        "rollout_rows": cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt,
        "max_new_tokens": cfg.policy.generation.max_new_tokens,
        "temperature": cfg.policy.generation.temperature,
        "device": "CPU (this machine); not a GPU result",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=float) + "\n")
    print(format_tables(res))
    print(f"wrote {out} ({res['seconds']:.0f} s)")
    return 0
