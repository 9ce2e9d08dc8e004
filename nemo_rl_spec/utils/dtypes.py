"""Weight dicts in the dtype a recipe names (``policy.precision``, ``policy.generation.vllm_cfg.precision``,
``checkpointing.consolidated_dtype``): the one cast every exporter uses (the Megatron worker's HF / MTP-drafter
exports and the online EAGLE-3 head's export).

Kept apart from :mod:`nemo_rl_spec.utils.precision` so that the config loader, which imports that module, does not
import torch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cast_state(state: Mapping[str, torch.Tensor], dtype: str | None) -> dict[str, torch.Tensor]:
    """``state`` with every floating-point tensor in ``dtype`` (``float32`` | ``bfloat16`` | ``float16``); integer and
    bool tensors, and tensors already in ``dtype``, are kept as they are (``Tensor.to`` returns the same tensor).
    ``dtype`` None: a plain copy of the dict, tensors untouched.

    Raises:
        ValueError: ``dtype`` is not one of :data:`TORCH_DTYPES`.
    """
    if dtype is None:
        return dict(state)
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected one of {sorted(TORCH_DTYPES)} (or None)")
    target = TORCH_DTYPES[dtype]
    return {k: v.to(target) if v.is_floating_point() else v for k, v in state.items()}
