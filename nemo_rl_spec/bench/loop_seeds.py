"""Several seeds of the loop benchmark in one table: per-seed ratios to autoregressive and a bootstrap interval.

``python examples/loop_seeds_table.py --out summary.json seed3.json seed4.json ...``, each input a
``bench_sync_vs_async.py`` output of the same modes on one ``grpo.seed`` (its ``ratios_vs_autoregressive`` and
``modes``). Per synchronous speculative mode and per seed (async modes are left out: their exposed generation is
only the part of generation on the trainer's critical path): generation and step seconds, generator throughput,
response tokens and acceptance length, each over autoregressive's, and the mean reward minus autoregressive's
(:func:`seed_ratios`). Over the seeds: the mean and a percentile-bootstrap 90% interval of each (with 3-5 seeds it
is narrow-biased, so the per-seed values are printed beside it). Writes ``--out`` JSON ``{"modes": {mode: {field:
{"per_seed": {file: value}, "mean", "interval90"}}}, "sources": [...], "machine"}`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nemo_rl_spec.utils.bench_runs import mean_and_interval
from nemo_rl_spec.utils.machine import sources_machine, write_bench_json

AR = "sync/autoregressive"
FIELDS = ("generation", "step", "tokens_per_s", "tokens", "acceptance_length", "mean_reward_minus_ar")


def seed_ratios(result: dict) -> dict[str, dict[str, float]]:
    """One benchmark output -> ``{speculative mode: {field: value}}``, the fields of :data:`FIELDS`:

    - ``generation`` / ``step``: the mode's mean seconds over its passes over autoregressive's (the file's
      ``of_means``: exposed generation, whole step; means over steps 2..N);
    - ``tokens_per_s``: the mode's generator throughput over autoregressive's (response tokens / seconds inside
      generate, whole run): the engine's speed with the rollouts' lengths divided out, which the seconds ratios are
      not (speculation changes the seeded rows' realisations, so the modes generate different token counts);
    - ``tokens``: the mode's response tokens per step over autoregressive's (``tokens_per_s x generation s``);
    - ``acceptance_length``, and ``mean_reward`` minus autoregressive's.

    Raises:
        KeyError: the file has no ``sync/autoregressive`` mode or no ratios for a speculative mode it ran.
    """
    modes, ratios = result["modes"], result["ratios_vs_autoregressive"]
    ar = modes[AR]
    out = {}
    for name, mode in modes.items():
        if name == AR or not name.startswith("sync/") or "error" in mode:
            continue
        r = ratios[name]
        tokens = mode["tokens_per_s"] * mode["exposed_generation_s"]
        out[name] = {
            "generation": r["generation"]["of_means"],
            "step": r["step"]["of_means"],
            "tokens_per_s": mode["tokens_per_s"] / ar["tokens_per_s"],
            "tokens": tokens / (ar["tokens_per_s"] * ar["exposed_generation_s"]),
            "acceptance_length": mode.get("acceptance_length", float("nan")),
            "mean_reward_minus_ar": mode["mean_reward"] - ar["mean_reward"],
        }
    return out


def summarize(paths: list[str]) -> dict:
    """Per mode and field: ``{"per_seed": {path stem: value}, "mean", "interval90"}`` over the files that ran it,
    under ``modes``; the input paths under ``sources``; the machine they ran on under ``machine``.

    Raises:
        ValueError: two inputs share a file stem (their seeds would merge into one entry).
    """
    stems = [Path(p).stem for p in paths]
    if len(set(stems)) != len(stems):
        raise ValueError(f"inputs {list(paths)}: file stems repeat ({stems}); give each seed's file its own name")
    docs = [json.loads(Path(p).read_text()) for p in paths]
    per_file = {stem: seed_ratios(doc) for stem, doc in zip(stems, docs)}
    modes = sorted({m for r in per_file.values() for m in r})
    out = {}
    for mode in modes:
        out[mode] = {}
        for field in FIELDS:
            per_seed = {stem: r[mode][field] for stem, r in per_file.items() if mode in r}
            out[mode][field] = {"per_seed": per_seed, **mean_and_interval(list(per_seed.values()))}
    return {"modes": out, "sources": list(paths), "machine": sources_machine(docs)}


def table(summary: dict) -> str:
    """Markdown: one row per mode and field, the per-seed values, their mean and 90% interval."""
    lines = ["| mode | field | per seed | mean | bootstrap 90% interval |", "|---|---|---|---|---|"]
    for mode, fields in summary["modes"].items():
        for field, s in fields.items():
            per = " / ".join(f"{v:.3f}" for v in s["per_seed"].values())
            ci = s["interval90"]
            interval = f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "-"
            lines.append(f"| {mode} | {field} | {per} | {s['mean']:.3f} | {interval} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="summary JSON to write")
    p.add_argument("inputs", nargs="+", help="bench_sync_vs_async.py outputs, one per seed")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = summarize(args.inputs)
    write_bench_json(args.out, summary, machine=summary["machine"], indent=2)
    print(table(summary))
    return 0
