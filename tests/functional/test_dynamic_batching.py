"""Dynamic batching (``policy.dynamic_batching``) and sequence packing (``policy.sequence_packing``) on the real
Megatron worker, tiny random Qwen3, CPU fp32.

Workers built alike, one with fixed-size micro-batches (the padded path) and one with length-sorted token-budget
micro-batches or with packs (rows concatenated, megatron-core's THD path with per-row bounds), see the same batch of
rows of very different lengths (5 to 120 tokens). Log-probs (policy and reference) and one train step (loss, grad
norm, every gradient, the weights after the step) must agree within 1e-5 (fp32 sums in another order and shape):
dynamic batching plainly, with MTP co-training (fixed coefficient: the MTP losses are normalised by global counts too),
and with the online EAGLE-3 head trained on hidden states captured from the dynamically batched forward (its weights
too); packing plainly and with the online draft (trained on the captured states unpacked to rows; packing refuses
MTP). A pack run as one row (without its row bounds) is far off: the test tells a correct pack from a broken one.
Parallel groups binning their own shards give the DP=1 padded step: dynamic batching at DP=2, packing at DP=2 x TP=2
(Ray, 2 and 4 worker processes).
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


def _policy_cfg(plan: str, feature: str, tp: int = 1) -> dict:
    """``plan``: "padded", "dynamic" or "packed"."""
    cfg = fm.base_recipe_section("policy")
    cfg.update(train_micro_batch_size=2, logprob_batch_size=3, max_total_sequence_length=128)
    cfg["megatron_cfg"]["optimizer"].update(lr=1e-3, adam_eps=1e-3)  # smooth first Adam step (test_megatron_parallel)
    cfg["megatron_cfg"]["tensor_model_parallel_size"] = tp
    if plan == "packed":  # train packs (MFFD, 160 tokens): {120, 33, 5}, {101, 17, 9}, {80, 64}
        cfg["sequence_packing"] = {"enabled": True, "train_mb_tokens": 160, "logprob_mb_tokens": 256}
    if plan == "dynamic":  # train plan: {120}, {101}, {80, 64}, {33, 17, 9, 5} (padded to 120, 104, 80, 40)
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


def _worker(model_dir: str, plan: str, feature: str = "plain") -> MegatronPolicyWorker:
    cfg = PolicyConfig.model_validate(_policy_cfg(plan, feature))
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
    worker = _worker(model_dir, "dynamic")
    plan = worker.micro_batch_plan(_batch(), "train")
    assert [mb.rows.tolist() for mb in plan] == [[0], [4], [7, 2], [5, 3, 1, 6]]
    assert [mb.seq_len for mb in plan] == [120, 104, 80, 40]
    padded = sum(2 * max(LENGTHS[i : i + 2]) for i in range(0, 8, 2))  # fixed chunks of 2 rows
    assert sum(mb.num_tokens for mb in plan) == 544 < padded == 730


def test_packed_plan_packs_the_rows(model_dir):
    """MFFD with 160 tokens: 120 and 101 are large (> 80) and open packs; no medium (53-80) row fits beside them;
    phase 4 fills them largest first (33 and 5 beside 120, 17 and 9 beside 101); 80 and 64 share a third pack."""
    plan = _worker(model_dir, "packed").micro_batch_plan(_batch(), "train")
    assert [(mb.rows.tolist(), mb.row_tokens) for mb in plan] == [
        ([0, 5, 6], (120, 33, 5)),
        ([4, 3, 1], (101, 17, 9)),
        ([7, 2], (80, 64)),
    ]
    assert sum(mb.num_tokens for mb in plan) == sum(LENGTHS) == 429


def test_packed_forward_needs_the_row_bounds(model_dir):
    """Two rows packed with their bounds give the padded log-probs; the same tokens given as one row (each token
    attending to everything before it in the pack) do not for the second row: the parity test below can fail."""
    from nemo_rl_spec.models.policy.sequence_packing import pack_rows, unpack_rows
    from nemo_rl_spec.models.policy.vocab_parallel import token_logprobs

    worker, data = _worker(model_dir, "padded"), _batch()
    rows, tokens = [7, 2], (80, 64)
    ids = data["input_ids"][rows, :80]
    expected = worker.get_logprobs(data)[rows, :80]
    packed = pack_rows(ids, tokens)
    diffs = {}
    with torch.no_grad():
        for name, bounds in {"row bounds": tokens, "one row": (sum(tokens),)}.items():
            logits = unpack_rows(mm.packed_gpt_logits(worker.model, packed, bounds), tokens, 80)
            got = token_logprobs(logits, ids, torch.tensor(tokens))
            diffs[name] = [float((got[b] - expected[b]).abs().max()) for b in range(2)]
    assert max(diffs["row bounds"]) < TOL, diffs
    assert diffs["one row"][0] < TOL and diffs["one row"][1] > 1e-2, diffs  # the first row sees nothing else


@pytest.mark.parametrize(
    "plan, feature",
    [("dynamic", "plain"), ("dynamic", "mtp"), ("dynamic", "draft"), ("packed", "plain"), ("packed", "draft")],
)
def test_plan_equals_padded_path(model_dir, plan, feature):
    padded, dynamic = _worker(model_dir, "padded", feature), _worker(model_dir, plan, feature)
    data = _batch()
    lp_padded, lp_dynamic = padded.get_logprobs(data), dynamic.get_logprobs(data)
    ref_padded, ref_dynamic = padded.get_reference_policy_logprobs(data), dynamic.get_reference_policy_logprobs(data)
    assert float(lp_padded.abs().max()) > 1.0  # not trivially small
    assert float((lp_padded - lp_dynamic).abs().max()) < TOL
    assert float((ref_padded - ref_dynamic).abs().max()) < TOL
    data = {**data, "prev_logprobs": lp_padded, "reference_policy_logprobs": ref_padded}

    m_padded, m_dynamic = padded.train(data), dynamic.train(data)
    assert m_padded["num_micro_batches"] == 4 and m_dynamic["num_micro_batches"] == (3 if plan == "packed" else 4)
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
    before = _params(_worker(model_dir, "padded", feature))
    after_padded, after_dynamic = _params(padded), _params(dynamic)
    assert _max_diff(before, after_padded) > 1e-4  # the step moved the weights (the draft's too)
    if feature == "draft":
        draft = [k for k in before if k.startswith("draft.fc")]
        assert draft and _max_diff({k: before[k] for k in draft}, {k: after_padded[k] for k in draft}) > 1e-4
    print(
        f"[{plan} {feature}] max |diff| log-probs {float((lp_padded - lp_dynamic).abs().max()):.2e}, reference "
        f"{float((ref_padded - ref_dynamic).abs().max()):.2e}, grads {_max_diff(_grads(padded), _grads(dynamic)):.2e}, "
        f"weights after the step {_max_diff(after_padded, after_dynamic):.2e}"
    )
    assert _max_diff(after_padded, after_dynamic) < TOL


@pytest.mark.timeout(600)
@pytest.mark.parametrize("plan, tp, workers", [("dynamic", 1, 2), ("packed", 2, 4)])
def test_parallel_plan_equals_dp1_padded(model_dir, plan, tp, workers):
    ray = pytest.importorskip("ray")
    from nemo_rl_spec.distributed.virtual_cluster import RayVirtualCluster
    from nemo_rl_spec.models.policy.lm_policy import Policy

    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cluster = RayVirtualCluster(num_nodes=1, cpus_per_node=2.0)
    reference = _worker(model_dir, "padded")
    policy = Policy(
        cluster,
        [0] * workers,
        PolicyConfig.model_validate(_policy_cfg(plan, "plain", tp=tp)),
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
        # each DP rank bins its own rows: shard lengths 120 9 64 17 and 101 33 5 80; dynamic: {120} {64 17} {9} and
        # {101} {80 33} {5}; packed: {120 17 9} {64} and {101 33 5} {80}
        assert m_dp2["num_micro_batches"] == (6 if plan == "dynamic" else 4)
        after = policy.export_megatron_weights()
        assert _max_diff(after, reference.export_megatron_weights()) < TOL
    finally:
        policy.shutdown()
        cluster.shutdown()
        if started_here:
            ray.shutdown()
