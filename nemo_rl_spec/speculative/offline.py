"""Offline draft initialisation: train an EAGLE-3 head on the policy's own responses.

The paper's finding: a draft trained on in-domain samples of the policy accepts far more than one trained on
generic chat. :func:`train_draft_on_sequences` takes sequences the policy produced (e.g. rollouts of the recipe's
prompts, from vLLM or transformers) and trains a head on the policy's hidden states for them, in micro-batches,
with soft targets (the policy's next-token distribution) or hard targets (the sampled tokens).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from nemo_rl_spec.speculative.capture import capture_hidden_states
from nemo_rl_spec.speculative.draft_trainer import DraftTrainer
from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead, draft_vocab_from_counts

logger = logging.getLogger(__name__)


def pad_sequences(sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int],
                  pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to [N, S] and build the loss mask of response tokens (positions >= prompt length).

    Returns (input_ids [N, S] int64, loss_mask [N, S] bool)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, (seq, p) in enumerate(zip(sequences, prompt_lengths)):
        ids[i, :len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        mask[i, p:len(seq)] = True
    return ids, mask


def train_draft_on_sequences(policy: torch.nn.Module, sequences: Sequence[Sequence[int]],
                             prompt_lengths: Sequence[int], *, head: Eagle3DraftHead | None = None,
                             aux_layer_ids: Sequence[int] | None = None, draft_vocab_size: int | None = None,
                             always_include: Sequence[int] = (), steps: int = 100, batch_size: int = 8,
                             lr: float = 3e-3, ttt_steps: int = 3, soft_targets: bool = True, seed: int = 0,
                             log_every: int = 0, trainer: DraftTrainer | None = None,
                             cache_policy_outputs: bool = False) -> tuple[Eagle3DraftHead, list[dict[str, float]]]:
    """Train (or continue training) an EAGLE-3 head on ``sequences`` the policy generated.

    Args:
        policy: HF causal LM (or megatron GPTModel) whose hidden states feed the head; run in no_grad.
        sequences, prompt_lengths: prompt + response token ids and where each response starts.
        head: head to continue training; else a new one from ``policy`` (lm_head initialised from the policy's).
        draft_vocab_size: build a reduced vocabulary of the most frequent response tokens (+ ``always_include``,
            e.g. EOS) when the head is new; full vocabulary when None.
        steps, batch_size: optimizer steps, rows per step (sampled without replacement per epoch, seeded).
        soft_targets: train on the policy's next-token distribution (else on the tokens).
        trainer: a :class:`DraftTrainer` to use (its head is trained, ``head`` and ``lr`` are ignored), e.g. to
            save its optimizer state with ``trainer.save_checkpoint`` afterwards; else a new one.
        cache_policy_outputs: run the policy once per sequence and keep its aux hidden states and (soft targets)
            its log-probs restricted to the draft vocabulary, instead of a policy forward every step. Same loss
            (``ttt_loss`` drops policy mass outside the draft vocabulary anyway); memory
            ``N * S * (n_aux * H + draft_vocab_size) * 4`` bytes.

    Returns:
        (head, per-step metrics).

    Raises:
        ValueError: ``cache_policy_outputs`` with soft targets and a cache above 4 GiB (use a reduced
            ``draft_vocab_size`` or fewer sequences).
    """
    ids, mask = pad_sequences(sequences, prompt_lengths)
    if trainer is not None:
        head = trainer.head
    if head is None:
        vocab = None
        if draft_vocab_size is not None:
            counts = torch.bincount(ids[mask], minlength=policy.config.vocab_size).float()
            vocab = draft_vocab_from_counts(counts, draft_vocab_size, always_include)
        head = Eagle3DraftHead.from_target(policy, aux_layer_ids=aux_layer_ids, draft_vocab=vocab, seed=seed)
    if trainer is None:
        trainer = DraftTrainer(head, lr=lr, ttt_steps=ttt_steps)
    cache = _policy_cache(policy, head, ids, batch_size, soft_targets) if cache_policy_outputs else None
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(ids), generator=gen)
    pos, history = 0, []
    for step in range(steps):
        if pos + batch_size > len(order):
            order, pos = torch.randperm(len(ids), generator=gen), 0
        rows = order[pos:pos + batch_size]
        pos += batch_size
        batch_ids, batch_mask = ids[rows], mask[rows]
        if cache is not None:
            aux, target = cache.batch(rows)
        else:
            aux, target = _policy_outputs(policy, head, batch_ids, soft_targets)
        metrics = trainer.step(aux, batch_ids, batch_mask, target)
        history.append(metrics)
        if log_every and step % log_every == 0:
            logger.info("draft step %d: %s", step, {k: round(v, 4) for k, v in metrics.items()})
    return head, history


def _policy_outputs(policy: torch.nn.Module, head: Eagle3DraftHead, batch_ids: torch.Tensor,
                    soft_targets: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Detached aux hidden states [B, S, n_aux * H] and policy log-probs [B, S, V] (None for hard targets)."""
    with torch.no_grad(), capture_hidden_states(policy, head.cfg.aux_layer_ids) as cap:
        out = policy(batch_ids)
    logits = out.logits if hasattr(out, "logits") else out
    return cap.aux_hidden(), (torch.log_softmax(logits.float(), -1) if soft_targets else None)


class _PolicyCache:
    """Per-sequence policy outputs: aux [N, S, n_aux * H], draft-vocabulary log-probs [N, S, Vd] (or None)."""

    def __init__(self, aux: torch.Tensor, draft_logprobs: torch.Tensor | None, draft_ids: torch.Tensor,
                 vocab_size: int) -> None:
        self.aux, self.draft_logprobs, self.draft_ids, self.vocab_size = aux, draft_logprobs, draft_ids, vocab_size

    def batch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Shape: rows [B] -> aux [B, S, n_aux * H], log-probs [B, S, V] (-inf outside the draft vocabulary)."""
        if self.draft_logprobs is None:
            return self.aux[rows], None
        part = self.draft_logprobs[rows]
        if part.shape[-1] == self.vocab_size:
            return self.aux[rows], part
        full = part.new_full((*part.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.draft_ids] = part
        return self.aux[rows], full


def _policy_cache(policy: torch.nn.Module, head: Eagle3DraftHead, ids: torch.Tensor, batch_size: int,
                  soft_targets: bool) -> _PolicyCache:
    N, S = ids.shape
    cfg = head.cfg
    nbytes = N * S * (cfg.num_aux * cfg.target_hidden_size + (cfg.draft_vocab_size if soft_targets else 0)) * 4
    if nbytes > 4 * (1 << 30):
        raise ValueError(f"cache_policy_outputs would hold {nbytes / (1 << 30):.1f} GiB ({N} sequences x {S} "
                         f"tokens, draft vocabulary {cfg.draft_vocab_size}): use a reduced draft_vocab_size or "
                         "fewer sequences")
    draft_ids = head.draft_ids.clone()
    aux_parts, lp_parts = [], []
    for start in range(0, N, batch_size):
        aux, target = _policy_outputs(policy, head, ids[start:start + batch_size], soft_targets)
        aux_parts.append(aux.float())
        if target is not None:
            lp_parts.append(target if cfg.draft_vocab_size == cfg.vocab_size else target.index_select(-1, draft_ids))
    return _PolicyCache(torch.cat(aux_parts), torch.cat(lp_parts) if lp_parts else None, draft_ids, cfg.vocab_size)
