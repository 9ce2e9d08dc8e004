"""Hidden-state capture on the megatron-core policy (GPTModel, [S, B, H] layout) and the detach boundary there:
captured aux states equal transformers' hidden states in vLLM's id convention, and draft training between the
policy's forward and backward leaves the policy's gradients bitwise unchanged (fp32).

Megatron needs a process group, so the scenario runs in a spawned process (``checks.run_isolated``).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("megatron.core")

from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.testing import checks

pytestmark = pytest.mark.timeout(1800)


def megatron_scenario(model_path: str) -> dict:
    from transformers import AutoModelForCausalLM

    from nemo_rl_spec.models.policy.megatron_model import build_from_hf, gpt_logits
    from nemo_rl_spec.speculative.capture import capture_hidden_states
    from nemo_rl_spec.speculative.draft_trainer import DraftTrainer
    from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead

    model, _ = build_from_hf(model_path)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.randint(0, hf.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    head = Eagle3DraftHead.from_target(hf, seed=0)
    trainer = DraftTrainer(head, ttt_steps=2)

    def policy_loss(logits):
        return -torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).mean()

    model.train()
    with capture_hidden_states(model, head.cfg.aux_layer_ids) as cap:
        logits = gpt_logits(model, ids)
    aux = cap.aux_hidden()
    draft_metrics = trainer.step(aux, ids, torch.ones_like(ids), torch.log_softmax(logits.detach().float(), -1))
    untouched = all(p.grad is None for p in model.parameters())
    policy_loss(logits).backward()
    grads_on = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    policy_loss(gpt_logits(model, ids)).backward()
    grads_off = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
    H = hf.config.hidden_size
    return {
        "aux_shape": tuple(aux.shape),
        "aux_requires_grad": aux.requires_grad,
        "diff_id0": float((aux[..., :H] - hs[0]).abs().max()),
        "diff_id1": float((aux[..., H : 2 * H] - hs[1]).abs().max()),
        "diff_id2_normed": float((hf.model.norm(aux[..., 2 * H :]) - hs[2]).abs().max()),
        "grads_untouched_by_draft": untouched,
        "same_grad_names": sorted(grads_on) == sorted(grads_off),
        "grads_bitwise_equal": all(torch.equal(grads_on[n], grads_off[n]) for n in grads_on),
        "num_grads": len(grads_on),
        "draft_grad_norm": draft_metrics["train/draft_grad_norm"],
    }


def test_megatron_capture_and_gradient_isolation():
    res = checks.run_isolated(megatron_scenario, resolve_model("tiny-qwen3"))
    print("\n", res)
    assert res["aux_shape"] == (2, 10, 3 * 64) and not res["aux_requires_grad"]
    assert res["diff_id0"] < 1e-5 and res["diff_id1"] < 1e-4 and res["diff_id2_normed"] < 1e-4
    assert res["grads_untouched_by_draft"] and res["same_grad_names"] and res["num_grads"] > 10
    assert res["grads_bitwise_equal"]
    assert res["draft_grad_norm"] > 0
