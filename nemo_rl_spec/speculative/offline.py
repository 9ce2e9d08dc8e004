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


def pad_sequences(
    sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to [N, S] and build the loss mask of response tokens (positions >= prompt length).

    Returns (input_ids [N, S] int64, loss_mask [N, S] bool)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.bool)
    for i, (seq, p) in enumerate(zip(sequences, prompt_lengths)):
        ids[i, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        mask[i, p : len(seq)] = True
    return ids, mask


def response_token_counts(
    sequences: Sequence[Sequence[int]], prompt_lengths: Sequence[int], vocab_size: int
) -> torch.Tensor:
    """How often each token id occurs in the responses (``seq[prompt_length:]``). Shape: -> [vocab_size] float64."""
    tokens = [t for seq, p in zip(sequences, prompt_lengths) for t in seq[p:]]
    return torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=vocab_size).double()


def train_draft_on_sequences(
    policy: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    *,
    head: Eagle3DraftHead | None = None,
    aux_layer_ids: Sequence[int] | None = None,
    draft_vocab_size: int | None = None,
    always_include: Sequence[int] = (),
    steps: int = 100,
    batch_size: int = 8,
    lr: float = 3e-3,
    ttt_steps: int = 3,
    soft_targets: bool = True,
    seed: int = 0,
    log_every: int = 0,
    trainer: DraftTrainer | None = None,
    cache_policy_outputs: bool = False,
) -> tuple[Eagle3DraftHead, list[dict[str, float]]]:
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
            its log-probs restricted to the draft vocabulary (:class:`PolicyOutputCache`), instead of a policy
            forward every step. Same loss (``ttt_loss`` drops policy mass outside the draft vocabulary anyway);
            memory ``total tokens * (n_aux * H + draft_vocab_size + 1) * 4`` bytes.

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
            counts = response_token_counts(sequences, prompt_lengths, policy.config.vocab_size)
            vocab = draft_vocab_from_counts(counts, draft_vocab_size, always_include)
        head = Eagle3DraftHead.from_target(policy, aux_layer_ids=aux_layer_ids, draft_vocab=vocab, seed=seed)
    if trainer is None:
        trainer = DraftTrainer(head, lr=lr, ttt_steps=ttt_steps)
    cache = _policy_cache(policy, head, sequences, batch_size, soft_targets) if cache_policy_outputs else None
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(ids), generator=gen)
    pos, history = 0, []
    for step in range(steps):
        if pos + batch_size > len(order):
            order, pos = torch.randperm(len(ids), generator=gen), 0
        rows = order[pos : pos + batch_size]
        pos += batch_size
        batch_ids, batch_mask = ids[rows], mask[rows]
        if cache is not None:
            aux, target = cache.batch(rows)
            batch_ids, batch_mask = batch_ids[:, : aux.shape[1]], batch_mask[:, : aux.shape[1]]
        else:
            aux, target = _policy_outputs(policy, head, batch_ids, soft_targets)
        metrics = trainer.step(aux, batch_ids, batch_mask, target)
        history.append(metrics)
        if log_every and step % log_every == 0:
            logger.info("draft step %d: %s", step, {k: round(v, 4) for k, v in metrics.items()})
    return head, history


