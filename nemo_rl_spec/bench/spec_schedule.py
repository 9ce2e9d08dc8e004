"""A recipe's own speculative engine against autoregressive decoding: the rollout phase and a running-batch sweep,
``python examples/bench_spec_schedule.py --config RECIPE --out FILE.json``.

Two engines in one fresh process, both :class:`~nemo_rl_spec.models.generation.vllm_worker.VllmGenerationWorker`
in the recipe's engine dtype and threads: the recipe's speculative engine exactly as the GRPO loop builds it
(``dynamic_speculation`` with its ``step_costs`` resolved as the loop resolves them), and the same engine without
speculation: the *batch-aware autoregressive baseline* (the same admission limit, so both run the same running
batch at every step). Every pair is interleaved, its order alternated. Measured: the GRPO rollout call on
``--groups`` prompt groups from the end of the training set (``speedup`` = AR seconds / speculative seconds, per
group and in total) and a sweep over running batch sizes ``--batches`` (tokens/s ratios, the k the schedule gives
at each b, the acceptance length, and ``sweep_k0_pooled``: the engine's k = 0 cost over every k = 0 point).
Options: ``--variant KEY=VALUE ...`` (a second speculative engine with changed ``dynamic_speculation`` keys),
``--matched-lengths`` (AR re-run at each engine's sampled lengths, :func:`~nemo_rl_spec.bench.engine_steps.
time_matched_rollout`), ``--ar-control`` (a second AR engine: this machine's noise floor). CPU numbers from this
machine; nothing here is a GPU result (``meta.device``).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from nemo_rl_spec.bench.engine_steps import build_worker, run_requests, time_matched_rollout, time_rollout
from nemo_rl_spec.data.prompts import format_prompt
from nemo_rl_spec.models.generation.vllm_worker import derive_row_seeds
from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.speculative import calibration as cal
from nemo_rl_spec.speculative.adaptive_k import k_for_batch_size
from nemo_rl_spec.testing import checks
from nemo_rl_spec.utils.bench_runs import bootstrap_interval
from nemo_rl_spec.utils.config import ConfigError, load_config
from nemo_rl_spec.utils.machine import write_bench_json

DEFAULT_RECIPE = "configs/grpo_math_smollm2_135m_longtail_spec.yaml"
DEFAULT_BATCHES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
AR_CONTROL = "ar_control"


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The options above; the rest of the command line are the recipe's ``key=value`` overrides."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="result JSON")
    p.add_argument("--config", default=DEFAULT_RECIPE, help=f"speculative recipe (default {DEFAULT_RECIPE})")
    p.add_argument("--groups", type=int, default=4, help="rollout-phase prompt groups (default 4)")
    p.add_argument("--batches", type=int, nargs="*", default=list(DEFAULT_BATCHES), help="sweep's running batches")
    p.add_argument("--sweep-tokens", type=int, default=32, help="tokens per request in the sweep (default 32)")
    p.add_argument("--sweep-repeats", type=int, default=3, help="interleaved pairs per sweep point (default 3)")
    p.add_argument(
        "--variant",
        nargs="+",
        default=None,
        metavar="KEY=VALUE",
        help="a second speculative engine: the recipe's with these dynamic_speculation keys changed",
    )
    p.add_argument(
        "--matched-lengths",
        action="store_true",
        help="also run AR on every group held to each engine's sampled row lengths (the tails' length difference "
        "removed from the ratio)",
    )
    p.add_argument(
        "--ar-control",
        action="store_true",
        help="also measure a second autoregressive engine against the first (the noise floor of every ratio)",
    )
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_known_args(argv)


def _order(names: list[str], i: int) -> list[str]:
    """Engine order of the i-th interleaved run: ``names`` rotated by i (AR first, then second, ...)."""
    j = i % len(names)
    return names[j:] + names[:j]


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
    engines = {"ar": build_worker(gen_cfg, path, seed, None, None, precision=prec)}
    for name, dynamic in opts["dynamic"].items():
        engines[name] = build_worker(gen_cfg, path, seed, opts["spec"], dynamic, precision=prec)
    if opts.get("ar_control"):
        engines[AR_CONTROL] = build_worker(gen_cfg, path, seed, None, None, precision=prec)
    names = list(engines)
    try:
        sched = engines["spec"].llm.llm_engine.vllm_config.speculative_config.num_speculative_tokens_per_batch_size
        if not sched:
            raise RuntimeError("the speculative engine has no batch-size schedule (dynamic_speculation is off)")
        schedule = [list(x) for x in sched]
        for name in names:  # warm-up: first calls pay one-off costs
            run_requests(engines[name], opts["prompts"][:2], [seed, seed + 1], opts["temperature"], 8)
        rollouts = []
        for g, group in enumerate(opts["groups"]):
            order = _order(names, g)
            runs = {n: time_rollout(engines[n], group, opts["generations"], seed + 1000 + g) for n in order}
            if opts.get("matched_lengths"):
                T, G = opts["temperature"], opts["generations"]
                runs["matched"] = {
                    n: time_matched_rollout(engines["ar"], group, G, seed + 1000 + g, T, runs[n]["response_tokens"])
                    for n in names
                }
            rollouts.append({**runs, "order": order})
        sweep = {b: _sweep_point(engines, opts, b, schedule) for b in opts["batches"]}
    finally:
        for w in engines.values():
            w.shutdown()
    return {"schedule": schedule, "rollouts": rollouts, "sweep": sweep, "seconds": time.perf_counter() - t0}


def _sweep_point(engines: dict, opts: dict[str, Any], b: int, schedule: list[list[int]]) -> dict[str, Any]:
    """``--sweep-repeats`` interleaved runs of every engine at constant running batch ``b``; per speculative
    engine the median over repeats of its tokens/s over the AR run's of the same repeat."""
    names = list(engines)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for i in range(opts["sweep_repeats"]):
        seeds = derive_row_seeds(opts["seed"] + 97 * b + i, b)
        for name in _order(names, i):
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
    point: dict[str, Any] = {
        "k": k_for_batch_size(schedule, b),
        "ar_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs["ar"]),
    }
    for name in names[1:]:
        ratios = [s["tokens_per_s"] / a["tokens_per_s"] for a, s in zip(runs["ar"], runs[name])]
        point[name] = {
            "speedup": statistics.median(ratios),
            "speedup_runs": ratios,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs[name]),
            "acceptance_length": statistics.median(r["acceptance_length"] for r in runs[name]),
        }
    return point


