"""Text table and plots of simulator results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from nemo_rl_spec.sim.interfaces import GenerationResult, StepResult

COLUMNS = ("scenario", "AR gen s", "SD gen s", "AR step s", "SD step s", "gen x", "e2e x")


def table(results: Sequence[StepResult]) -> str:
    """Fixed-width table: per scenario the AR and speculative (SD) generation and step seconds and speedups."""
    width = max([len(COLUMNS[0])] + [len(r.name) for r in results])
    lines = [f"{COLUMNS[0]:<{width}}" + "".join(f"{c:>11}" for c in COLUMNS[1:])]
    for r in results:
        vals = (r.ar.generation, r.spec.generation, r.ar_step_s, r.spec_step_s, r.generation_speedup, r.e2e_speedup)
        lines.append(
            f"{r.name:<{width}}" + "".join(f"{v:>11.2f}" for v in vals[:4]) + "".join(f"{v:>10.3f}x" for v in vals[4:])
        )
    return "\n".join(lines)


def _figure(ncols: int = 1):
    import matplotlib  # lazy: matplotlib only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot

    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4), squeeze=False)
    return fig, axes[0]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot

    plt.close(fig)
    return path


def plot_k_sweep(sweeps: dict[str, list[dict]], paper: dict[str, dict], path: Path) -> Path:
    """Generation and end-to-end speedup vs k per workload; the paper's k = 3 measurements as stars."""
    fig, (ax_g, ax_e) = _figure(2)
    for name, rows in sweeps.items():
        ks = [r["k"] for r in rows]
        line = ax_g.plot(ks, [r["generation_speedup"] for r in rows], "o-", label=name)[0]
        ax_e.plot(ks, [r["e2e_speedup"] for r in rows], "o-", color=line.get_color(), label=name)
        ref = paper.get(name, {})
        for ax, key in ((ax_g, "generation_speedup"), (ax_e, "e2e_speedup")):
            if ref.get(key):
                ax.plot([3], [ref[key]], "*", ms=14, color=line.get_color())
    for ax, title in ((ax_g, "generation speedup"), (ax_e, "end-to-end speedup")):
        ax.set(xlabel="draft length k", ylabel=title, title=f"{title} vs k (stars: paper, k=3)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def plot_acceptance(rows: list[dict], closed_form: list[float], path: Path) -> Path:
    """Simulated speedups vs per-position acceptance, with Leviathan's closed form for reference."""
    fig, (ax,) = _figure()
    a = [r["alpha"] for r in rows]
    ax.plot(a, [r["generation_speedup"] for r in rows], "o-", label="generation (simulated)")
    ax.plot(a, [r["e2e_speedup"] for r in rows], "s-", label="end to end (simulated)")
    ax.plot(a, closed_form, "--", label="closed form E/(kc+1), c at batch 1")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(xlabel="per-position acceptance alpha", ylabel="speedup", title="speedup vs acceptance (k=3)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_batch(
    curves: dict[str, list[dict]], concurrency: list[dict], measured: list[tuple[int, float]], path: Path
) -> Path:
    """Left: per-pass speculative gain vs batch per hardware and context (docs/results/cpu_step_costs.md's measured CPU points as
    crosses). Right: RL-Zero phase speedups vs the engine's batch cap."""
    fig, (ax, ax2) = _figure(2)
    for name, rows in curves.items():
        ax.plot([r["batch"] for r in rows], [r["pass_speedup"] for r in rows], "-", label=name)
    if measured:
        ax.plot(*zip(*measured), "kx", ms=9, label="cpu measured (docs/results/cpu_step_costs.md)")
    ax.set_xscale("log", base=2)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set(xlabel="batch (sequences)", ylabel="pass speedup", title="speculative gain per pass vs batch")
    ax.legend(fontsize=7)
    caps = [r["max_num_seqs"] for r in concurrency]
    ax2.plot(caps, [r["generation_speedup"] for r in concurrency], "o-", label="generation")
    ax2.plot(caps, [r["e2e_speedup"] for r in concurrency], "s-", label="end to end")
    ax2.set_xscale("log", base=2)
    ax2.set(xlabel="engine batch cap (max_num_seqs)", ylabel="speedup", title="RL-Zero phase speedup vs batch cap")
    ax2.legend(fontsize=8)
    for a in (ax, ax2):
        a.grid(alpha=0.3)
    return _save(fig, path)


def plot_scale(rows: list[dict], path: Path) -> Path:
    """235B speedups vs cluster size."""
    fig, (ax,) = _figure()
    n = [r["devices"] for r in rows]
    for key in ("generation_speedup", "e2e_speedup", "e2e_speedup_vs_sync_ar"):
        ax.plot(n, [r[key] for r in rows], "o-", label=key)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="GPUs (fixed rollouts per step)", ylabel="speedup", title="Qwen3-235B-A22B async: speedup vs scale")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_traces(ar: GenerationResult, spec: GenerationResult, title: str, path: Path) -> Path:
    """Active sequences vs time on the slowest engine, autoregressive vs speculative: the drain and the tail."""
    fig, (ax,) = _figure()
    for res, label in ((ar, "autoregressive"), (spec, "speculative")):
        ax.plot(np.cumsum(res.time_trace), res.batch_trace, label=f"{label} ({res.seconds:.1f} s)")
    ax.set(xlabel="seconds", ylabel="active sequences", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def to_jsonable(obj: Any) -> Any:
    """Numpy scalars/arrays and nested containers -> plain JSON types."""
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    return obj
