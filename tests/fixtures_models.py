"""Tiny random Hugging Face causal LMs (Llama, Qwen3) saved to a directory, for Megatron policy tests.

Import from a test with ``sys.path.insert(0, <tests dir>)`` then ``import fixtures_models``.
"""
from __future__ import annotations

import torch

TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-6)


def tiny_hf_config(arch: str, tie_word_embeddings: bool):
    """``arch`` in {"llama", "qwen3"}. Qwen3 gets head_dim 32 != hidden/heads (as real Qwen3 models do)."""
    from transformers import LlamaConfig, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**TINY_DIMS, tie_word_embeddings=tie_word_embeddings, architectures=["LlamaForCausalLM"])
    if arch == "qwen3":
        return Qwen3Config(**TINY_DIMS, head_dim=32, tie_word_embeddings=tie_word_embeddings,
                           architectures=["Qwen3ForCausalLM"])
    raise ValueError(arch)


def build_hf_model(config, seed: int = 0):
    """An fp32 eager-attention HF model with every weight random (norm gains ~1 +- 0.3, so a mis-mapped
    norm changes the logits; matrices N(0, 0.15^2), so logits span several nats)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.3 * noise if param.dim() == 1 else 0.15 * noise)
    return model


def save_tiny_model(path, arch: str = "qwen3", tie_word_embeddings: bool = True, seed: int = 0):
    """Build and ``save_pretrained`` (safetensors) a tiny random model into ``path``; returns the model."""
    model = build_hf_model(tiny_hf_config(arch, tie_word_embeddings), seed)
    model.save_pretrained(str(path))
    return model


def load_hf_from_state(config, state: dict[str, torch.Tensor]):
    """A fresh eager fp32 HF model with ``state`` loaded strictly (the refit check)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    model.load_state_dict(state, strict=True)
    return model


def hf_token_logprobs(model, input_ids: torch.Tensor, input_lengths: torch.Tensor, temperature: float = 1.0):
    """Independent reference: log_softmax(logits / T) of each next token, aligned with input_ids.

    Shape: [B, S] -> [B, S] float32; 0 at position 0 and at positions >= input_lengths.
    """
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    out = torch.zeros(input_ids.shape, dtype=torch.float32)
    for b in range(input_ids.shape[0]):
        for s in range(1, int(input_lengths[b])):
            out[b, s] = logprobs[b, s - 1, input_ids[b, s]]
    return out
