"""Response-length samples: a clipped log-normal, drawn by stratified quantiles so the tail is always present.

Why quantiles: the makespan of a synchronous generation phase is set by the longest responses; i.i.d. draws would
make it noisy from seed to seed. Sample i of n is the quantile (i + 0.5) / n, then the samples are shuffled
(seeded) to model arrival order, so runs are reproducible and the tail of n samples is the expected tail.
"""

from __future__ import annotations

from functools import lru_cache
from statistics import NormalDist

import numpy as np

from nemo_rl_spec.sim.interfaces import LengthDistSpec

_STD_NORMAL = NormalDist()


def lognormal_quantiles(median: float, sigma: float, n: int) -> np.ndarray:
    """Stratified quantiles of LogNormal(ln median, sigma): median * exp(sigma * z_{(i+0.5)/n}), tokens. Shape: [n]."""
    return median * np.exp(sigma * _normal_quantiles(n))


@lru_cache(maxsize=64)
def _normal_quantiles(n: int) -> np.ndarray:
    """z_{(i+0.5)/n} for i < n (cached: the sweeps reuse a few sizes). Shape: [n]."""
    z = np.array([_STD_NORMAL.inv_cdf((i + 0.5) / n) for i in range(n)])
    z.setflags(write=False)
    return z


def sample_lengths(spec: LengthDistSpec, n: int, seed: int, median_scale: float = 1.0) -> np.ndarray:
    """``n`` response lengths, integer tokens in [min_tokens, max_tokens], in seeded random order. Shape: [n].

    ``median_scale`` multiplies the median (used when fitting lengths to a measured generation time).
    """
    raw = lognormal_quantiles(spec.median_tokens * median_scale, spec.sigma, n)
    lengths = np.clip(np.rint(raw), spec.min_tokens, spec.max_tokens).astype(np.int64)
    return np.random.default_rng(seed).permutation(lengths)


def length_biased_mean_progress(lengths: np.ndarray) -> float:
    """Mean KV length (response part) of a sequence alive at a random time: E[L^2] / (2 E[L]), tokens.

    A uniformly random moment falls in a sequence with probability proportional to its length and at a uniform
    point of it (renewal theory), so the live cache is longer than half the mean length when lengths vary.
    """
    lengths = np.asarray(lengths, dtype=float)
    return float(np.square(lengths).mean() / (2.0 * lengths.mean()))
