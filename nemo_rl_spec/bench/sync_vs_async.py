"""Benchmark sync against async GRPO, autoregressive against speculative rollouts, on one recipe and seed.

``python examples/bench_sync_vs_async.py --out bench.json [--config configs/grpo_math_tiny.yaml] [--steps 8]``
``python examples/bench_sync_vs_async.py --merge first.json rerun.json --out bench.json`` (combine re-run modes)

Runs {sync, async age 1, async age 2} x {autoregressive, speculative} in this process (each mode gets fresh Ray
actors from the same initial weights, seeds and prompt stream). ``--repeats R`` runs the list R times, every other
pass in reverse order (:func:`schedule`), so slow drift of the machine does not favour the mode that ran first.
Writes the ``--out`` JSON (per mode: :func:`summarize`; the settings; the machine), a Markdown table next to it
(``.md``, also printed) and a plot of the step-time split (``.png``). Speculative mode uses vLLM
``speculative_config`` (``--spec-config`` JSON; default: ``draft_model`` with a 1-layer truncation of the target,
k = 3, not refit); ``--spec-recipe`` runs the speculative modes on that recipe's own draft settings instead. If the
speculative engine cannot start, those modes are reported with their error and the autoregressive half still runs.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
import traceback
from pathlib import Path

from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.testing.lossless import build_truncated_draft
from nemo_rl_spec.utils.config import check_runtime_support, load_config
from nemo_rl_spec.utils.machine import sources_machine, write_bench_json

MODES = [("sync", 0), ("async_age1", 1), ("async_age2", 2)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output JSON path (the .md table and .png plot go next to it)")
    p.add_argument("--config", default="configs/grpo_math_tiny.yaml")
    p.add_argument("--steps", type=int, default=8, help="GRPO steps per mode")
    p.add_argument("--spec-config", default=None, help="JSON speculative_config (default: 1-layer draft_model, k=3)")
    p.add_argument(
        "--spec-recipe",
        default=None,
        help="run the speculative modes on this recipe as written (its speculative_config and policy.draft, "
        "e.g. online EAGLE-3 refit every step) instead of --config + --spec-config",
    )
    p.add_argument("--workdir", default=None, help="keep per-mode logs here (default: a fresh temp dir)")
    p.add_argument(
        "--decoding",
        nargs="+",
        default=["autoregressive", "speculative"],
        help="autoregressive, speculative, or speculative@NAME: the speculative run with the overrides "
        "of --spec-variant NAME",
    )
    p.add_argument(
        "--spec-variant",
        nargs="+",
        action="append",
        default=[],
        metavar=("NAME", "KEY=VALUE"),
        help="a named speculative variant: NAME then key=value overrides added to the speculative run "
        "(e.g. before policy.generation.dynamic_speculation.plain_step_at_k0=false); repeatable",
    )
    p.add_argument("--modes", nargs="+", default=[m for m, _ in MODES], choices=[m for m, _ in MODES])
    p.add_argument("--replot", action="store_true", help="only rewrite the table and plot from an existing --out")
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="JSON",
        help="only combine the modes of earlier outputs into --out (a later file's mode replaces an "
        "earlier one: for re-running single modes), recompute speedup_vs_sync, rewrite table and plot",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="passes over the modes, alternating forward and reverse order (interleaved modes)",
    )
    p.add_argument("--attempts", type=int, default=3, help="tries per mode (Ray startup can time out under load)")
    p.add_argument("overrides", nargs="*", help="extra key=value overrides applied to every mode")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    args.variants = {v[0]: list(v[1:]) for v in args.spec_variant}
    for d in args.decoding:
        base, _, name = d.partition("@")
        if base not in ("autoregressive", "speculative") or (
            name and (base != "speculative" or name not in args.variants)
        ):
            p.error(
                f"--decoding {d}: expected autoregressive, speculative or speculative@NAME with --spec-variant NAME"
            )
    return args


def _mean(values: list[float]) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def default_spec_config(workdir: Path, model_name: str) -> dict:
    """``draft_model`` speculation with the target's first decoder layer as the draft (k = 3)."""
    draft = build_truncated_draft(resolve_model(model_name), workdir / "draft_1layer", num_layers=1)
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}


