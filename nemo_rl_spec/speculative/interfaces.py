"""Interfaces of the speculative-decoding subpackage.

Worked example of a :class:`DraftBatchSpec` (B = 2, S = 6, aux ids (0, 1, 2) of a hidden-64 policy,
prompt lengths 2 and 3, right padding with id 0)::

    input_ids     = [[5, 9, 7, 7, 2, 0],        # prompt [5, 9], response [7, 7, 2]
                     [4, 4, 8, 3, 0, 0]]        # prompt [4, 4, 8], response [3]
    loss_mask     = [[0, 0, 1, 1, 1, 0],
                     [0, 0, 0, 1, 0, 0]]
    hidden_states : [2, 6, 192] float32, detached (3 aux layers x 64)
    target_logprobs (optional): [2, 6, V], row s = log p_policy(. | input_ids[:s+1])

Draft step j of chain t predicts ``input_ids[t+2+j]`` and is trained when ``loss_mask[t+2+j]`` is 1; e.g. in
row 0, step 0 is trained at chains t = 0, 1, 2 (predicting 7, 7, 2).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypedDict

import torch


class DraftBatchSpec(TypedDict, total=False):
    """What the policy worker hands to the draft trainer (all detached, on CPU or the trainer's device).

    hidden_states: [B, S, n_aux * H] float32, aux layers concatenated in ascending id order.
    input_ids: [B, S] int64.
    loss_mask: [B, S] bool / 0-1: tokens the draft learns to predict.
    target_logprobs: [B, S, V] float32 (optional): the policy's next-token log-probs at each position.
    policy_version: int, the policy weights that produced hidden_states.
    """

    hidden_states: torch.Tensor
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    target_logprobs: torch.Tensor
    policy_version: int


class DraftTrainerInterface(ABC):
    """A trainer of a speculative draft on the policy's detached activations."""

    draft_version: int

    @abstractmethod
    def step(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        target_logprobs: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step; returns ``train/draft_loss``, ``train/draft_grad_norm`` and more."""

    @abstractmethod
    def export_weights(self) -> dict[str, torch.Tensor]:
        """Checkpoint-named weights the generation engine's drafter loads."""

    @abstractmethod
    def save_checkpoint(self, path) -> None:
        """Write the draft (vLLM-loadable) and its optimizer state under ``path``."""

    @abstractmethod
    def load_checkpoint(self, path) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
