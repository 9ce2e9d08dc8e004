"""Sequence packing of the Megatron policy worker: NeMo-RL's ``policy.sequence_packing``.

A packed micro-batch puts the tokens of its rows one after the other in a single sequence of T tokens: row b
contributes its first ``row_tokens[b]`` tokens (its length rounded up to ``sequence_length_round``, capped at the
batch width; with round 1 only its real tokens). The model runs it through megatron-core's THD path
(:func:`~.megatron_model.packed_gpt_logits`: ``cu_seqlens`` bounds, RoPE restarting at every row, attention within
each row by :class:`~.packed_attention.PackedDotProductAttention`); the per-token log-probs taken on the pack are
scattered back to [b, S] (:func:`unpack_logprobs`), so every later computation (losses, metrics) is the unpacked
one. A packed step therefore equals the padded step to float32 rounding; what changes is the work: sum(row_tokens)
tokens through the linear layers, the output layer and the log-softmax instead of rows x longest row (the attention
alone runs on the rows re-padded, see :mod:`~.packed_attention`).

Micro-batch plans: rows are assigned to packs of at most ``train_mb_tokens`` / ``logprob_mb_tokens`` tokens by one
of NeMo-RL's four algorithms (:data:`ALGORITHMS`); a row larger than the budget gets a pack of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_rl_spec.models.policy.dynamic_batching import MicroBatch, padded_length

ALGORITHMS = ("concatenative", "first_fit_decreasing", "first_fit_shuffle", "modified_first_fit_decreasing")


@dataclass(frozen=True)
class PackedMicroBatch(MicroBatch):
    """A micro-batch whose rows run packed into one sequence.

    Attributes:
        rows: int64 [b] row indices (as :class:`MicroBatch`), in packing order.
        seq_len: the longest row's length (the columns the rows are trimmed to before packing).
        row_tokens: tokens of each row in the pack, aligned with ``rows`` (its length rounded, capped at the width).
    """

    row_tokens: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens computed: the pack's length T = ``sum(row_tokens)``."""
        return sum(self.row_tokens)


# ---- bin packing -----------------------------------------------------------------------------------------------------
def _first_fit(
    order: list[int], sizes: list[int], capacity: int, bins: list[list[int]] | None = None
) -> list[list[int]]:
    """Place each item of ``order`` into the first bin (in opening order) with room, else a new bin."""
    bins = [] if bins is None else bins
    loads = [sum(sizes[i] for i in b) for b in bins]
    for item in order:
        for k, load in enumerate(loads):
            if load + sizes[item] <= capacity:
                bins[k].append(item)
                loads[k] += sizes[item]
                break
        else:
            bins.append([item])
            loads.append(sizes[item])
    return bins


def _concatenative(sizes: list[int], capacity: int) -> list[list[int]]:
    """Rows in their order; a bin is closed when the next row does not fit."""
    bins, load = [], 0
    for item, size in enumerate(sizes):
        if not bins or load + size > capacity:
            bins.append([])
            load = 0
        bins[-1].append(item)
        load += size
    return bins


def _decreasing(sizes: list[int], items: list[int] | None = None) -> list[int]:
    items = range(len(sizes)) if items is None else items
    return sorted(items, key=lambda i: (-sizes[i], i))


