"""The every-position lossless statistics (nemo_rl_spec.testing.lossless: randomized PIT, rank bins, KS, Bonferroni)
on synthetic sequences from a known autoregressive distribution: exact sampling and exact speculative sampling
(accept min(1, p / q), else the residual) pass; the negative control's rule (else resample from p) and a slightly
mis-tempered sampler are detected at the functional test's sample size and alpha."""

from __future__ import annotations

import math

import pytest
import torch

from nemo_rl_spec.testing.lossless import filtered_log_probs, ks_uniform, pit_and_rank, position_tests

V, M, N, ALPHA, TEMPERATURE, TOP_P, RANK_BINS = 64, 4, 600, 1e-3, 0.7, 0.9, 4


def _tables(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits of a first-order Markov chain over V tokens ([V + 1, V]: row V is the start state) and a
    sharper, perturbed draft's."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V + 1, V, generator=g, dtype=torch.float64) * 2.0
    draft = 1.5 * target + 0.7 * torch.randn(V + 1, V, generator=g, dtype=torch.float64)
    return target, draft


def _conditionals(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    return filtered_log_probs(logits, temperature, top_p).exp()


def _sample(rule: str, seed: int = 1, temperature: float = TEMPERATURE) -> torch.Tensor:
    """N sequences of M tokens: "exact" from p; "spec" / "lossy": draft x ~ q (the draft at TEMPERATURE, no top-p),
    accepted with min(1, p(x) / q(x)), else drawn from norm(max(0, p - q)) ("spec") or from p ("lossy")."""
    target, draft = _tables()
    p_all = _conditionals(target, temperature, TOP_P)
    q_all = torch.softmax(draft / TEMPERATURE, -1)
    g = torch.Generator().manual_seed(seed)
    state = torch.full((N,), V, dtype=torch.long)
    out = []
    for _ in range(M):
        p, q = p_all[state], q_all[state]
        if rule == "exact":
            tok = torch.multinomial(p, 1, generator=g).squeeze(-1)
        else:
            x = torch.multinomial(q, 1, generator=g).squeeze(-1)
            px, qx = p.gather(-1, x[:, None]).squeeze(-1), q.gather(-1, x[:, None]).squeeze(-1)
            accept = torch.rand(N, generator=g, dtype=torch.float64) < (px / qx).clamp(max=1.0)
            fallback = (p - q).clamp_min(0.0) if rule == "spec" else p
            tok = torch.where(accept, x, torch.multinomial(fallback, 1, generator=g).squeeze(-1))
        out.append(tok)
        state = tok
    return torch.stack(out, 1)


def _tests(samples: torch.Tensor, seed: int = 3) -> dict:
    target, _ = _tables()
    prev = torch.cat([torch.full((N, 1), V, dtype=torch.long), samples[:, :-1]], 1)
    lp = filtered_log_probs(target[prev.reshape(-1)], TEMPERATURE, TOP_P)
    v = torch.rand(N * M, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    res = pit_and_rank(lp, samples.reshape(-1), v, RANK_BINS)
    assert bool(torch.isfinite(res["log_p"]).all())  # every sampler here keeps to the top-p set
    return position_tests(res["u"].view(N, M), res["rank"].view(N, M), res["bin_probs"].view(N, M, -1))


@pytest.mark.parametrize("rule", ["exact", "spec"])
def test_exact_and_speculative_sampling_pass(rule):
    rep = _tests(_sample(rule))
    assert rep["p"] >= ALPHA, rep
    assert rep["pooled_ks_p"] >= ALPHA and rep["pooled_chi2_p"] >= ALPHA


def test_resample_from_target_is_detected():
    rep = _tests(_sample("lossy"))
    assert rep["p"] < ALPHA, rep
    assert rep["pooled_chi2_p"] < ALPHA
    # the bias is toward the draft's (sharper) proposals: more top-1 tokens than the exact conditionals give
    assert all(r["top1_observed"] > r["top1_expected"] for r in rep["positions"])


def test_wrong_temperature_is_detected():
    assert _tests(_sample("exact", temperature=0.6))["p"] < ALPHA


def test_pit_and_rank_values():
    lp = torch.log(torch.tensor([[0.2, 0.5, 0.3, 0.0]], dtype=torch.float64))
    for tok, v, u, rank in [
        (1, 0.0, 0.5, 1),
        (1, 1.0, 0.0, 1),
        (2, 0.5, 0.65, 2),
        (0, 0.25, 0.95, 3),
        (3, 0.5, 1.0, 4),
    ]:
        res = pit_and_rank(lp, torch.tensor([tok]), torch.tensor([v]), 2)
        assert float(res["u"]) == pytest.approx(u)
        assert int(res["rank"]) == rank
        assert res["bin_probs"][0].tolist() == pytest.approx([0.5, 0.3, 0.2])
    assert float(pit_and_rank(lp, torch.tensor([3]), torch.tensor([0.5]), 2)["log_p"]) == -math.inf


def test_filtered_log_probs_is_vllm_top_p():
    # probs 0.5, 0.3, 0.15, 0.05 at T = 1: top_p 0.8 keeps {0.5, 0.3} (cumulative from below 0.05, 0.2 <= 0.2)
    logits = torch.log(torch.tensor([0.15, 0.5, 0.05, 0.3]))
    p = filtered_log_probs(logits, 1.0, 0.8).exp()
    assert p.tolist() == pytest.approx([0.0, 0.625, 0.0, 0.375], abs=1e-6)
    assert filtered_log_probs(logits, 0.5, 1.0).exp().tolist() == pytest.approx(
        torch.softmax(logits.double() / 0.5, -1).tolist()
    )


@pytest.mark.parametrize("scale", [1.0, 3.0, 8.0])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_filtered_log_probs_candidates_equal_sampling_filter(scale, top_p):
    """The candidate shortcut (and its fallback for flat rows) keeps exactly SamplingFilter.keep_mask's set."""
    from nemo_rl_spec.models.policy.sampling_filter import SamplingFilter

    logits = torch.randn(300, 5000, generator=torch.Generator().manual_seed(0)) * scale
    kept = torch.isfinite(filtered_log_probs(logits, 0.7, top_p, candidates=256))
    assert torch.equal(kept, SamplingFilter(top_p=top_p).keep_mask(logits / 0.7))


def test_ks_uniform():
    grid = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    d, p = ks_uniform(grid)
    assert d == pytest.approx(0.0005) and p == 1.0
    d, p = ks_uniform(grid**1.5)
    assert p < 1e-6
    # the Kolmogorov limit: P(sqrt(n) D > 1.358) = 0.05
    n = 10_000
    _, p = ks_uniform(torch.cat([torch.zeros(1), torch.linspace(1.358 / math.sqrt(n), 1, n - 1)]))
    assert 0.03 < p < 0.07
