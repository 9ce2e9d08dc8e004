"""Online EAGLE-3 draft training inside the Megatron policy worker (tiny random Qwen3, CPU fp32).

Covers the detach boundary on the real worker: with the same batches, a worker training the draft online ends
with bitwise the same policy gradients (``main_grad``) and parameters as a worker without a draft, while the draft's
parameters move; the draft's loss equals an independent TTT loss computed from hidden states captured by a separate
forward; checkpoints restore the draft; exports are paired with the policy version they were exported with.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fixtures_models as fm  # noqa: E402

from nemo_rl_spec.algorithms.loss import ClippedPGLossFn  # noqa: E402
from nemo_rl_spec.models.policy import megatron_model as mm  # noqa: E402
from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker  # noqa: E402
from nemo_rl_spec.speculative.capture import capture_hidden_states  # noqa: E402
from nemo_rl_spec.utils.config_schema import PolicyConfig  # noqa: E402

torch.set_num_threads(1)


def _policy_cfg(draft: bool, micro=2, lr=1e-2, draft_precision="float32") -> dict:
    cfg = fm.base_recipe_section("policy")
    cfg.update(train_micro_batch_size=micro, logprob_batch_size=4)
    cfg["megatron_cfg"]["optimizer"].update(lr=lr)
    if draft:
        cfg["draft"] = {
            "enabled": True,
            "online": True,
            "precision": draft_precision,
            "optimizer": {"lr": 1e-2, "max_grad_norm": 1.0},
        }
        cfg["generation"]["vllm_kwargs"] = {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 2}}
    return cfg


def _batch(seed=0) -> dict:
    return fm.train_batch(seed, sample_mask=[1.0, 1.0, 0.0, 1.0])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_draft")
    fm.save_tiny_model(path, "qwen3", True)
    return str(path)


def _worker(model_dir, draft: bool, **kw):
    return MegatronPolicyWorker(
        PolicyConfig.model_validate(_policy_cfg(draft, **kw)),
        ClippedPGLossFn(fm.base_recipe_section("loss_fn")),
        model_dir,
        seed=3,
    )


def _grads(worker):
    return {n: p.main_grad.detach().clone() for n, p in worker.module.named_parameters() if p.requires_grad}


def _params(worker):
    return {k: v.detach().clone() for k, v in mm.megatron_param_state(worker.module).items()}


def test_policy_gradients_bitwise_equal_with_and_without_online_draft(model_dir):
    plain, with_draft = _worker(model_dir, draft=False), _worker(model_dir, draft=True)
    draft_before = copy.deepcopy(with_draft.draft.head.state_dict())
    for step in range(2):
        data = fm.on_policy(plain, _batch(seed=step))
        policy_embedding = with_draft.module.embedding.word_embeddings.weight.detach().clone()
        m_plain = plain.train(data)
        m_draft = with_draft.train(data)
        g_plain, g_draft = _grads(plain), _grads(with_draft)
        assert set(g_plain) == set(g_draft) and len(g_plain) > 10
        for name in g_plain:
            assert torch.equal(g_plain[name], g_draft[name]), (step, name)
        assert m_plain["grad_norm"] == m_draft["grad_norm"] and m_plain["loss"] == m_draft["loss"]
    p_plain, p_draft = _params(plain), _params(with_draft)
    assert all(torch.equal(p_plain[k], p_draft[k]) for k in p_plain)
    after = with_draft.draft.head.state_dict()
    trained = [n for n, p in with_draft.draft.head.named_parameters() if p.requires_grad]
    assert "fc.weight" in trained and "lm_head.weight" in trained and "embed_tokens.weight" not in trained
    assert all(not torch.equal(draft_before[k], after[k]) for k in trained)  # every trained draft tensor moved
    assert m_draft["draft_version"] == 2.0 and m_draft["draft_loss"] > 0 and m_draft["draft_grad_norm"] > 0
    for key in ("draft_acc_step0", "draft_acc_step1", "draft_lr"):
        assert key in m_draft
    # the draft's frozen embedding is the policy's at the start of the last step (vLLM's drafter shares it)
    assert torch.equal(after["embed_tokens.weight"], policy_embedding)
    assert not torch.equal(policy_embedding, draft_before["embed_tokens.weight"])


def test_draft_loss_equals_independent_ttt_loss(model_dir):
    """One micro-batch: the reported draft loss equals the TTT loss of a copy of the head on hidden states and soft
    targets captured by a separate forward of a copy of the policy (before the step)."""
    worker = _worker(model_dir, draft=True, micro=4)
    data = fm.on_policy(worker, _batch(seed=5))
    head = copy.deepcopy(worker.draft.head)
    ref, _ = mm.build_from_hf(model_dir, seed=3)
    mm.load_megatron_state(ref, _params(worker))
    with torch.no_grad(), capture_hidden_states(ref, head.cfg.aux_layer_ids) as cap:
        logits = mm.gpt_logits(ref, data["input_ids"])
    mask = (data["token_mask"] * data["sample_mask"].unsqueeze(1)).bool()
    expected, _ = head.ttt_loss(cap.aux_hidden(), data["input_ids"], mask, 2, torch.log_softmax(logits.float(), -1))
    m = worker.train(data)
    assert m["draft_loss"] == pytest.approx(float(expected), rel=1e-5)


def test_bf16_draft_leaves_policy_gradients_bitwise_and_tracks_the_fp32_draft(model_dir):
    """``policy.draft.precision: bfloat16`` on the real worker: the policy's gradients are bitwise those of the fp32
    draft's worker (the autocast covers the draft's forward only), the draft loss differs from the fp32 draft's by bf16
    rounding only, and the head's weights stay fp32."""
    w32 = _worker(model_dir, draft=True)
    w16 = _worker(model_dir, draft=True, draft_precision="bfloat16")
    assert w16.draft.trainer.autocast_dtype == torch.bfloat16 and w32.draft.trainer.autocast_dtype is None
    data = fm.on_policy(w32, _batch(seed=2))
    m32, m16 = w32.train(data), w16.train(data)
    g32, g16 = _grads(w32), _grads(w16)
    assert all(torch.equal(g32[name], g16[name]) for name in g32) and len(g32) > 10
    assert m16["draft_loss"] != m32["draft_loss"] and m16["draft_loss"] == pytest.approx(m32["draft_loss"], rel=1e-3)
    assert all(p.dtype == torch.float32 for p in w16.draft.head.parameters())


