"""The EAGLE-3 training-time-test loss computed only where it scores (the online draft's training step).

:meth:`~nemo_rl_spec.speculative.eagle3.Eagle3DraftHead.ttt_loss` runs the output layer at every position of every
draft step and reads soft targets ``log_softmax(policy_logits)`` [B, S, V] at every position, though a term counts
only where ``loss_mask`` is true (the response tokens). Here the same loss is computed on the scored tokens only:
the soft targets at the N scored tokens, restricted to the draft vocabulary's columns (:func:`scored_soft_targets`,
[N, draft_vocab]); the draft layer beyond step 0 only on the window of chain starts that reach a scored token
(:func:`chain_window`, :meth:`~nemo_rl_spec.speculative.eagle3.Eagle3DraftHead.unroll_hidden`); the output layer,
the draft's log-softmax and the cross-entropy only at the (chain, step) pairs that score.

Same loss, same gradients and same metrics as ``ttt_loss`` (tests/unit/test_ttt_scored.py compares the two on
random heads, reduced and full vocabulary, with holes in the mask); a pure cost cut
(docs/results/draft_training_cost.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead


def scored_index(loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token index) of every token the TTT loss scores (``loss_mask`` true at index >= 2), row-major.

    Shape: loss_mask [B, S] (bool / 0-1) -> rows, cols int64 [N], N = ``DraftTrainer.scored_tokens(loss_mask)``.
    """
    rows, cols = loss_mask[:, 2:].bool().nonzero(as_tuple=True)
    return rows, cols + 2


def scored_soft_targets(
    logits: torch.Tensor, loss_mask: torch.Tensor, temperature: float, draft_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """The policy's soft targets at the scored tokens: ``log_softmax(logits[b, q - 1] / temperature)`` over the full
    vocabulary for each scored (b, q) of :func:`scored_index`, then only the ``draft_ids`` columns (None: all).

    Row for row the values ``ttt_loss`` reads from ``log_softmax(logits.float() / temperature)`` [B, S, V].
    Shape: logits [B, S, V] (any float dtype, detached here), loss_mask [B, S], draft_ids [Vd] ->
    [N, Vd] (or [N, V]) float32.
    """
    rows, cols = scored_index(loss_mask)
    target = torch.log_softmax(logits.detach()[rows, cols - 1].float() / temperature, dim=-1)
    return target if draft_ids is None else target.index_select(-1, draft_ids)


def chain_window(cols: torch.Tensor, num_steps: int, seq_len: int) -> tuple[int, int]:
    """Chain starts [start, end) that reach a scored token: step j of chain t scores token t + 2 + j, j < num_steps.

    Shape: cols [N] token indices of :func:`scored_index` -> (start, end); (0, seq_len) when N = 0.
    """
    if cols.numel() == 0:
        return 0, seq_len
    return max(int(cols.min()) - 1 - num_steps, 0), int(cols.max()) - 1


def _draft_columns(head: Eagle3DraftHead, targets: torch.Tensor | None) -> torch.Tensor | None:
    """Soft targets [N, V] or [N, Vd] -> [N, Vd] float32 (the draft vocabulary's columns)."""
    if targets is None:
        return None
    targets = targets.float()
    return targets if targets.shape[-1] == head.cfg.draft_vocab_size else targets.index_select(-1, head.draft_ids)


def _step_terms(
    head: Eagle3DraftHead, hidden: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor | None
) -> tuple[torch.Tensor, float]:
    """One draft step's mean cross-entropy and top-1 accuracy over its scored tokens (``ttt_loss``'s terms).

    Soft (``targets``): ``-sum_v p_policy(v) log q_draft(v)`` over the draft vocabulary; hard: ``-log q_draft(token)``,
    tokens outside the draft vocabulary skipped. Shape: hidden [n, H] (pre-norm), tokens [n] target ids,
    targets [n, Vd] log-probs or None -> (scalar loss, accuracy).
    """
    logits = head.lm_head(head.norm(hidden)).float()
    logq = torch.log_softmax(logits, dim=-1)
    if targets is not None:
        valid = torch.ones_like(tokens, dtype=torch.bool)
        per_tok = -(targets.exp() * logq).sum(-1)
    else:
        draft_tok = head.target_to_draft[tokens]
        valid = draft_tok >= 0
        per_tok = -logq.gather(-1, draft_tok.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    n = valid.sum().clamp_min(1)
    accuracy = float(((head.draft_ids[logits.argmax(-1)] == tokens) & valid).sum() / n)
    return (per_tok * valid).sum() / n, accuracy


def scored_ttt_loss(
    head: Eagle3DraftHead,
    aux_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    num_steps: int,
    scored_targets: torch.Tensor | None = None,
    step_weights: Sequence[float] | None = None,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """:meth:`Eagle3DraftHead.ttt_loss` (same loss ``sum_j w_j * mean_j / sum_j w_j``, same gradients, same
    ``draft_loss_step{j}`` / ``draft_acc_step{j}``) computed at the scored tokens only (module docstring).

    Shape: aux_hidden [B, S, n_aux * H_t] (detached), input_ids [B, S], loss_mask [B, S], scored_targets
    [N, Vd] or [N, V] policy log-probs of each scored token of :func:`scored_index` (:func:`scored_soft_targets`;
    None: hard targets) -> scalar loss, metrics.
    Raises:
        ValueError: ``aux_hidden`` requires grad (the draft loss would reach the policy).
    """
    if aux_hidden.requires_grad:
        raise ValueError("aux_hidden requires grad: detach the policy's hidden states before the draft loss")
    weights = list(step_weights) if step_weights is not None else [0.8**j for j in range(num_steps)]
    S = input_ids.shape[1]
    rows, cols = scored_index(loss_mask)
    start, end = chain_window(cols, num_steps, S)
    hiddens = head.unroll_hidden(aux_hidden, input_ids, num_steps, (start, end), position_ids)
    targets = _draft_columns(head, scored_targets)
    total = aux_hidden.new_zeros((), dtype=torch.float32)
    metrics: dict[str, float] = {}
    for j, hidden in enumerate(hiddens):
        if 2 + j >= S:
            break
        keep = cols >= 2 + j  # scored tokens step j reaches (chain t = q - 2 - j >= 0)
        r, q = rows[keep], cols[keep]
        step_loss, accuracy = _step_terms(
            head, hidden[r, q - 2 - j - start], input_ids[r, q], None if targets is None else targets[keep]
        )
        total = total + weights[j] * step_loss
        metrics[f"draft_loss_step{j}"] = float(step_loss.detach())
        metrics[f"draft_acc_step{j}"] = accuracy
    return total / float(sum(weights[:num_steps])), metrics
