"""Per-component cost of one vLLM engine step, from the timings ``examples/bench_spec_rollouts.py`` takes inside the
engine (``--k0-profile``: k = 0 steps; ``--spec-profile``: steps that carry k > 0 drafts).

The engine-side timer (``ComponentTimer`` in the example) adds up, per engine step, the seconds spent in a few of
the model runner's calls (the *measured* keys: :data:`MAIN`, :data:`SPEC_DETAIL`). This module turns those raw sums
into components (the *derived* keys are residuals: :func:`step_parts`), reduces a run to its median step and a set
of interleaved runs to their quietest value per component, and prints the tables. It imports neither vLLM nor
torch, so the unit tests check it alone.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

MAIN = ("target_forward", "target_logits", "sampling", "drafter")
"""Measured on every engine: the keys the ``bookkeeping`` residual subtracts (seconds per engine step).

- ``target_forward``: the target model's forward (``GPUModelRunner._model_forward``; on an EAGLE-3 engine this
  includes the aux hidden-state capture).
- ``target_logits``: the target's ``compute_logits``.
- ``sampling``: ``GPUModelRunner._sample`` (vLLM's ``Sampler``, or its ``RejectionSampler`` on a step with drafts).
- ``drafter``: ``propose_draft_token_ids`` (drafter input preparation, the aux hidden-state concat, its passes and
  draft sampling).
"""
SPEC_DETAIL = (
    "rs_forward",
    "rs_bonus",
    "rs_processors",
    "rs_constraints",
    "rs_accept",
    "rs_logprobs",
    "drafter_kv_pass",
    "drafter_forward",
    "drafter_sample",
)
"""Measured only with ``detail`` (the spec profile): parts of ``sampling`` and ``drafter``.

- ``rs_forward``: ``RejectionSampler.forward`` as a whole.
- ``rs_bonus``: the plain ``Sampler`` call inside it (the bonus token of every request).
- ``rs_processors``: ``RejectionSampler.apply_logits_processors`` (penalties, bad words, min tokens).
- ``rs_constraints``: ``apply_sampling_constraints`` (temperature division of the target logits, top-k / top-p,
  the per-request -> per-token expansion).
- ``rs_accept``: ``rejection_sample`` (target argmax / softmax, recovered tokens, the accept / reject kernels).
- ``rs_logprobs``: ``RejectionSampler._get_logprobs_tensors`` (log-probs of the accepted tokens).
- ``drafter_kv_pass``: the drafter model's first forward of the step (over every token the target verified: it
  writes the drafter's KV for them and yields the first draft position).
- ``drafter_forward``: the drafter model's later forwards of the step (draft positions 2..k, one token each).
- ``drafter_sample``: the drafter's ``_sample_draft_tokens`` (its ``compute_logits`` over its vocabulary, argmax
  or, drafting probabilistically, softmax and sampling).
"""
COMPONENTS = (*MAIN, "bookkeeping")
"""The k = 0 profile's columns."""
SPEC_COMPONENTS = (
    "target_forward",
    "target_logits",
    "drafter",
    "sampling",
    "bookkeeping",
)
"""The spec profile's main table: the step by component (each also as a share of the step)."""
SPEC_DETAIL_COLUMNS = (
    "drafter_kv_pass",
    "drafter_forward",
    "drafter_sample",
    "drafter_other",
    "rs_bonus",
    "logits_copies",
    "rs_constraints",
    "rs_accept",
    "rs_logprobs",
    "rs_processors",
    "sampling_other",
)
"""The spec profile's detail table: the drafter and the rejection sampler taken apart."""
HEADERS = {
    "target_forward": "target forward",
    "target_logits": "target logits",
    "sampling": "sampling",
    "drafter": "drafter",
    "bookkeeping": "bookkeeping",
    "drafter_kv_pass": "drafter KV pass",
    "drafter_forward": "drafter fwd 2..k",
    "drafter_sample": "drafter logits+sample",
    "drafter_other": "drafter other",
    "rs_bonus": "bonus sampler",
    "logits_copies": "logits copies/dtype",
    "rs_constraints": "temperature/top-k/p",
    "rs_accept": "accept/reject",
    "rs_logprobs": "logprobs",
    "rs_processors": "logits processors",
    "sampling_other": "sampling other",
}


