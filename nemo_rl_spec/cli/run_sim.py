"""Performance simulator of RL steps with speculative rollouts (nemo_rl_spec.sim).

    python examples/run_sim.py --out results/sim/sim.json             # every scenario in configs/sim and the sweeps
    python examples/run_sim.py calibrate --metrics logs/<run>/metrics.jsonl [--spec-metrics ...] \\
        [--scenario configs/sim/cpu_smollm2_default.yaml] --out results/sim/cpu_fitted.yaml
    python examples/run_sim.py fidelity --metrics logs/<run>/metrics.jsonl [--recipe configs/<recipe>.yaml] \\
        [--spec-metrics ... --spec-recipe configs/<recipe>.yaml --spec-override k=v ...] --out results/sim/fidelity.json
    python examples/run_sim.py spec-bench --out results/sim/spec_bench.json
    python examples/run_sim.py project-spec --bench BENCH.json [BENCH2.json ...] --out PROJECTION.json

The default sweep prints a table and writes JSON and PNG plots. ``calibrate`` fits the CPU profile to a measured
run (``--spec-metrics`` adds the AR-fit -> speculative-run check); ``fidelity`` fits on the first half of an AR run
and predicts the held-out half; ``spec-bench`` times vLLM on this CPU with and without EAGLE-3; ``project-spec``
projects a measured rollout benchmark (``bench_spec_rollouts`` or ``bench_spec_schedule`` JSONs) to GPUs: same
acceptance, simulated costs, labelled a projection. ``--help`` of each subcommand lists its options.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from nemo_rl_spec.sim import paper, report, sweeps
from nemo_rl_spec.sim.calibrate import calibrate, read_jsonl
from nemo_rl_spec.sim.config import CONFIG_DIR, load_scenario, scenario_files
from nemo_rl_spec.sim.cpu_profile import DESIGN_DECODE_STEPS, design_fit_errors
from nemo_rl_spec.sim.fidelity import fidelity, format_table, scenario_from_recipe
from nemo_rl_spec.sim.formulas import expected_tokens_per_pass, speculative_speedup
from nemo_rl_spec.sim.projection import main as project_spec_main
from nemo_rl_spec.sim.simulate import generation_traces, pass_cost_ratios, simulate
from nemo_rl_spec.sim.spec_bench import main as spec_bench_main
from nemo_rl_spec.sim.step import resolve
from nemo_rl_spec.utils.config import apply_overrides, load_yaml_with_defaults

REPO = Path(__file__).resolve().parents[2]  # the repository root (docs/, configs/)

PUBLISHED_FORMULA_CASES = ((0.8, 3, 0.05), (0.6, 2, 0.1), (0.0, 3, 0.05))


def formula_checks() -> list[dict[str, float]]:
    """Expected tokens per pass and speedup for the published (alpha, k, c) cases."""
    return [
        {
            "alpha": a,
            "k": k,
            "draft_cost": c,
            "tokens_per_pass": expected_tokens_per_pass(a, k),
            "speedup": speculative_speedup(a, k, c),
        }
        for a, k, c in PUBLISHED_FORMULA_CASES
    ]


def result_entry(scn, res) -> dict[str, Any]:
    """JSON entry of one scenario: speedups, phases, drivers and the paper comparison when published values exist."""
    entry = {
        "generation_speedup": res.generation_speedup,
        "e2e_speedup": res.e2e_speedup,
        "ar_step_s": res.ar_step_s,
        "spec_step_s": res.spec_step_s,
        "ar": res.ar.model_dump(),
        "spec": res.spec.model_dump(),
        "details": res.details,
        "description": scn.description,
    }
    if scn.paper:
        entry["paper_comparison"] = paper.compare_to_paper(scn, res)
    return entry


def run_sweeps(scns: dict[str, Any]) -> dict[str, Any]:
    """k, acceptance, batch, hardware and scale sweeps around the shipped scenarios."""
    zero, think = scns["paper_8b_rl_zero"], scns["paper_8b_rl_think"]
    big, cpu = scns["qwen3_235b_2048gb200_async"], scns["cpu_smollm2_default"]
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    batch = {
        f"{hw} 8B, {ctx} ctx": sweeps.pass_speedup_vs_batch(zero, batches, float(ctx), hw)
        for hw in ("h100", "gb200")
        for ctx in (512, 4096)
    }
    batch["cpu smollm2 (random head), 128 ctx"] = sweeps.pass_speedup_vs_batch(cpu, [1, 2, 4, 8, 16, 32, 64], 128.0)
    return {
        "k": {name: sweeps.k_sweep(s) for name, s in (("paper_8b_rl_zero", zero), ("paper_8b_rl_think", think))},
        "k_shape": {
            name: paper.k_sweep_shape(s) for name, s in (("paper_8b_rl_zero", zero), ("paper_8b_rl_think", think))
        },
        "acceptance": sweeps.acceptance_sweep(zero),
        "batch": batch,
        "concurrency": sweeps.concurrency_sweep(zero),
        "hardware": sweeps.hardware_sweep(zero),
        "scale": sweeps.scale_sweep(big),
    }


FIDELITY_DIR = REPO / "docs" / "results" / "simulator" / "fidelity"


def measured_fidelity() -> dict[str, Any]:
    """Per-phase errors of the committed fidelity reports (docs/results/simulator/fidelity/fidelity_*.json, written by
    ``run_sim.py fidelity``), keyed by file stem; empty when there are none."""
    out: dict[str, Any] = {}
    for path in sorted(FIDELITY_DIR.glob("fidelity_*.json")):
        rep = json.loads(path.read_text())
        out[path.stem] = {
            key: {ph: v["error"] for ph, v in rep[key]["phases"].items()}
            for key in ("ar_holdout", "ar_prior", "spec", "spec_prior")
            if key in rep
        }
    return out


def write_plots(out: Path, scns: dict[str, Any], sw: dict[str, Any]) -> list[str]:
    """All plots, named <out stem>_<kind>.png next to the JSON."""
    stem = out.with_suffix("")
    pub = {n: scns[n].paper for n in ("paper_8b_rl_zero", "paper_8b_rl_think")}
    c1 = pass_cost_ratios(resolve(scns["paper_8b_rl_zero"]), 1.0, 2200.0)["draft_cost"]  # draft cost at batch 1
    closed = [speculative_speedup(r["alpha"], 3, c1) for r in sw["acceptance"]]
    measured = [(b, plain / eagle) for b, (plain, eagle) in DESIGN_DECODE_STEPS.items()]
    ar, sp = generation_traces(scns["paper_8b_rl_zero"])
    paths = [
        report.plot_k_sweep(sw["k"], pub, Path(f"{stem}_k_sweep.png")),
        report.plot_acceptance(sw["acceptance"], closed, Path(f"{stem}_acceptance.png")),
        report.plot_batch(sw["batch"], sw["concurrency"], measured, Path(f"{stem}_batch.png")),
        report.plot_scale(sw["scale"], Path(f"{stem}_scale.png")),
        report.plot_traces(ar, sp, "RL-Zero generation, slowest engine", Path(f"{stem}_trace.png")),
    ]
    return [str(p) for p in paths]


def sweep_main(args: argparse.Namespace) -> int:
    """Run everything, print the table and the paper comparison, write JSON (+ plots)."""
    scns = {load_scenario(f).name: load_scenario(f) for f in scenario_files(args.config_dir)}
    results = {name: simulate(s) for name, s in scns.items()}
    big = scns["qwen3_235b_2048gb200_async"]
    proj = paper.projection(big)
    sw = run_sweeps(scns)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "formulas": formula_checks(),
        "scenarios": {n: result_entry(scns[n], r) for n, r in results.items()},
        "projection_235b": proj,
        "sweeps": sw,
        "cpu_profile": {
            "design_fit_errors": design_fit_errors().tolist(),
            "fidelity_vs_measured_run": measured_fidelity(),
        },
    }
    for row in proj["rows"]:
        doc["scenarios"][f"{big.name}_k{row['k']}"] = {
            "generation_speedup": row["generation_speedup"],
            "e2e_speedup": row["e2e_speedup"],
            **row,
        }
    doc["hardware_8b_rl_zero"] = {r["hardware"]: r for r in sw["hardware"]}
    if not args.no_plots:
        doc["plots"] = write_plots(out, scns, sw)
    out.write_text(json.dumps(report.to_jsonable(doc), indent=1))
    print_summary(list(results.values()), doc)
    print(f"wrote {out}")
    return 0


def print_summary(results: list, doc: dict[str, Any]) -> None:
    """Table of scenarios, paper errors, k-sweep shape and projection."""
    print(report.table(results))
    for name, entry in doc["scenarios"].items():
        for key, cmp in entry.get("paper_comparison", {}).items():
            print(
                f"  {name:<22} {key:<20} predicted {cmp['predicted']:8.3f}  paper {cmp['paper']:8.3f}"
                f"  error {100 * cmp['error']:+6.1f}%"
            )
    for name, shape in doc["sweeps"]["k_shape"].items():
        steps = ", ".join(f"k={k}: {t:.1f}s" for k, t in shape["spec_step_s"].items())
        print(f"  k sweep {name}: {steps}; best k={shape['best_k']}; k7 slower than k3: {shape['k7_slower_than_k3']}")
    for row in doc["projection_235b"]["rows"]:
        print(
            f"  235B async k={row['k']}: generation {row['generation_speedup']:.2f}x, e2e {row['e2e_speedup']:.2f}x"
            f" (vs sync AR: e2e {row['e2e_speedup_vs_sync_ar']:.2f}x; sync only: generation "
            f"{row['sync_generation_speedup']:.2f}x, e2e {row['sync_e2e_speedup']:.2f}x)"
        )


def calibrate_main(argv: list[str]) -> int:
    """Fit a scenario to measured metrics.jsonl files; print the report; write the fitted scenario YAML."""
    p = argparse.ArgumentParser(prog="run_sim.py calibrate", description=calibrate.__doc__)
    p.add_argument("--metrics", required=True, help="metrics.jsonl of the autoregressive run")
    p.add_argument("--spec-metrics", help="metrics.jsonl of the speculative run (fidelity check)")
    p.add_argument("--scenario", default=str(CONFIG_DIR / "cpu_smollm2_default.yaml"))
    p.add_argument("--skip", type=int, default=1, help="warm-up steps to ignore")
    p.add_argument("--out", required=True, help="fitted scenario YAML")
    args = p.parse_args(argv)
    spec = read_jsonl(args.spec_metrics) if args.spec_metrics else None
    fitted, rep = calibrate(load_scenario(args.scenario), read_jsonl(args.metrics), spec, args.skip)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = fitted.model_dump(exclude_none=True)
    data["name"] = f"{fitted.name}_fitted"
    out.write_text(yaml.safe_dump(report.to_jsonable(data), sort_keys=False))
    print(json.dumps(report.to_jsonable(rep), indent=1))
    print(f"wrote {out}")
    return 0


def load_recipe(path: str, overrides: list[str]) -> dict[str, Any]:
    """A GRPO recipe (``defaults:`` merged, ``key=value`` overrides applied, interpolations resolved) as a dict."""
    return OmegaConf.to_container(apply_overrides(load_yaml_with_defaults(path), overrides), resolve=True)


def fidelity_main(argv: list[str]) -> int:
    """Held-out fidelity of a scenario against measured runs; prints tables, writes the JSON report."""
    p = argparse.ArgumentParser(prog="run_sim.py fidelity", description=fidelity.__doc__)
    p.add_argument("--metrics", required=True, help="metrics.jsonl of the autoregressive run")
    p.add_argument("--config", default=str(CONFIG_DIR / "cpu_smollm2_default.yaml"), help="scenario YAML")
    p.add_argument(
        "--recipe",
        default=str(REPO / "configs" / "grpo_math_smollm2_135m.yaml"),
        help="GRPO recipe of the AR run (batch sizes, response cap)",
    )
    p.add_argument("--override", action="append", default=[], help="recipe override of the AR run, key=value")
    p.add_argument("--spec-metrics", help="metrics.jsonl of a speculative run (predicted, never fitted)")
    p.add_argument("--spec-recipe", help="GRPO recipe of the speculative run (k, draft); default --recipe")
    p.add_argument("--spec-override", action="append", default=[], help="override of the speculative recipe")
    p.add_argument("--warmup", type=int, default=1, help="timed steps dropped at the start of each run")
    p.add_argument("--n-fit", type=int, default=None, help="AR steps after warm-up to fit on (default: half)")
    p.add_argument(
        "--fit-metrics",
        help="fit on this other AR run instead (all steps after warm-up) and hold out "
        "every step of --metrics after warm-up (cross-run check)",
    )
    p.add_argument("--out", required=True, help="JSON report")
    args = p.parse_args(argv)
    scn = scenario_from_recipe(load_scenario(args.config), load_recipe(args.recipe, args.override))
    spec_scn = spec = None
    if args.spec_metrics:
        spec = read_jsonl(args.spec_metrics)
        spec_scn = scenario_from_recipe(
            load_scenario(args.config), load_recipe(args.spec_recipe or args.recipe, args.spec_override)
        )
    fit_runs = read_jsonl(args.fit_metrics) if args.fit_metrics else None
    rep = fidelity(scn, read_jsonl(args.metrics), spec, args.warmup, args.n_fit, spec_scn, fit_runs)
    rep["inputs"] = {
        "metrics": args.metrics,
        "config": args.config,
        "recipe": args.recipe,
        "override": args.override,
        "spec_metrics": args.spec_metrics,
        "spec_recipe": args.spec_recipe,
        "spec_override": args.spec_override,
        "warmup": args.warmup,
        "n_fit": args.n_fit,
        "fit_metrics": args.fit_metrics,
    }
    fit = rep["fit"]
    print(
        f"fit on AR steps {fit['steps']}: measured/predicted "
        + ", ".join(f"{k} {v:.3f}" for k, v in fit["ratios"].items())
        + f"; refit fixed cost {fit['refit_overhead_s']:.2f} s; other {fit['other_s']:.2f} s"
    )
    for key, title in (
        ("ar_holdout", "AR, held-out steps, fitted profile"),
        ("ar_prior", "AR, same steps, a-priori profile (docs/results/cpu_step_costs.md micro-benchmarks)"),
        ("spec", "speculative run, AR-fitted profile"),
        ("spec_prior", "speculative, a-priori"),
    ):
        if key in rep:
            print(f"\n{title} (steps {rep[key]['steps']}):\n{format_table(rep, key)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report.to_jsonable(rep), indent=1))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``calibrate ...`` fits a scenario to measured runs, ``fidelity ...`` checks held-out predictions,
    ``spec-bench ...`` measures vLLM with and without speculation, ``project-spec ...`` projects a measured
    rollout benchmark (or the long-tail recipe's schedule benchmarks) to GPUs; anything else runs the sweep. Returns the
    exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "calibrate":
        return calibrate_main(argv[1:])
    if argv and argv[0] == "fidelity":
        return fidelity_main(argv[1:])
    if argv and argv[0] == "spec-bench":
        return spec_bench_main(argv[1:])
    if argv and argv[0] == "project-spec":
        return project_spec_main(argv[1:])
    epilog = (
        "subcommands (each with its own --help): calibrate (fit a scenario to a measured run), fidelity (held-out "
        "predictions against a run), spec-bench (vLLM with and without speculation), project-spec (a measured "
        "rollout benchmark projected to GPUs); without one, the sweep over every scenario runs"
    )
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=epilog)
    p.add_argument("--out", required=True, help="JSON output; plots are written next to it")
    p.add_argument("--config-dir", default=str(CONFIG_DIR))
    p.add_argument("--no-plots", action="store_true")
    return sweep_main(p.parse_args(argv))
