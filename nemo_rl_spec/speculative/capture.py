"""Capture the policy's aux hidden states during its own forward pass, across a ``.detach()`` boundary.

``capture_hidden_states(model, layer_ids)`` registers forward hooks on the model's embedding and decoder layers
and collects, for each requested id (vLLM's EAGLE-3 convention: id 0 = embedding output, id k = output of
decoder layer k-1, i.e. the residual stream after k layers, before the final norm), the detached activation.
Works for Hugging Face causal LMs (``model.model.embed_tokens`` / ``model.model.layers``, batch-first) and
megatron-core ``GPTModel`` (``model.embedding`` / ``model.decoder.layers``, sequence-first ``[S, B, H]``), also
when wrapped in DDP / Float16Module (``.module`` chains).

Example::

    with capture_hidden_states(policy_model, head.cfg.aux_layer_ids) as cap:
        logits = policy_model(input_ids)          # the policy's normal log-prob / train forward
    aux = cap.aux_hidden()                        # [B, S, n_aux * H], requires_grad=False
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


def _unwrap(model: nn.Module) -> nn.Module:
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def find_layers(model: nn.Module) -> tuple[nn.Module, Sequence[nn.Module], bool]:
    """Locate (embedding module, decoder layers, sequence_first) of an HF or megatron-core model.

    Raises:
        ValueError: neither layout is recognised (pass ``embedding``/``layers`` explicitly).
    """
    m = _unwrap(model)
    if hasattr(m, "decoder") and hasattr(m.decoder, "layers") and hasattr(m, "embedding"):
        return m.embedding, list(m.decoder.layers), True  # megatron-core GPTModel: [S, B, H]
    inner = getattr(m, "model", None)
    if inner is not None and hasattr(inner, "layers") and hasattr(inner, "embed_tokens"):
        return inner.embed_tokens, list(inner.layers), False  # HF *ForCausalLM
    if hasattr(m, "layers") and hasattr(m, "embed_tokens"):
        return m.embed_tokens, list(m.layers), False  # HF base model
    raise ValueError(f"cannot find embedding/decoder layers in {type(m).__name__}; pass them explicitly")


@dataclass
class HiddenStateCapture:
    """Holds detached activations keyed by aux layer id (filled by the hooks, one forward pass)."""

    layer_ids: tuple[int, ...]
    sequence_first: bool
    states: dict[int, torch.Tensor] = field(default_factory=dict)

    def aux_hidden(self, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """Concatenation over ``layer_ids`` (ascending, as vLLM concatenates them).

        Shape: [B, S, len(layer_ids) * H], batch-first whatever the model's layout; detached.

        Raises:
            RuntimeError: a requested layer did not run (no forward pass inside the context, or an id > L).
        """
        missing = [i for i in self.layer_ids if i not in self.states]
        if missing:
            raise RuntimeError(f"no hidden state captured for aux layer ids {missing}")
        parts = [self.states[i] for i in self.layer_ids]
        if self.sequence_first:
            parts = [p.transpose(0, 1) for p in parts]
        out = torch.cat(parts, dim=-1)
        return out if dtype is None else out.to(dtype)


@contextmanager
def capture_hidden_states(
    model: nn.Module,
    layer_ids: Sequence[int],
    *,
    embedding: nn.Module | None = None,
    layers: Sequence[nn.Module] | None = None,
    sequence_first: bool | None = None,
) -> Iterator[HiddenStateCapture]:
    """Forward-hook context manager; see the module docstring.

    The hooks store ``output.detach()`` (first element when a layer returns a tuple, as megatron's
    TransformerLayer does), so nothing computed from the captured tensors can send gradient into the policy.
    If the model runs several forwards inside the context (micro-batches), the last one wins: capture per
    micro-batch. Hooks are removed on exit, also on error.

    Args:
        layer_ids: aux ids in vLLM's convention (0 = embedding output, k = after decoder layer k-1).
        embedding, layers, sequence_first: override the auto-detected layout (:func:`find_layers`).
    """
    ids = tuple(sorted({int(i) for i in layer_ids}))
    if embedding is None or layers is None or sequence_first is None:
        emb_auto, layers_auto, seq_auto = find_layers(model)
        embedding = embedding if embedding is not None else emb_auto
        layers = layers if layers is not None else layers_auto
        sequence_first = seq_auto if sequence_first is None else sequence_first
    if any(i < 0 or i > len(layers) for i in ids):
        raise ValueError(f"aux layer ids {ids} outside [0, {len(layers)}]")
    cap = HiddenStateCapture(ids, bool(sequence_first))

    def make_hook(layer_id: int):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            cap.states[layer_id] = out.detach()

        return hook

    handles = []
    try:
        for i in ids:
            module = embedding if i == 0 else layers[i - 1]
            handles.append(module.register_forward_hook(make_hook(i)))
        yield cap
    finally:
        for h in handles:
            h.remove()
