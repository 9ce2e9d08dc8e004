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
                             log_every: int = 0) -> tuple[Eagle3DraftHead, list[dict[str, float]]]:
    """Train (or continue training) an EAGLE-3 head on ``sequences`` the policy generated.

    Args:
        policy: HF causal LM (or megatron GPTModel) whose hidden states feed the head; run in no_grad.
        sequences, prompt_lengths: prompt + response token ids and where each response starts.
        head: head to continue training; else a new one from ``policy`` (lm_head initialised from the policy's).
        draft_vocab_size: build a reduced vocabulary of the most frequent response tokens (+ ``always_include``,
            e.g. EOS) when the head is new; full vocabulary when None.
        steps, batch_size: optimizer steps, rows per step (sampled without replacement per epoch, seeded).
        soft_targets: train on the policy's next-token distribution (else on the tokens).

    Returns:
        (head, per-step metrics).
    """
    ids, mask = pad_sequences(sequences, prompt_lengths)
    if head is None:
        vocab = None
        if draft_vocab_size is not None:
            counts = torch.bincount(ids[mask], minlength=policy.config.vocab_size).float()
            vocab = draft_vocab_from_counts(counts, draft_vocab_size, always_include)
        head = Eagle3DraftHead.from_target(policy, aux_layer_ids=aux_layer_ids, draft_vocab=vocab, seed=seed)
    trainer = DraftTrainer(head, lr=lr, ttt_steps=ttt_steps)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(ids), generator=gen)
    pos, history = 0, []
    for step in range(steps):
        if pos + batch_size > len(order):
            order, pos = torch.randperm(len(ids), generator=gen), 0
        rows = order[pos:pos + batch_size]
        pos += batch_size
        batch_ids, batch_mask = ids[rows], mask[rows]
        with torch.no_grad(), capture_hidden_states(policy, head.cfg.aux_layer_ids) as cap:
            out = policy(batch_ids)
        logits = out.logits if hasattr(out, "logits") else out
        target = torch.log_softmax(logits.float(), -1) if soft_targets else None
        metrics = trainer.step(cap.aux_hidden(), batch_ids, batch_mask, target)
        history.append(metrics)
        if log_every and step % log_every == 0:
            logger.info("draft step %d: %s", step, {k: round(v, 4) for k, v in metrics.items()})
    return head, history
