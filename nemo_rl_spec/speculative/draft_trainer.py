"""Online / offline trainer of the EAGLE-3 draft head on the policy's detached hidden states.

The policy worker captures aux hidden states (:func:`~nemo_rl_spec.speculative.capture.capture_hidden_states`)
and optionally its next-token log-probs during its own forward; both are detached there, and
:meth:`DraftTrainer.step` refuses tensors that still require grad, so the draft loss can never reach policy
parameters. The draft has its own optimizer (AdamW) and gradient clipping.

Data parallel (several policy workers, each training the same draft on its row shard): :meth:`DraftTrainer.apply`
takes a :class:`DataParallelSync` that sums the accumulated gradients and loss sums over the ranks before clipping,
so every rank's draft takes the step of the whole global batch and the replicas stay identical.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead
from nemo_rl_spec.speculative.interfaces import DraftTrainerInterface
from nemo_rl_spec.speculative.ttt_scored import scored_index, scored_ttt_loss


class DataParallelSync(Protocol):
    """Sums over the data-parallel ranks (each a collective that every rank calls, also one without rows)."""

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``values`` over the ranks (same shape)."""

    def sum_metrics(self, values: dict[str, float]) -> dict[str, float]:
        """Key-wise sum of metric dicts over the ranks (a key missing on a rank counts as absent there)."""

    def grads(self, params: list[torch.nn.Parameter]) -> None:
        """Replace every ``param.grad`` by its sum over the ranks (missing gradients count as zeros)."""


