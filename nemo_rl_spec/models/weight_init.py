"""Deterministic weight initialisation of the locally built HF models (tiny random models, the testbed)."""

from __future__ import annotations


def init_deterministic(model, seed: int, embed_std: float, linear_std: float) -> None:
    """Initialise ``model`` in place without transformers' init code or the global RNG: norms 1, the input
    embedding ~ N(0, embed_std), every other tensor ~ N(0, linear_std), drawn in sorted parameter-name order from one
    generator seeded with ``seed`` (so a build is bit-identical)."""
    import torch  # lazy: this module imports without torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                std = embed_std if name == "model.embed_tokens.weight" else linear_std
                param.copy_(torch.randn(param.shape, generator=gen) * std)
