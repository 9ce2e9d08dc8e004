"""Closed-form speculative-decoding and Amdahl formulas (Leviathan et al. 2023, sections 3.1-3.4).

Notation: ``alpha`` = probability that a draft token is accepted given all earlier ones were (per-position
acceptance), ``k`` = draft tokens per target pass, ``draft_cost`` = c = cost of one draft forward relative to
one target forward.
"""

from __future__ import annotations

from typing import Mapping, Sequence


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """Mean tokens emitted per target (verification) pass, tokens.

    Formula: E = (1 - alpha^(k+1)) / (1 - alpha)  (= 1 + alpha + ... + alpha^k; k+1 when alpha = 1).
    The emitted tokens are the accepted drafts plus the one token the target always contributes (replacement
    or bonus). Example: alpha 0.8, k 3 -> 2.952.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def tokens_per_pass_per_position(per_position: Sequence[float]) -> float:
    """Mean tokens per target pass for position-dependent acceptance, tokens.

    Formula: E = 1 + sum_{j=1..k} prod_{i<=j} alpha_i, alpha_i = P(draft i accepted | drafts 1..i-1 accepted).
    Reduces to :func:`expected_tokens_per_pass` when all alpha_i are equal.
    """
    total, survive = 1.0, 1.0
    for a in per_position:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance must lie in [0, 1], got {a}")
        survive *= a
        total += survive
    return total


def alpha_for_acceptance_length(acceptance_length: float, k: int, tol: float = 1e-12) -> float:
    """Constant per-position acceptance alpha whose E(alpha, k) equals ``acceptance_length`` (bisection).

    Inverts E = (1 - alpha^(k+1)) / (1 - alpha), which rises monotonically from 1 (alpha 0) to k+1 (alpha 1).
    Example: E = 2.952, k = 3 -> alpha 0.8.
    """
    if not 1.0 <= acceptance_length <= k + 1:
        raise ValueError(f"acceptance length must lie in [1, {k + 1}], got {acceptance_length}")
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if expected_tokens_per_pass(mid, k) < acceptance_length:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def speculative_speedup(alpha: float, k: int, draft_cost: float) -> float:
    """Wall-time speedup of speculative over plain decoding when verifying k+1 tokens costs one target pass.

    Formula: S = (1 - alpha^(k+1)) / ((1 - alpha) (k c + 1)), c = draft_cost (Leviathan et al. 2023, Thm 3.8).
    Examples: (0.8, 3, 0.05) -> 2.567; (0.6, 2, 0.1) -> 1.6333; alpha 0 -> 1 / (k c + 1).
    """
    if draft_cost < 0:
        raise ValueError(f"draft_cost must be >= 0, got {draft_cost}")
    return expected_tokens_per_pass(alpha, k) / (k * draft_cost + 1.0)


def amdahl_speedup(fraction: float, speedup: float) -> float:
    """Whole-job speedup when a part taking ``fraction`` of the time runs ``speedup`` times faster.

    Formula: S = 1 / ((1 - f) + f / s)  (Amdahl 1967).
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
    if speedup <= 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    return 1.0 / ((1.0 - fraction) + fraction / speedup)


def phase_amdahl_speedup(phase_seconds: Mapping[str, float], phase_speedups: Mapping[str, float]) -> float:
    """End-to-end speedup of a sequential step whose phases speed up independently (phases not named: 1x).

    Formula: S = sum_p t_p / sum_p (t_p / s_p). With one accelerated phase this is :func:`amdahl_speedup`.
    Example: {gen: 100, rest: 51.2}, {gen: 1.7668} -> 151.2 / (56.6 + 51.2) = 1.4026.
    """
    unknown = set(phase_speedups) - set(phase_seconds)
    if unknown:
        raise KeyError(f"speedups for unknown phases: {sorted(unknown)}")
    before = sum(phase_seconds.values())
    after = sum(t / phase_speedups.get(name, 1.0) for name, t in phase_seconds.items())
    return before / after