class DraftTrainer(DraftTrainerInterface):
    """Trains an :class:`Eagle3DraftHead` with the training-time-test loss.

    Args:
        head: the draft head (its ``embed_tokens`` is frozen and not optimised).
        lr, weight_decay, betas, eps: AdamW settings (``policy.draft.optimizer.*``).
        max_grad_norm: clip the draft's gradient norm (None: no clipping; the norm is still reported).
        ttt_steps: unrolled draft steps (usually ``num_speculative_tokens``).
        step_weights: per-step loss weights (default ``0.8^j``).
        loss_weight: multiplies the loss (``policy.draft.loss_weight``); reported loss is unweighted.
        micro_batch_size: rows per forward/backward (gradients accumulate; None: whole batch).
        autocast_dtype: None (plain fp32) or ``torch.bfloat16``: run the draft's forward under ``torch.autocast``
            on the device of the hidden states passed to :meth:`accumulate` (mixed precision: the weights,
            gradients and optimizer state stay fp32). ``policy.draft.precision``.

    Raises:
        ValueError: ``autocast_dtype`` is neither None nor ``torch.bfloat16``.

    Attributes:
        draft_version: number of optimizer steps taken (exported with the weights for versioned refits).
    """

    def __init__(
        self,
        head: Eagle3DraftHead,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        max_grad_norm: float | None = 1.0,
        ttt_steps: int = 3,
        step_weights: Sequence[float] | None = None,
        loss_weight: float = 1.0,
        micro_batch_size: int | None = None,
        autocast_dtype: torch.dtype | None = None,
    ) -> None:
        if autocast_dtype not in (None, torch.bfloat16):
            raise ValueError(f"autocast_dtype={autocast_dtype}: expected None or torch.bfloat16")
        self.head = head
        self.autocast_dtype = autocast_dtype
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.max_grad_norm = max_grad_norm
        self.ttt_steps = int(ttt_steps)
        self.step_weights = list(step_weights) if step_weights is not None else None
        self.loss_weight = float(loss_weight)
        self.micro_batch_size = micro_batch_size
        self.draft_version = 0
        self._loss_sum, self._metric_sums = 0.0, {}

    def sync_embeddings(self, policy_embedding_weight: torch.Tensor) -> None:
        """Copy the policy's current input embedding into the head (vLLM's drafter shares the target's)."""
        self.head.set_target_embeddings(policy_embedding_weight)

    def step(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        target_logprobs: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One optimizer step of the draft on a batch captured from the policy (``micro_batch_size`` rows per
        forward/backward): :meth:`zero_grad`, :meth:`accumulate` per micro-batch, :meth:`apply`.

        Args:
            hidden_states: [B, S, n_aux * H] aux hidden states (``HiddenStateCapture.aux_hidden()``), detached.
            input_ids: [B, S] the sequences the policy processed (prompt + response).
            mask: [B, S] tokens the draft should learn to predict (e.g. response tokens), bool or 0/1.
            target_logprobs: optional [B, S, V] policy log-probs of the next token at each position (soft
                targets); hard targets (the tokens) otherwise.

        Returns:
            ``train/draft_loss``, ``train/draft_grad_norm`` (before clipping), ``train/draft_lr``,
            ``train/draft_acc_step{j}`` (teacher-forced top-1 accuracy of step j), ``train/draft_version``.

        Raises:
            ValueError: an input still requires grad (it would leak the draft loss into the policy).
        """
        self.zero_grad()
        mbs = self.micro_batch_size or input_ids.shape[0]
        total = self.num_loss_tokens(mask)
        for start in range(0, input_ids.shape[0], mbs):
            sl = slice(start, start + mbs)
            self.accumulate(
                hidden_states[sl],
                input_ids[sl],
                mask[sl],
                None if target_logprobs is None else target_logprobs[sl],
                total,
            )
        return self.apply()

    @staticmethod
    def scored_tokens(mask: torch.Tensor) -> int:
        """Tokens of ``mask`` [B, S] the TTT loss can score (positions >= 2; may be 0)."""
        return int(mask[:, 2:].bool().sum())

    @staticmethod
    def num_loss_tokens(mask: torch.Tensor) -> int:
        """:meth:`scored_tokens`, at least 1: the normaliser to pass to :meth:`accumulate` for a batch split into
        micro-batches (with data parallelism: the sum of every rank's :meth:`scored_tokens`, at least 1)."""
        return max(DraftTrainer.scored_tokens(mask), 1)

    def zero_grad(self) -> None:
        """Start a new accumulation (clears gradients and the running metrics)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._loss_sum, self._metric_sums = 0.0, {}

    def accumulate(
        self,
        hidden_states: torch.Tensor,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        target_logprobs: torch.Tensor | None,
        total_tokens: int,
    ) -> None:
        """Forward + backward of one micro-batch, weighted by its share ``valid tokens / total_tokens`` of the
        whole batch (so the accumulated gradient is that of the token-weighted mean loss).

        Shapes as in :meth:`step`; ``target_logprobs`` may also be the scored tokens' rows only, [N, V] or
        [N, draft_vocab_size] in :func:`~nemo_rl_spec.speculative.ttt_scored.scored_index` order (what the online
        draft passes, :func:`~nemo_rl_spec.speculative.ttt_scored.scored_soft_targets`). The loss is
        :func:`~nemo_rl_spec.speculative.ttt_scored.scored_ttt_loss`: ``ttt_loss`` computed at the scored tokens only.
        ``total_tokens`` = :meth:`num_loss_tokens` of the whole batch's mask.
        Raises:
            ValueError: an input still requires grad.
        """
        for name, t in (("hidden_states", hidden_states), ("target_logprobs", target_logprobs)):
            if t is not None and t.requires_grad:
                raise ValueError(f"{name} requires grad: pass policy tensors through .detach() first")
        valid = self.scored_tokens(mask)
        if valid == 0:
            return
        self.head.train()
        if target_logprobs is not None and target_logprobs.dim() == 3:
            rows, cols = scored_index(mask)
            target_logprobs = target_logprobs[rows, cols - 1]
        with self._autocast(hidden_states.device.type):
            loss, metrics = scored_ttt_loss(
                self.head, hidden_states.float(), input_ids, mask, self.ttt_steps, target_logprobs, self.step_weights
            )
        share = valid / total_tokens
        (loss * share * self.loss_weight).backward()
        self._loss_sum += float(loss.detach()) * share
        for k, v in metrics.items():
            self._metric_sums[k] = self._metric_sums.get(k, 0.0) + v * share

    def _autocast(self, device_type: str) -> torch.autocast:
        """``torch.autocast`` in :attr:`autocast_dtype` for the forward (disabled when it is None). The backward runs
        outside it, as torch recommends; the loss and log-softmaxes are fp32 either way (autocast's fp32 ops)."""
        dtype = self.autocast_dtype or torch.float32
        return torch.autocast(device_type, dtype=dtype, enabled=self.autocast_dtype is not None)

    def apply(self, sync: DataParallelSync | None = None) -> dict[str, float]:
        """Clip and take the optimizer step on the accumulated gradient; returns the metrics of :meth:`step`.

        ``sync``: sum gradients and loss / metric sums over data-parallel ranks first (module docstring); each
        rank must have accumulated with the global :meth:`num_loss_tokens` as ``total_tokens``.
        """
        sums = {"draft_loss": self._loss_sum, **self._metric_sums}
        if sync is not None:
            sync.grads(self.params)
            sums = sync.sum_metrics(sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.params, self.max_grad_norm if self.max_grad_norm is not None else math.inf
        )
        self.optimizer.step()
        self.draft_version += 1
        out = {
            "train/draft_grad_norm": float(grad_norm),
            "train/draft_lr": float(self.optimizer.param_groups[0]["lr"]),
            "train/draft_version": float(self.draft_version),
        }
        out.update({f"train/{k}": v for k, v in sums.items()})
        return out

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Checkpoint-named draft weights for :func:`~nemo_rl_spec.speculative.draft_refit.refit_drafter`."""
        return self.head.export_state_dict()

    def state_dict(self) -> dict[str, Any]:
        return {
            "head": self.head.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "draft_version": self.draft_version,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.head.load_state_dict(state["head"])
        if "d2t" in state["head"]:
            self.head.set_draft_vocab(state["head"]["d2t"] + torch.arange(self.head.cfg.draft_vocab_size))
        self.optimizer.load_state_dict(state["optimizer"])
        self.draft_version = int(state["draft_version"])

    def save_checkpoint(self, path: str | Path) -> None:
        """Head in vLLM format (``path/``) plus trainer state (``path/draft_trainer.pt``)."""
        path = Path(path)
        self.head.save_pretrained(path)
        torch.save(self.state_dict(), path / "draft_trainer.pt")

    def load_checkpoint(self, path: str | Path) -> None:
        self.load_state_dict(torch.load(Path(path) / "draft_trainer.pt", weights_only=True))
