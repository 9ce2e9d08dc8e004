"""megatron-core's local core attention extended to THD packed sequences, so megatron's own packed path runs
without Transformer Engine (on CPU, and on a GPU image without TE).

With ``packed_seq_params`` (``qkv_format="thd"``) megatron's ``Attention`` squeezes the batch dimension, applies RoPE
per row (``cu_seqlens``: positions restart at every row) and hands the core attention [T, heads, head_dim] tensors of
the whole pack; TE's variable-length kernel then attends within each row. ``DotProductAttention`` asserts
``packed_seq_params is None``; :class:`PackedDotProductAttention` instead gathers the rows of the pack into a
padded batch [longest row, rows, heads, d] and runs the parent's own computation on it (scaled scores, softmax under
a causal and key-padding mask, GQA head repeat) in one batched call, then gathers the real tokens back into the pack.
Only the attention sees padding (rows x longest row^2 scores per layer, as an unpacked micro-batch of those rows);
the linear layers, the output layer and the log-softmax see the pack's real tokens only. (A loop over rows was
measured slower on CPU: one small call per row and layer, and torch's fused CPU attention backward in bf16.)
"""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention

from nemo_rl_spec.models.policy.sequence_packing import row_index


class PackedDotProductAttention(DotProductAttention):
    """``DotProductAttention`` that also accepts THD packed sequences (module docstring); without
    ``packed_seq_params`` it is the parent unchanged."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type=None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Shapes: unpacked as the parent ([s, b, heads, d] -> [s, b, heads * d]); packed: query [T, heads, d],
        key / value [T, groups, d] -> [T, 1, heads * d], row i being tokens cu_seqlens_q[i] .. cu_seqlens_q[i+1] - 1.

        Raises:
            ValueError: a packed format other than ``thd``, cu_seqlens that differ for queries and keys, or an
                attention mask with a pack (rows are masked by their bounds only).
        """
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if packed_seq_params.qkv_format != "thd" or attention_mask is not None:
            raise ValueError(
                f"PackedDotProductAttention takes qkv_format='thd' packs without an attention mask, got "
                f"qkv_format={packed_seq_params.qkv_format!r}, mask={'set' if attention_mask is not None else None}"
            )
        bounds = packed_seq_params.cu_seqlens_q
        if packed_seq_params.cu_seqlens_kv is not None and not torch.equal(packed_seq_params.cu_seqlens_kv, bounds):
            raise ValueError("PackedDotProductAttention: cu_seqlens_kv must equal cu_seqlens_q (self-attention)")
        index, mask = _row_layout(tuple(bounds.tolist()), query.device)

        def to_rows(x: torch.Tensor) -> torch.Tensor:  # [T, n, d] -> [longest, rows, n, d], padding zeros
            return torch.cat([x, x.new_zeros((1, *x.shape[1:]))])[index].transpose(0, 1)

        out = super().forward(to_rows(query), to_rows(key), to_rows(value), mask, attn_mask_type, attention_bias)
        valid = index < query.shape[0]  # [rows, longest], row-major: the pack's order
        return out.transpose(0, 1)[valid].unsqueeze(1)  # [T, 1, heads * d]


def _row_layout(bounds: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
    """For a pack with row bounds ``bounds`` (cu_seqlens): the gather index [rows, longest] into the pack's T tokens
    (:func:`~.sequence_packing.row_index`: T, one past the end, for padding) and megatron's boolean mask
    [rows, 1, longest, longest] (True = masked: a later key or a padding key).

    Worked example: bounds (0, 3, 5) -> index [[0, 1, 2], [3, 4, 5]]; row 1's mask masks key 2 everywhere.
    """
    row_tokens = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    longest = max(row_tokens)
    index = row_index(row_tokens, longest, device)
    causal = torch.ones(longest, longest, dtype=torch.bool, device=device).tril()
    keep = causal & (index < bounds[-1]).unsqueeze(1)  # [rows, longest (q), longest (k)]: causal, real keys
    return index, ~keep.unsqueeze(1)
