"""Projection of measured CPU speculative configurations to GPUs (a simulator projection, not a measurement).

Input: a rollout-benchmark JSON (``examples/bench_spec_rollouts.py --out``): per (k, batch) the measured
acceptance length E and step-cost ratio r = t_spec(b) / t_ar(b) on this CPU. For each hardware preset the
simulator's roofline gives the pass costs of the same target and EAGLE-3 draft shape at the same batch and context::

    r_hw(k, b) = t_verify(k + 1 tokens, b) + k * t_draft(b)  /  t_decode(b)         (generation.spec_pass_cost)
    speedup_hw(k, b) = E_measured(k, b) / r_hw(k, b)                                  (steady state at batch b)

The acceptance is taken as measured (the draft does not change with the hardware); only the costs move. GPU weights
are assumed bf16; the ``cpu`` rows are the simulator's a-priori CPU profile next to the measured r, a check of the
cost model. :func:`derive_schedule` on the projected costs gives each hardware's batch-aware schedule. Input 2
(:func:`project_longtail`): ``bench_spec_schedule`` JSONs of the long-tail recipe, whose rollout phase is rebuilt
per prompt group from its measured response lengths and acceptance and costed pass by pass for AR, the recipe's
schedule and the derived ones.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import OmegaConf

from nemo_rl_spec.sim.batching import active_batch_and_context, passes_needed
from nemo_rl_spec.sim.formulas import expected_tokens_per_pass
from nemo_rl_spec.sim.generation import ar_pass_cost, spec_pass_cost
from nemo_rl_spec.sim.interfaces import ModelSpec, PassCostFn
from nemo_rl_spec.sim.presets import MODELS, eagle3_draft, resolve_profile
from nemo_rl_spec.speculative.adaptive_k import derive_schedule, interpolate_cost, k_for_batch_size, load_step_costs
from nemo_rl_spec.utils.config import load_yaml_with_defaults

#: Benchmark ``meta.model`` (a resolve_model name) -> simulator model preset.
BENCH_MODELS = {"smollm2-135m-instruct": "smollm2-135m", "tiny-qwen3": "tiny-qwen3"}
GPU_BYTES = {"bytes_per_param": 2.0, "kv_bytes_per_elem": 2.0}
DRAFT_VOCAB_LARGE = 32000  # public EAGLE-3 heads for Qwen3 (presets.DRAFTS)


def bench_models(meta: Mapping[str, Any], hardware: str, target: str | None = None) -> tuple[ModelSpec, ModelSpec]:
    """(target, EAGLE-3 draft) presets for a benchmark's ``meta`` on ``hardware`` (bf16 on GPUs).

    ``target`` (a simulator preset such as ``qwen3-8b``) replaces the measured model: the same measured acceptance
    applied to a larger target and its EAGLE-3 preset draft (32k draft vocabulary), a what-if, not the measured draft.

    Raises:
        KeyError: ``meta['model']`` (or ``target``) has no simulator preset (names it and the known ones).
    """
    if target is not None:
        if target not in MODELS:
            raise KeyError(f"projection target {target!r} is not a simulator model preset; known: {sorted(MODELS)}")
        spec = MODELS[target].model_copy(update=GPU_BYTES) if hardware != "cpu" else MODELS[target]
        return spec, eagle3_draft(spec, DRAFT_VOCAB_LARGE)
    name = meta.get("model")
    if name not in BENCH_MODELS:
        raise KeyError(f"bench meta.model {name!r} has no simulator preset; known: {sorted(BENCH_MODELS)}")
    spec = MODELS[BENCH_MODELS[name]]
    if hardware != "cpu":
        spec = spec.model_copy(update=GPU_BYTES)
    vocab = int((meta.get("draft_training") or {}).get("draft_vocab_size") or spec.vocab)
    return spec, eagle3_draft(spec, vocab)


def step_cost_fns(
    target: ModelSpec, draft: ModelSpec, hardware: str, ks: Sequence[int], max_batch: int
) -> dict[int, PassCostFn]:
    """Simulated decode-step cost functions of one engine on one device of ``hardware``: {0: the autoregressive
    pass (``generation.ar_pass_cost``), k: the speculative pass with k drafts (``generation.spec_pass_cost``)}, each
    ``cost(batch [P], summed context tokens [P]) -> seconds [P]`` for running batches up to ``max_batch``.

    k = 0 is the plain decode pass: the simulator has no cost for the EAGLE drafter's KV-keeping pass at k = 0.
    """
    profile = resolve_profile(hardware)
    fns: dict[int, PassCostFn] = {0: ar_pass_cost(target, profile, 1, max_batch)}
    fns.update({int(k): spec_pass_cost(target, draft, profile, 1, int(k), max_batch) for k in ks if int(k) > 0})
    return fns


def pass_costs(
    target: ModelSpec,
    draft: ModelSpec,
    hardware: str,
    ks: Sequence[int],
    batches: Sequence[int],
    context_per_seq: float,
) -> tuple[dict[int, float], dict[int, dict[int, float]]]:
    """Simulated seconds of one decode pass per running batch b (context b * ``context_per_seq`` tokens):
    ({b: t_ar}, {k: {b: t_spec}}), one engine on one device of ``hardware``."""
    b = np.asarray(sorted(set(int(x) for x in batches)), dtype=float)
    ctx = b * context_per_seq
    fns = step_cost_fns(target, draft, hardware, ks, int(b.max()))
    ar = fns[0](b, ctx)
    spec = {int(k): fns[int(k)](b, ctx) for k in ks}
    return (
        {int(x): float(t) for x, t in zip(b, ar)},
        {k: {int(x): float(t) for x, t in zip(b, v)} for k, v in spec.items()},
    )


def project_bench(
    bench: Mapping[str, Any],
    hardware: Sequence[str] = ("cpu", "h100", "gb200"),
    sweep_batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    target: str | None = None,
) -> dict[str, Any]:
    """Project every measured (k, batch) row of a rollout-benchmark JSON to each hardware preset.

    Args:
        bench: the benchmark's JSON: ``meta`` (model, draft_training.draft_vocab_size, prompt_tokens_mean,
            max_new_tokens), ``rows`` ({name: {k, batch, acceptance_length, step_cost_ratio, speedup}}) and
            ``step_costs.acceptance_rate`` ({k: per-token a}).
        hardware: simulator presets (``cpu`` = the a-priori profile of this machine).
        sweep_batches: running batch sizes of the per-hardware sweep at the measured per-token acceptance.
        target: project onto this simulator model preset instead of the measured one (:func:`bench_models`).
    Returns:
        ``rows`` (measured values plus ``r_<hw>`` and ``speedup_<hw>`` = E / r_<hw>), ``sweep`` ({hw: [{k, batch,
        r, speedup}]}) and ``schedule`` ({hw: derive_schedule's [(first, last, k)]}), with ``context_per_seq``.
    Raises:
        KeyError: a required key is missing from ``bench`` (names it).
    """
    for key in ("meta", "rows"):
        if key not in bench:
            raise KeyError(f"rollout benchmark JSON has no {key!r} key (expected the output of bench_spec_rollouts)")
    meta = bench["meta"]
    context = float(meta.get("prompt_tokens_mean", 0.0)) + float(meta.get("max_new_tokens", 0)) / 2.0
    rows = [dict(r) for r in bench["rows"].values()]
    ks = sorted({int(r["k"]) for r in rows})
    batches = sorted({int(r["batch"]) for r in rows} | set(sweep_batches))
    accept = {int(k): float(a) for k, a in (bench.get("step_costs") or {}).get("acceptance_rate", {}).items()}
    out: dict[str, Any] = {
        "context_per_seq": context,
        "hardware": list(hardware),
        "sweep": {},
        "schedule": {},
        "target": target or BENCH_MODELS.get(meta.get("model")),
    }
    for hw in hardware:
        model, draft = bench_models(meta, hw, target)
        ar, spec = pass_costs(model, draft, hw, ks, batches, context)
        for r in rows:
            ratio = spec[int(r["k"])][int(r["batch"])] / ar[int(r["batch"])]
            r[f"r_{hw}"], r[f"speedup_{hw}"] = ratio, float(r["acceptance_length"]) / ratio
        out["sweep"][hw] = [
            {
                "k": k,
                "batch": b,
                "r": spec[k][b] / ar[b],
                "speedup": expected_tokens_per_pass(accept[k], k) / (spec[k][b] / ar[b]),
            }
            for k in ks
            if k in accept
            for b in sweep_batches
        ]
        if accept:
            out["schedule"][hw] = derive_schedule(ar, spec, accept, max_batch_size=max(batches))
    out["rows"] = rows
    return out


def format_projection(result: Mapping[str, Any]) -> str:
    """Markdown table of :func:`project_bench`'s rows (measured on the CPU, projected per hardware)."""
    hws = result["hardware"]
    head = (
        "| k | batch | L (measured) | r CPU measured | speedup CPU measured | "
        + " | ".join(f"r {h} | E/r {h}" for h in hws)
        + " |"
    )
    lines = [head, "|" + "---|" * (5 + 2 * len(hws))]
    for r in sorted(result["rows"], key=lambda r: (r["k"], r["batch"])):
        cells = [
            str(r["k"]),
            str(r["batch"]),
            f"{r['acceptance_length']:.2f}",
            f"{r.get('step_cost_ratio', float('nan')):.2f}",
            f"{r.get('speedup', float('nan')):.2f}",
        ]
        cells += [f"{r[f'r_{h}']:.2f} | {r[f'speedup_{h}']:.2f}" for h in hws]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- the long-tail recipe's benchmark (nemo_rl_spec/bench/spec_schedule.py; docs/results/longtail.md)

#: Keys a ``bench_spec_schedule`` JSON must have (spec_schedule.main writes them).
SCHEDULE_BENCH_KEYS = ("schedule", "rollouts", "sweep", "meta")
#: ``--sweep-tokens`` of spec_schedule.parse_args when ``meta.command`` does not give it (sim may not import bench).
SWEEP_TOKENS_DEFAULT = 32
#: Mean prompt tokens of the long-tail recipe's prompts (docs/results/longtail.md; the bench JSON does not record them).
LONGTAIL_PROMPT_TOKENS = 45.0


def is_schedule_bench(bench: Mapping[str, Any]) -> bool:
    """True for a ``bench_spec_schedule`` JSON (rollout phase + running-batch sweep), False for a rollout bench."""
    return "rollouts" in bench and "sweep" in bench


def check_schedule_bench(bench: Mapping[str, Any], name: str) -> None:
    """Raise KeyError naming ``name`` (the file) and the first missing key of a ``bench_spec_schedule`` JSON:
    the top-level keys, ``meta.config`` / ``meta.step_costs``, and per rollout group ``ar.response_tokens`` and
    ``spec.acceptance_length``."""
    for key in SCHEDULE_BENCH_KEYS:
        if key not in bench:
            raise KeyError(f"{name}: no {key!r} key (expected a bench_spec_schedule JSON: {SCHEDULE_BENCH_KEYS})")
    for key in ("config", "step_costs"):
        if not bench["meta"].get(key):
            raise KeyError(f"{name}: no 'meta.{key}' (the recipe and its calibration entry the bench ran with)")
    for g, roll in enumerate(bench["rollouts"]):
        for eng, key in (("ar", "response_tokens"), ("spec", "acceptance_length")):
            if (roll.get(eng) or {}).get(key) is None:
                raise KeyError(f"{name}: no 'rollouts[{g}].{eng}.{key}'")


def sweep_tokens(meta: Mapping[str, Any]) -> int:
    """Tokens per request of the bench's running-batch sweep: ``--sweep-tokens`` in ``meta.command``, else the
    bench's default (:data:`SWEEP_TOKENS_DEFAULT`)."""
    words = shlex.split(str(meta.get("command", "")))
    for i, w in enumerate(words[:-1]):
        if w == "--sweep-tokens":
            return int(words[i + 1])
    return SWEEP_TOKENS_DEFAULT


def rollout_profile(response_tokens: Sequence[int], prompt_tokens: float) -> tuple[np.ndarray, np.ndarray]:
    """Running batch b_p and summed KV context C_p at every decode pass p of an autoregressive rollout in which all
    rows start together (the bench's 32 rows fit the admission limit) and each emits one token per pass.
    Shapes: [P], [P], P = the longest response. ``batching.active_batch_and_context`` with tokens_per_pass 1."""
    lengths = np.asarray(response_tokens, dtype=float)
    if lengths.size == 0:
        raise ValueError("rollout_profile: no response lengths")
    passes = passes_needed(lengths, 1.0)
    n = len(passes)
    return active_batch_and_context(passes, np.zeros(n, dtype=np.int64), np.full(n, float(prompt_tokens)), 1.0)


def schedule_ks(schedule: Sequence[Sequence[int]] | None, batch: np.ndarray) -> np.ndarray:
    """k the schedule ([(first, last, k)], vLLM's rule, :func:`k_for_batch_size`) gives each running batch of
    ``batch`` (shape [P] -> [P] int); all 0 for ``None`` (autoregressive decoding)."""
    b = np.asarray(batch).astype(int)
    if not schedule:
        return np.zeros(b.shape, dtype=int)
    lookup = {int(x): k_for_batch_size(schedule, int(x)) for x in np.unique(b)}
    return np.array([lookup[int(x)] for x in b], dtype=int)


def acceptance_from_rollout(
    batch: np.ndarray, schedule: Sequence[Sequence[int]], acceptance_length: float, grid: int = 20001
) -> float:
    """Per-token acceptance a of a speculative rollout whose measured acceptance length (tokens per request per
    drafting step, over all its drafting steps) is ``acceptance_length``.

    Mean-field: the pass of running batch b_p of the AR profile (``batch``, shape [P]) holds b_p request-tokens,
    which the speculative engine emits in b_p / E_{k_p}(a) request-steps (k_p from ``schedule``), so

        L(a) = sum_{p: k_p > 0} b_p / sum_{p: k_p > 0} b_p / E_{k_p}(a),

    increasing in a; solved on a grid of ``grid`` values of a (linear interpolation; one k reduces to
    ``formulas.alpha_for_acceptance_length``).

    Raises:
        ValueError: the schedule drafts at no running batch of the profile, or L lies outside [1, L(1)].
    """
    ks = schedule_ks(schedule, batch)
    weights = {int(k): float(np.asarray(batch)[ks == k].sum()) for k in np.unique(ks) if k > 0}
    if not weights:
        raise ValueError(f"schedule {schedule} drafts at no running batch of this rollout (max {int(max(batch))})")
    a = np.linspace(0.0, 1.0, grid)
    per_k = {k: sum(a**j for j in range(k + 1)) for k in weights}  # E_k(a) = 1 + a + ... + a^k, shape [grid]
    length = sum(weights.values()) / sum(w / per_k[k] for k, w in weights.items())
    if not length[0] - 1e-12 <= acceptance_length <= length[-1] + 1e-12:
        raise ValueError(f"acceptance length {acceptance_length} outside [1, {length[-1]:.3f}] for schedule {schedule}")
    return float(np.interp(acceptance_length, length, a))


def rollout_seconds(
    batch: np.ndarray,
    context: np.ndarray,
    costs: Mapping[int, PassCostFn],
    schedule: Sequence[Sequence[int]] | None,
    acceptance_rate: float,
) -> float:
    """Mean-field seconds of a rollout with the AR pass profile (``batch``, ``context``: shapes [P]) decoded under
    ``schedule`` (None: autoregressive) at per-token acceptance a:

        T = sum_p c_{k_p}(b_p, C_p) / E_{k_p}(a),   k_p = schedule's k at b_p, E_0 = 1, c_0 = the AR pass,

    i.e. every request advances E_k(a) tokens per step while b requests run (tokens of the AR profile, in token
    space; speculation does not change which rows are still running at a given token position).

    Raises:
        KeyError: ``costs`` has no function for a k the schedule uses.
    """
    ks = schedule_ks(schedule, batch)
    total = 0.0
    for k in np.unique(ks):
        m = ks == k
        total += float(costs[int(k)](batch[m], context[m]).sum()) / expected_tokens_per_pass(acceptance_rate, int(k))
    return total


def calibrated_cost_fns(step_costs: Mapping[str, Any]) -> dict[int, PassCostFn]:
    """Cost functions from a measured step-cost table (``ar_step_s`` {b: s}, ``spec_step_s`` {k: {b: s}}):
    ``adaptive_k.interpolate_cost`` over the running batch; the context argument is ignored (the calibration ran at a
    short context). Same shape as :func:`step_cost_fns`."""

    def fn(table: Mapping[Any, float]) -> PassCostFn:
        pts = {int(b): float(c) for b, c in table.items()}
        return lambda batch, context: np.array([interpolate_cost(pts, float(x)) for x in np.asarray(batch)])

    fns = {0: fn(step_costs["ar_step_s"])}
    fns.update({int(k): fn(v) for k, v in step_costs["spec_step_s"].items() if int(k) > 0})
    return fns


def resolve_referenced(path_str: str, name: str, key: str, subdir: str) -> Path:
    """A file a bench JSON names (``meta.<key>``): the path as written, else ``<subdir>/<basename>`` under the working
    directory (a copy of the repository on another machine), else ``<subdir>/superseded/<basename>`` (step-cost
    entries of an older calibration key version, kept for the JSONs that name them). Raises FileNotFoundError naming
    ``name`` and the key."""
    path = Path(path_str)
    local = Path(subdir) / path.name  # preferred for an absolute path: the JSON written here stays portable
    for cand in (*((local, path) if path.is_absolute() else (path, local)), Path(subdir) / "superseded" / path.name):
        if cand.is_file():
            return cand
    raise FileNotFoundError(f"{name}: meta.{key}={path_str}: no such file (nor {Path(subdir) / path.name})")


def longtail_inputs(benches: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, Any]:
    """What the bench JSONs only reference, read from the recipe (``meta.config``) and the calibration entry
    (``meta.step_costs``) of the last bench: the model name (``policy.model_name``), the recipe's per-token
    ``acceptance_rate`` and ``min_speedup`` (``policy.generation.dynamic_speculation``), its ``max_new_tokens``, the
    draft's vocabulary rows (``key.draft.draft_vocab_rows``) and the measured CPU step costs.

    Raises:
        KeyError / FileNotFoundError: a missing key or file (names the bench file and the key).
    """
    name, bench = benches[-1]
    for n, b in benches:
        check_schedule_bench(b, n)
    recipe_path = resolve_referenced(bench["meta"]["config"], name, "config", "configs")
    cfg = load_yaml_with_defaults(recipe_path)
    dyn = OmegaConf.select(cfg, "policy.generation.dynamic_speculation")
    if dyn is None or dyn.get("acceptance_rate") is None:
        raise KeyError(f"{recipe_path}: no policy.generation.dynamic_speculation.acceptance_rate")
    entry_path = resolve_referenced(bench["meta"]["step_costs"], name, "step_costs", "configs/spec_step_costs")
    entry = json.loads(entry_path.read_text())
    vocab = (entry.get("key") or {}).get("draft", {}).get("draft_vocab_rows")
    if vocab is None:
        raise KeyError(f"{entry_path}: no 'key.draft.draft_vocab_rows'")
    return {
        "recipe": str(recipe_path),
        "model": str(OmegaConf.select(cfg, "policy.model_name")),
        "acceptance_rate_recipe": float(dyn["acceptance_rate"]),
        "min_speedup_recipe": float(dyn.get("min_speedup", 1.0)),
        "max_new_tokens": int(
            bench["meta"].get("max_new_tokens") or OmegaConf.select(cfg, "policy.generation.max_new_tokens")
        ),
        "draft_vocab": int(vocab),
        "step_costs_file": str(entry_path),
        "step_costs": load_step_costs(entry_path),
    }


def project_longtail(
    benches: Sequence[tuple[str, Mapping[str, Any]]],
    hardware: Sequence[str] = ("cpu", "h100", "gb200"),
    prompt_tokens: float = LONGTAIL_PROMPT_TOKENS,
    ks: Sequence[int] = (1, 2, 3),
    max_batch: int = 64,
    min_speedup: float = 1.0,
    target: str | None = None,
) -> dict[str, Any]:
    """Project one or several ``bench_spec_schedule`` JSONs (the long-tail recipe's benchmark) to hardware presets.

    (a) Sweep: each rep's drafting rows (k > 0; b requests of ``sweep_tokens`` tokens, constant running batch) go
    through :func:`project_bench` with the measured acceptance length L: r_hw(k, b) and L / r_hw at context
    ``prompt_tokens + sweep_tokens / 2``, plus E_k(a_meas) / r_hw for every swept b.
    (b) Rollout phase: per rollout group, the AR pass profile from its measured response lengths
    (:func:`rollout_profile`), its per-token acceptance a_g from its measured L under the schedule the rep ran
    (:func:`acceptance_from_rollout`), and :func:`rollout_seconds` on each hardware's simulated costs for AR, the
    recipe's schedule (the last bench's ``schedule``) and the schedules ``derive_schedule`` picks from the projected
    costs (context ``prompt_tokens + max_new_tokens / 2``, ``min_speedup``: 1.0 = the argmax, as ``project-spec``;
    the recipe's own margin is in ``inputs``) at a_meas (median of a_g) and at the recipe's held-out a. Phase
    speedup = total AR seconds / total seconds over all groups (the bench's definition). ``cpu_calibrated`` repeats
    (b) with this machine's measured step costs (a check of the mean-field rollout model against the measured CPU
    phase; not with ``target``). ``target``: the same acceptance and response lengths on another simulator model
    preset and its 32k-vocabulary EAGLE-3 draft (a what-if, :func:`bench_models`).

    Returns:
        {"inputs", "sweep": {rep: project_bench output}, "rollout": {"groups": [...], "phase": {hw: {...}},
        "schedules": {hw: {...}}}}; seconds are simulated seconds of one engine on one device.
    Raises:
        KeyError / FileNotFoundError / ValueError: malformed bench (names the file and key).
    """
    inp = longtail_inputs(benches)
    recipe_schedule = [list(x) for x in benches[-1][1]["schedule"]]
    groups = []
    for name, bench in benches:
        for g, roll in enumerate(bench["rollouts"]):
            batch, ctx = rollout_profile(roll["ar"]["response_tokens"], prompt_tokens)
            length = float(roll["spec"]["acceptance_length"])
            try:
                a_g = acceptance_from_rollout(batch, bench["schedule"], length)
            except ValueError as exc:
                raise ValueError(f"{name}: rollouts[{g}]: {exc}") from exc
            groups.append(
                {
                    "bench": name,
                    "group": g,
                    "schedule_ran": bench["schedule"],
                    "acceptance_length": length,
                    "a": a_g,
                    "measured_speedup": roll["ar"]["seconds"] / roll["spec"]["seconds"],
                    "measured_ar_seconds": roll["ar"]["seconds"],
                    "measured_spec_seconds": roll["spec"]["seconds"],
                    # the derived profile runs exactly the running batches the AR engine's step timer saw
                    "profile_matches_measured_batches": sorted({int(x) for x in batch})
                    == sorted(int(x) for x in roll["ar"].get("seconds_by_batch", {})),
                    "_profile": (batch, ctx),
                }
            )
    a_meas = float(np.median([g["a"] for g in groups]))
    meta = {"model": inp["model"], "draft_training": {"draft_vocab_size": inp["draft_vocab"]}}
    rollout_ctx = prompt_tokens + inp["max_new_tokens"] / 2.0
    schedules: dict[str, dict[str, Any]] = {}
    phase: dict[str, dict[str, float]] = {}
    all_hw = [*hardware, *(["cpu_calibrated"] if target is None else [])]
    for hw in all_hw:
        if hw == "cpu_calibrated":
            costs = calibrated_cost_fns(inp["step_costs"])
            ar, spec = inp["step_costs"]["ar_step_s"], inp["step_costs"]["spec_step_s"]
        else:
            model, draft = bench_models(meta, hw, target)
            costs = step_cost_fns(model, draft, hw, ks, max_batch)
            ar, spec = pass_costs(model, draft, hw, ks, range(1, max_batch + 1), rollout_ctx)
        derive = {
            name: [list(x) for x in derive_schedule(ar, spec, a, max_batch_size=max_batch, min_speedup=min_speedup)]
            for name, a in (("derived_a_meas", a_meas), ("derived_a_recipe", inp["acceptance_rate_recipe"]))
        }
        schedules[hw] = {"recipe": recipe_schedule, **derive}
        totals = dict.fromkeys(("ar", *schedules[hw]), 0.0)
        drafting_ar = 0.0
        for g in groups:
            batch, ctx = g["_profile"]
            t_ar = rollout_seconds(batch, ctx, costs, None, g["a"])
            sched_s = {n: rollout_seconds(batch, ctx, costs, s, g["a"]) for n, s in schedules[hw].items()}
            g[hw] = {"ar_s": t_ar, **{f"{n}_s": t for n, t in sched_s.items()}}
            g[hw].update({f"{n}_speedup": t_ar / t for n, t in sched_s.items()})
            m = schedule_ks(recipe_schedule, batch) > 0
            drafting_ar += float(costs[0](batch[m], ctx[m]).sum())
            totals["ar"] += t_ar
            for n, t in sched_s.items():
                totals[n] += t
        phase[hw] = {f"{n}_speedup": totals["ar"] / totals[n] for n in schedules[hw]}
        phase[hw]["ar_share_at_recipe_drafting_batches"] = drafting_ar / totals["ar"]
    measured_share = [s for _, b in benches for s in (b.get("summary") or {}).get("ar_share_at_drafting_batches", [])]
    phase["measured_cpu"] = {
        "recipe_speedup": sum(g["measured_ar_seconds"] for g in groups)
        / sum(g["measured_spec_seconds"] for g in groups),
        "ar_share_at_drafting_batches_per_group": measured_share,
    }
    sweep = {}
    for name, bench in benches:
        st = sweep_tokens(bench["meta"])
        rows = {
            f"b{b}": {
                "k": int(p["k"]),
                "batch": int(b),
                "acceptance_length": float(p["spec"]["acceptance_length"]),
                "speedup": float(p["spec"]["speedup"]),
            }
            for b, p in bench["sweep"].items()
            if int(p["k"]) > 0
        }
        adapted = {
            "meta": {**meta, "prompt_tokens_mean": prompt_tokens, "max_new_tokens": st},
            "rows": rows,
            "step_costs": {"acceptance_rate": dict.fromkeys(ks, a_meas)},
        }
        sweep[name] = project_bench(
            adapted, hardware, sweep_batches=sorted(int(b) for b in bench["sweep"]), target=target
        )
        sweep[name]["k0_measured_speedup"] = {
            int(b): float(p["spec"]["speedup"]) for b, p in bench["sweep"].items() if int(p["k"]) == 0
        }
    for g in groups:
        del g["_profile"]
    inp = {k: v for k, v in inp.items() if k != "step_costs"}
    return {
        "inputs": {
            **inp,
            "prompt_tokens": prompt_tokens,
            "rollout_context_per_seq": rollout_ctx,
            "a_measured_median": a_meas,
            "min_speedup": min_speedup,
            "recipe_schedule": recipe_schedule,
        },
        "hardware": list(hardware),
        "target": target or BENCH_MODELS.get(inp["model"]),
        "sweep": sweep,
        "rollout": {"groups": groups, "phase": phase, "schedules": schedules},
    }


def format_longtail(result: Mapping[str, Any]) -> str:
    """Markdown tables of :func:`project_longtail`: the sweep's drafting rows per bench, the rollout phase per
    hardware (with the schedules), and the rollout groups (recipe schedule)."""
    hws = result["hardware"]
    inp = result["inputs"]
    lines = [
        "| bench | b | k | L measured | speedup CPU measured | " + " | ".join(f"r {h} | L/r {h}" for h in hws) + " |",
        "|" + "---|" * (5 + 2 * len(hws)),
    ]
    for name, part in result["sweep"].items():
        for r in sorted(part["rows"], key=lambda r: r["batch"]):
            cells = [
                Path(name).stem,
                str(r["batch"]),
                str(r["k"]),
                f"{r['acceptance_length']:.2f}",
                f"{r['speedup']:.2f}",
            ]
            cells += [f"{r[f'r_{h}']:.2f} | {r[f'speedup_{h}']:.2f}" for h in hws]
            lines.append("| " + " | ".join(cells) + " |")
    k0 = [x for part in result["sweep"].values() for x in part["k0_measured_speedup"].values()]
    if k0:
        lines.append(
            f"k = 0 rows: measured CPU speedup {min(k0):.2f}-{max(k0):.2f} (median {float(np.median(k0)):.2f}); "
            "projected 1.00 on every preset (the simulator has no drafter pass at k = 0)"
        )
    phase, scheds = result["rollout"]["phase"], result["rollout"]["schedules"]
    lines += [
        "",
        f"rollout phase (recipe schedule {inp['recipe_schedule']}; a_meas = {inp['a_measured_median']:.3f} median of "
        f"the groups' a; recipe a = {inp['acceptance_rate_recipe']:.2f}; derive_schedule min_speedup "
        f"{inp['min_speedup']:g}, context {inp['rollout_context_per_seq']:.0f} tokens per sequence)",
        "| costs | AR time at recipe's drafting batches | recipe schedule | derived, a_meas | derived, recipe a |",
        "|---|---|---|---|---|",
    ]
    m = phase["measured_cpu"]
    shares = m["ar_share_at_drafting_batches_per_group"]
    lines.append(
        "| CPU measured (the schedule each bench ran) | "
        + (f"{min(shares):.0%}-{max(shares):.0%} per group | " if shares else "- | ")
        + f"{m['recipe_speedup']:.3f}x | - | - |"
    )
    costed = [h for h in ("cpu_calibrated", *hws) if h in phase]
    for hw in costed:
        ph, sc = phase[hw], scheds[hw]
        lines.append(
            f"| {hw} | {ph['ar_share_at_recipe_drafting_batches']:.0%} | {ph['recipe_speedup']:.3f}x | "
            f"{ph['derived_a_meas_speedup']:.3f}x {sc['derived_a_meas']} | "
            f"{ph['derived_a_recipe_speedup']:.3f}x {sc['derived_a_recipe']} |"
        )
    lines += [
        "",
        "| bench | group | L measured | a | CPU measured | " + " | ".join(costed) + " |",
        "|" + "---|" * (5 + len(costed)),
    ]
    for g in result["rollout"]["groups"]:
        cells = [Path(g["bench"]).stem, str(g["group"]), f"{g['acceptance_length']:.2f}", f"{g['a']:.3f}"]
        cells += [f"{g['measured_speedup']:.3f}"] + [f"{g[h]['recipe_speedup']:.3f}" for h in costed]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_bench(path: str | Path) -> dict[str, Any]:
    """Read a benchmark JSON. Raises SystemExit naming the file when it is missing or not JSON."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"--bench {path}: no such file (expected a bench_spec_rollouts or bench_spec_schedule JSON)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--bench {path}: not JSON ({exc})") from exc


def main(argv: list[str]) -> int:
    """CLI of ``run_sim.py project-spec``: project a rollout-benchmark JSON, or one or several
    ``bench_spec_schedule`` JSONs (the long-tail recipe: :func:`project_longtail`), print the tables, write JSON."""
    p = argparse.ArgumentParser(prog="run_sim.py project-spec", description=__doc__.splitlines()[0])
    p.add_argument(
        "--bench",
        required=True,
        nargs="+",
        help="one JSON of examples/bench_spec_rollouts.py, or one or more of examples/bench_spec_schedule.py",
    )
    p.add_argument("--hardware", nargs="+", default=["cpu", "h100", "gb200"])
    p.add_argument(
        "--what-if-target",
        default="qwen3-8b",
        help="also project the measured acceptance onto this model preset ('' to skip)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=float,
        default=LONGTAIL_PROMPT_TOKENS,
        help=f"bench_spec_schedule only: mean prompt tokens (not recorded there; default {LONGTAIL_PROMPT_TOKENS:g})",
    )
    p.add_argument(
        "--min-speedup",
        type=float,
        default=1.0,
        help="bench_spec_schedule only: derive_schedule's margin for the derived schedules (default 1.0, the argmax)",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    benches = [(str(path), load_bench(path)) for path in args.bench]
    kinds = {is_schedule_bench(b) for _, b in benches}
    if kinds == {True}:
        result = {
            "label": "simulator projection from CPU measurements (not a GPU measurement)",
            "bench": [name for name, _ in benches],
            **project_longtail(benches, args.hardware, args.prompt_tokens, min_speedup=args.min_speedup),
        }
        if args.what_if_target:
            gpus = [h for h in args.hardware if h != "cpu"]
            result["what_if_target"] = project_longtail(
                benches, gpus, args.prompt_tokens, min_speedup=args.min_speedup, target=args.what_if_target
            )
        print(f"\nlong-tail recipe, {result['target']} (PROJECTION on GPUs)\n{format_longtail(result)}")
        if "what_if_target" in result:
            what_if = result["what_if_target"]
            print(f"\nwhat-if: {what_if['target']} (PROJECTION)\n{format_longtail(what_if)}")
        return write_result(result, args.out)
    if len(benches) != 1 or kinds != {False}:
        raise SystemExit("--bench: give one bench_spec_rollouts JSON, or only bench_spec_schedule JSONs")
    path, bench = benches[0]
    result = {
        "label": "simulator projection from CPU measurements (not a GPU measurement)",
        "bench": path,
        "measured_model": project_bench(bench, args.hardware),
    }
    if args.what_if_target:
        gpus = [h for h in args.hardware if h != "cpu"]
        result["what_if_target"] = project_bench(bench, gpus, target=args.what_if_target)
    for name, part in result.items():
        if isinstance(part, dict):
            print(
                f"\n{name} ({part['target']}; context {part['context_per_seq']:.0f} tokens per sequence; "
                f"PROJECTION on GPUs)\n{format_projection(part)}\nschedule: {part['schedule']}"
            )
    return write_result(result, args.out)


def write_result(result: Mapping[str, Any], out: str | Path) -> int:
    """Write ``result`` as JSON to ``out`` (parents created), say so, return 0."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0