def speculative_config(args: argparse.Namespace, model_name: str, workdir: Path) -> dict:
    """The speculative modes' ``speculative_config``: ``--spec-config``, else ``--spec-recipe``'s own, else
    :func:`default_spec_config`."""
    if args.spec_config:
        return json.loads(args.spec_config)
    if args.spec_recipe:
        return load_config(args.spec_recipe, args.overrides).policy.generation.vllm_kwargs["speculative_config"]
    return default_spec_config(workdir, model_name)


def summarize(history: list[dict], is_async: bool) -> dict:
    """Per-mode numbers from the step metrics (seconds are wall clock, means over steps 2..N, the first step being
    pipeline fill and warm-up).

    - ``step_time_s``: ``timing/train/total_step_time`` (sync: generate + train + refit; async: the trainer's wait
      for a batch + train + refit).
    - ``exposed_generation_s``: generation on the trainer's critical path: sync ``timing/train/generation`` (all of
      it), async ``timing/train/exposed_generation`` (the part of the buffer wait during which vLLM was generating,
      plus the refit bubble: the refit waiting for the generate call in flight).
    - ``tokens_per_s``: response tokens sampled / seconds inside generate calls (generator throughput).
    - ``acceptance_length``: 1 + accepted / drafting rounds of the training rollouts, from the per-step
      ``vllm/spec_*`` counts the loop logs (:func:`rollout_acceptance`; autoregressive: 1.0 by definition);
      ``acceptance_length_with_validation``: the same from the engines' counters over the whole run, the final
      greedy validation included.
    - ``final_reward`` / ``final_accuracy``: ``train/reward`` of the last step / greedy validation accuracy after the
      last step.
    """
    steady = history[1:] or history
    if is_async:
        exposed = [m.get("timing/train/exposed_generation", 0.0) for m in steady]
        tokens = sum(m.get("async/batch_generated_tokens", 0.0) for m in history)
        gen_s = sum(m.get("async/batch_generation_s", 0.0) for m in history)
    else:
        exposed = [m.get("timing/train/generation", 0.0) for m in steady]
        tokens = sum(
            m.get("train/mean_response_length", 0.0) * m.get("rollout_alloc/train_rollouts", 0.0) for m in history
        )
        gen_s = sum(m.get("timing/train/generation", 0.0) for m in history)
    last = history[-1] if history else {}
    key = lambda k: _mean([m.get(k, 0.0) for m in steady])
    return {
        "step_time_s": key("timing/train/total_step_time"),
        "exposed_generation_s": _mean(exposed),
        "tokens_per_s": tokens / gen_s if gen_s > 0 else float("nan"),
        "final_reward": last.get("train/reward", float("nan")),
        "final_accuracy": last.get("validation/accuracy", float("nan")),
        "mean_reward": _mean([m.get("train/reward") for m in history]),
        "logprobs_s": key("timing/train/policy_and_reference_logprobs"),
        "training_s": key("timing/train/policy_training"),
        "draft_train_s": key("train/draft_seconds"),
        "weight_sync_s": key("timing/train/weight_sync"),
        "buffer_starvation_s": key("timing/train/idle/buffer_starvation") if is_async else None,
        "refit_bubble_s": key("timing/train/idle/refit_bubble") if is_async else None,
        "max_trajectory_age": max((m.get("async/trajectory_age_max", 0.0) for m in history), default=0.0),
        "evicted_groups": last.get("async/evicted_groups_total", 0.0),
        "is_weight_max": max((m.get("train/is_weight_max", float("nan")) for m in history), default=float("nan")),
        "steps": len(history),
    }


def rollout_acceptance(history: list[dict]) -> dict[str, float]:
    """``acceptance_length`` (1 + accepted / drafts) and ``spec_num_drafts`` of the training rollouts: the per-step
    ``vllm/spec_num_drafts`` / ``vllm/spec_num_accepted_tokens`` the loop logs, summed over every step. The
    validation's generate calls (greedy, at the end of the run) are not in them; the engines' whole-run counters,
    which are, give ``acceptance_length_with_validation``. NaN acceptance without drafts."""
    drafts = sum(m.get("vllm/spec_num_drafts", 0.0) for m in history)
    accepted = sum(m.get("vllm/spec_num_accepted_tokens", 0.0) for m in history)
    return {"acceptance_length": 1.0 + accepted / drafts if drafts else float("nan"), "spec_num_drafts": drafts}


def schedule(keys: list[str], repeats: int) -> list[tuple[int, str]]:
    """Run order of ``repeats`` passes over ``keys``: (repeat index, key), even passes forward, odd ones reversed
    (``["a", "b"]``, 2 -> ``[(0, "a"), (0, "b"), (1, "b"), (1, "a")]``).

    Raises:
        ValueError: ``repeats < 1``."""
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    return [(r, k) for r in range(repeats) for k in (keys if r % 2 == 0 else keys[::-1])]


