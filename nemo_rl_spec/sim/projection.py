"""Projection of measured CPU speculative configurations to GPUs (a simulator projection, not a measurement).

Input: a rollout-benchmark JSON (``examples/bench_spec_rollouts.py --out``): per (k, batch) the measured
acceptance length L = E, the measured step-cost ratio r = t_spec(b) / t_ar(b) on this CPU, and the measured
speedup. For each hardware preset the simulator's roofline gives the pass costs of the same target and the same
EAGLE-3 draft shape at the same running batch and context, so that

    r_hw(k, b) = t_verify(k + 1 tokens, b) + k * t_draft(b)  /  t_decode(b)         (generation.spec_pass_cost)
    speedup_hw(k, b) = E_measured(k, b) / r_hw(k, b)                                  (steady state at batch b)

E / r is the bound the CPU benchmark compares its measured speedups to (docs/speculative.md: 0.91-1.42 of it).
The acceptance is taken as measured (the draft does not change with the hardware); only the costs move. On GPUs
the weights are assumed bf16 (2 bytes per parameter and per KV element), on the CPU they stay as measured (fp32).
The ``cpu`` rows are the simulator's a-priori CPU profile next to the measured r: a check of the cost model on
the one machine where both exist.

The batch-aware schedule each hardware would get is :func:`derive_schedule` on the projected costs with the
measured per-token acceptance (``step_costs.acceptance_rate``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nemo_rl_spec.sim.formulas import expected_tokens_per_pass
from nemo_rl_spec.sim.generation import ar_pass_cost, spec_pass_cost
from nemo_rl_spec.sim.interfaces import ModelSpec
from nemo_rl_spec.sim.presets import MODELS, eagle3_draft, resolve_profile
from nemo_rl_spec.speculative.adaptive_k import derive_schedule

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
    profile = resolve_profile(hardware)
    b = np.asarray(sorted(set(int(x) for x in batches)), dtype=float)
    ctx = b * context_per_seq
    top = int(b.max())
    ar = ar_pass_cost(target, profile, 1, top)(b, ctx)
    spec = {int(k): spec_pass_cost(target, draft, profile, 1, int(k), top)(b, ctx) for k in ks}
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


def main(argv: list[str]) -> int:
    """CLI of ``run_sim.py project-spec``: project a rollout-benchmark JSON, print the tables, write JSON."""
    p = argparse.ArgumentParser(prog="run_sim.py project-spec", description=__doc__.splitlines()[0])
    p.add_argument("--bench", required=True, help="JSON written by examples/bench_spec_rollouts.py --out")
    p.add_argument("--hardware", nargs="+", default=["cpu", "h100", "gb200"])
    p.add_argument(
        "--what-if-target",
        default="qwen3-8b",
        help="also project the measured acceptance onto this model preset ('' to skip)",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    path = Path(args.bench)
    if not path.is_file():
        raise SystemExit(f"--bench {path}: no such file (expected a bench_spec_rollouts JSON)")
    bench = json.loads(path.read_text())
    result = {
        "label": "simulator projection from CPU measurements (not a GPU measurement)",
        "bench": str(path),
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0