def step_parts(step_s: float, measured: Mapping[str, float]) -> dict[str, float]:
    """One engine step's components from its wall time and the measured sums.

    Args:
        step_s: the step's wall seconds.
        measured: seconds per measured key (:data:`MAIN`, optionally :data:`SPEC_DETAIL`); missing detail keys
            count as 0 (an AR engine has no rejection sampler or drafter).

    Returns:
        ``measured`` plus ``step`` and the derived residuals (``bookkeeping``; with any detail key also
        ``logits_copies``, ``sampling_other``, ``drafter_other``), all seconds:

        - ``bookkeeping`` = step - target_forward - target_logits - sampling - drafter (scheduler, input
          preparation, output processing, spec-decode bookkeeping, stats).
        - ``logits_copies`` = rs_forward - rs_bonus - rs_processors - rs_constraints - rs_accept - rs_logprobs: what
          ``RejectionSampler.forward`` does in its own body: indexing the logits into bonus and target rows
          (copies), the target rows' conversion to float32 (a copy in bf16, a no-op in fp32) and their clone.
        - ``sampling_other`` = sampling - rs_forward (draft probabilities handed over, the seed patch's generator
          states).
        - ``drafter_other`` = drafter - drafter_kv_pass - drafter_forward - drafter_sample (input preparation, the
          aux hidden-state concat, positions and slot mappings, drafter attention metadata).

    Raises:
        KeyError: a :data:`MAIN` key is missing from ``measured``.
    """
    out = {key: float(measured[key]) for key in MAIN}
    out["step"] = float(step_s)
    out["bookkeeping"] = step_s - sum(out[key] for key in MAIN)
    if any(key in measured for key in SPEC_DETAIL):
        d = {key: float(measured.get(key, 0.0)) for key in SPEC_DETAIL}
        out.update(d)
        rs_parts = d["rs_bonus"] + d["rs_processors"] + d["rs_constraints"] + d["rs_accept"] + d["rs_logprobs"]
        out["logits_copies"] = d["rs_forward"] - rs_parts if d["rs_forward"] else 0.0
        out["sampling_other"] = out["sampling"] - d["rs_forward"] if d["rs_forward"] else 0.0
        out["drafter_other"] = out["drafter"] - d["drafter_kv_pass"] - d["drafter_forward"] - d["drafter_sample"]
    return out


def keep_step(n_requests: int, n_tokens: int, batch: int, k: int) -> bool:
    """Whether a step is a pure decode step of ``batch`` requests that each carried ``k`` drafts (``k + 1`` tokens
    scheduled per request; k = 0: plain decode). Prefill steps and steps at another batch are left out."""
    return n_requests == batch and n_tokens == batch * (k + 1)


