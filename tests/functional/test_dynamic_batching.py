"""Dynamic batching (``policy.dynamic_batching``) on the real Megatron worker, tiny random Qwen3, CPU fp32.

Two workers built alike, one with fixed-size micro-batches (the padded path) and one with length-sorted token-budget
micro-batches, see the same batch of rows of very different lengths (5 to 120 tokens). Log-probs (policy and
reference) and one train step (loss, grad norm, every gradient, the weights after the step) must agree within 1e-5:
plainly, with MTP co-training (fixed coefficient: the MTP losses are normalised by global counts too), and with the
online EAGLE-3 head trained on hidden states captured from the dynamically batched forward (its weights too).
A DP=2 group binning its own shards gives the DP=1 padded step (Ray and two worker processes, about 16 s: CI tier).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fixtures_models as fm  # noqa: E402

from nemo_rl_spec.algorithms.loss import ClippedPGLossFn  # noqa: E402
from nemo_rl_spec.models.policy import megatron_model as mm  # noqa: E402
from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker  # noqa: E402
from nemo_rl_spec.utils.config_schema import PolicyConfig  # noqa: E402

torch.set_num_threads(1)
LENGTHS = [120, 9, 64, 17, 101, 33, 5, 80]
WIDTH, PROMPT = 120, 4  # responses start at position 4 (>= the draft's TTT reach, see dynamic_batching.py)
TOL = 1e-5


def _policy_cfg(dynamic: bool, feature: str) -> dict:
    cfg = fm.base_recipe_section("policy")
    cfg.update(train_micro_batch_size=2, logprob_batch_size=3, max_total_sequence_length=128)
    cfg["megatron_cfg"]["optimizer"].update(lr=1e-3, adam_eps=1e-3)  # smooth first Adam step (test_megatron_parallel)
    if dynamic:  # train plan: {120}, {101}, {80, 64}, {33, 17, 9, 5} (padded to 120, 104, 80, 40)
        cfg["dynamic_batching"] = {
            "enabled": True,
            "train_mb_tokens": 160,
            "logprob_mb_tokens": 256,
            "sequence_length_round": 8,
        }
    if feature == "mtp":
        cfg["megatron_cfg"].update(mtp_num_layers=1, mtp_loss_mode="ce", mtp_loss_scaling_factor=0.5)
    if feature == "draft":
        cfg["draft"] = {"enabled": True, "online": True, "optimizer": {"lr": 1e-3}}
        cfg["generation"]["vllm_kwargs"] = {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 2}}
    return cfg


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_dynbatch")
    fm.save_tiny_model(path, "qwen3", True)
    return str(path)


def _loss_cfg() -> dict:
    return {**fm.base_recipe_section("loss_fn"), "reference_policy_kl_penalty": 0.05}


def _worker(model_dir: str, dynamic: bool, feature: str) -> MegatronPolicyWorker:
    cfg = PolicyConfig.model_validate(_policy_cfg(dynamic, feature))
    return MegatronPolicyWorker(cfg, ClippedPGLossFn(_loss_cfg()), model_dir, seed=3, init_reference_model=True)


def _batch() -> dict:
    gen = torch.Generator().manual_seed(7)
    n = len(LENGTHS)
    ids = torch.randint(1, 512, (n, WIDTH), generator=gen)
    token_mask = torch.zeros(n, WIDTH)
    for b, length in enumerate(LENGTHS):
        ids[b, length:] = 0
        token_mask[b, PROMPT:length] = 1.0
    return dict(
        input_ids=ids,
        input_lengths=torch.tensor(LENGTHS),
        token_mask=token_mask,
        sample_mask=torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0]),
        advantages=torch.randn(n, generator=gen),
        generation_logprobs=torch.zeros(n, WIDTH),
    )


def _params(worker) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in mm.megatron_param_state(worker.module).items()}
    if worker.draft is not None:
        state.update({f"draft.{k}": p.detach().clone() for k, p in worker.draft.head.named_parameters()})
    return state


def _grads(worker) -> dict[str, torch.Tensor]:
    grads = {
        n: p.main_grad.detach().clone()
        for n, p in worker.module.named_parameters()
        if p.requires_grad and hasattr(p, "main_grad")
    }
    grads.update(
        {
            n: p.grad.detach().clone()
            for n, p in worker.module.named_parameters()
            if n.startswith(mm.MTP_PREFIX) and p.grad is not None
        }
    )
    return grads


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b) and a
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_token_budget_plan_regroups_the_rows(model_dir):
    worker = _worker(model_dir, dynamic=True, feature="plain")
    plan = worker.micro_batch_plan(_batch(), "train")
    assert [mb.rows.tolist() for mb in plan] == [[0], [4], [7, 2], [5, 3, 1, 6]]
    assert [mb.seq_len for mb in plan] == [120, 104, 80, 40]
    padded = sum(2 * max(LENGTHS[i : i + 2]) for i in range(0, 8, 2))  # fixed chunks of 2 rows
    assert sum(mb.num_tokens for mb in plan) == 544 < padded == 730


@pytest.mark.parametrize("feature", ["plain", "mtp", "draft"])
def test_dynamic_batching_equals_padded_path(model_dir, feature):
    padded, dynamic = _worker(model_dir, False, feature), _worker(model_dir, True, feature)
    data = _batch()
    lp_padded, lp_dynamic = padded.get_logprobs(data), dynamic.get_logprobs(data)
    ref_padded, ref_dynamic = padded.get_reference_policy_logprobs(data), dynamic.get_reference_policy_logprobs(data)
    assert float(lp_padded.abs().max()) > 1.0  # not trivially small
    assert float((lp_padded - lp_dynamic).abs().max()) < TOL
    assert float((ref_padded - ref_dynamic).abs().max()) < TOL
    data = {**data, "prev_logprobs": lp_padded, "reference_policy_logprobs": ref_padded}

    m_padded, m_dynamic = padded.train(data), dynamic.train(data)
    assert m_padded["num_micro_batches"] == 4 and m_dynamic["num_micro_batches"] == 4
    assert m_padded["grad_norm"] > 0
    for key in ("loss", "grad_norm", "probs_ratio", "kl_penalty", "num_valid_tokens"):
        assert m_dynamic[key] == pytest.approx(m_padded[key], rel=TOL, abs=TOL), key
    if feature == "mtp":
        for key in ("mtp/loss_0", "mtp/ce_0", "mtp/acceptance_0", "mtp/grad_norm"):
            assert m_dynamic[key] == pytest.approx(m_padded[key], rel=TOL, abs=TOL), key
    if feature == "draft":
        for key in ("draft_loss", "draft_grad_norm", "draft_acc_step0", "draft_acc_step1"):
            assert m_dynamic[key] == pytest.approx(m_padded[key], rel=TOL, abs=TOL), key
    assert _max_diff(_grads(padded), _grads(dynamic)) < TOL
    before = _params(_worker(model_dir, False, feature))
    after_padded, after_dynamic = _params(padded), _params(dynamic)
    assert _max_diff(before, after_padded) > 1e-4  # the step moved the weights (the draft's too)
    if feature == "draft":
        draft = [k for k in before if k.startswith("draft.fc")]
        assert draft and _max_diff({k: before[k] for k in draft}, {k: after_padded[k] for k in draft}) > 1e-4
    print(
        f"[{feature}] max |diff| log-probs {float((lp_padded - lp_dynamic).abs().max()):.2e}, reference "
        f"{float((ref_padded - ref_dynamic).abs().max()):.2e}, grads {_max_diff(_grads(padded), _grads(dynamic)):.2e}, "
        f"weights after the step {_max_diff(after_padded, after_dynamic):.2e}"
    )
    assert _max_diff(after_padded, after_dynamic) < TOL


@pytest.mark.timeout(600)
def test_dp2_dynamic_batching_equals_dp1_padded(model_dir):
    ray = pytest.importorskip("ray")
    from nemo_rl_spec.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl_spec.models.policy.lm_policy import Policy

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cluster = RayVirtualCluster(num_nodes=1, cpus_per_node=2.0)
    reference = _worker(model_dir, False, "plain")
    policy = Policy(
        cluster,
        [0, 0],
        PolicyConfig.model_validate(_policy_cfg(True, "plain")),
        ClippedPGLossFn(_loss_cfg()),
        model_dir,
        3,
        num_cpus=0.5,
        init_reference_model=True,
        env_vars={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    try:
        data = _batch()
        lp_dp1, lp_dp2 = reference.get_logprobs(data), policy.get_logprobs(data)
        assert float((lp_dp1 - lp_dp2).abs().max()) < TOL
        ref_lp = reference.get_reference_policy_logprobs(data)
        data = {**data, "prev_logprobs": lp_dp1, "reference_policy_logprobs": ref_lp}
        m_dp1, m_dp2 = reference.train(data), policy.train(data)
        for key in ("loss", "grad_norm", "probs_ratio", "kl_penalty", "num_valid_tokens"):
            assert m_dp2[key] == pytest.approx(m_dp1[key], rel=TOL, abs=TOL), key
        assert m_dp2["num_micro_batches"] == 6  # shard lengths 120 9 64 17 -> {120} {64 17} {9}; 101 33 5 80 ->
        # {101} {80 33} {5}: each rank binned its own rows
        after = policy.export_megatron_weights()
        assert _max_diff(after, reference.export_megatron_weights()) < TOL
    finally:
        policy.shutdown()
        cluster.shutdown()
        if started_here:
            ray.shutdown()
