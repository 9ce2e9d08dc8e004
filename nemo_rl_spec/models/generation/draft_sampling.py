"""Draft tokens and recovered tokens sampled by inverse CDF on CPU: the same distributions as vLLM's speculative
step draws, at a fraction of its fixed cost.

With ``draft_sample_method: probabilistic`` at temperature > 0, vLLM's EAGLE proposer samples each draft token as
``argmax(q / E)`` with E a [batch, vocab] tensor of exponential noise (the exponential-race form of sampling from
q, which needs no host sync on a GPU), and the rejection sampler draws each request's recovered token the same way
from norm(max(0, p - q)). On a 2-core CPU filling that noise costs about 0.93 ms per row at a 49,152-token
vocabulary, whatever the draft vocabulary. :func:`inverse_cdf_sample` draws the same distribution from one uniform
per row (``x = min{i : C_i > u}``, ``C`` the float64 cumulative sum), about 0.08 ms per row. Only the draft
token's distribution matters for losslessness (speculative sampling accepts x with min(1, p(x) / q(x)) and
resamples from the residual; Leviathan et al. 2023, Chen et al. 2023), and the returned q is vLLM's own, so the
verified tokens keep the target's distribution. :func:`sample_recovered_tokens_inverse_cdf` does the same for the
recovered tokens, one uniform per request from that request's generator (seeded) or the global RNG.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

_SAMPLING_EPS = 1e-5  # vLLM's threshold below which a temperature means greedy (vllm/v1/sample/sampler.py)
_vllm_originals: dict[str, Callable] = {}  # vLLM's own functions replaced here, by name (for the use_vllm_* toggles)


def _draw(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``min{i : cdf[r, i] > u[r] * cdf[r, -1]}`` per row, clamped to the last index. cdf [rows, vocab] float64
    (non-decreasing), u [rows] in [0, 1) -> [rows] int64."""
    target = u.view(-1, 1) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(1)


