"""``checkpointing.save_consolidated`` (NeMo-RL): the policy written as an HF checkpoint round-trips. On the real
Megatron worker (tiny random Qwen3, CPU fp32, in process), after one optimizer step:

- transformers loads the directory with exactly the worker's exported weights (bitwise);
- a Megatron worker started from the directory (``policy.model_name`` = the directory, the project's HF loader)
  gives the same log-probs as the trained worker within 1e-6;
- transformers' own forward on it agrees with the worker within 1e-5 (an independent implementation).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fixtures_models as fm  # noqa: E402

from nemo_rl_spec.algorithms.loss import ClippedPGLossFn  # noqa: E402
from nemo_rl_spec.models.hf_export import write_consolidated_hf  # noqa: E402
from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker  # noqa: E402
from nemo_rl_spec.utils.config_schema import PolicyConfig  # noqa: E402

torch.set_num_threads(1)
LOSS = ClippedPGLossFn(fm.base_recipe_section("loss_fn"))


@pytest.mark.parametrize("tied", [True, False])
def test_consolidated_checkpoint_round_trips(tmp_path, tied):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    fm.save_tiny_model(model_dir, "qwen3", tie_word_embeddings=tied)
    raw = fm.base_recipe_section("policy")
    raw["megatron_cfg"]["optimizer"].update(lr=1e-2)
    cfg = PolicyConfig.model_validate(raw)
    worker = MegatronPolicyWorker(cfg, LOSS, str(model_dir), 0)
    data = fm.on_policy(worker, fm.train_batch(seed=1))
    worker.train(data)
    exported = worker.export_hf_weights()
    out = write_consolidated_hf(exported, model_dir, tmp_path / "consolidated")

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    state = hf.state_dict()
    assert all(torch.equal(state[k], v) for k, v in exported.items())  # lm_head re-tied when tied
    assert ("lm_head.weight" in load_file(str(out / "model.safetensors"))) == (not tied)  # as HF writes it

    trained = worker.get_logprobs(data)
    reloaded = MegatronPolicyWorker(cfg, LOSS, str(out), 0).get_logprobs(data)
    assert (reloaded - trained).abs().max().item() <= 1e-6
    stale = MegatronPolicyWorker(cfg, LOSS, str(model_dir), 0).get_logprobs(data)
    assert (stale - trained).abs().max().item() > 1e-3  # the step moved the policy
    hf_lp = fm.hf_token_logprobs(hf, data["input_ids"], data["input_lengths"])
    assert (hf_lp - trained).abs().max().item() < 1e-5
