"""Draft-token sampling by inverse CDF on CPU (issue 35 item 2: a fixed cost of vLLM's speculative step, patched).

With ``draft_sample_method: probabilistic`` at temperature > 0, vLLM's EAGLE proposer samples each draft token with
``compute_probs_and_sample_next_token`` (``vllm/v1/spec_decode/llm_base_proposer.py``): the draft's softmax q, then
``argmax(q / E)`` with E a [batch, vocab] tensor of exponential noise (the exponential-race form of sampling from q,
which needs no host sync on a GPU). On this CPU filling that noise costs about 19 ns per element, 0.93 ms per row
at a 49,152-token vocabulary (2 threads, measured): k of them per row per drafting step, most of the drafter's
"logits + sample" time in docs/speculative.md ("Where a drafting step's time goes"), and the same cost whatever the
draft vocabulary (an EAGLE-3 head's reduced vocabulary is mapped back to the full one first).

:func:`inverse_cdf_sample` draws the same distribution from one uniform per row: ``x = min{i : C_i > u}`` with
``C`` the float64 cumulative sum of the row and ``u ~ U[0, C_V)``, 0.08 ms per row here. Only the draft token's
distribution matters for losslessness (speculative sampling accepts x with min(1, p(x) / q(x)) and resamples from
norm(max(0, p - q)) on rejection; Leviathan et al. 2023, Chen et al. 2023), and the returned q is vLLM's own, so
the verified tokens keep the target's distribution; only which draft is proposed from the global RNG changes.
A token with q = 0 is never drawn (its C equals its predecessor's, so an earlier index already satisfies C > u).
"""

from __future__ import annotations

import torch

_SAMPLING_EPS = 1e-5  # vLLM's threshold below which a temperature means greedy (vllm/v1/sample/sampler.py)
_vllm_compute_probs_and_sample = None  # vLLM's own, kept for use_vllm_draft_sampler()


def inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row of ``probs`` [batch, vocab] (non-negative, any positive total) drawn with probability
    ``probs[r, i] / probs[r].sum()``: ``min{i : C_i > u}``, ``C`` the row's float64 cumulative sum, ``u`` uniform
    in [0, C_vocab). Returns [batch] int64. Zero-probability indices are never returned.

    Raises:
        ValueError: ``probs`` is not 2-D, or a row has no positive mass.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs: expected [batch, vocab], got shape {tuple(probs.shape)}")
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    total = cdf[:, -1:]
    if bool((total <= 0).any()):
        raise ValueError("probs: a row has no positive mass")
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device, generator=generator) * total
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


def compute_probs_and_sample_inverse_cdf(logits: torch.Tensor, sampling_metadata, use_fp64_gumbel: bool = False):
    """vLLM's ``compute_probs_and_sample_next_token`` (same arguments and results) with the draft token drawn by
    :func:`inverse_cdf_sample` instead of the exponential race. ``logits`` [batch, vocab] are divided in place by
    each row's temperature (greedy rows: by 1), as vLLM does.

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
    next_token_ids = inverse_cdf_sample(probs)
    if is_greedy is not None:
        next_token_ids = torch.where(is_greedy, probs.argmax(dim=-1), next_token_ids)
    return next_token_ids, probs


def install_inverse_cdf_draft_sampler() -> bool:
    """Make :func:`compute_probs_and_sample_inverse_cdf` the EAGLE proposer's draft sampler in this process
    (``llm_base_proposer.compute_probs_and_sample_next_token``, read at call time). Idempotent; leaves anything
    other than vLLM's own in place. Returns True when installed."""
    global _vllm_compute_probs_and_sample
    import vllm.v1.spec_decode.llm_base_proposer as proposer  # lazy: vllm is slow to import

    current = proposer.compute_probs_and_sample_next_token
    if current is compute_probs_and_sample_inverse_cdf:
        return True
    if getattr(current, "__module__", None) != proposer.__name__:
        return False
    _vllm_compute_probs_and_sample = current
    proposer.compute_probs_and_sample_next_token = compute_probs_and_sample_inverse_cdf
    return True


def use_vllm_draft_sampler(on: bool = True) -> None:
    """For benchmarks (the "before"): ``on`` puts vLLM's own draft sampler (exponential race) back in this process;
    ``on=False`` reinstalls :func:`compute_probs_and_sample_inverse_cdf`.

    Raises:
        RuntimeError: :func:`install_inverse_cdf_draft_sampler` has not installed it in this process.
    """
    import vllm.v1.spec_decode.llm_base_proposer as proposer  # lazy: vllm is slow to import

    if _vllm_compute_probs_and_sample is None:
        raise RuntimeError("install_inverse_cdf_draft_sampler() has not run in this process")
    proposer.compute_probs_and_sample_next_token = (
        _vllm_compute_probs_and_sample if on else compute_probs_and_sample_inverse_cdf
    )
