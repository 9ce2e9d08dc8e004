"""Policy (trainer) backend interface (NeMo-RL's PolicyInterface, trimmed)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from nemo_rl_spec.distributed.interfaces import TrainDatumSpec


class PolicyInterface(ABC):
    """A trainable policy: log-probs, a training step, HF-named weight export, checkpoints."""

    @abstractmethod
    def get_logprobs(self, data: TrainDatumSpec, temperature: float = 1.0, filtered: bool = True) -> torch.Tensor:
        """Per-token log-probs of ``data['input_ids']`` with logits divided by ``temperature``; with ``filtered``,
        under the generation engine's top-k / top-p filter when it samples with one (``policy.generation.top_k`` /
        ``top_p``: the distribution the engine's log-probs are of), else over the full softmax.

        Shape: [B, S] -> [B, S] float32, aligned with input_ids (position 0 and padding are 0).
        """

    @abstractmethod
    def train(self, data: TrainDatumSpec, train_draft: bool = True) -> dict[str, float]:
        """One optimizer step (over micro-batches) with the configured loss; returns metrics
        (``loss``, ``grad_norm``, ``lr``, loss-specific keys). ``train_draft``: also train the online draft in this
        step (False: the draft is left as it is; ``policy.draft.train_period``)."""

    @abstractmethod
    def export_hf_weights(self, version: int | None = None, dtype: str | None = None) -> dict[str, torch.Tensor]:
        """Current weights under Hugging Face names (incl. ``lm_head.weight`` when embeddings are tied), cast once to
        ``dtype`` (``float32`` | ``bfloat16``; None: the parameters' dtype); ``version``
        is the weight version they will be loaded as (a drafter exported next is paired with it). In a worker group
        every rank calls it (a collective that gathers tensor-parallel slices) and only rank 0 returns the tensors;
        the others return an empty dict."""

    @abstractmethod
    def draft_version(self) -> int | None:
        """The ``draft_version`` :meth:`export_draft_weights` would report now (optimizer steps the drafter has
        taken); None without a drafter."""

    @abstractmethod
    def export_draft_weights(self, dtype: str | None = None) -> dict:
        """The drafter trained with the policy (online EAGLE-3 head or MTP layers):
        ``{"weights": checkpoint-named tensors, "draft_version": int, "policy_version": int}``; the weights in
        ``dtype`` (the engines' dtype; None: float32)."""

    @abstractmethod
    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> None:
        """Write model + optimizer state under ``path`` (a directory that exists); ``save_optimizer=False``: the
        model without optimizer state (a load then restarts the optimizer)."""

    @abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""


@runtime_checkable
class PolicyController(Protocol):
    """What the drivers (sync and async GRPO, the refitter, checkpoints) call on the policy's controller
    (:class:`~nemo_rl_spec.models.policy.lm_policy.Policy`, over its Megatron worker group). Every method returns a
    value; weights come back as a ``RemoteValue`` (``.get()`` fetches them), never as a Ray handle."""

    def get_logprobs(self, data: TrainDatumSpec, temperature: float = 1.0, filtered: bool = True) -> torch.Tensor:
        """[B, S] -> [B, S] float32 token log-probs (see :meth:`PolicyInterface.get_logprobs`)."""

    def get_reference_policy_logprobs(self, data: TrainDatumSpec, temperature: float = 1.0) -> torch.Tensor:
        """The same under the frozen reference policy (KL penalty)."""

    def train(self, data: TrainDatumSpec, train_draft: bool = True) -> dict[str, float]:
        """One or more optimizer steps over ``data`` (the online draft too with ``train_draft``); combined
        metrics."""

    def draft_version(self) -> int | None:
        """Rank 0's :meth:`PolicyInterface.draft_version`."""

    def mtp_warm_start(
        self, train_data: TrainDatumSpec, eval_data: TrainDatumSpec, steps: int, batch_size: int, lr: float, seed: int
    ) -> dict[str, float]:
        """CE warm start of the MTP layers (trunk frozen) on every rank; rank 0's ``mtp_warm_start/*`` metrics."""

    def mtp_states(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's MTP parameters (CPU, its TP slices), rank order."""

    def load_mtp_states(self, states: Sequence[dict[str, torch.Tensor]]) -> None:
        """Rank r loads ``states[r]`` (fresh MTP optimizer)."""

    def export_hf_weights(self, version: int | None = None, dtype: str | None = None) -> Any:
        """HF-named weights as a ``RemoteValue``, recorded as ``version``."""

    def export_draft_weights(self, dtype: str | None = None) -> Any:
        """The drafter export as a ``RemoteValue``."""

    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> None:
        """Write model (+ optimizer) state under ``path``."""

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""

    def node_ids(self) -> list[str]:
        """Ray node id of every rank (placement lines)."""

    def shutdown(self) -> None:
        """Stop the workers."""