def combine_repeats(runs: list[dict]) -> dict:
    """One mode's result from its repeats: every numeric field the mean over the repeats that ran (errors
    skipped), the repeats themselves under ``repeats``; a mode whose every repeat failed keeps the last error."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {**runs[-1], "repeats": runs}
    out = {
        k: _mean([r.get(k) for r in ok])
        for k, v in ok[0].items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    return {**out, "repeats": runs}


def start_ray(cfg, attempts: int = 5) -> None:
    """Start the local Ray instance once for every mode. Ray gives the raylet a hard-coded 30 s to register, which
    an oversubscribed 2-core host can miss; retry."""
    import ray  # lazy: Ray internals, once output is routed

    from nemo_rl_spec.algorithms.grpo_setup import init_ray  # lazy: loads ray or megatron-core

    for attempt in range(1, attempts + 1):
        try:
            init_ray(cfg)
            return
        except Exception:
            if ray.is_initialized():
                ray.shutdown()
            if attempt == attempts:
                raise
            time.sleep(10)


def release(s) -> None:
    """``grpo_setup.teardown`` without stopping Ray (the next mode reuses it): stop the engines and policy workers and
    release their placement group."""
    if s is None:
        return
    s.workers.shutdown()
    s.logger.close()


def run_mode(config: str, overrides: list[str], is_async: bool, speculative: bool) -> dict:
    """One mode end to end (setup, train, release the actors); returns :func:`summarize` plus wall times and
    acceptance."""
    from nemo_rl_spec.algorithms.grpo import grpo_train  # lazy: loads ray or megatron-core
    from nemo_rl_spec.algorithms.grpo_setup import setup  # lazy: loads ray or megatron-core

    cfg = load_config(config, overrides)
    start_ray(cfg)
    check_runtime_support(cfg)
    s, t0 = None, time.perf_counter()
    try:
        s = setup(cfg)
        setup_s = time.perf_counter() - t0
        before = s.generation.spec_counters() if speculative else None
        t1 = time.perf_counter()
        if is_async:
            from nemo_rl_spec.algorithms.async_grpo import async_grpo_train  # lazy: loads ray or megatron-core

            history = async_grpo_train(s)
        else:
            history = grpo_train(s)
        loop_s = time.perf_counter() - t1
        out = summarize(history, is_async)
        out.update(setup_s=setup_s, loop_wall_s=loop_s, loop_wall_per_step_s=loop_s / max(len(history), 1))
        if speculative:
            delta = s.generation.spec_counters() - before
            out.update(rollout_acceptance(history))
            out["acceptance_length_with_validation"] = delta.acceptance_length
            out["spec_num_drafts_with_validation"] = delta.num_drafts
        else:
            out["acceptance_length"] = 1.0
        return out
    finally:
        release(s)


def mode_overrides(name: str, age: int, decoding: str, spec: dict | None, steps: int, workdir: Path) -> list[str]:
    vllm_kwargs = {"disable_log_stats": False}
    if decoding.startswith("speculative"):
        vllm_kwargs["speculative_config"] = spec
    out = [
        f"grpo.max_num_steps={steps}",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "loss_fn.use_importance_sampling_correction=true",
        "loss_fn.truncated_importance_sampling_ratio=2.0",
        f"policy.generation.vllm_kwargs={json.dumps(vllm_kwargs)}",
        "checkpointing.enabled=false",
        f"logger.log_dir={workdir}/{name}_{decoding}/logs",
        "logger.progress_bar=false",
    ]
    if age:
        out.append("+grpo.async_grpo=" + json.dumps({"enabled": True, "max_trajectory_age_steps": age}))
    return out


def table(results: dict) -> str:
    cols = [
        "step_time_s",
        "exposed_generation_s",
        "logprobs_s",
        "training_s",
        "weight_sync_s",
        "buffer_starvation_s",
        "refit_bubble_s",
        "tokens_per_s",
        "acceptance_length",
        "final_reward",
        "mean_reward",
        "final_accuracy",
        "max_trajectory_age",
        "speedup_vs_sync",
        "overlap_bound",
    ]
    lines = ["| mode | " + " | ".join(cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'].splitlines()[-1][:120]} |")
            continue
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib  # lazy: matplotlib only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot

    names = [n for n, r in results.items() if "error" not in r]
    parts = [
        ("exposed_generation_s", "exposed generation"),
        ("logprobs_s", "log-probs"),
        ("training_s", "training"),
        ("weight_sync_s", "refit"),
    ]
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(names)), 4))
    bottom = [0.0] * len(names)
    for key, label in parts:
        vals = [results[n].get(key) or 0.0 for n in names]
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    other = [max(0.0, results[n]["step_time_s"] - b) for n, b in zip(names, bottom)]
    ax.bar(names, other, bottom=bottom, label="other (scoring, overhead)")
    ax.set_ylabel("seconds per step (mean, steps 2..N)")
    ax.set_title("GRPO step time: sync vs async, autoregressive vs speculative")
    ax.legend(fontsize=7)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(out: Path, results: dict) -> str:
    """Write ``out``'s .md table and .png plot; returns the table."""
    md = table(results)
    out.with_suffix(".md").write_text(md + "\n")
    plot(results, out.with_suffix(".png"))
    return md