def spec_names(res: dict[str, Any]) -> list[str]:
    """The engines compared with AR, in measurement order (``spec``, then ``variant`` and ``ar_control`` if any)."""
    return [n for n in res["rollouts"][0] if n not in ("ar", "order", "matched")]


def pooled_k0(sweep: dict, name: str) -> dict[str, Any] | None:
    """Geometric mean of ``name``'s per-repeat tokens/s ratios to AR over every sweep point where the schedule gives
    k = 0, with a 90% percentile-bootstrap interval of it (resampling the ratios' logs; the repeats of one point
    are treated as independent, which they are up to the machine's drift). None without such a point.

    Returns:
        ``{"geomean", "interval90": (low, high) or None, "n": number of ratios}``.
    """
    logs = [math.log(x) for p in sweep.values() if p["k"] == 0 for x in p[name]["speedup_runs"]]
    if not logs:
        return None
    ci = bootstrap_interval(logs)
    return {
        "geomean": math.exp(statistics.fmean(logs)),
        "interval90": None if ci is None else (math.exp(ci[0]), math.exp(ci[1])),
        "n": len(logs),
    }


def amdahl_bound(
    ar_seconds: list[float], drafting_shares: list[float], acceptance_lengths: list[float | None]
) -> float:
    """Upper bound of a rollout phase's speedup over AR when only the drafting batches can gain (Amdahl's law per
    group): ``sum_g a_g / sum_g a_g * ((1 - f_g) + f_g / L_g)``.

    It assumes the best case for speculation: steps at k = 0 cost what AR steps cost, and a drafting step costs no
    more than an AR step at the same running batch (drafting and verification free) while it emits ``L_g`` tokens per
    request, so AR's time at drafting batches shrinks by ``L_g`` at most. Approximations: ``f_g`` is a share of AR's
    engine-step time applied to its wall seconds (their ratio was 0.985-0.989 in the saved runs); one ``L_g`` serves
    every drafting batch size of the group; the drafting batches are those of the static schedule (a live or dynamic
    schedule may draft elsewhere). A measured phase above the bound means the engines' rows differed in length
    (compare against ``matched_amdahl_bound``) or run-to-run noise (about 0.1 on one rollout phase here).

    Args:
        ar_seconds: [G] AR seconds of each group's rollout (``a_g``).
        drafting_shares: [G] share of that time at running batches where the schedule drafts (``f_g``, in [0, 1]).
        acceptance_lengths: [G] the speculative engine's measured tokens per verification step in that group
            (``L_g`` >= 1; None: the group never drafted, ``L_g`` = 1).

    Raises:
        ValueError: lists of different lengths, empty, a share outside [0, 1] or an acceptance length below 1.
    """
    if not ar_seconds or not len(ar_seconds) == len(drafting_shares) == len(acceptance_lengths):
        raise ValueError("amdahl_bound: ar_seconds, drafting_shares and acceptance_lengths need one entry per group")
    bounded = 0.0
    for a, f, acc in zip(ar_seconds, drafting_shares, acceptance_lengths):
        length = 1.0 if acc is None or math.isnan(acc) else float(acc)
        if not 0.0 <= f <= 1.0 or length < 1.0:
            raise ValueError(f"amdahl_bound: share {f} (expected [0, 1]) or acceptance length {acc} (expected >= 1)")
        bounded += a * ((1.0 - f) + f / length)
    return sum(ar_seconds) / bounded


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Per compared engine: rollout-phase ratios (per group, and total AR seconds / total seconds), the sweep's
    minimum and its pooled k = 0 ratio (:func:`pooled_k0`); and the share of the AR rollouts' engine-step time at
    running batches where the schedule drafts.

    Returns:
        ``{"ar_seconds": [per group], "ar_share_at_drafting_batches": [per group], NAME: {"rollout_phase_speedup",
        "rollout_speedups", "seconds", "acceptance_length" (per group), "amdahl_bound" (:func:`amdahl_bound`: the
        most the phase could gain at these shares and acceptance lengths), "sweep_min_speedup", "sweep_min_batch",
        "sweep_k0_pooled"; with ``--matched-lengths`` also "matched_phase_speedup", "matched_speedups" (AR held to
        NAME's row lengths over NAME's seconds) and "matched_amdahl_bound" (the bound from that held AR run)},
        "ar_held_over_natural" (with ``--matched-lengths``)}``.
    """
    sched, rolls, sweep = res["schedule"], res["rollouts"], res["sweep"]
    ar_s = [r["ar"]["seconds"] for r in rolls]

    def drafting_share(run: dict[str, Any]) -> float:
        by_batch = run["seconds_by_batch"]
        return sum(s for b, s in by_batch.items() if k_for_batch_size(sched, int(b)) > 0) / sum(by_batch.values())

    out: dict[str, Any] = {"ar_seconds": ar_s, "ar_share_at_drafting_batches": [drafting_share(r["ar"]) for r in rolls]}
    for name in spec_names(res):
        sp_s = [r[name]["seconds"] for r in rolls]
        accs = [r[name]["acceptance_length"] for r in rolls]
        worst = min(sweep, key=lambda b: sweep[b][name]["speedup"]) if sweep else None
        out[name] = {
            "rollout_phase_speedup": sum(ar_s) / sum(sp_s),
            "rollout_speedups": [x / y for x, y in zip(ar_s, sp_s)],
            "seconds": sp_s,
            "acceptance_length": accs,
            "amdahl_bound": amdahl_bound(ar_s, out["ar_share_at_drafting_batches"], accs) if rolls else None,
            "sweep_min_speedup": sweep[worst][name]["speedup"] if worst is not None else None,
            "sweep_min_batch": worst,
            "sweep_k0_pooled": pooled_k0(sweep, name) if sweep else None,
        }
        if all("matched" in r for r in rolls):
            m_ar = [r["matched"][name]["seconds"] for r in rolls]  # AR held to this engine's row lengths
            out[name]["matched_phase_speedup"] = sum(m_ar) / sum(sp_s)
            out[name]["matched_speedups"] = [x / y for x, y in zip(m_ar, sp_s)]
            m_share = [drafting_share(r["matched"][name]) for r in rolls]
            out[name]["matched_amdahl_bound"] = amdahl_bound(m_ar, m_share, accs)
    if rolls and all("matched" in r for r in rolls):
        out["ar_held_over_natural"] = sum(r["matched"]["ar"]["seconds"] for r in rolls) / sum(ar_s)
    return out


def format_tables(res: dict[str, Any]) -> str:
    """Markdown: the rollout phase per group, then the sweep, one column group per speculative engine."""
    s, names = res["summary"], spec_names(res)
    lines = [f"schedule [first, last, k]: {res['schedule']}; engines: {', '.join(names)}"]
    head = "| group | AR s | AR tokens | AR time at drafting batches | "
    head += " | ".join(f"{n} s | {n} speedup | {n} acc. length" for n in names)
    lines += [head + " |", "|" + "---|" * (4 + 3 * len(names))]
    for g, r in enumerate(res["rollouts"]):
        cells = [
            f"{g}",
            f"{r['ar']['seconds']:.1f}",
            f"{r['ar']['tokens']}",
            f"{s['ar_share_at_drafting_batches'][g]:.0%}",
        ]
        for n in names:
            cells += [
                f"{r[n]['seconds']:.1f}",
                f"{s[n]['rollout_speedups'][g]:.3f}",
                _acc(r[n]["acceptance_length"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    for n in names:
        lines.append(f"rollout phase, {n}: {s[n]['rollout_phase_speedup']:.3f}x (total AR seconds / total seconds)")
        if s[n].get("amdahl_bound") is not None:
            lines.append(
                f"bound, {n}: {s[n]['amdahl_bound']:.3f}x if drafting and verification were free (amdahl_bound)"
            )
        if "matched_phase_speedup" in s[n]:
            per = " ".join(f"{x:.3f}" for x in s[n]["matched_speedups"])
            lines.append(f"rollout phase, AR held to {n}'s row lengths: {s[n]['matched_phase_speedup']:.3f}x ({per})")
    if "ar_held_over_natural" in s:
        lines.append(f"check: AR held to its own lengths / AR natural: {s['ar_held_over_natural']:.3f}")
    lines += [
        "",
        "| running batch | k | AR tok/s | "
        + " | ".join(f"{n} tok/s | {n} speedup (median) | per repeat | {n} acc. length" for n in names)
        + " |",
        "|" + "---|" * (3 + 4 * len(names)),
    ]
    for b, p in res["sweep"].items():
        cells = [f"{b}", f"{p['k']}", f"{p['ar_tokens_per_s']:.1f}"]
        for n in names:
            q = p[n]
            runs = " ".join(f"{x:.3f}" for x in q["speedup_runs"])
            cells += [f"{q['tokens_per_s']:.1f}", f"{q['speedup']:.3f}", runs, _acc(q["acceptance_length"])]
        lines.append("| " + " | ".join(cells) + " |")
    for n in names:
        if s[n]["sweep_min_batch"] is not None:
            lines.append(f"sweep minimum, {n}: {s[n]['sweep_min_speedup']:.3f}x at b = {s[n]['sweep_min_batch']}")
        pooled = s[n].get("sweep_k0_pooled")
        if pooled is not None:
            ci = pooled["interval90"]
            within = "" if ci is None else f", 90% interval {ci[0]:.3f}-{ci[1]:.3f}"
            lines.append(f"sweep k = 0 pooled, {n}: {pooled['geomean']:.3f}x (geometric mean of {pooled['n']}{within})")
    return "\n".join(lines)


def _acc(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.2f}"


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
    dyn = gen_cfg["dynamic_speculation"]
    dyn["max_batch_size"] = max(dyn["max_batch_size"], max(args.batches, default=1))
    dynamic = {"spec": dyn}
    if args.variant:
        changed = load_config(
            args.config,
            [*args.overrides, *(f"policy.generation.dynamic_speculation.{kv}" for kv in args.variant)],
        ).policy.generation.dynamic_speculation.model_dump()
        dynamic["variant"] = {**changed, "step_costs": dyn["step_costs"], "max_batch_size": dyn["max_batch_size"]}
    return {
        "gen_cfg": gen_cfg,
        "model_path": model_path,
        "precision": cfg.policy.engine_precision,
        "spec": spec,
        "dynamic": dynamic,
        "groups": [pool[g * P : (g + 1) * P] for g in range(args.groups)],
        "generations": G,
        "prompts": pool,
        "batches": list(args.batches),
        "sweep_tokens": args.sweep_tokens,
        "sweep_repeats": args.sweep_repeats,
        "temperature": cfg.policy.generation.temperature,
        "seed": args.seed,
        "ar_control": args.ar_control,
        "matched_lengths": args.matched_lengths,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0, or 2 on a bad recipe, override, option or missing draft / calibration entry."""
    args, overrides = parse_args(argv)
    args.overrides = overrides
    bad = [kv for kv in args.variant or () if "=" not in kv or "." in kv.split("=", 1)[0]]
    if bad:
        print(
            f"error: --variant {bad}: dynamic_speculation KEY=VALUE items only (put the recipe's key=value "
            "overrides before --variant)",
            file=sys.stderr,
        )
        return 2
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
        "variant": args.variant,
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
    write_bench_json(out, res, default=float)
    print(format_tables(res))
    print(f"wrote {out} ({res['seconds']:.0f} s)")
    return 0
