"""Drafter catch-up: skip the EAGLE drafter's pass on k = 0 decode steps, re-run it later over exactly the positions
it skipped.

vLLM runs the drafter's first forward pass on every step, k = 0 included, so that the drafter's KV cache holds
every position when drafting resumes (``SpecDecodeBaseProposer.propose``). Skipping that pass at large running
batches makes a k = 0 step cost an autoregressive step, but leaves the skipped positions' drafter KV slots stale,
which lowers acceptance once the batch shrinks into the drafting range (docs/results/longtail.md).
:class:`DrafterCatchUp` keeps, for every skipped decode step, what the drafter would have read (each request's
input token, position, KV slot and the target's aux hidden states); when a request's drafter pass next runs, the
skipped run of positions is fed to the drafter first, as a chunked prefill through vLLM's own ``propose`` with
k = 0, so its KV cache is what it would have been without the skip, for far less than one pass per step. Only pure
decode steps are skipped and recorded (prompt positions always have drafter KV, recorded rows never include
rejected tokens). Verification is untouched: outputs stay lossless whatever the drafter's cache holds
(tests/functional/test_drafter_catch_up_engine.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SkippedDecodeStep:
    """What the drafter would have read on one skipped decode step of ``b`` requests (one token each).

    Attributes:
        rows: request id -> row index in this step's batch.
        token_ids: ``[b]`` int, each request's input token (target vocabulary) at ``positions``.
        positions: ``[b]`` int, the token's position in its sequence.
        slots: ``[b]`` int64, the KV-cache slot of that position (the drafter shares the target's KV cache group,
            so its slot is the target's).
        hidden_states: ``[b, D]``, the target's hidden states for the drafter (EAGLE-3: ``D`` = 3 x hidden size).
    """

    rows: dict[str, int]
    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    hidden_states: torch.Tensor


@dataclass
class CatchUpRun:
    """One request's skipped positions to replay, contiguous and ending right before its current query.

    Attributes:
        batch_row: the request's row in the current step's batch (its block-table row).
        token_ids: ``[m]`` input tokens at ``positions``; ``positions``: ``[m]`` consecutive; ``slots``: ``[m]``;
        hidden_states: ``[m, D]``.
        next_token_id: the token at ``positions[-1] + 1`` (the current query's first token): the drafter's input
            for the last row (EAGLE shifts inputs by one).
    """

    batch_row: int
    token_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    hidden_states: torch.Tensor
    next_token_id: int


class DrafterCatchUp:
    """Records skipped decode steps and replays them through the drafter when its pass next runs.

    Memory: one ``D``-wide hidden-state row per skipped (request, position), held until the request's next drafter
    pass or until it leaves the engine (finished or preempted): for 64 requests x 500 skipped steps x D = 1,728 in
    bf16, about 110 MB.

    Args:
        max_tokens_per_pass: the drafter's token buffer size (vLLM: ``max_num_batched_tokens``); replays longer than
            this are split into chunks of at most this many tokens, in order, each attending to the earlier ones.
    """

    def __init__(self, max_tokens_per_pass: int) -> None:
        if max_tokens_per_pass < 1:
            raise ValueError(f"max_tokens_per_pass must be >= 1, got {max_tokens_per_pass}")
        self.max_tokens_per_pass = max_tokens_per_pass
        self.steps: list[SkippedDecodeStep] = []
        self.pending: set[str] = set()
        self.replayed_tokens = 0

    def record(self, req_ids: Sequence[str], propose_kwargs: dict[str, Any]) -> None:
        """Keep a skipped decode step's drafter inputs (``propose_kwargs``: the keyword arguments vLLM's model runner
        passed to ``drafter.propose``; ``req_ids``: the batch's request ids in row order, one token per request)."""
        cad = propose_kwargs["common_attn_metadata"]
        b = cad.batch_size()
        self.steps.append(
            SkippedDecodeStep(
                rows={rid: i for i, rid in enumerate(req_ids[:b])},
                token_ids=propose_kwargs["target_token_ids"][:b].clone(),
                positions=propose_kwargs["target_positions"][:b].clone(),
                slots=cad.slot_mapping[:b].clone(),
                hidden_states=propose_kwargs["target_hidden_states"][:b].clone(),
            )
        )
        self.pending.update(req_ids[:b])

    def forget_all_but(self, live: Any) -> None:
        """Drop what is kept for requests not in ``live`` (a container of request ids: those still in the engine)."""
        gone = [rid for rid in self.pending if rid not in live]
        if gone:
            self.pending.difference_update(gone)
            self._prune()

    def runs_for(self, req_ids: Sequence[str], propose_kwargs: dict[str, Any]) -> list[CatchUpRun]:
        """The replay runs of the current step's requests (``propose_kwargs`` of the step whose drafter pass is
        about to run), and forget everything kept for those requests (after this pass their earlier skipped
        positions can no longer be contiguous with a later query)."""
        cad = propose_kwargs["common_attn_metadata"]
        b = cad.batch_size()
        starts = cad.query_start_loc_cpu[:b].tolist()
        first_positions = propose_kwargs["target_positions"][starts].tolist()
        first_tokens = propose_kwargs["target_token_ids"][starts].tolist()
        runs = []
        for row, rid in enumerate(req_ids[:b]):
            if rid in self.pending:
                run = self._run(rid, row, int(first_positions[row]), int(first_tokens[row]))
                if run is not None:
                    runs.append(run)
        if runs or self.pending.intersection(req_ids[:b]):
            self.pending.difference_update(req_ids[:b])
            self._prune()
        return runs

    def _run(self, rid: str, batch_row: int, first_position: int, first_token: int) -> CatchUpRun | None:
        need, picked = first_position - 1, []
        for step in reversed(self.steps):
            row = step.rows.get(rid)
            if row is None:
                continue
            if int(step.positions[row]) != need:
                break
            picked.append((step, row))
            need -= 1
        if not picked:
            return None
        picked.reverse()

        def gather(attr: str) -> torch.Tensor:
            return torch.stack([getattr(step, attr)[row] for step, row in picked])

        return CatchUpRun(
            batch_row=batch_row,
            token_ids=gather("token_ids"),
            positions=gather("positions"),
            slots=gather("slots"),
            hidden_states=gather("hidden_states"),
            next_token_id=first_token,
        )

    def _prune(self) -> None:
        self.steps = [step for step in self.steps if not self.pending.isdisjoint(step.rows)]

    def replay(self, runs: Sequence[CatchUpRun], propose: Callable[..., Any], propose_kwargs: dict[str, Any]) -> int:
        """Feed ``runs`` to the drafter through ``propose`` (vLLM's ``drafter.propose``) with k = 0, in passes of
        at most ``max_tokens_per_pass`` tokens (a run longer than that in consecutive chunks, earliest first).
        Returns the number of tokens replayed."""
        total = 0
        for batch in pack_chunks(runs, self.max_tokens_per_pass):
            cad = catch_up_attention_metadata(propose_kwargs["common_attn_metadata"], batch)
            propose(
                num_speculative_tokens=0,
                target_token_ids=torch.cat([run.token_ids for run in batch]),
                target_positions=torch.cat([run.positions for run in batch]),
                target_hidden_states=torch.cat([run.hidden_states for run in batch]),
                next_token_ids=torch.tensor(
                    [run.next_token_id for run in batch], dtype=propose_kwargs["next_token_ids"].dtype
                ),
                token_indices_to_sample=None,
                common_attn_metadata=cad,
                sampling_metadata=propose_kwargs["sampling_metadata"],
            )
            total += cad.num_actual_tokens
        self.replayed_tokens += total
        return total


def pack_chunks(runs: Sequence[CatchUpRun], max_tokens: int) -> list[list[CatchUpRun]]:
    """Split ``runs`` into passes of at most ``max_tokens`` tokens with at most one chunk per request each; a
    request's chunks go to successive passes in position order (each chunk's KV is written before the next one
    reads it). A chunk's ``next_token_id`` is the token after it: the next chunk's first token, or the run's own.

    Raises:
        ValueError: ``max_tokens`` < 1.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    passes: list[list[CatchUpRun]] = []
    current: list[CatchUpRun] = []
    used = 0
    for run in runs:
        m = int(run.positions.shape[0])
        for lo in range(0, m, max_tokens):
            hi = min(lo + max_tokens, m)
            nxt = int(run.token_ids[hi]) if hi < m else run.next_token_id
            chunk = CatchUpRun(
                run.batch_row,
                run.token_ids[lo:hi],
                run.positions[lo:hi],
                run.slots[lo:hi],
                run.hidden_states[lo:hi],
                nxt,
            )
            if current and (used + hi - lo > max_tokens or lo > 0):
                passes.append(current)
                current, used = [], 0
            current.append(chunk)
            used += hi - lo
    if current:
        passes.append(current)
    return passes


def catch_up_attention_metadata(cad: Any, runs: Sequence[CatchUpRun]) -> Any:
    """vLLM ``CommonAttentionMetadata`` for one replay pass: request ``i`` queries ``runs[i].positions`` (``m_i``
    consecutive positions ending at ``p_i``) over a context of ``p_i + 1`` tokens, with its block-table row from the
    current step's metadata ``cad`` and the recorded KV slots; every other field is the current step's or unset.

    Returns:
        A copy of ``cad`` with ``query_start_loc`` ``[n + 1]`` (int32 cumulative ``m_i``), ``seq_lens`` ``[n]``
        (``p_i + 1``), ``block_table_tensor`` ``[n, max_blocks]``, ``slot_mapping`` ``[sum m_i]``.
    """
    lengths = [int(run.positions.shape[0]) for run in runs]
    seq_lens = [int(run.positions[-1]) + 1 for run in runs]
    qsl = torch.zeros(len(runs) + 1, dtype=cad.query_start_loc.dtype)
    qsl[1:] = torch.tensor(lengths).cumsum(0)
    seq = torch.tensor(seq_lens, dtype=cad.seq_lens.dtype)
    rows = torch.tensor([run.batch_row for run in runs], dtype=torch.long)
    return cad.replace(
        query_start_loc=qsl.to(cad.query_start_loc.device),
        query_start_loc_cpu=qsl,
        seq_lens=seq.to(cad.seq_lens.device),
        num_reqs=len(runs),
        num_actual_tokens=int(qsl[-1]),
        max_query_len=max(lengths),
        max_seq_len=max(seq_lens),
        block_table_tensor=cad.block_table_tensor[rows.to(cad.block_table_tensor.device)],
        slot_mapping=torch.cat([run.slots for run in runs]).to(cad.slot_mapping.device),
        causal=True,
        logits_indices_padded=None,
        num_logits_indices=None,
        max_logits_per_req=None,
        positions=None,
        is_prefilling=None,
        seq_lens_cpu_upper_bound=seq,
        req_idx=None,
        dcp_local_seq_lens=None,
        dcp_local_seq_lens_cpu_upper_bound=None,
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )
