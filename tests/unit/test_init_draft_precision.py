"""``make draft`` / examples/init_draft.py ``--precision``: the offline draft trains under bf16 autocast when asked,
as ``policy.draft.precision`` does online (float32 by default, the shipped draft's); a bad value names the flag."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fixtures_models as fm  # noqa: E402

from nemo_rl_spec.cli import init_draft  # noqa: E402

BASE = ["--config", "configs/grpo_math_smollm2_135m_spec.yaml", "--out", "unused"]


@pytest.mark.parametrize("flags,dtype", [([], None), (["--precision", "bfloat16"], torch.bfloat16)])
def test_precision_reaches_the_draft_trainer(flags, dtype):
    args, _ = init_draft.parse_args([*BASE, *flags])
    policy = fm.build_hf_model(fm.tiny_hf_config("qwen3", True))
    trainer = init_draft._make_trainer(args, policy, None, None, seed=0)
    assert trainer.autocast_dtype == dtype
    assert all(p.dtype == torch.float32 for p in trainer.head.parameters())


def test_a_bad_precision_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        init_draft.parse_args([*BASE, "--precision", "float16"])
    assert "--precision" in capsys.readouterr().err