def _policy_outputs(
    policy: torch.nn.Module, head: Eagle3DraftHead, batch_ids: torch.Tensor, soft_targets: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Detached aux hidden states [B, S, n_aux * H] and policy log-probs [B, S, V] (None for hard targets)."""
    with torch.no_grad(), capture_hidden_states(policy, head.cfg.aux_layer_ids) as cap:
        out = policy(batch_ids)
    logits = out.logits if hasattr(out, "logits") else out
    return cap.aux_hidden(), (torch.log_softmax(logits.float(), -1) if soft_targets else None)


class PolicyOutputCache:
    """The policy's outputs for draft training, one unpadded entry per sequence.

    Per sequence i of length L_i: ``aux[i]`` [L_i, n_aux * H] (detached aux hidden states), ``logprobs[i]``
    [L_i, Vd] (the policy's next-token log-probs at temperature 1, normalised over the full vocabulary, restricted to
    the draft vocabulary's ids; absent for hard targets) and ``shift[i]`` [L_i] with
    ``log p_T(v) = log p_1(v) / T + shift`` at the cache's ``temperature`` T (for acceptance estimates).
    Memory ``sum_i L_i * (n_aux * H + Vd + 1) * 4`` bytes.
    """

    def __init__(
        self,
        aux: list[torch.Tensor],
        logprobs: list[torch.Tensor] | None,
        shift: list[torch.Tensor],
        temperature: float,
    ) -> None:
        self.aux, self.logprobs, self.shift, self.temperature = aux, logprobs, shift, float(temperature)

    def __len__(self) -> int:
        return len(self.aux)

    def nbytes(self) -> int:
        parts = [*self.aux, *self.shift, *(self.logprobs or [])]
        return sum(t.numel() * t.element_size() for t in parts)

    def batch(self, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Right-padded (zeros) batch. Shape: rows [B] -> aux [B, S, n_aux * H], log-probs [B, S, Vd] or None
        (S = the longest of the rows; pair with :func:`pad_sequences` of the same rows, which masks the padding)."""
        rows = [int(r) for r in rows]
        aux = torch.nn.utils.rnn.pad_sequence([self.aux[r] for r in rows], batch_first=True)
        if self.logprobs is None:
            return aux, None
        return aux, torch.nn.utils.rnn.pad_sequence([self.logprobs[r] for r in rows], batch_first=True)

    def tempered_logprobs(self, rows: Sequence[int]) -> torch.Tensor:
        """log p_T restricted to the draft vocabulary, right-padded. Shape: rows [B] -> [B, S, Vd].

        Raises:
            ValueError: the cache holds no log-probs (hard targets).
        """
        if self.logprobs is None:
            raise ValueError("this cache was built without soft targets: no log-probs to temper")
        parts = [self.logprobs[int(r)] / self.temperature + self.shift[int(r)].unsqueeze(-1) for r in rows]
        return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)


@torch.no_grad()
def build_policy_cache(
    policy: torch.nn.Module,
    head: Eagle3DraftHead,
    sequences: Sequence[Sequence[int]],
    batch_size: int = 8,
    soft_targets: bool = True,
    temperature: float = 1.0,
    on_batch=None,
) -> PolicyOutputCache:
    """Run the policy once over ``sequences`` (batches of ``batch_size``, right-padded; causal attention makes
    the padding irrelevant to the kept positions) and keep what draft training and acceptance estimates need.

    ``on_batch(n)`` is called with the number of sequences done after each batch (a progress bar).
    """
    draft_ids = head.draft_ids.clone()
    full = head.cfg.draft_vocab_size == head.cfg.vocab_size
    n_seq = len(sequences)
    aux_out: list = [None] * n_seq
    shift_out: list = [None] * n_seq
    lp_out: list | None = [None] * n_seq if soft_targets else None
    order = sorted(range(n_seq), key=lambda i: len(sequences[i]))  # similar lengths together: less padding
    for start in range(0, n_seq, batch_size):
        idx = order[start : start + batch_size]
        chunk = [sequences[i] for i in idx]
        ids, _ = pad_sequences(chunk, [len(c) for c in chunk])
        with capture_hidden_states(policy, head.cfg.aux_layer_ids) as cap:
            out = policy(ids)
        logits = (out.logits if hasattr(out, "logits") else out).float()
        aux = cap.aux_hidden()
        lse = torch.logsumexp(logits, -1)
        shift = lse / temperature - torch.logsumexp(logits / temperature, -1)
        for i, (row, seq) in enumerate(zip(idx, chunk)):
            n = len(seq)
            aux_out[row] = aux[i, :n].clone()
            shift_out[row] = shift[i, :n].clone()
            if lp_out is not None:
                lp = logits[i, :n] - lse[i, :n].unsqueeze(-1)
                lp_out[row] = lp.clone() if full else lp.index_select(-1, draft_ids)
        if on_batch is not None:
            on_batch(len(chunk))
    return PolicyOutputCache(aux_out, lp_out, shift_out, temperature)


def _policy_cache(
    policy: torch.nn.Module,
    head: Eagle3DraftHead,
    sequences: Sequence[Sequence[int]],
    batch_size: int,
    soft_targets: bool,
) -> PolicyOutputCache:
    cfg = head.cfg
    tokens = sum(len(q) for q in sequences)
    nbytes = tokens * (cfg.num_aux * cfg.target_hidden_size + (cfg.draft_vocab_size if soft_targets else 0)) * 4
    if nbytes > 4 * (1 << 30):
        raise ValueError(
            f"cache_policy_outputs would hold {nbytes / (1 << 30):.1f} GiB ({len(sequences)} sequences, "
            f"{tokens} tokens, draft vocabulary {cfg.draft_vocab_size}): use a reduced "
            "draft_vocab_size or fewer sequences"
        )
    return build_policy_cache(policy, head, sequences, batch_size, soft_targets)
