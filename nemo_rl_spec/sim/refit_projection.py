"""Refit seconds and their share of an RL step for each refit transport (a simulator projection, not a measurement).

    .venv/bin/python -m nemo_rl_spec.sim.refit_projection --out docs/results/simulator/refit_transport_235b.json

For a scenario (default: the 2048-GB200 Qwen3-235B async projection) it simulates the step with the lumped refit
model and with each transport of :mod:`nemo_rl_spec.sim.refit` (ray with sender-served and tree pulls, nccl, and
cuda_ipc where the layout is colocated), in the scenario's own layout and in a synchronous colocated variant, and
prints and writes refit seconds, step seconds and refit's share of the step, autoregressive and speculative.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from nemo_rl_spec.sim.config import CONFIG_DIR, load_scenario
from nemo_rl_spec.sim.interfaces import RefitSpec, ScenarioSpec
from nemo_rl_spec.sim.model_math import total_params
from nemo_rl_spec.sim.simulate import simulate
from nemo_rl_spec.sim.step import resolve
from nemo_rl_spec.sim.sweeps import with_speculation

DEFAULT_CONFIG = CONFIG_DIR / "qwen3_235b_2048gb200_async.yaml"
#: (label, refit spec fields or None for the lumped model)
VARIANTS: tuple[tuple[str, Optional[dict[str, Any]]], ...] = (
    ("lumped (refit: null)", None),
    ("ray (sender pulls)", {"transport": "ray", "ray_fetch": "sender"}),
    ("ray (tree pulls)", {"transport": "ray", "ray_fetch": "tree"}),
    ("nccl", {"transport": "nccl"}),
    ("cuda_ipc", {"transport": "cuda_ipc"}),
)
NOTE = "simulator projection from assumed bandwidths and latencies (RefitSpec defaults), not a measurement"


def layouts(scenario: ScenarioSpec) -> dict[str, ScenarioSpec]:
    """The scenario as given and, when it is not already one, its synchronous colocated variant."""
    out = {f"{scenario.mode}, {'colocated' if scenario.layout.colocated else 'split'}": scenario}
    if scenario.mode != "sync" or not scenario.layout.colocated:
        data = scenario.model_dump()
        data.update(mode="sync")
        data["layout"]["colocated"] = True
        out["sync, colocated"] = ScenarioSpec.model_validate(data)
    return out


def with_refit(scenario: ScenarioSpec, refit: Optional[dict[str, Any]]) -> ScenarioSpec:
    """``scenario`` with its ``refit`` section replaced (None: the lumped model), validated."""
    return ScenarioSpec.model_validate({**scenario.model_dump(), "refit": refit})


def transport_row(layout: str, label: str, scenario: ScenarioSpec) -> dict[str, Any]:
    """One row: refit and step seconds, refit share of the step (refit / step), AR and speculative, the speedup."""
    r = simulate(scenario)
    return {
        "layout": layout,
        "transport": label,
        "ar_refit_s": r.ar.refit,
        "ar_step_s": r.ar_step_s,
        "ar_refit_share": r.ar.refit / r.ar_step_s,
        "spec_refit_s": r.spec.refit,
        "spec_step_s": r.spec_step_s,
        "spec_refit_share": r.spec.refit / r.spec_step_s,
        "e2e_speedup": r.e2e_speedup,
        "ar_gen_devices": r.details.get("ar_gen_devices", float(scenario.layout.total_devices)),
        "spec_gen_devices": r.details.get("spec_gen_devices", float(scenario.layout.total_devices)),
    }


def transport_rows(scenario: ScenarioSpec) -> list[dict[str, Any]]:
    """:func:`transport_row` for every layout of :func:`layouts` and every variant it admits (cuda_ipc: colocated)."""
    rows = []
    for name, scn in layouts(scenario).items():
        for label, refit in VARIANTS:
            if refit and refit["transport"] == "cuda_ipc" and not scn.layout.colocated:
                continue
            rows.append(transport_row(name, label, with_refit(scn, refit)))
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of :func:`transport_rows` (seconds, shares in percent)."""
    head = "| layout | transport | AR refit s | AR step s | refit share AR | spec refit s | spec step s | "
    head += "refit share spec | e2e speedup | gen GPUs AR / spec |\n|---|---|---|---|---|---|---|---|---|---|"
    lines = [
        f"| {r['layout']} | {r['transport']} | {r['ar_refit_s']:.2f} | {r['ar_step_s']:.1f} | "
        f"{100 * r['ar_refit_share']:.1f}% | {r['spec_refit_s']:.2f} | {r['spec_step_s']:.1f} | "
        f"{100 * r['spec_refit_share']:.1f}% | {r['e2e_speedup']:.2f}x | "
        f"{r['ar_gen_devices']:.0f} / {r['spec_gen_devices']:.0f} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def report(scenario: ScenarioSpec) -> dict[str, Any]:
    """JSON-able result: scenario, k, weight bytes, the RefitSpec defaults assumed, the rows and the note."""
    res = resolve(scenario)
    return {
        "note": NOTE,
        "scenario": scenario.name,
        "k": scenario.speculative.k,
        "weight_bytes": total_params(res.model) * res.model.bytes_per_param,
        "draft_bytes": total_params(res.draft) * res.draft.bytes_per_param,
        "refit_defaults": RefitSpec(transport="nccl").model_dump(exclude={"transport"}),
        "rows": transport_rows(scenario),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Print the per-transport table of a scenario and write it as JSON. Returns the exit code."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="scenario YAML")
    p.add_argument("--k", type=int, default=None, help="draft length (default: the scenario's), same acceptance")
    p.add_argument("--out", required=True, help="JSON output")
    args = p.parse_args(argv)
    scn = load_scenario(args.config)
    if args.k is not None:
        scn = with_speculation(scn, args.k, resolve(scn).alpha)
    doc = report(scn)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"{doc['scenario']}, k={doc['k']}, {doc['weight_bytes'] / 1e9:.0f} GB of weights; {NOTE}")
    print(format_table(doc["rows"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
