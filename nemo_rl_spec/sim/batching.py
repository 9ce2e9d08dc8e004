"""Continuous batching in *pass* space: which sequences are active at each engine pass and how much KV they hold.

Every pass advances every active sequence by ``tokens_per_pass`` tokens (1 for plain decoding; the mean
acceptance length for speculative decoding, a mean-field step: the pass count of a sequence of L tokens is
ceil(L / tokens_per_pass); its relative spread is ~ 1/sqrt(L) and ignored). Sequences arrive in the given order
and take a free slot first-come-first-served; at most ``max_concurrency`` run at once (vLLM max_num_seqs or the
KV-cache capacity). Because every active sequence advances once per pass, the schedule does not depend on how
long a pass takes, so it is computed once and costed with any :class:`~nemo_rl_spec.sim.interfaces.PassCostFn`.
"""

from __future__ import annotations

import heapq

import numpy as np


def passes_needed(lengths: np.ndarray, tokens_per_pass: float) -> np.ndarray:
    """Passes each sequence needs: ceil(L / tokens_per_pass), at least 1. Shape: [n] int."""
    if tokens_per_pass < 1.0:
        raise ValueError(f"tokens_per_pass must be >= 1, got {tokens_per_pass}")
    return np.maximum(1, np.ceil(np.asarray(lengths, dtype=float) / tokens_per_pass - 1e-9)).astype(np.int64)


def admission_passes(passes: np.ndarray, max_concurrency: int) -> np.ndarray:
    """Pass index at which each sequence starts, FCFS with ``max_concurrency`` slots. Shape: [n] int.

    The first ``max_concurrency`` start at pass 0; each later one starts when the earliest running one ends.
    """
    n = len(passes)
    starts = np.zeros(n, dtype=np.int64)
    if n <= max_concurrency:
        return starts
    ends = [int(p) for p in passes[:max_concurrency]]
    heapq.heapify(ends)
    for i in range(max_concurrency, n):
        start = heapq.heappop(ends)
        starts[i] = start
        heapq.heappush(ends, start + int(passes[i]))
    return starts


def active_batch_and_context(
    passes: np.ndarray, starts: np.ndarray, prompt_tokens: np.ndarray, tokens_per_pass: float
) -> tuple[np.ndarray, np.ndarray]:
    """Active sequences b(p) and summed KV context C(p) at every pass p of the engine. Shapes: [P], [P].

    Sequence i is active on passes [s_i, s_i + n_i) with context P_i + tau (p - s_i) at pass p, so
    C(p) = sum_active (P_i - tau s_i) + tau p b(p), computed with difference arrays in O(n + P).
    """
    ends = starts + passes
    total = int(ends.max())
    b = np.cumsum(np.bincount(starts, minlength=total + 1) - np.bincount(ends, minlength=total + 1))[:total]
    offset = np.asarray(prompt_tokens, dtype=float) - tokens_per_pass * starts
    a = np.cumsum(
        np.bincount(starts, weights=offset, minlength=total + 1)
        - np.bincount(ends, weights=offset, minlength=total + 1)
    )[:total]
    context = a + tokens_per_pass * np.arange(total) * b
    return b.astype(float), context