def add_speedups(results: dict) -> None:
    """In place, per decoding: ``speedup_vs_sync`` = sync step time / the mode's step time, and on async rows
    ``overlap_bound`` = sync step time / (sync step time - sync exposed generation)."""
    for decoding in sorted({k.split("/")[1] for k in results}):
        sync = results.get(f"sync/{decoding}", {})
        ref, gen = sync.get("step_time_s"), sync.get("exposed_generation_s")
        for name, age in MODES:
            r = results.get(f"{name}/{decoding}")
            if r and "error" not in r and ref:
                r["speedup_vs_sync"] = ref / r["step_time_s"]
                if age and gen is not None and ref > gen:
                    r["overlap_bound"] = ref / (ref - gen)


RATIO_KEYS = {"generation": "exposed_generation_s", "step": "step_time_s", "training": "training_s"}


def ratios_vs_autoregressive(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per speculative mode ``<name>/speculative[@variant]``: its seconds over ``<name>/autoregressive``'s, per
    repeat (repeat i against repeat i: the two ran side by side in the same pass) and of the means, for generation
    (exposed), the whole step and training."""
    out = {}
    for key, spec_runs in runs.items():
        name, decoding = key.split("/")
        ar_runs = runs.get(f"{name}/autoregressive")
        if not decoding.startswith("speculative") or not ar_runs:
            continue
        pairs = [(s, a) for s, a in zip(spec_runs, ar_runs) if "error" not in s and "error" not in a]
        if not pairs:
            continue
        row = {}
        for label, field in RATIO_KEYS.items():
            per = [s[field] / a[field] for s, a in pairs if a.get(field)]
            row[label] = {
                "per_repeat": per,
                "of_means": _mean([s[field] for s, _ in pairs]) / _mean([a[field] for _, a in pairs]),
                "spec_s": [s[field] for s, _ in pairs],
                "ar_s": [a[field] for _, a in pairs],
            }
        row["draft_train_s"] = [s.get("draft_train_s") for s, _ in pairs]
        row["spec_num_drafts"] = [s.get("spec_num_drafts") for s, _ in pairs]
        out[key] = row
    return out


def ratio_table(ratios: dict[str, dict]) -> str:
    """Markdown: per speculative mode, generation / step / training seconds over autoregressive's."""
    lines = [
        "| mode | generation ratio (per repeat) | generation, of means | step ratio (per repeat) | "
        "step, of means | training, of means | draft training s | drafts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in ratios.items():

        def per(label: str, r: dict = r) -> str:
            return " ".join(f"{x:.3f}" for x in r[label]["per_repeat"])

        draft = [x for x in r["draft_train_s"] if x is not None and not math.isnan(x)]
        lines.append(
            f"| {key} | {per('generation')} | {r['generation']['of_means']:.3f} | {per('step')} | "
            f"{r['step']['of_means']:.3f} | {r['training']['of_means']:.3f} | "
            f"{_mean(draft):.2f} | {r['spec_num_drafts']} |"
        )
    return "\n".join(lines)


def merge(paths: list[str], out: Path) -> str:
    """Combine the ``modes`` of several outputs (later files win) into ``out``, keeping each file's settings under
    ``settings.sources`` and their machine as ``machine`` (:func:`~nemo_rl_spec.utils.machine.sources_machine`);
    returns the table."""
    results, sources, docs = {}, [], []
    for path in paths:
        docs.append(doc := json.loads(Path(path).read_text()))
        results.update(doc["modes"])
        sources.append({"file": str(path), "modes": sorted(doc["modes"]), "settings": doc.get("settings")})
    add_speedups(results)
    write_bench_json(
        out, {"modes": results, "settings": {"sources": sources}}, machine=sources_machine(docs), indent=2, default=str
    )
    return write_reports(out, results)


def mode_recipe(args: argparse.Namespace, key: str, spec: dict | None, workdir: Path) -> tuple[str, list[str]]:
    """The recipe and overrides mode ``key`` ("<name>/<decoding>") runs with: ``--spec-recipe`` (else ``--config``)
    for the speculative modes, then the common overrides, the mode's own (:func:`mode_overrides`) and, for
    ``speculative@NAME``, the variant's. ``grpo_setup.preflight`` resolves the result as for any run (e.g. a
    ``speculative@k0`` variant whose schedule never drafts runs with its online draft frozen)."""
    name, decoding = key.split("/")
    speculative = decoding.startswith("speculative")
    variant = args.variants.get(decoding.partition("@")[2], []) if speculative else []
    overrides = [
        *args.overrides,
        *mode_overrides(name, dict(MODES)[name], decoding, spec, args.steps, workdir),
        *variant,
    ]
    return (args.spec_recipe if speculative and args.spec_recipe else args.config), overrides


def run_with_attempts(
    args: argparse.Namespace, key: str, spec: dict | None, spec_error: str | None, workdir: Path
) -> dict:
    """One run of mode ``key`` ("<name>/<decoding>"), retried up to ``--attempts`` times (Ray's startup can time out
    on a loaded machine); a mode that keeps failing returns ``{"error": traceback}`` so the others still run."""
    name, decoding = key.split("/")
    speculative = decoding.startswith("speculative")
    if speculative and spec_error:
        return {"error": spec_error}
    age = dict(MODES)[name]
    config, overrides = mode_recipe(args, key, spec, workdir)
    result: dict = {}
    for attempt in range(1, args.attempts + 1):
        print(f"=== {key} (attempt {attempt})", flush=True)
        try:
            result = run_mode(config, overrides, is_async=age > 0, speculative=speculative)
            result["attempts"] = attempt
            return result
        except KeyboardInterrupt:
            raise
        except Exception:  # noqa: BLE001 - one failed mode must not lose the others
            result = {"error": traceback.format_exc(), "attempts": attempt}
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.replot:
        print(write_reports(out, json.loads(out.read_text())["modes"]))
        return 0
    if args.merge:
        print(merge(args.merge, out))
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_sync_async_"))
    base = load_config(args.config, args.overrides)
    spec, spec_error = None, None
    if any(d.startswith("speculative") for d in args.decoding):
        try:
            spec = speculative_config(args, base.policy.model_name, workdir)
        except Exception:  # noqa: BLE001 - reported per mode
            spec_error = traceback.format_exc()
    keys = [f"{name}/{decoding}" for decoding in args.decoding for name, _ in MODES if name in args.modes]
    order = schedule(keys, args.repeats)
    runs: dict[str, list[dict]] = {k: [] for k in keys}
    results: dict[str, dict] = {}
    for repeat, key in order:
        runs[key].append(run_with_attempts(args, key, spec, spec_error, workdir / f"repeat{repeat}"))
        results[key] = combine_repeats(runs[key]) if args.repeats > 1 else runs[key][-1]
        print(json.dumps({key: runs[key][-1]}, default=str), flush=True)
        write_bench_json(out, {"modes": results}, indent=2, default=str)
    add_speedups(results)
    ratios = ratios_vs_autoregressive(runs)
    settings = {
        "config": args.config,
        "spec_recipe": args.spec_recipe,
        "steps": args.steps,
        "overrides": args.overrides,
        "repeats": args.repeats,
        "order": [k for _, k in order],
        "spec_variants": args.variants,
        "speculative_config": spec,
        "note": "means over steps 2..N; see examples/bench_sync_vs_async.py",
    }
    write_bench_json(
        out, {"modes": results, "ratios_vs_autoregressive": ratios, "settings": settings}, indent=2, default=str
    )
    print(write_reports(out, results))
    if ratios:
        print(ratio_table(ratios))
    from nemo_rl_spec.algorithms.grpo_setup import teardown  # lazy: loads ray or megatron-core

    teardown(None)  # stop Ray
    return 0
