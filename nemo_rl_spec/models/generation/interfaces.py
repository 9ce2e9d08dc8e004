"""Generation backend interface (NeMo-RL's GenerationInterface, trimmed to what this project uses)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol, TypedDict, runtime_checkable

import torch


class GenerationDatumSpec(TypedDict):
    """Input of :meth:`GenerationInterface.generate`.

    prompt_token_ids: list of B prompts, each a list of token ids (already chat-formatted).
    """

    prompt_token_ids: list[list[int]]


class GenerationOutputSpec(TypedDict):
    """Output of :meth:`GenerationInterface.generate` for B prompts x n samples = N rows (prompt-major).

    output_ids: [N, S] int64, prompt + response, right-padded with pad_token_id.
    input_lengths: [N] int64, prompt length of each row.
    unpadded_sequence_lengths: [N] int64, prompt + response length.
    generation_logprobs: [N, S] float32, log-prob of each response token under the sampling distribution
        (after temperature), 0 on prompt and padding.
    prompt_index: [N] int64, which prompt each row came from.
    policy_version: int, draft_version: int | None.
    spec_counters: SpecDecodeCounters of this call (speculative/metrics.py), or None without speculation.
    """

    output_ids: torch.Tensor
    input_lengths: torch.Tensor
    unpadded_sequence_lengths: torch.Tensor
    generation_logprobs: torch.Tensor
    prompt_index: torch.Tensor
    policy_version: int
    draft_version: int | None
    spec_counters: Any


class GenerationInterface(ABC):
    """A generation backend that samples responses and accepts versioned weight refits."""

    @abstractmethod
    def generate(
        self,
        data: GenerationDatumSpec,
        n: int,
        seed: int,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
    ) -> GenerationOutputSpec:
        """Sample ``n`` responses per prompt (temperature / max_new_tokens / top_p / top_k from config unless
        overridden)."""

    @abstractmethod
    def score(self, input_ids: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
        """Per-token log-probs of given sequences under the current weights at temperature 1.

        Shape: input_ids [B, S], input_lengths [B] -> [B, S] (position s = log-prob of token s; 0 at s=0 and on
        padding). Used by the refit probe (``refit/logprob_mismatch``).
        """

    @abstractmethod
    def update_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Load HF-named policy weights and record ``version``."""

    @abstractmethod
    def update_draft_weights(self, draft: dict) -> dict:
        """Load the drafter's weights (``{"weights", "draft_version", "policy_version"}``) after the policy refit of
        the same version; refuses a draft paired with another policy version (DraftVersionMismatchError) unless
        stale drafts are allowed. Returns the versions the engine now holds."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the engine."""


@runtime_checkable
class GenerationController(Protocol):
    """What the drivers call on the generation controller
    (:class:`~nemo_rl_spec.models.generation.vllm_generation.VllmGeneration`, over its vLLM engines). Every method
    returns a value, never a Ray handle; weights may be passed as a plain dict or as the policy's ``RemoteValue``."""

    def generate(
        self,
        data: GenerationDatumSpec,
        n: int,
        seed: int,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
    ) -> GenerationOutputSpec:
        """``n`` samples per prompt, with the engines' ``policy_version`` / ``draft_version`` / ``spec_counters``."""

    def score(self, input_ids: torch.Tensor, input_lengths: torch.Tensor) -> list[torch.Tensor]:
        """Per engine: [B, S] -> [B, S] float32 log-probs of the given tokens under its weights (the refit probe)."""

    def update_weights(self, weights: Any, version: int) -> None:
        """Load HF-named policy weights into every engine as ``version``."""

    def update_draft_weights(self, draft: Any) -> list[dict[str, Any]]:
        """Load a drafter export into every engine; each engine's result."""

    def get_versions(self) -> list[dict[str, int | None]]:
        """(policy, draft) versions per engine."""

    def node_ids(self) -> list[str]:
        """Ray node id of every engine (placement lines)."""

    def shutdown(self) -> None:
        """Stop the engines."""
