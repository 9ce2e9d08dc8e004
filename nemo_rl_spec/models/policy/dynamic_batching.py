"""Micro-batch plans of the Megatron policy worker: fixed-size row chunks, or NeMo-RL's dynamic batching.

A plan is a list of :class:`MicroBatch` (row indices into the worker's batch, padded length). The worker runs one
forward (and backward) per entry on ``rows`` trimmed to ``seq_len`` columns and writes per-row outputs back at
``rows``, so the caller sees its original row order whatever the plan. :func:`fixed_size_plan` (the default):
consecutive chunks of ``rows_per_mb`` rows, each trimmed to its own longest row. :func:`token_budget_plan`
(``policy.dynamic_batching.enabled``): rows sorted by length, packed up to a padded-token budget.

Why the results do not change (fp32 rounding aside): rows never attend to each other (causal attention, right
padding), and the worker's losses are divided by global counts (valid tokens / sequences of the whole global batch,
:meth:`~.megatron_worker.MegatronPolicyWorker._global_counts`), so the gradient is a sum over rows whatever the
grouping. The one exception is OCC's coefficient lambda, computed per micro-batch (docs/guides/occ.md): regrouping rows
changes it as another micro-batch size would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a plan.

    Attributes:
        rows: int64 [b] indices of its rows in the batch (b >= 1).
        seq_len: columns it is trimmed to (>= its longest row, >= 1).
    """

    rows: torch.Tensor
    seq_len: int

    @property
    def num_tokens(self) -> int:
        """Padded tokens it computes: ``len(rows) * seq_len``."""
        return int(self.rows.numel()) * self.seq_len


def padded_length(length: int, round_to: int, width: int) -> int:
    """``length`` (at least 1) rounded up to a multiple of ``round_to``, capped at ``width`` (the batch's columns),
    e.g. (37, 16, 100) -> 48, (37, 64, 50) -> 50."""
    return min(-(-max(int(length), 1) // round_to) * round_to, width)


def fixed_size_plan(lengths: torch.Tensor, rows_per_mb: int) -> list[MicroBatch]:
    """Consecutive chunks of ``rows_per_mb`` rows (the last one smaller), each trimmed to its longest row.

    Shape: lengths [B] (tokens per row) -> ceil(B / rows_per_mb) micro-batches ([] for B = 0).
    Raises:
        ValueError: ``rows_per_mb < 1``.
    """
    if rows_per_mb < 1:
        raise ValueError(f"rows_per_mb={rows_per_mb} must be >= 1")
    plan = []
    for start in range(0, int(lengths.numel()), rows_per_mb):
        rows = torch.arange(start, min(start + rows_per_mb, int(lengths.numel())))
        plan.append(MicroBatch(rows, max(int(lengths[rows].max()), 1)))
    return plan


def token_budget_plan(lengths: torch.Tensor, max_tokens: int, round_to: int, width: int) -> list[MicroBatch]:
    """Length-sorted micro-batches of at most ``max_tokens`` padded tokens (NeMo-RL's ``train_mb_tokens`` /
    ``logprob_mb_tokens`` and ``sequence_length_round``): rows sorted by length, longest first (stable, so equal
    lengths keep their order), and filled greedily into micro-batches while ``rows x padded length <= max_tokens``;
    the padded length of a micro-batch is its first (longest) row rounded up to ``round_to`` and capped at the batch
    width. A row longer than the budget gets a micro-batch of its own.

    Worked example: lengths [5, 30, 12, 28, 7], budget 64, round_to 8, width 32 -> order 1, 3, 2, 4, 0; micro-batch
    {1, 3} padded to 32 (2 x 32 = 64 tokens), {2, 4, 0} padded to 16 (48 tokens; a fourth row would make 64, but
    there is none): 112 tokens. Fixed chunks of 2 rows pad to 30, 28 and 7: 2*30 + 2*28 + 7 = 123 tokens.

    Shape: lengths [B] (tokens per row, <= width) -> micro-batches covering every row exactly once.
    Raises:
        ValueError: ``max_tokens``, ``round_to`` or ``width`` < 1.
    """
    if min(max_tokens, round_to, width) < 1:
        raise ValueError(f"max_tokens={max_tokens}, round_to={round_to} and width={width} must be >= 1")
    order = torch.argsort(lengths, descending=True, stable=True).tolist()
    plan, current, seq_len = [], [], 0
    for row in order:
        if current and (len(current) + 1) * seq_len > max_tokens:
            plan.append(MicroBatch(torch.tensor(current, dtype=torch.long), seq_len))
            current = []
        if not current:
            seq_len = padded_length(int(lengths[row]), round_to, width)
        current.append(row)
    if current:
        plan.append(MicroBatch(torch.tensor(current, dtype=torch.long), seq_len))
    return plan


def select_rows(data: dict, micro_batch: MicroBatch) -> dict:
    """The rows of ``micro_batch`` of every tensor in ``data``, trimmed to ``seq_len`` along dim 1 when the tensor
    has one; non-tensors and 0-d tensors pass unchanged.

    Shape: [B, S, ...] -> [b, seq_len, ...]; [B] -> [b].
    """
    out = {}
    for key, value in data.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[key] = value
            continue
        rows = value.index_select(0, micro_batch.rows)
        out[key] = rows[:, : micro_batch.seq_len] if rows.dim() > 1 else rows
    return out