def run_summary(steps: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Median over a run's kept steps, per key (the keys of the first step), plus ``n_steps``.

    Raises:
        ValueError: ``steps`` is empty (no kept step: the run never reached a constant batch).
    """
    if not steps:
        raise ValueError("no kept step in this run (prefill only, or the batch never reached its size)")
    return {key: statistics.median(float(s[key]) for s in steps) for key in steps[0]} | {"n_steps": len(steps)}


def quietest(runs: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per key, the smallest value over interleaved runs (a shared machine only ever adds time). ``n_steps`` is
    left out. Each column is its own minimum, so the components need not add up exactly to ``step``.

    Raises:
        ValueError: ``runs`` is empty.
    """
    if not runs:
        raise ValueError("no runs")
    return {key: min(float(r[key]) for r in runs) for key in runs[0] if key != "n_steps"}


def reduce_runs(runs: Mapping[str, Mapping[int, Sequence[Mapping[str, float]]]]) -> dict[str, dict[int, dict]]:
    """``{engine: {batch: [run summaries]}}`` -> ``{engine: {batch: quietest}}`` (seconds per step)."""
    return {name: {b: quietest(rs) for b, rs in by_b.items()} for name, by_b in runs.items()}


def interleaved_order(names: Sequence[str], rep: int) -> list[str]:
    """Engine order of repeat ``rep``: forward on even repeats, reversed on odd ones (drift cancels)."""
    return list(names) if rep % 2 == 0 else list(names)[::-1]


def _fmt_ms(seconds: float, step: float | None) -> str:
    ms = f"{1e3 * seconds:.1f}"
    return ms if step is None else f"{ms} ({100 * seconds / step:.0f}%)"


def format_component_table(
    table: Mapping[str, Mapping[int, Mapping[str, float]]],
    columns: Iterable[str],
    ar: str = "ar",
    shares: bool = False,
    labels: Mapping[str, str] | None = None,
) -> str:
    """Markdown table: one row per (batch, engine), ms per step by column, and the step over ``ar``'s step.

    Args:
        table: ``{engine: {batch: {key: seconds}}}`` (:func:`reduce_runs`); every engine has the same batches.
        columns: component keys to show after ``step ms``; a key an engine lacks, and a zero ``drafter`` (an engine
            without one), show ``-``.
        ar: the reference engine (its step is the denominator of ``step / AR``).
        shares: also print each component as a percentage of its row's step.
        labels: engine name -> row label (default the name).

    Raises:
        KeyError: ``ar`` is not in ``table``.
    """
    columns = list(columns)
    lines = [
        "| engine | batch | step ms | " + " | ".join(HEADERS.get(c, c) for c in columns) + " | step / AR |",
        "|" + "---|" * (len(columns) + 4),
    ]
    ref = table[ar]
    for b in sorted(ref):
        for name, by_b in table.items():
            c = by_b[b]
            cells = [
                "-"
                if key not in c or (key == "drafter" and c[key] == 0.0)
                else _fmt_ms(c[key], c["step"] if shares else None)
                for key in columns
            ]
            label = (labels or {}).get(name, name)
            lines.append(
                f"| {label} | {b} | {1e3 * c['step']:.1f} | "
                + " | ".join(cells)
                + f" | {c['step'] / ref[b]['step']:.3f} |"
            )
    return "\n".join(lines)


def verification_summary(
    table: Mapping[str, Mapping[int, Mapping[str, float]]], ar: str = "ar"
) -> dict[str, dict[int, dict[str, float]]]:
    """Where a speculative step's extra time over the AR step goes, per engine and batch (ms per step).

    Returns ``{engine: {batch: {"extra_ms": step - AR step, "target_ms": extra target forward + logits,
    "drafter_ms": drafter, "sampling_ms": extra sampling, "bookkeeping_ms": extra bookkeeping}}}`` for every
    engine but ``ar``. The four parts add up to ``extra_ms`` up to the per-column minimum of :func:`quietest`.

    Raises:
        KeyError: ``ar`` is not in ``table``.
    """
    ref = table[ar]
    out: dict[str, dict[int, dict[str, float]]] = {}
    for name, by_b in table.items():
        if name == ar:
            continue
        out[name] = {}
        for b, c in by_b.items():
            r = ref[b]
            out[name][b] = {
                "extra_ms": 1e3 * (c["step"] - r["step"]),
                "target_ms": 1e3
                * (c["target_forward"] + c["target_logits"] - r["target_forward"] - r["target_logits"]),
                "drafter_ms": 1e3 * c["drafter"],
                "sampling_ms": 1e3 * (c["sampling"] - r["sampling"]),
                "bookkeeping_ms": 1e3 * (c["bookkeeping"] - r["bookkeeping"]),
            }
    return out
