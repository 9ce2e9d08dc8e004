"""Inverse-CDF draft sampling: the distribution it draws, against exact probabilities and against
vLLM's own exponential-race sampler, with a negative control."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nemo_rl_spec.models.generation import draft_sampling as ds

N = 200_000


def _max_z(counts: torch.Tensor, probs: torch.Tensor, n: int) -> float:
    """Largest |observed - expected| / sd over the indices (binomial sd)."""
    p = probs / probs.sum()
    sd = (n * p * (1 - p)).clamp_min(1e-12).sqrt()
    return float(((counts - n * p).abs() / sd).max())


def test_inverse_cdf_draws_the_row_distribution_and_never_a_zero():
    torch.manual_seed(0)
    row = torch.tensor([0.0, 0.05, 0.0, 0.3, 0.15, 0.0, 0.0, 0.0])  # total 0.5: u must be scaled by it
    x = ds.inverse_cdf_sample(row.expand(N, -1).contiguous())
    counts = torch.bincount(x, minlength=8).double()
    assert counts[row == 0].sum() == 0
    assert _max_z(counts, row.double(), N) < 4.5
    # negative control: u in [0, 1) not scaled by the row's total puts half the draws on the last index (q = 0)
    cdf = row.expand(N, -1).cumsum(-1, dtype=torch.float64)
    wrong = torch.searchsorted(cdf, torch.rand(N, 1, dtype=torch.float64), right=True).clamp_(max=7).squeeze(1)
    assert torch.bincount(wrong, minlength=8)[7] > N // 3


def test_inverse_cdf_edge_cases_and_errors():
    one_hot = torch.zeros(4, 5)
    one_hot[torch.arange(4), torch.tensor([0, 4, 2, 4])] = 1.0
    assert ds.inverse_cdf_sample(one_hot).tolist() == [0, 4, 2, 4]
    g = torch.Generator().manual_seed(3)
    a = ds.inverse_cdf_sample(torch.rand(6, 50), generator=g)
    b = ds.inverse_cdf_sample(torch.rand(6, 50), generator=torch.Generator().manual_seed(3))
    assert a.shape == (6,) and a.dtype == torch.int64 and b.shape == (6,)
    with pytest.raises(ValueError, match="no positive mass"):
        ds.inverse_cdf_sample(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"expected \[batch, vocab\]"):
        ds.inverse_cdf_sample(torch.ones(3))


def _meta(temperature, all_greedy=False, all_random=True):
    return SimpleNamespace(temperature=temperature, all_greedy=all_greedy, all_random=all_random)


def test_same_probs_and_distribution_as_vllms_sampler():
    vllm_proposer = pytest.importorskip("vllm.v1.spec_decode.llm_base_proposer")
    vllm_sample = (
        ds._vllm_originals.get("compute_probs_and_sample_next_token")
        or vllm_proposer.compute_probs_and_sample_next_token
    )
    torch.manual_seed(1)
    base = torch.tensor([2.0, 0.5, float("-inf"), 1.0, -1.0, float("-inf")])  # -inf: outside a draft vocabulary
    temp = torch.full((N,), 0.7)
    ours_ids, ours_p = ds.compute_probs_and_sample_inverse_cdf(base.expand(N, -1).clone(), _meta(temp))
    theirs_ids, theirs_p = vllm_sample(base.expand(N, -1).clone(), _meta(temp))
    assert torch.equal(ours_p, theirs_p)  # the q the rejection sampler reads: vLLM's own, bit for bit
    expected = torch.softmax(base / 0.7, -1).double()
    for ids in (ours_ids, theirs_ids):
        counts = torch.bincount(ids, minlength=6).double()
        assert counts[2] == counts[5] == 0
        assert _max_z(counts, expected, N) < 4.5


def test_greedy_rows_and_all_greedy_batches():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 4.9], [0.0, 0.0, 9.0]])
    ids, probs = ds.compute_probs_and_sample_inverse_cdf(logits.clone(), _meta(None, all_greedy=True))
    assert ids.tolist() == [1, 0, 2] and torch.equal(probs, logits)
    temp = torch.tensor([0.0, 1.0, 0.0])  # rows 0 and 2 greedy in a mixed batch
    torch.manual_seed(2)
    ids, probs = ds.compute_probs_and_sample_inverse_cdf(logits.clone(), _meta(temp, all_random=False))
    assert ids[0] == 1 and ids[2] == 2
    assert torch.allclose(probs[1], torch.softmax(logits[1], -1))  # the random row divided by its temperature 1


def test_a_seeded_row_draws_from_its_own_generator():
    """Row 0 has a generator: its draft is the inverse CDF of that generator's first float64, whatever the global
    RNG did before; row 1 has none and follows the global RNG (a seeded row's draw leaves it untouched)."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    probs = torch.softmax(logits / 0.7, -1)
    u0 = torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(11))[0]
    expected0 = int(torch.searchsorted(probs[0].double().cumsum(-1), u0 * probs[0].double().sum(), right=True))
    rows0, rows1 = set(), set()
    for global_seed in range(12):
        torch.manual_seed(global_seed)
        meta = SimpleNamespace(**vars(_meta(torch.full((2,), 0.7))), generators={0: torch.Generator().manual_seed(11)})
        ids, _ = ds.compute_probs_and_sample_inverse_cdf(logits.clone(), meta)
        torch.manual_seed(global_seed)
        u1 = torch.rand(2, dtype=torch.float64)[1]  # the global draw row 1 gets
        rows0.add(int(ids[0]))
        assert int(ids[1]) == int(
            torch.searchsorted(probs[1].double().cumsum(-1), u1 * probs[1].double().sum(), right=True)
        )
        rows1.add(int(ids[1]))
    assert rows0 == {expected0} and len(rows1) > 1


def test_install_and_use_vllm_draft_sampler_toggle():
    proposer = pytest.importorskip("vllm.v1.spec_decode.llm_base_proposer")
    assert ds.install_inverse_cdf_draft_sampler()
    assert proposer.compute_probs_and_sample_next_token is ds.compute_probs_and_sample_inverse_cdf
    assert ds.install_inverse_cdf_draft_sampler()  # idempotent
    ds.use_vllm_draft_sampler()
    assert proposer.compute_probs_and_sample_next_token.__module__ == proposer.__name__
    ds.use_vllm_draft_sampler(on=False)
    assert proposer.compute_probs_and_sample_next_token is ds.compute_probs_and_sample_inverse_cdf
