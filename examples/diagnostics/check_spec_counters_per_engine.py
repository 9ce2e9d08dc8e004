"""Several speculative vLLM engines in one process: is each engine's acceptance its own?

``python examples/diagnostics/check_spec_counters_per_engine.py`` (run it through ``heavy``: three engines start;
about a minute on 2 cores).

Builds, in ONE spawned process, on the tests' tiny target (tiny-qwen3) with the tests' tiny EAGLE-3 head: engine
``k1`` (EAGLE-3, k = 1), engine ``k3`` (k = 3), engine ``ar`` (no speculation; its stat logger is the newest, as in
``bench_spec_rollouts.py --spec-profile``). Each generates the same greedy ``ignore_eos`` batch in turn; then
``k1`` and ``k3`` generate it again. Checked, for each speculative engine:

- its counts on the second run (after the other engines were built) equal its counts on the first (greedy,
  same batch, prefix cache reset: what it alone did);
- draft tokens = k * drafts, drafts > 0, finite acceptance length;
- drafts + accepted per request lies in [N - 1, N - 1 + k] (N = max_tokens: the prefill emits one token, each
  verification step one plus the accepted ones, the last step may overshoot by at most k).

It also prints what ``LLM.get_metrics()`` (the process-global Prometheus registry) gives for the same intervals,
the reader before the fix: the older engines' second runs read zero drafts there (NaN acceptance), because each new
engine's ``PrometheusStatLogger`` unregisters every ``vllm:`` collector already registered
(vllm/v1/metrics/loggers.py, ``PrometheusStatLogger.__init__`` -> ``unregister_vllm_metrics()``).

Exit status 0 when every check passes, 1 otherwise. The functional tier runs it
(tests/functional/test_diagnostics_scripts.py); the logger's logic without engines is
tests/unit/test_spec_counters_per_engine.py.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NUM_PROMPTS, MAX_TOKENS = 8, 24


def scenario(target: str, head: str, prompts: list[list[int]], max_tokens: int) -> dict:
    """The engines' runs (in a fresh process): ``{run name: {"own": SpecDecodeCounters, "global": ...}}``."""
    from vllm import SamplingParams

    from nemo_rl_spec.speculative.metrics import SpecDecodeCounters, read_spec_decode_counters
    from nemo_rl_spec.testing import checks

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engines, out = {}, {}

    def global_counters(llm):  # the pre-fix reader: the process-global Prometheus registry
        return SpecDecodeCounters.from_vllm_metrics(llm.get_metrics())

    def run(name: str, label: str) -> None:
        llm = engines[name]
        llm.reset_prefix_cache()
        own0, glob0 = read_spec_decode_counters(llm), global_counters(llm)
        checks.generate_tokens(llm, prompts, params)
        out[label] = {"own": read_spec_decode_counters(llm) - own0, "global": global_counters(llm) - glob0}

    for name, k in (("k1", 1), ("k3", 3), ("ar", 0)):
        spec = {"method": "eagle3", "model": head, "num_speculative_tokens": k} if k else None
        engines[name] = checks.make_llm(target, spec)
        run(name, f"{name} run 1")
    for name in ("k1", "k3"):
        run(name, f"{name} run 2")
    for llm in engines.values():
        checks.shutdown(llm)
    return out


def main() -> int:
    """Run the scenario and the checks; print one line per run and per failed check. Returns the exit status."""
    from transformers import AutoTokenizer

    from nemo_rl_spec.models.hf_assets import resolve_model
    from nemo_rl_spec.testing import checks
    from nemo_rl_spec.testing.lossless import lossless_prompts

    target = resolve_model("tiny-qwen3")
    prompts = lossless_prompts(AutoTokenizer.from_pretrained(target), 64)
    head = checks.train_tiny_head(  # the functional tests' head (cached)
        target, prompts[:16], tempfile.mkdtemp(prefix="spec_counters_head_"), cache_dir=checks.default_draft_cache()
    )["path"]
    res = checks.run_isolated(scenario, target, head, prompts[:NUM_PROMPTS], MAX_TOKENS)
    for label, r in res.items():
        for reader in ("own", "global"):
            c = r[reader]
            print(
                f"{label:9s} {reader:6s} drafts {c.num_drafts:4d} draft_tokens {c.num_draft_tokens:4d} accepted "
                f"{c.num_accepted_tokens:4d} acceptance_length {c.acceptance_length:.3f}"
            )
    failures = []
    for name, k in (("k1", 1), ("k3", 3)):
        first, second = res[f"{name} run 1"]["own"], res[f"{name} run 2"]["own"]
        if second != first:
            failures.append(f"{name}: second run {second} != first run {first}")
        for run, c in (("run 1", first), ("run 2", second)):
            if not (c.num_drafts > 0 and math.isfinite(c.acceptance_length)):
                failures.append(f"{name} {run}: no drafts counted ({c})")
            if c.num_draft_tokens != k * c.num_drafts:
                failures.append(f"{name} {run}: draft tokens {c.num_draft_tokens} != {k} * drafts {c.num_drafts}")
            lo, hi = (MAX_TOKENS - 1) * NUM_PROMPTS, (MAX_TOKENS - 1 + k) * NUM_PROMPTS
            if not lo <= c.num_drafts + c.num_accepted_tokens <= hi:
                failures.append(
                    f"{name} {run}: drafts + accepted {c.num_drafts + c.num_accepted_tokens} not in [{lo}, {hi}]"
                )
    ar = res["ar run 1"]["own"]
    if ar.num_drafts:
        failures.append(f"ar: counted drafts {ar}")
    for f in failures:
        print("FAIL", f)
    print("OK: each engine's counters are its own" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
