"""The lossless checks in a given engine dtype (issue 35: fp32 and bf16), driven by
``examples/diagnostics/lossless_bf16.py``.

- :func:`greedy_study`: greedy decodes of the same prompts by an autoregressive engine and by speculative engines
  (EAGLE-3 head trained on that engine dtype's own greedy continuations, a ``draft_model`` that is a clean
  full-depth copy of the target) at several batch shapes; AR-vs-AR divergence is the baseline, spec-vs-AR divergence is held to it
  by :func:`~nemo_rl_spec.testing.batch_numerics.hold_to_baseline` (exact equality in fp32).
- :func:`t1_study`: the CI-sized T = 1 distribution test with both negative controls on an engine of the given dtype
  (``tests/functional/test_speculative_sampling.py::test_ci_sized_lossless_sampling_and_its_two_controls`` is
  this function in float32). The exact reference stays transformers' fp32
  pair distribution: at 1,000 samples a bf16 engine's own rounding of the probabilities is far below what the test
  resolves, and a failure there would be reported, not hidden.

Every engine runs in its own spawned process (``checks.run_isolated``).
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from nemo_rl_spec.testing import checks
from nemo_rl_spec.testing.batch_numerics import divergence, hold_to_baseline
from nemo_rl_spec.testing.lossless import (
    MIN_ACCEPTANCE_LENGTH,
    PairDistribution,
    build_truncated_draft,
    chi_square_goodness_of_fit,
    exact_pair_distribution,
    total_variation,
)

# the CI-sized T = 1 test's constants (also tests/functional/test_speculative_sampling.py's)
T1_SAMPLES, T1_K, T1_ALPHA, T1_TOP = 1000, 5, 1e-3, 64


def draft_configs(
    target: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    k: int,
    methods: Sequence[str],
    work: Path,
    head_steps: int = 150,
) -> dict[str, dict | Callable[[list[list[int]], str], dict]]:
    """``speculative_config`` per method: "eagle3" = a callable that, given the AR engine's greedy outputs of
    ``prompts`` in a dtype, trains (cached) a head for ``head_steps`` steps on exactly those continuations (the
    engine's own: a bf16 engine's greedy text differs from fp32's) and returns its config; "draft_model" = the
    target's full-depth copy."""
    from transformers import AutoConfig  # lazy: transformers is slow to import

    out: dict[str, dict | Callable[[list[list[int]], str], dict]] = {}
    for method in methods:
        if method == "eagle3":

            def eagle3(ar_outputs: list[list[int]], dtype: str) -> dict:
                head = checks.train_tiny_head(
                    target,
                    prompts,
                    str(work / f"eagle3_{dtype}"),
                    max_new_tokens=max_tokens,
                    steps=head_steps,
                    cache_dir=checks.default_draft_cache(),
                    continuations=ar_outputs,
                )
                return {"method": "eagle3", "model": head["path"], "num_speculative_tokens": k}

            out[method] = eagle3
        elif method == "draft_model":
            layers = AutoConfig.from_pretrained(target).num_hidden_layers
            draft = build_truncated_draft(target, work / "draft_model", num_layers=layers)
            out[method] = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": k}
        else:
            raise ValueError(f"unknown method {method!r} (eagle3, draft_model)")
    return out


def _acceptance(counters) -> dict[str, Any]:
    return {
        "acceptance_length": counters.acceptance_length if counters.num_drafts else None,
        "num_drafts": counters.num_drafts,
        "num_accepted_tokens": counters.num_accepted_tokens,
    }


def greedy_study(
    target: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    batch_sizes: Sequence[int],
    drafts: dict[str, dict | Callable[[list[list[int]], str], dict]],
    dtype: str,
    threads: int = 1,
) -> dict[str, Any]:
    """AR-vs-AR and spec-vs-AR greedy divergence at ``batch_sizes`` in ``dtype``, and the verdict per method.

    Comparisons: AR at b_i vs AR at b_j for every pair of shapes (the baseline); speculative at b vs AR at b' for
    every pair of shapes (the same shape and the others). The verdict for a method also requires acceptance length
    >= ``MIN_ACCEPTANCE_LENGTH`` at every shape (with nothing accepted, equality would prove nothing).
    """

    def run(spec):
        return checks.run_isolated(
            checks.greedy_at_shapes, target, prompts, max_tokens, list(batch_sizes), spec, threads=threads, dtype=dtype
        )

    ar = run(None)
    report: dict[str, Any] = {
        "dtype": dtype,
        "ar": {"start_s": ar["start_s"], "generate_s": {}},
        "ar_vs_ar": [],
        "methods": {},
    }
    for b in batch_sizes:
        report["ar"]["generate_s"][b] = ar["shapes"][b]["generate_s"]
    report["ar"]["outputs"] = ar["shapes"][batch_sizes[0]]["outputs"]  # for comparisons across dtypes
    baseline = []
    for a, b in itertools.combinations(batch_sizes, 2):
        d = divergence(ar["shapes"][a]["outputs"], ar["shapes"][b]["outputs"])
        baseline.append(d)
        report["ar_vs_ar"].append({"a": f"ar@{a}", "b": f"ar@{b}", **d.as_dict()})
    for name, spec in drafts.items():
        if callable(spec):  # a draft trained on this engine's own greedy outputs
            spec = spec(report["ar"]["outputs"], dtype)
        res = run(spec)
        comparisons, divs = [], []
        for b, a in itertools.product(batch_sizes, batch_sizes):
            d = divergence(ar["shapes"][a]["outputs"], res["shapes"][b]["outputs"])
            divs.append(d)
            comparisons.append({"a": f"ar@{a}", "b": f"{name}@{b}", **d.as_dict()})
        acceptance = {b: _acceptance(res["shapes"][b]["counters"]) for b in batch_sizes}
        accepted = all((x["acceptance_length"] or 0.0) >= MIN_ACCEPTANCE_LENGTH for x in acceptance.values())
        verdict = hold_to_baseline(baseline, divs, max_tokens, exact=dtype == "float32")
        report["methods"][name] = {
            "speculative_config": spec,
            "acceptance": acceptance,
            "accepted": accepted,
            "generate_s": {b: res["shapes"][b]["generate_s"] for b in batch_sizes},
            "spec_vs_ar": comparisons,
            "verdict": verdict.as_dict(),
            "passed": verdict.passed and accepted,
        }
    return report


def t1_study(
    target: str,
    prompt: Sequence[int],
    spec_config: dict,
    dtype: str,
    seed: int = 2,
    exact: PairDistribution | None = None,
) -> dict[str, Any]:
    """The CI-sized T = 1 test and its two negative controls in ``dtype``: passes when acceptance length >
    ``MIN_ACCEPTANCE_LENGTH``, the shipped sampler's goodness-of-fit p >= ``T1_ALPHA`` and both controls' p <
    ``T1_ALPHA`` (against transformers' fp32 exact pair distribution: ``exact``, computed here when None; it must
    have ``top = T1_TOP``).

    Returns {"dtype", "num_samples", "k", "alpha", "phases", "passed"}; per phase ("patched", "negative_control",
    "unpatched"): "chi2", "dof", "p", the acceptance ("acceptance_length" None without drafts, "num_drafts",
    "num_accepted_tokens"), "generate_s", "sample_shape" ([samples, 2]) and "tv_vs_patched" (total variation
    between the phase's and the shipped sampler's empirical pair distributions).
    """
    if exact is None:
        exact = exact_pair_distribution(target, prompt, T1_TOP)
    res = checks.run_isolated(
        checks.sampler_controls_scenario,
        target,
        prompt,
        T1_SAMPLES,
        dict(spec_config, num_speculative_tokens=T1_K),
        seed=seed,
        threads=2,
        dtype=dtype,
    )
    patched_counts = exact.counts(res["patched"]["samples"])
    phases = {}
    for name, r in res.items():
        counts = exact.counts(r["samples"])
        stat, dof, p = chi_square_goodness_of_fit(counts, exact.probs)
        phases[name] = {
            "chi2": stat,
            "dof": dof,
            "p": p,
            **_acceptance(r["counters"]),
            "generate_s": r["generate_s"],
            "sample_shape": list(r["samples"].shape),
            "tv_vs_patched": total_variation(counts, patched_counts),
        }
    passed = (
        (phases["patched"]["acceptance_length"] or 0.0) > MIN_ACCEPTANCE_LENGTH
        and phases["patched"]["p"] >= T1_ALPHA
        and phases["negative_control"]["p"] < T1_ALPHA
        and phases["unpatched"]["p"] < T1_ALPHA
    )
    return {"dtype": dtype, "num_samples": T1_SAMPLES, "k": T1_K, "alpha": T1_ALPHA, "phases": phases, "passed": passed}


def t1_spec_config(target: str, prompts: Sequence[Sequence[int]]) -> dict:
    """The T = 1 test's head: ``train_tiny_head`` on the 16 lossless prompts with its defaults (the same cached head
    as ``test_speculative_sampling.py``'s ``spec_config`` fixture)."""
    work = Path(tempfile.mkdtemp(prefix="lossless_t1_"))
    res = checks.train_tiny_head(target, prompts[:16], str(work / "t1"), cache_dir=checks.default_draft_cache())
    return {"method": "eagle3", "model": res["path"], "num_speculative_tokens": T1_K}
