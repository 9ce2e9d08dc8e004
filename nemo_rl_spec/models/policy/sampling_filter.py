"""The generation engine's top-k / top-p filter, applied to the trainer's logits so both score the same distribution.

vLLM samples a token from ``softmax(filter(logits / T))`` and, with ``logprobs_mode="processed_logprobs"``, returns
its log-prob under that filtered, renormalised distribution. A trainer that scores ``log_softmax(logits / T)`` over
the full vocabulary then disagrees with the engine by ``log`` of the kept probability mass on every token, which
biases every importance ratio and clip decision. NeMo-RL's answer, used here: the trainer's current and previous
log-probs are taken under the same filter; the reference policy's (the KL term) are not.

The filter is vLLM's (``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p_pytorch``), re-derived, on one row
of temperature-scaled logits ``z``, ascending order ``z_(1) <= ... <= z_(V)``:

- top-k: keep ``z_i >= z_(V-k+1)`` (the k-th largest value; ties with it are kept);
- top-p, after top-k: with ``c_j = sum_{i <= j} softmax(z_kept)_(i)`` in ascending order, drop ``z_(j)`` where
  ``c_j <= 1 - p``; the largest is always kept. The mask is computed without gradient; the kept logits keep theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class SamplingFilter:
    """vLLM's top-k / top-p filter (module docstring) as the trainer applies it.

    Attributes:
        top_k: keep the k largest logits (None: off); ``policy.generation.top_k``.
        top_p: keep the smallest top set holding probability >= p (1.0: off); ``policy.generation.top_p``.
    """

    top_k: Optional[int] = None
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"SamplingFilter.top_k must be >= 1 or None, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingFilter.top_p must be in (0, 1], got {self.top_p}")

    @classmethod
    def from_generation(cls, generation) -> Optional["SamplingFilter"]:
        """The filter the engine applies when it samples under ``generation`` (a ``GenerationConfig``), or None when
        it applies none (greedy decoding ignores both keys, as the generation worker does)."""
        if float(generation.temperature) <= 0.0:
            return None
        f = cls(top_k=generation.top_k, top_p=float(generation.top_p))
        return f if f.active else None

    @property
    def active(self) -> bool:
        """Whether the filter drops anything at all."""
        return self.top_k is not None or self.top_p < 1.0

    @torch.no_grad()
    def keep_mask(self, scaled_logits: torch.Tensor) -> torch.Tensor:
        """Which vocabulary entries the engine's sampler keeps.

        Args:
            scaled_logits: full-vocabulary logits already divided by the temperature, any float dtype (computed in
                float32, as vLLM's sampler does).

        Shape: [..., V] -> [..., V] bool.
        """
        flat = scaled_logits.detach().float().reshape(-1, scaled_logits.shape[-1])
        vocab = flat.shape[-1]
        ordered, order = flat.sort(dim=-1, descending=False)
        if self.top_k is not None and self.top_k < vocab:
            cutoff = ordered[:, vocab - self.top_k].unsqueeze(-1)
            ordered = ordered.masked_fill(ordered < cutoff, -float("inf"))
        if self.top_p < 1.0:
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative <= 1.0 - self.top_p
            drop[:, -1] = False
            ordered = ordered.masked_fill(drop, -float("inf"))
        keep = torch.empty_like(flat, dtype=torch.bool).scatter_(-1, order, torch.isfinite(ordered))
        return keep.reshape(scaled_logits.shape)
