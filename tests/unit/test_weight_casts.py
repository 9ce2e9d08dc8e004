"""The one dtype cast of weight exports (utils/dtypes.py: the Megatron worker's HF / MTP-drafter exports and the online
EAGLE-3 head's export) and the zero biases a MiMo refit adds (models/generation/mimo_surgery.py)."""

import pytest
import torch

from nemo_rl_spec.models.generation.mimo_surgery import with_zero_biases
from nemo_rl_spec.utils.dtypes import cast_state


def test_cast_state_casts_floating_tensors_only():
    state = {
        "w": torch.randn(3, 2),
        "ids": torch.arange(4),
        "mask": torch.tensor([True, False]),
        "h": torch.randn(2, dtype=torch.bfloat16),
    }
    out = cast_state(state, "bfloat16")
    assert {k: v.dtype for k, v in out.items()} == {
        "w": torch.bfloat16,
        "ids": torch.int64,
        "mask": torch.bool,
        "h": torch.bfloat16,
    }
    assert torch.equal(out["w"], state["w"].bfloat16()) and out["ids"] is state["ids"] and out["h"] is state["h"]
    back = cast_state(out, "float32")
    assert back["w"].dtype == torch.float32 and torch.equal(back["w"], state["w"].bfloat16().float())
    same = cast_state(state, None)
    assert same == state and same is not state and all(same[k] is state[k] for k in state)
    with pytest.raises(ValueError, match="'float8'"):
        cast_state(state, "float8")


def test_zero_biases_are_added_only_where_missing():
    q = torch.randn(4, 3, dtype=torch.bfloat16)
    weights = {"l.q_proj.weight": q, "l.k_proj.weight": torch.randn(2, 3), "l.k_proj.bias": torch.ones(2)}
    out = with_zero_biases(weights, {"l.q_proj.bias", "l.k_proj.bias", "l.v_proj.bias"})
    assert set(out) == {*weights, "l.q_proj.bias"}  # v_proj has no weight here: nothing to size a bias by
    assert out["l.q_proj.bias"].dtype == torch.bfloat16 and torch.equal(
        out["l.q_proj.bias"], torch.zeros(4, dtype=torch.bfloat16)
    )
    assert out["l.k_proj.bias"] is weights["l.k_proj.bias"] and "l.q_proj.bias" not in weights