def _modified_first_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """Johnson & Garey's MFFD (1985), items classed by size s against the capacity C: large (s > C/2), medium
    (C/3 < s <= C/2), small (C/6 < s <= C/3), tiny (the rest).

    1. every large item opens a bin (largest first);
    2. forward over those bins: add the largest medium item that fits;
    3. backward over the bins that got no medium item: if the two smallest small items fit together, add the smallest
       and then the largest small item that still fits;
    4. forward over all bins: add the largest remaining item that fits, repeatedly;
    5. what remains goes to new bins by first fit decreasing.
    """
    cls = {"large": [], "medium": [], "small": [], "tiny": []}
    for i in _decreasing(sizes):
        s = sizes[i] * 6
        key = "large" if s > 3 * capacity else "medium" if s > 2 * capacity else "small" if s > capacity else "tiny"
        cls[key].append(i)
    bins = [[i] for i in cls["large"]]
    room = [capacity - sizes[i] for i in cls["large"]]
    medium, small = list(cls["medium"]), sorted(cls["small"], key=lambda i: (sizes[i], i))  # small: ascending
    got_medium = [False] * len(bins)
    for k in range(len(bins)):  # 2
        fit = next((i for i in medium if sizes[i] <= room[k]), None)
        if fit is not None:
            medium.remove(fit)
            bins[k].append(fit)
            room[k] -= sizes[fit]
            got_medium[k] = True
    for k in reversed(range(len(bins))):  # 3
        if got_medium[k] or len(small) < 2 or sizes[small[0]] + sizes[small[1]] > room[k]:
            continue
        first = small.pop(0)
        bins[k].append(first)
        room[k] -= sizes[first]
        second = next(i for i in reversed(small) if sizes[i] <= room[k])
        small.remove(second)
        bins[k].append(second)
        room[k] -= sizes[second]
    rest = _decreasing(sizes, medium + small + cls["tiny"])
    for k in range(len(bins)):  # 4: rest is in decreasing order, so the first that fits is the largest
        while (fit := next((i for i in rest if sizes[i] <= room[k]), None)) is not None:
            rest.remove(fit)
            bins[k].append(fit)
            room[k] -= sizes[fit]
    return bins + _first_fit(rest, sizes, capacity)  # 5


def pack_bins(sizes: list[int], capacity: int, algorithm: str, seed: int = 0) -> list[list[int]]:
    """Assign items of ``sizes`` to bins of total size <= ``capacity`` (an item larger than ``capacity`` alone).

    ``concatenative``: in order, a new bin when the next item does not fit; ``first_fit_decreasing``: largest first,
    each into the first bin with room; ``first_fit_shuffle``: the same in a random order (``seed``);
    ``modified_first_fit_decreasing``: :func:`_modified_first_fit_decreasing`.

    Worked example: sizes [5, 30, 12, 28, 7], capacity 40: concatenative [[0, 1], [2, 3], [4]]; first fit decreasing
    [[1, 4], [3, 2], [0]] (30+7, 28+12, 5).

    Returns: lists of item indices; every index exactly once, no empty bin.
    Raises:
        ValueError: unknown ``algorithm`` or ``capacity`` < 1.
    """
    if capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1")
    if algorithm == "concatenative":
        return _concatenative(sizes, capacity)
    if algorithm == "first_fit_decreasing":
        return _first_fit(_decreasing(sizes), sizes, capacity)
    if algorithm == "first_fit_shuffle":
        order = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed)).tolist()
        return _first_fit(order, sizes, capacity)
    if algorithm == "modified_first_fit_decreasing":
        return _modified_first_fit_decreasing(sizes, capacity)
    raise ValueError(f"unknown sequence packing algorithm {algorithm!r}; expected one of {ALGORITHMS}")


def packed_plan(
    lengths: torch.Tensor, max_tokens: int, round_to: int, width: int, algorithm: str, seed: int = 0
) -> list[PackedMicroBatch]:
    """Packed micro-batches of at most ``max_tokens`` tokens (NeMo-RL's ``train_mb_tokens`` / ``logprob_mb_tokens``,
    ``sequence_length_round`` and ``algorithm``): each row costs its length rounded up to ``round_to`` (capped at the
    batch ``width``), rows are binned by :func:`pack_bins`.

    Worked example: lengths [5, 30, 12, 28, 7], budget 40, round 1, first_fit_decreasing -> packs {1, 4} (37 tokens),
    {3, 2} (40), {0} (5): 82 tokens, against 112 for dynamic batching with budget 64 and round 8.

    Shape: lengths [B] -> micro-batches covering every row exactly once.
    Raises:
        ValueError: ``max_tokens``, ``round_to`` or ``width`` < 1, or an unknown ``algorithm``.
    """
    if min(max_tokens, round_to, width) < 1:
        raise ValueError(f"max_tokens={max_tokens}, round_to={round_to} and width={width} must be >= 1")
    sizes = [padded_length(int(n), round_to, width) for n in lengths.tolist()]
    plan = []
    for members in pack_bins(sizes, max_tokens, algorithm, seed):
        tokens = tuple(sizes[i] for i in members)  # >= each row's length, <= width
        plan.append(PackedMicroBatch(torch.tensor(members, dtype=torch.long), max(tokens), tokens))
    return plan