def test_train_draft_false_leaves_the_draft_untouched_and_the_policy_bitwise(model_dir):
    """``train(data, train_draft=...)`` on the real worker (what the driver passes for ``policy.draft.train_period``),
    next to a worker training its draft in every step on the same batches: step 0 trains both drafts identically;
    step 1 with ``train_draft=False`` leaves that draft untouched (no hooks, no draft step, no ``draft_*`` metrics,
    ``draft_version`` unchanged) while the other one moves; step 2 trains it again. The policy is bitwise the same in
    both workers throughout."""
    every, skipping = _worker(model_dir, draft=True), _worker(model_dir, draft=True)
    draft_keys = {"draft_loss", "draft_version", "draft_seconds"}
    for step in range(3):
        data = fm.on_policy(every, _batch(seed=step))
        before = copy.deepcopy(skipping.draft.head.state_dict())
        m_every, m_skip = every.train(data), skipping.train(data, train_draft=step != 1)
        g_every, g_skip = _grads(every), _grads(skipping)
        assert all(torch.equal(g_every[n], g_skip[n]) for n in g_every) and m_every["loss"] == m_skip["loss"]
        after = skipping.draft.head.state_dict()
        if step == 1:
            assert not draft_keys & set(m_skip) and draft_keys <= set(m_every)
            assert all(torch.equal(before[k], after[k]) for k in before)
            assert skipping.draft_version() == 1 and every.draft_version() == 2
        else:
            assert m_skip["draft_version"] == step // 2 + 1 and m_skip["draft_loss"] > 0
            assert not torch.equal(before["fc.weight"], after["fc.weight"])
        if step == 0:
            assert m_skip["draft_loss"] == m_every["draft_loss"]
            assert all(torch.equal(after[k], every.draft.head.state_dict()[k]) for k in after)
    assert m_every["draft_version"] == 3.0 and skipping.draft_version() == 2
    assert skipping.export_draft_weights()["draft_version"] == skipping.draft_version()
    assert not torch.equal(after["fc.weight"], every.draft.head.state_dict()["fc.weight"])


def test_draft_checkpoint_roundtrip_and_version_pairing(model_dir, tmp_path):
    worker = _worker(model_dir, draft=True)
    worker.train(fm.on_policy(worker, _batch(seed=1)))
    worker.export_hf_weights(version=7)
    exported = worker.export_draft_weights()
    assert exported["policy_version"] == 7 and exported["draft_version"] == 1
    worker.save_checkpoint(str(tmp_path))
    fresh = _worker(model_dir, draft=True)
    assert not torch.equal(fresh.export_draft_weights()["weights"]["fc.weight"], exported["weights"]["fc.weight"])
    fresh.load_checkpoint(str(tmp_path))
    restored = fresh.export_draft_weights()
    assert restored["draft_version"] == 1 and restored["policy_version"] == 7
    assert set(restored["weights"]) == set(exported["weights"])
    assert all(torch.equal(restored["weights"][k], exported["weights"][k]) for k in exported["weights"])


def test_export_draft_without_online_draft_raises(model_dir):
    with pytest.raises(RuntimeError, match="policy.draft.online"):
        _worker(model_dir, draft=False).export_draft_weights()
    assert _worker(model_dir, draft=False).draft_version() is None
