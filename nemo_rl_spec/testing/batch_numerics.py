"""Greedy equality under batch-shape numerics: how often two greedy decodes of the same prompts differ, and the rule
that holds speculative decoding to the autoregressive-vs-autoregressive baseline (what lossless means in bf16).

In fp32 a speculative greedy decode equals the autoregressive one token for token (the lossless tests). In bf16 two
*autoregressive* decodes of the same prompts already differ when the batch shape differs (other kernels, other
reduction orders, near-ties in the argmax flip), so exact equality is the wrong test there; the right one is that
speculation (which changes the shape of every forward: k + 1 tokens per sequence) diverges no more often, and no
earlier, than a change of batch shape does.

Pure logic (no engine): :func:`divergence` compares two lists of token sequences; :func:`hold_to_baseline` is the
verdict rule. The engine runs are ``checks.greedy_at_shapes``; the driver is ``examples/diagnostics/lossless_bf16.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# z of the binomial margin in :func:`hold_to_baseline` (about a 2-sigma one-sided allowance)
MARGIN_Z = 2.0


@dataclass(frozen=True)
class Divergence:
    """Where two greedy decodes of the same prompts part.

    ``first_divergence[i]``: index (tokens, 0 = first generated token) of the first differing token of sequence i,
    None when identical (a length difference counts at the shorter length). ``mismatch_rate`` = differing
    sequences / sequences. ``mean_first_divergence``: mean index over the differing sequences only (None when none
    differ). ``mean_matched_prefix``: mean matched prefix length over all sequences, an identical sequence counting
    its full length (the censored mean; it falls both when more sequences diverge and when they diverge earlier).
    """

    num_sequences: int
    num_differ: int
    mismatch_rate: float
    mean_first_divergence: float | None
    mean_matched_prefix: float
    first_divergence: list[int | None]

    def as_dict(self) -> dict:
        return asdict(self)


def first_divergence_index(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token of two sequences (the shorter length when one is a prefix of the other),
    None when equal."""
    a, b = list(a), list(b)
    for i, (u, v) in enumerate(zip(a, b)):
        if u != v:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> Divergence:
    """:class:`Divergence` of ``other`` from ``reference`` (same prompts, same order).

    Raises:
        ValueError: the two lists hold different numbers of sequences, or none.
    """
    if len(reference) != len(other) or not reference:
        raise ValueError(f"need the same non-zero number of sequences, got {len(reference)} and {len(other)}")
    firsts = [first_divergence_index(r, o) for r, o in zip(reference, other)]
    differ = [f for f in firsts if f is not None]
    matched = [len(r) if f is None else f for r, f in zip(reference, firsts)]
    return Divergence(
        num_sequences=len(firsts),
        num_differ=len(differ),
        mismatch_rate=len(differ) / len(firsts),
        mean_first_divergence=sum(differ) / len(differ) if differ else None,
        mean_matched_prefix=sum(matched) / len(matched),
        first_divergence=firsts,
    )


def binomial_margin(baseline_rate: float, n: int, z: float = MARGIN_Z) -> float:
    """Allowance for a second mismatch rate measured on ``n`` sequences to exceed ``baseline_rate`` by chance:
    ``z * sqrt(2 p (1 - p) / n)`` with ``p = max(baseline_rate, 1 / n)`` (the standard error of a difference of
    two binomial proportions of equal rate p; the floor 1 / n keeps a zero baseline from allowing nothing while
    a rate of one sequence in n is unresolvable). p is capped at 1/2, where the variance is largest.

    Example: baseline 0 over n = 32 -> p = 1/32, margin 2 * sqrt(2 * (1/32) * (31/32) / 32) = 0.0870.
    """
    if n <= 0:
        raise ValueError("n must be positive")
    p = min(max(baseline_rate, 1.0 / n), 0.5)
    return z * math.sqrt(2.0 * p * (1.0 - p) / n)


@dataclass(frozen=True)
class Verdict:
    """Result of :func:`hold_to_baseline` (all rates are fractions of sequences, prefixes in tokens)."""

    passed: bool
    exact: bool  # the rule applied was exact equality (fp32)
    baseline_rate: float  # max AR-vs-AR mismatch rate over the shape pairs
    rate_bound: float  # what speculation's rate may reach
    worst_spec_rate: float
    baseline_prefix: float  # min AR-vs-AR mean matched prefix
    prefix_bound: float  # what speculation's mean matched prefix may not fall below
    worst_spec_prefix: float
    reasons: list[str]

    def as_dict(self) -> dict:
        return asdict(self)


def hold_to_baseline(
    ar_vs_ar: Sequence[Divergence],
    spec_vs_ar: Sequence[Divergence],
    max_tokens: int,
    exact: bool,
    z: float = MARGIN_Z,
) -> Verdict:
    """The rule that holds speculative greedy decoding to the autoregressive batch-shape baseline.

    ``exact`` (fp32): every spec-vs-AR comparison must be identical (mismatch rate 0); the baseline is reported only.

    Otherwise (bf16), with ``p_b`` = the largest AR-vs-AR mismatch rate over the shape comparisons, ``n`` = sequences
    per comparison, ``m = binomial_margin(p_b, n, z)``:

    1. rate: every spec-vs-AR mismatch rate <= ``p_b + m``;
    2. position: every spec-vs-AR mean matched prefix (censored at ``max_tokens``) >= the smallest AR-vs-AR mean
       matched prefix - ``m * max_tokens`` (an extra fraction m of diverging sequences can cost at most
       ``m * max_tokens`` of the censored mean, so the same allowance as the rate; divergences not earlier on
       average than a batch-shape change causes).

    Raises:
        ValueError: an empty list, or comparisons of different sizes.
    """
    if not ar_vs_ar or not spec_vs_ar:
        raise ValueError("need at least one AR-vs-AR and one spec-vs-AR comparison")
    n = {d.num_sequences for d in (*ar_vs_ar, *spec_vs_ar)}
    if len(n) != 1:
        raise ValueError(f"comparisons over different numbers of sequences: {sorted(n)}")
    (n,) = n
    p_b = max(d.mismatch_rate for d in ar_vs_ar)
    prefix_b = min(d.mean_matched_prefix for d in ar_vs_ar)
    worst_rate = max(d.mismatch_rate for d in spec_vs_ar)
    worst_prefix = min(d.mean_matched_prefix for d in spec_vs_ar)
    reasons = []
    if exact:
        rate_bound, prefix_bound = 0.0, float(max_tokens)
        if worst_rate > 0:
            reasons.append(f"exact rule: speculation differs from AR in {worst_rate:.3f} of sequences")
    else:
        m = binomial_margin(p_b, n, z)
        rate_bound, prefix_bound = p_b + m, prefix_b - m * max_tokens
        if worst_rate > rate_bound:
            reasons.append(f"spec-vs-AR mismatch rate {worst_rate:.3f} > bound {rate_bound:.3f} (baseline {p_b:.3f})")
        if worst_prefix < prefix_bound:
            reasons.append(
                f"spec-vs-AR mean matched prefix {worst_prefix:.1f} < bound {prefix_bound:.1f} tokens "
                f"(baseline {prefix_b:.1f})"
            )
    return Verdict(
        passed=not reasons,
        exact=exact,
        baseline_rate=p_b,
        rate_bound=rate_bound,
        worst_spec_rate=worst_rate,
        baseline_prefix=prefix_b,
        prefix_bound=prefix_bound,
        worst_spec_prefix=worst_prefix,
        reasons=reasons,
    )