def inverse_cdf_sample(
    probs: torch.Tensor, generator: torch.Generator | None = None, u: torch.Tensor | None = None
) -> torch.Tensor:
    """One index per row of ``probs`` [batch, vocab] (non-negative, any positive total) drawn with probability
    ``probs[r, i] / probs[r].sum()``: ``min{i : C_i > u_r C_vocab}``, ``C`` the row's float64 cumulative sum, ``u``
    [batch] float64 uniforms in [0, 1) (given, or drawn from ``generator``). Returns [batch] int64. Zero-probability
    indices are never returned.

    Raises:
        ValueError: ``probs`` is not 2-D, or a row has no positive mass.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs: expected [batch, vocab], got shape {tuple(probs.shape)}")
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    if bool((total <= 0).any()):
        raise ValueError("probs: a row has no positive mass")
    if u is None:
        u = torch.rand(total.shape[0], dtype=torch.float64, device=probs.device, generator=generator)
    return _draw(cdf, u)


def compute_probs_and_sample_inverse_cdf(logits: torch.Tensor, sampling_metadata, use_fp64_gumbel: bool = False):
    """vLLM's ``compute_probs_and_sample_next_token`` (same arguments and results) with the draft token drawn by
    inverse CDF (:func:`inverse_cdf_sample`'s rule) instead of the exponential race. ``logits`` [batch, vocab] are
    divided in place by each row's temperature (greedy rows: by 1), as vLLM does.

    A seeded request (``sampling_metadata.generators``: batch index -> ``torch.Generator``) draws its draft token's
    uniform from its own generator, one float64 per drafting step; other rows use the global RNG. vLLM's own
    sampler draws every row's noise from the global RNG ("TODO: Consider seeds" in ``llm_base_proposer``), so a
    seeded request's accept / reject test ``u < p(d) / q(d)`` depended on whatever else had run in the process
    (tests/functional/test_seeded_speculation.py). Each draft is a sample of q either way. Assumes one logits row
    per request (EAGLE / EAGLE-3 / MTP / draft model: one token per drafting pass).

    Returns:
        ``(next_token_ids [batch] int64, probs [batch, vocab] float32)``; all-greedy batches: ``(argmax, logits)``
        (vLLM's: the rejection sampler reads no draft probabilities for greedy requests); greedy rows of a mixed
        batch take the argmax.
    """
    del use_fp64_gumbel  # no noise tensor: float64 is used for the cumulative sum throughout
    if sampling_metadata.all_greedy:
        return logits.argmax(dim=-1), logits
    temperature = sampling_metadata.temperature
    if temperature is None:
        raise ValueError("sampling_metadata.temperature is None for a batch that is not all greedy")
    is_greedy = None
    if not sampling_metadata.all_random:
        is_greedy = temperature < _SAMPLING_EPS
        temperature = torch.where(is_greedy, 1.0, temperature)
    logits.div_(temperature.view(-1, 1))
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    u = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device)
    for i, generator in (getattr(sampling_metadata, "generators", None) or {}).items():
        if i < probs.shape[0] and (is_greedy is None or not bool(is_greedy[i])):
            u[i] = torch.rand(1, dtype=torch.float64, device=probs.device, generator=generator)[0]
    next_token_ids = inverse_cdf_sample(probs, u=u)
    if is_greedy is not None:
        next_token_ids = torch.where(is_greedy, probs.argmax(dim=-1), next_token_ids)
    return next_token_ids, probs


def _install(module: ModuleType, name: str, replacement: Callable) -> bool:
    """``module.name = replacement`` if ``module.name`` is vLLM's own function (defined in ``module``), keeping the
    original for :func:`_use_vllm`; a function from elsewhere (a negative control) keeps its place. Idempotent.
    Returns True when ``replacement`` is installed."""
    current = getattr(module, name)
    if current is replacement:
        return True
    if getattr(current, "__module__", None) != module.__name__:
        return False
    _vllm_originals[name] = current
    setattr(module, name, replacement)
    return True


def _use_vllm(module: ModuleType, name: str, replacement: Callable, on: bool) -> None:
    """``module.name`` = vLLM's original (``on``) or ``replacement``.

    Raises:
        RuntimeError: :func:`_install` has not replaced ``module.name`` in this process.
    """
    if name not in _vllm_originals:
        raise RuntimeError(f"the inverse-CDF patch of {module.__name__}.{name} has not run in this process")
    setattr(module, name, _vllm_originals[name] if on else replacement)


def install_inverse_cdf_draft_sampler() -> bool:
    """Make :func:`compute_probs_and_sample_inverse_cdf` the EAGLE proposer's draft sampler in this process
    (``llm_base_proposer.compute_probs_and_sample_next_token``, read at call time). Idempotent; leaves anything
    other than vLLM's own in place. Returns True when installed."""
    import vllm.v1.spec_decode.llm_base_proposer as proposer  # lazy: vllm is slow to import

    return _install(proposer, "compute_probs_and_sample_next_token", compute_probs_and_sample_inverse_cdf)


def use_vllm_draft_sampler(on: bool = True) -> None:
    """For benchmarks (the "before"): ``on`` puts vLLM's own draft sampler (exponential race) back in this process;
    ``on=False`` reinstalls :func:`compute_probs_and_sample_inverse_cdf`.

    Raises:
        RuntimeError: :func:`install_inverse_cdf_draft_sampler` has not replaced vLLM's in this process.
    """
    import vllm.v1.spec_decode.llm_base_proposer as proposer  # lazy: vllm is slow to import

    _use_vllm(proposer, "compute_probs_and_sample_next_token", compute_probs_and_sample_inverse_cdf, on)


def request_uniforms(num_draft_tokens: list[int], generators: dict, device=None) -> torch.Tensor:
    """One float64 uniform in [0, 1) per request: from the request's own ``torch.Generator`` when it has one and
    drafts (a request without drafts leaves its generator untouched, as vLLM does), else from the global RNG.
    num_draft_tokens: [batch] ints; generators: batch index -> generator. Returns [batch] float64."""
    u = torch.rand(len(num_draft_tokens), dtype=torch.float64, device=device)
    for i, generator in generators.items():
        if num_draft_tokens[i] > 0:
            u[i] = torch.rand(1, dtype=torch.float64, device=device, generator=generator)[0]
    return u


def sample_recovered_tokens_inverse_cdf(
    max_spec_len,
    num_draft_tokens,
    cu_num_draft_tokens,
    draft_token_ids,
    draft_probs,
    target_probs,
    sampling_metadata,
    device,
    use_fp64_gumbel=False,
):
    """vLLM's ``rejection_sampler.sample_recovered_tokens`` (same signature; same distribution, other
    realisations): the recovered token of each draft position drawn from norm(max(0, p - q)) (``draft_probs``
    None: norm(p with the draft token zeroed)) by inverse CDF, with one uniform per request
    (:func:`request_uniforms`). The speculative-sampling residual of Leviathan et al. 2023 / Chen et al. 2023.
    Shapes: num_draft_tokens [batch] ints, draft_token_ids [num_tokens], draft_probs / target_probs
    [num_tokens, vocab] -> [num_tokens] token ids (``draft_token_ids``' dtype). A position whose residual has no
    mass (p == q; its draft is always accepted, so its recovered token is never read) gets the last index."""
    del max_spec_len, cu_num_draft_tokens, use_fp64_gumbel
    if draft_probs is None:
        residual = target_probs.scatter(1, draft_token_ids.long().view(-1, 1), 0.0)
    else:
        residual = (target_probs - draft_probs).clamp_(min=0.0)
    counts = torch.as_tensor(num_draft_tokens, dtype=torch.long, device=residual.device)
    u = request_uniforms(num_draft_tokens, sampling_metadata.generators, device).repeat_interleave(counts)
    recovered = _draw(residual.cumsum(dim=-1, dtype=torch.float64), u)
    return recovered.to(draft_token_ids.dtype)


def install_inverse_cdf_recovered_sampler() -> bool:
    """Make :func:`sample_recovered_tokens_inverse_cdf` the rejection sampler's ``sample_recovered_tokens`` in this
    process (read at call time by ``rejection_sample``). Idempotent; leaves anything other than vLLM's own in place
    (a negative control keeps its place). Returns True when installed."""
    import vllm.v1.sample.rejection_sampler as rs  # lazy: vllm is slow to import

    return _install(rs, "sample_recovered_tokens", sample_recovered_tokens_inverse_cdf)


def use_vllm_recovered_sampler(on: bool = True) -> None:
    """For benchmarks (the "before"): ``on`` puts vLLM's own ``sample_recovered_tokens`` (exponential noise, filled
    twice for seeded rows) back in this process; ``on=False`` reinstalls :func:`sample_recovered_tokens_inverse_cdf`.

    Raises:
        RuntimeError: :func:`install_inverse_cdf_recovered_sampler` has not replaced vLLM's in this process.
    """
    import vllm.v1.sample.rejection_sampler as rs  # lazy: vllm is slow to import

    _use_vllm(rs, "sample_recovered_tokens", sample_recovered_tokens_inverse_cdf, on)