# ---- packing a micro-batch -----------------------------------------------------------------------------------------
def pack_rows(input_ids: torch.Tensor, row_tokens: tuple[int, ...]) -> torch.Tensor:
    """Concatenate the first ``row_tokens[b]`` tokens of each row.

    Shape: input_ids [b, S] (S >= max(row_tokens)) -> [1, T], T = sum(row_tokens).
    Raises:
        ValueError: ``row_tokens`` does not have one entry per row, or an entry is < 1 or > S.
    """
    if len(row_tokens) != input_ids.shape[0] or min(row_tokens, default=0) < 1 or max(row_tokens) > input_ids.shape[1]:
        raise ValueError(
            f"row_tokens {row_tokens} must give 1..{input_ids.shape[1]} tokens for each of the "
            f"{input_ids.shape[0]} rows"
        )
    return torch.cat([input_ids[b, :n] for b, n in enumerate(row_tokens)]).unsqueeze(0)


def row_index(row_tokens: tuple[int, ...], seq_len: int, device=None) -> torch.Tensor:
    """Where each row's columns sit in its pack: ``index[b, c]`` = the pack position of row b's token c for
    c < row_tokens[b], else T = sum(row_tokens) (one past the end: a padding slot).

    Worked example: row_tokens (3, 2), seq_len 3 -> [[0, 1, 2], [3, 4, 5]].
    Shape: -> [b, seq_len] int64.
    """
    lengths = torch.tensor(row_tokens, device=device)
    starts = lengths.cumsum(0) - lengths
    column = torch.arange(seq_len, device=device)
    return torch.where(column < lengths.unsqueeze(1), starts.unsqueeze(1) + column, int(lengths.sum()))


def unpack_rows(packed: torch.Tensor, row_tokens: tuple[int, ...], seq_len: int) -> torch.Tensor:
    """Scatter a pack's per-token outputs back to rows: row b gets the b-th segment at columns 0 .. row_tokens[b] - 1
    and zeros after. One gather (:func:`row_index`; its backward one index-add), not a copy per row.

    Shape: packed [1, T, ...] -> [b, seq_len, ...] (seq_len >= max(row_tokens)).
    """
    rows = torch.cat([packed[0], packed.new_zeros((1, *packed.shape[2:]))])
    return rows[row_index(row_tokens, seq_len, packed.device)]


def unpack_logprobs(
    packed: torch.Tensor, row_tokens: tuple[int, ...], input_lengths: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Per-token log-probs of a pack, as :func:`~.vocab_parallel.token_logprobs` gives them for the unpacked rows.

    ``packed[0, t]`` is the log-prob of pack token t given the logits at t - 1; at the first token of a row that is
    the previous row's last position, so column 0 of every row is set to 0, as are the columns from
    ``input_lengths[b]`` on (padding, and the rounding tokens of a pack).

    Shape: packed [1, T] float32, input_lengths [b] -> [b, seq_len] float32.
    """
    out = unpack_rows(packed, row_tokens, seq_len)
    column = torch.arange(seq_len, device=out.device)
    valid = (column > 0) & (column < input_lengths.to(out.device).unsqueeze(1))
    return torch.where(valid, out, 0.0)


def unpack_capture(capture, row_tokens: tuple[int, ...], seq_len: int) -> None:
    """Unpack, in place, the hidden states an online draft captured from a packed forward
    (:class:`~nemo_rl_spec.speculative.capture.HiddenStateCapture`, sequence-first): each [T, 1, H] state becomes
    [seq_len, b, H] with row b's tokens at 0 .. row_tokens[b] - 1 and zeros after, as the unpacked forward's rows
    (whose states past a row's length the draft's loss mask never reads)."""
    for layer, state in capture.states.items():
        rows = unpack_rows(state.transpose(0, 1) if capture.sequence_first else state, row_tokens, seq_len)
        capture.states[layer] = rows.transpose(0, 1) if capture.sequence_first else rows
