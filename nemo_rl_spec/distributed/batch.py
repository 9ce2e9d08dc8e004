"""Splitting a batch by data-parallel rank and putting the pieces back together.

A batch is a ``dict[str, torch.Tensor]`` whose tensors share their first (row) dimension (TrainDatumSpec); values
that are not tensors, or tensors of rank 0, are passed to every shard unchanged.

Worked example (B=5 rows, dp_size=2): shard 0 gets rows 0..2, shard 1 rows 3..4 (``torch.tensor_split``: the first
``B % dp_size`` shards get one row more). :func:`gather_batch` of the two shards' per-row outputs, right-padded to
a common width, gives rows 0..4 again.
"""

from __future__ import annotations

from typing import Any

import torch


def shard_bounds(num_rows: int, dp_size: int) -> list[tuple[int, int]]:
    """Row ranges ``[start, stop)`` of the ``dp_size`` contiguous shards of ``num_rows`` rows (sizes differ by at most
    one, larger first; a shard may be empty when ``num_rows < dp_size``).

    Raises:
        ValueError: ``dp_size < 1`` or ``num_rows < 0``.
    """
    if dp_size < 1 or num_rows < 0:
        raise ValueError(f"dp_size={dp_size} must be >= 1 and num_rows={num_rows} >= 0")
    base, extra = divmod(num_rows, dp_size)
    bounds, start = [], 0
    for d in range(dp_size):
        stop = start + base + (d < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def _num_rows(data: dict[str, Any]) -> int:
    rows = {int(v.shape[0]) for v in data.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(rows) != 1:
        raise ValueError(f"batch tensors disagree on the row count (or there are none): {sorted(rows)}")
    return rows.pop()


def shard_batch(data: dict[str, Any], dp_size: int) -> list[dict[str, Any]]:
    """``dp_size`` contiguous row shards of ``data`` (:func:`shard_bounds`).

    Shape: every tensor [B, ...] -> shard d holds [B_d, ...] with sum_d B_d = B.
    Raises:
        ValueError: tensors with different row counts.
    """
    bounds = shard_bounds(_num_rows(data), dp_size)
    out = []
    for start, stop in bounds:
        out.append({k: (v[start:stop] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in data.items()})
    return out


def gather_batch(shards: list[torch.Tensor], pad_value: float = 0.0) -> torch.Tensor:
    """Concatenate per-shard outputs along rows, right-padding dim 1 (when present) to the widest shard.

    Shape: [B_d, S_d, ...] for each shard -> [sum B_d, max S_d, ...].
    """
    if shards[0].dim() < 2:
        return torch.cat(shards)
    width = max(s.shape[1] for s in shards)
    padded = [
        torch.nn.functional.pad(s, (0, 0) * (s.dim() - 2) + (0, width - s.shape[1]), value=pad_value) for s in shards
    ]
    return torch.cat(padded)
