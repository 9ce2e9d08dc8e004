"""megatron-core's local core attention extended to THD packed sequences, so megatron's own packed path runs
without Transformer Engine (on CPU, and on a GPU image without TE).

With ``packed_seq_params`` (``qkv_format="thd"``) megatron's ``Attention`` squeezes the batch dimension, applies RoPE
per row (``cu_seqlens``: positions restart at every row) and hands the core attention [T, heads, head_dim] tensors of
the whole pack; TE's variable-length kernel then attends within each row. ``DotProductAttention`` asserts
``packed_seq_params is None``; :class:`PackedDotProductAttention` instead attends within each row's slice: with
megatron's vanilla softmax and no attention window by torch's fused ``scaled_dot_product_attention`` (causal, grouped
query heads, megatron's softmax scale; one kernel per row, where the parent takes about eight operations), otherwise
by the parent's own computation on the slice. Either way the attention costs sum(L_i^2) per pack, as with the
variable-length kernel, not T^2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention


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
        bounds = bounds.tolist()
        row = self._fused_row if self._fusable() else self._parent_row
        rows = [
            row(query[start:end], key[start:end], value[start:end], attn_mask_type, attention_bias)
            for start, end in zip(bounds[:-1], bounds[1:])
        ]
        return torch.cat(rows, dim=0)

    def _fusable(self) -> bool:
        """True when the parent's attention is plain causal softmax attention without dropout (what the fused kernel
        computes here)."""
        cfg = self.config
        no_dropout = cfg.attention_dropout == 0.0 or not self.training
        return cfg.softmax_type == "vanilla" and cfg.window_size is None and no_dropout

    def _fused_row(self, query, key, value, attn_mask_type, attention_bias) -> torch.Tensor:
        """One row: query [L, heads, d], key / value [L, groups, d] -> [L, 1, heads * d]."""
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            key.transpose(0, 1).unsqueeze(0),
            value.transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=self.softmax_scale,
            enable_gqa=self.num_attention_heads_per_partition != self.num_query_groups_per_partition,
        )  # [1, heads, L, d]
        return out[0].transpose(0, 1).reshape(query.shape[0], 1, -1)

    def _parent_row(self, query, key, value, attn_mask_type, attention_bias) -> torch.Tensor:
        return super().forward(
            query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1), None, attn_mask_type, attention_bias
        )
