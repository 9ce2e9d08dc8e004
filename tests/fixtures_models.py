"""Tiny random Hugging Face causal LMs (Llama, Qwen3) saved to a directory, for Megatron policy tests.

Import from a test with ``sys.path.insert(0, <tests dir>)`` then ``import fixtures_models``.
"""

from __future__ import annotations

import torch

TINY_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def tiny_hf_config(arch: str, tie_word_embeddings: bool):
    """``arch`` in {"llama", "qwen3"}. Qwen3 gets head_dim 32 != hidden/heads (as real Qwen3 models do)."""
    from transformers import LlamaConfig, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**TINY_DIMS, tie_word_embeddings=tie_word_embeddings, architectures=["LlamaForCausalLM"])
    if arch == "qwen3":
        return Qwen3Config(
            **TINY_DIMS, head_dim=32, tie_word_embeddings=tie_word_embeddings, architectures=["Qwen3ForCausalLM"]
        )
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


def base_recipe_section(section: str) -> dict:
    """A top-level section (``policy``, ``loss_fn``, ...) of ``configs/grpo_math_base.yaml``, as a fresh dict."""
    import os

    import yaml

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "grpo_math_base.yaml")
    with open(path) as f:
        return yaml.safe_load(f)[section]


def train_batch(
    seed: int = 0, batch: int = 4, seq: int = 16, vocab: int = 512, sample_mask: list[float] | None = None
) -> dict:
    """A training batch for ``MegatronPolicyWorker.train`` on random tokens: lengths 16, 11, 14, 7 (padding 0 after
    them), response mask from position 3, advantages 1.0, -0.5, 0.8, -1.3, zero generation log-probs.
    Shapes: input_ids / token_mask / generation_logprobs [batch, seq]; input_lengths / sample_mask / advantages
    [batch]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([16, 11, 14, 7][:batch])
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    token_mask = torch.zeros(batch, seq)
    for b, n in enumerate(lengths.tolist()):
        ids[b, n:] = 0
        token_mask[b, 3:n] = 1.0
    mask = torch.ones(batch) if sample_mask is None else torch.tensor(sample_mask[:batch])
    return dict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=mask,
        advantages=torch.tensor([1.0, -0.5, 0.8, -1.3])[:batch],
        generation_logprobs=torch.zeros(batch, seq),
    )


def on_policy(worker, data: dict) -> dict:
    """``data`` with ``prev_logprobs`` from ``worker`` (the first, on-policy minibatch)."""
    return {**data, "prev_logprobs": worker.get_logprobs(data)}


def train_data_from_generation(setup, gen: dict, step: int) -> dict:
    """A training batch from one ``generate`` output of a running GRPO ``setup`` (Ray actors): the sampled
    sequences with their response mask, random advantages seeded by ``step``, vLLM's generation log-probs and the
    policy's ``prev_logprobs`` of them. Shapes: [B, S] tensors, [B] lengths / advantages."""
    from nemo_rl_spec.algorithms.rollouts import response_mask

    ids, prompt_lens, seq_lens = gen["output_ids"], gen["input_lengths"], gen["unpadded_sequence_lengths"]
    adv = torch.randn(ids.shape[0], generator=torch.Generator().manual_seed(step))
    data = {
        "input_ids": ids,
        "input_lengths": seq_lens,
        "token_mask": response_mask(prompt_lens, seq_lens, ids.shape[1]),
        "sample_mask": torch.ones(ids.shape[0]),
        "advantages": adv,
        "generation_logprobs": gen["generation_logprobs"],
    }
    data["prev_logprobs"] = setup.policy.get_logprobs(data, setup.cfg.policy.generation.temperature)
    return data


def random_token_batch(lengths: list[int], seq: int, seed: int, response_start: int = 3) -> dict:
    """Random sequences for policy tests: ``input_ids`` [B, seq] (ids 1..vocab-1, 0 after each length),
    ``input_lengths`` [B], ``token_mask`` [B, seq] (1 from ``response_start`` to the length), and the generator
    (seeded with ``seed``, already used for the ids) for the caller's further draws."""
    gen = torch.Generator().manual_seed(seed)
    rows = len(lengths)
    ids = torch.randint(1, TINY_DIMS["vocab_size"], (rows, seq), generator=gen)
    token_mask = torch.zeros(rows, seq)
    for b, n in enumerate(lengths):
        ids[b, n:] = 0
        token_mask[b, response_start:n] = 1.0
    return {"input_ids": ids, "input_lengths": torch.tensor(lengths), "token_mask": token_mask, "generator": gen}


def randomize_eagle3_head(head, seed: int = 0, std: float = 0.3):
    """Give an ``Eagle3DraftHead`` visible random weights (linears N(0, std^2), norm gains 1 +- 0.3), a random
    embedding and, when its draft vocabulary is reduced, a random sorted draft vocabulary; returns the head."""
    cfg = head.cfg
    head.reset_parameters(seed=seed, std=std)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
    head.set_target_embeddings(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen))
    if cfg.draft_vocab_size < cfg.vocab_size:
        head.set_draft_vocab(torch.randperm(cfg.vocab_size, generator=gen)[: cfg.draft_vocab_size].sort().values)
    return head
