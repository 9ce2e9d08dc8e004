"""Megatron policy scale-out through :class:`Policy` + :class:`RayWorkerGroup` (real Ray actors, one gloo world,
megatron-core's DDP / distributed optimizer / TP layers; tiny random Qwen3 with q/k norms and tied embeddings, fp32).

The independent computation is the single-worker path: a ``MegatronPolicyWorker`` built in this process (world size
1, DP = TP = 1) on the same weights and batches. Every group of workers is started once (module fixtures) and runs
its whole scenario; the tests then compare pieces of it:

- DP=2 (plain optimizer) vs DP=1 on a 7-row batch (shards of 4 and 3 rows) and then a 1-row batch (DP rank 1 gets
  no rows): log-probs, loss, grad norm, every parameter; a checkpoint written at DP=2 loads at DP=1 and the next
  step equals the DP=2 one (the Adam state came through).
- DP=2 with the distributed optimizer and MTP co-training (occ) vs DP=1 with the plain optimizer: the same, MTP
  parameters and ``mtp/*`` metrics included; the checkpoint of the sharded Adam state resumes at DP=1.
- DP=2 x TP=2 (4 workers) with the online EAGLE-3 head vs DP=1: log-probs, the step, draft metrics and weights.
- TP=2 with MTP (occ) vs TP=1: log-probs, export_hf_weights tensor for tensor, one step; per-TP-rank checkpoint
  round trip.
- activation checkpointing (full, and selective core_attn / mlp recompute, also on THD packs) equals no
  checkpointing after one step (in process), gradients included, and the recompute really runs.
- the reference policy (KL penalty) at TP=2: initial weights swapped in and out bitwise, k3 KL matches the loss's.

Tolerances: 1e-6 where only the order of fp32 sums differs (DP: the same micro-batches, summed on two ranks); 1e-5
with TP (matmuls split over ranks, softmax over vocabulary shards). Adam's first steps divide by sqrt(v) ~ |g|,
so weights are compared after steps with ``adam_eps=1e-3`` (a smooth update; with 1e-8 it is ~sign(g) and turns
1e-8 gradient rounding into lr-sized jumps, see test_megatron_policy.py). The EAGLE-3 head's optimizer has eps 1e-8
(not configurable), so its weights are compared relative to how far they moved, next to its loss / grad norm.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fixtures_models as fm  # noqa: E402

ray = pytest.importorskip("ray")
from nemo_rl_spec.algorithms.loss import ClippedPGLossFn  # noqa: E402
from nemo_rl_spec.distributed.virtual_cluster import RayVirtualCluster  # noqa: E402
from nemo_rl_spec.models.policy import megatron_model as mm  # noqa: E402
from nemo_rl_spec.models.policy.lm_policy import Policy  # noqa: E402
from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker  # noqa: E402
from nemo_rl_spec.utils.config_schema import PolicyConfig  # noqa: E402

pytestmark = pytest.mark.timeout(900)
torch.set_num_threads(1)
SEED = 3
LOSS = ClippedPGLossFn(fm.base_recipe_section("loss_fn"))


def _cfg(
    tp: int = 1,
    distributed_optimizer: bool = False,
    mtp: bool = False,
    draft: bool = False,
    activation_checkpointing: bool = False,
    precision: str = "float32",
    mtp_mode: str = "policy",
    recompute_granularity: str | None = None,
    recompute_modules: list[str] | None = None,
    packed: bool = False,
) -> PolicyConfig:
    """Micro-batches of 2 rows for training and log-probs: the DP shards (4 + 3 rows) split into the same
    micro-batches as DP=1, so OCC's per-micro-batch lambda is comparable. ``packed``: THD packs of up to 28 tokens
    (two full rows of :func:`_batch`) instead."""
    cfg = fm.base_recipe_section("policy")
    cfg.update(
        train_micro_batch_size=2,
        logprob_batch_size=2,
        train_global_batch_size=8,  # 7 rows: one step
        precision=precision,
    )
    mcfg = cfg["megatron_cfg"]
    mcfg.update(tensor_model_parallel_size=tp, activation_checkpointing=activation_checkpointing, num_threads=1)
    mcfg.update(recompute_granularity=recompute_granularity, recompute_modules=recompute_modules)
    if packed:
        cfg.update(max_total_sequence_length=28, sequence_packing={"enabled": True, "train_mb_tokens": 28})
        cfg["sequence_packing"]["logprob_mb_tokens"] = 28
    mcfg["optimizer"].update(lr=1e-2, adam_eps=1e-3, use_distributed_optimizer=distributed_optimizer)
    if mtp:
        # policy mode: a fixed lambda sends the MTP gradient into the trunk; the step-level reference c / v2 checks the
        # DP and TP sums of full gradients
        # (the reference takes autograd.grad, which activation checkpointing refuses: off there)
        reference = not activation_checkpointing
        mcfg.update(mtp_num_layers=1, mtp_loss_mode=mtp_mode, mtp_loss_scaling_factor=0.5, mtp_occ_reference=reference)
    if draft:
        cfg["draft"] = {"enabled": True, "online": True, "optimizer": {"lr": 1e-3, "max_grad_norm": 1.0}}
        cfg["generation"]["vllm_kwargs"] = {"speculative_config": {"method": "eagle3", "num_speculative_tokens": 2}}
    return PolicyConfig.model_validate(cfg)


def _batch(rows: int, seed: int, seq: int = 14) -> dict:
    """``rows`` random sequences (lengths 14, 9, 12, 5, 14, 7, 11; padding 0 after), response from position 3,
    sample 2 masked out (when there are 3 rows or more), advantages ~ N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([14, 9, 12, 5, 14, 7, 11][:rows])
    ids = torch.randint(1, fm.TINY_DIMS["vocab_size"], (rows, seq), generator=gen)
    token_mask = torch.zeros(rows, seq)
    for b, n in enumerate(lengths.tolist()):
        ids[b, n:] = 0
        token_mask[b, 3:n] = 1.0
    sample_mask = torch.ones(rows)
    if rows >= 3:
        sample_mask[2] = 0.0
    return dict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=sample_mask,
        advantages=torch.randn(rows, generator=gen),
        generation_logprobs=torch.zeros(rows, seq),
    )


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b) and a, (sorted(set(a) ^ set(b)))[:5]
    for k in a:
        assert a[k].shape == b[k].shape, k
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _assert_metrics_close(got: dict, expected: dict, keys, rel: float, where: str = "") -> None:
    for key in keys:
        assert got[key] == pytest.approx(expected[key], rel=rel, abs=1e-9), (where, key, got[key], expected[key])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_qwen3_parallel")
    fm.save_tiny_model(path, "qwen3", True)  # 4 heads, 2 KV groups, head_dim 32, vocab 512: splits over TP=2
    return str(path)


@pytest.fixture(scope="module")
def cluster():
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    virtual = RayVirtualCluster(num_nodes=1, cpus_per_node=2.0)
    yield virtual
    virtual.shutdown()
    if started_here:
        ray.shutdown()


def _policy(cluster, model_dir: str, workers: int, cfg: PolicyConfig) -> Policy:
    return Policy(
        cluster,
        [0] * workers,
        cfg,
        LOSS,
        model_dir,
        SEED,
        num_cpus=0.5,
        env_vars={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )


def _reference(model_dir: str, cfg: PolicyConfig, seed: int = SEED) -> MegatronPolicyWorker:
    return MegatronPolicyWorker(cfg, LOSS, model_dir, seed)


def _train_both(policy, reference, data: dict) -> tuple[dict, dict]:
    data = {**data, "prev_logprobs": reference.get_logprobs(data)}
    return policy.train(data), reference.train(data)


def _dp_scenario(cluster, model_dir, tmp_path_factory, parallel_cfg: PolicyConfig, reference_cfg: PolicyConfig):
    """DP=2 vs DP=1: log-probs, a 7-row step, a 1-row step (empty shard), checkpoint at DP=2 -> DP=1, a third step
    on both the DP=2 group and the resumed DP=1 worker."""
    policy, reference = _policy(cluster, model_dir, 2, parallel_cfg), _reference(model_dir, reference_cfg)
    try:
        out = {
            "layouts": policy.layouts,
            "initial": reference.export_megatron_weights(),
            "logprobs": (policy.get_logprobs(_batch(7, 0)), reference.get_logprobs(_batch(7, 0))),
            "steps": [],
        }
        for data in (_batch(7, 1), _batch(1, 2)):
            metrics = _train_both(policy, reference, data)
            out["steps"].append((*metrics, policy.export_megatron_weights(), reference.export_megatron_weights()))
        ckpt = tmp_path_factory.mktemp("dp2_ckpt")
        policy.save_checkpoint(str(ckpt))
        out["ckpt_files"] = sorted(os.listdir(ckpt))
        resumed = _reference(model_dir, reference_cfg, seed=SEED + 11)  # other init: everything must come from disk
        resumed.load_checkpoint(str(ckpt))
        out["resumed_weights"] = resumed.export_megatron_weights()
        metrics = _train_both(policy, resumed, _batch(7, 3))
        out["after_resume"] = (*metrics, policy.export_megatron_weights(), resumed.export_megatron_weights())
    finally:
        policy.shutdown()
    return out


@pytest.fixture(scope="module")
def dp2(cluster, model_dir, tmp_path_factory):
    return _dp_scenario(cluster, model_dir, tmp_path_factory, _cfg(), _cfg())


@pytest.fixture(scope="module")
def dp2_distopt_mtp(cluster, model_dir, tmp_path_factory):
    return _dp_scenario(
        cluster, model_dir, tmp_path_factory, _cfg(distributed_optimizer=True, mtp=True), _cfg(mtp=True)
    )


@pytest.fixture(scope="module")
def dp2_bf16_distopt(cluster, model_dir, tmp_path_factory):
    """bf16 (Megatron mixed precision) DP=2 with the distributed optimizer (sharded fp32 masters) vs bf16 DP=1."""
    return _dp_scenario(
        cluster,
        model_dir,
        tmp_path_factory,
        _cfg(distributed_optimizer=True, precision="bfloat16"),
        _cfg(precision="bfloat16"),
    )


PG_KEYS = ("loss", "grad_norm", "probs_ratio", "num_valid_tokens", "num_valid_seqs", "is_weight")
MTP_KEYS = ("mtp/lambda", "mtp/c_ref", "mtp/v2_ref", "mtp/loss_0", "mtp/ce_0", "mtp/acceptance", "mtp/grad_norm")


@pytest.mark.parametrize("scenario", ["dp2", "dp2_distopt_mtp"])
def test_dp2_layout_logprobs_and_steps_equal_dp1(scenario, request):
    run = request.getfixturevalue(scenario)
    assert [(lay["dp_rank"], lay["tp_rank"], lay["dp_size"]) for lay in run["layouts"]] == [(0, 0, 2), (1, 0, 2)]
    assert all(lay["distributed_optimizer"] == (scenario == "dp2_distopt_mtp") for lay in run["layouts"])
    got, expected = run["logprobs"]
    assert got.shape == expected.shape == (7, 14) and (got - expected).abs().max().item() < 1e-6
    for step, (m_dp2, m_dp1, w_dp2, w_dp1) in enumerate(run["steps"]):
        _assert_metrics_close(m_dp2, m_dp1, PG_KEYS, rel=1e-6, where=f"step {step}")
        if scenario == "dp2_distopt_mtp":  # c_ref: a sum of gradient products that cancels (1e-7 weights -> 1e-6)
            _assert_metrics_close(m_dp2, m_dp1, MTP_KEYS, rel=1e-5, where=f"step {step}")
        assert _max_diff(w_dp2, w_dp1) < 1e-6, step
        assert _max_diff(w_dp1, run["initial"]) > 1e-3  # the steps moved every compared tensor set
    if scenario == "dp2_distopt_mtp":
        assert any(k.startswith("mtp.") for k in run["initial"])
        assert run["steps"][0][1]["mtp/lambda"] == 0.5  # the trunk took a share of the MTP gradient
    assert run["steps"][1][0]["num_micro_batches"] == 1  # the 1-row step: DP rank 1 ran no micro-batch


@pytest.mark.parametrize("scenario", ["dp2", "dp2_distopt_mtp"])
def test_checkpoint_saved_at_dp2_resumes_at_dp1(scenario, request):
    run = request.getfixturevalue(scenario)
    assert run["ckpt_files"] == ["megatron_policy_tp0.pt"]  # DP-replicated state written once
    assert _max_diff(run["resumed_weights"], run["steps"][-1][2]) == 0.0
    m_dp2, m_resumed, w_dp2, w_resumed = run["after_resume"]
    _assert_metrics_close(m_dp2, m_resumed, ("loss", "grad_norm"), rel=1e-6)
    assert _max_diff(w_dp2, w_resumed) < 1e-6  # the Adam moments (sharded over DP with the distributed optimizer)


@pytest.fixture(scope="module")
def dp2_tp2_draft(cluster, model_dir):
    """4 workers (DP=2 x TP=2) with the online EAGLE-3 head vs DP=1: log-probs and one 7-row step."""
    cfg = _cfg(tp=2, draft=True)
    policy, reference = _policy(cluster, model_dir, 4, cfg), _reference(model_dir, _cfg(draft=True))
    try:
        draft_before = reference.export_draft_weights()["weights"]
        out = {
            "layouts": policy.layouts,
            "logprobs": (policy.get_logprobs(_batch(7, 0)), reference.get_logprobs(_batch(7, 0))),
        }
        out["metrics"] = _train_both(policy, reference, _batch(7, 1))
        out["weights"] = (policy.export_megatron_weights(), reference.export_megatron_weights())
        out["draft"] = (
            policy.export_draft_weights().get()["weights"],
            reference.export_draft_weights()["weights"],
            draft_before,
        )
    finally:
        policy.shutdown()
    return out


def test_dp2_tp2_with_online_draft_equals_dp1(dp2_tp2_draft):
    run = dp2_tp2_draft
    assert [(lay["dp_rank"], lay["tp_rank"]) for lay in run["layouts"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    got, expected = run["logprobs"]
    assert (got - expected).abs().max().item() < 1e-5
    m_par, m_ref = run["metrics"]
    _assert_metrics_close(
        m_par,
        m_ref,
        PG_KEYS + ("draft_loss", "draft_grad_norm", "draft_acc_step0", "draft_acc_step1", "draft_version"),
        rel=1e-5,
    )
    assert _max_diff(*run["weights"]) < 1e-5
    draft_par, draft_ref, draft_before = run["draft"]
    moved = _max_diff(draft_ref, draft_before)
    assert moved > 5e-4  # lr 1e-3: the head took a real step
    assert _max_diff(draft_par, draft_ref) < 1e-2 * moved


@pytest.fixture(scope="module")
def tp2_mtp(cluster, model_dir, tmp_path_factory):
    """TP=2 with MTP (policy mode, full-gradient reference) vs TP=1: log-probs, export, one step; then a per-TP-rank checkpoint round trip."""
    policy, reference = _policy(cluster, model_dir, 2, _cfg(tp=2, mtp=True)), _reference(model_dir, _cfg(mtp=True))
    try:
        out = {
            "layouts": policy.layouts,
            "export": (policy.export_hf_weights(1).get(), reference.export_hf_weights(1)),
            "logprobs": (policy.get_logprobs(_batch(7, 0)), reference.get_logprobs(_batch(7, 0))),
        }
        out["metrics"] = _train_both(policy, reference, _batch(7, 1))
        out["weights"] = (policy.export_megatron_weights(), reference.export_megatron_weights())
        out["export_after"] = (policy.export_hf_weights(2).get(), reference.export_hf_weights(2))
        ckpt = tmp_path_factory.mktemp("tp2_ckpt")
        policy.save_checkpoint(str(ckpt))
        out["ckpt_files"], out["ckpt_dir"] = sorted(os.listdir(ckpt)), str(ckpt)
        step2 = {**_batch(5, 2), "prev_logprobs": policy.get_logprobs(_batch(5, 2))}
        first = (policy.train(step2), policy.export_megatron_weights())
        policy.load_checkpoint(str(ckpt))
        out["restored"] = policy.export_megatron_weights()
        out["replayed"] = (first, (policy.train(step2), policy.export_megatron_weights()))
        # MTP warm start at TP=2 (vocab-parallel CE / argmax, TP-aware clipping) vs TP=1 from the same weights
        mm.load_megatron_state(reference.module, policy.export_megatron_weights())
        warm = (_batch(7, 3), _batch(3, 4), 4, 4, 3e-3, 5)
        out["warm"] = (policy.mtp_warm_start(*warm), reference.mtp_warm_start(*warm))
        out["warm_weights"] = (policy.export_megatron_weights(), reference.export_megatron_weights())
        states = policy.mtp_states()
        policy.load_mtp_states([{k: torch.zeros_like(v) for k, v in st.items()} for st in states])
        policy.load_mtp_states(states)
        out["warm_states"] = (states, policy.mtp_states())
    finally:
        policy.shutdown()
    return out


def test_tp2_logprobs_export_and_step_equal_tp1(tp2_mtp):
    run = tp2_mtp
    assert [(lay["tp_rank"], lay["tp_size"], lay["dp_size"]) for lay in run["layouts"]] == [(0, 2, 1), (1, 2, 1)]
    got, expected = run["logprobs"]
    assert (got - expected).abs().max().item() < 1e-5
    export_tp2, export_tp1 = run["export"]
    assert "lm_head.weight" in export_tp1 and _max_diff(export_tp2, export_tp1) < 1e-6  # names, shapes, values
    m_tp2, m_tp1 = run["metrics"]
    _assert_metrics_close(m_tp2, m_tp1, PG_KEYS + MTP_KEYS, rel=1e-5)
    assert _max_diff(*run["weights"]) < 1e-5  # every parameter, the MTP block included
    assert _max_diff(*run["export_after"]) < 1e-5


def test_tp2_checkpoint_round_trip_replays_the_step(tp2_mtp, model_dir):
    run = tp2_mtp
    assert run["ckpt_files"] == ["megatron_policy_tp0.pt", "megatron_policy_tp1.pt"]
    assert _max_diff(run["restored"], run["weights"][0]) == 0.0
    (m_first, w_first), (m_again, w_again) = run["replayed"]
    assert m_first["loss"] == m_again["loss"] and m_first["grad_norm"] == m_again["grad_norm"]
    assert _max_diff(w_first, w_again) == 0.0
    with pytest.raises(ValueError, match="has TP=2; resume with policy.megatron_cfg.tensor_model_parallel_size=2"):
        _reference(model_dir, _cfg(mtp=True)).load_checkpoint(run["ckpt_dir"])  # per-TP-rank files: same TP only


def test_tp2_mtp_warm_start_equals_tp1_and_states_round_trip(tp2_mtp):
    got, expected = tp2_mtp["warm"]
    assert got.keys() == expected.keys()
    ce_keys = [k for k in got if "/ce" in k or "/train_ce" in k]
    _assert_metrics_close(got, expected, ce_keys, rel=1e-5)
    for key in (k for k in got if "/acceptance" in k):  # argmax over vocabulary shards: a near tie may flip one of
        assert got[key] == pytest.approx(expected[key], abs=1.01 / 17), key  # the 17 held-out targets
    tp2_weights, tp1_weights = tp2_mtp["warm_weights"]
    assert _max_diff(tp2_weights, tp1_weights) < 1e-5
    states, reloaded = tp2_mtp["warm_states"]  # per TP rank: its slices, loaded back bitwise
    assert len(states) == 2 and all(set(st) == set(again) for st, again in zip(states, reloaded))
    assert all(torch.equal(st[k], again[k]) for st, again in zip(states, reloaded) for k in st)
    fc2 = "mtp.layers.0.mtp_model_layer.mlp.linear_fc2.weight"  # row-parallel: [H, F / 2] on each rank
    assert torch.equal(torch.cat([states[0][fc2], states[1][fc2]], dim=1), tp2_weights[fc2])


def _main_grads(worker: MegatronPolicyWorker) -> dict[str, torch.Tensor]:
    """The fp32 gradients the last ``train`` left in the DDP buffer (clipped: the same factor in both runs compared)."""
    params = worker.model.module.named_parameters()
    return {name: p.main_grad.detach().clone() for name, p in params if getattr(p, "main_grad", None) is not None}


# recompute: "full" (whole layers) or the selective modules; the modules hooked to see the recompute run
RECOMPUTED = {"core_attn": "self_attention.core_attention", "mlp": "mlp"}


@pytest.mark.parametrize(
    "mode, recompute",
    [
        ("policy", "full"),
        ("detach", "full"),
        ("policy", ["core_attn"]),
        ("detach", ["core_attn", "mlp"]),
        ("packed", ["core_attn"]),  # the checkpointed attention reruns PackedDotProductAttention on THD packs
    ],
    ids=["policy-full", "detach-full", "policy-core_attn", "detach-core_attn+mlp", "packed-core_attn"],
)
def test_activation_checkpointing_equals_no_checkpointing(model_dir, mode, recompute):
    """megatron-core's recompute (``activation_checkpointing`` with ``recompute_granularity`` full or selective
    ``recompute_modules``) gives the step of no recompute: loss, metrics, every DDP gradient and the weights after
    the step. ``mode``: the MTP co-training mode (policy: the MTP gradient reaches the trunk; detach: it does not),
    or ``packed``: THD sequence packing without MTP (packing refuses MTP co-training).

    Tolerance: the recompute reruns the same fp32 CPU ops on the same inputs, so the results are measured
    bitwise equal (max |diff| 0.0 for every case); 1e-7 (relative for metrics, absolute for gradients ~1e-2 after
    clipping and for weights ~1e-1) leaves room only for fp32 rounding, should a kernel reorder a sum when rerun.
    """
    mtp = mode != "packed"
    selective = recompute != "full"
    extra = dict(recompute_granularity="selective", recompute_modules=recompute) if selective else {}
    cfg_plain = _cfg(mtp=mtp, mtp_mode=mode, packed=not mtp)
    plain = _reference(model_dir, cfg_plain)
    if mtp:
        plain.mtp_occ_reference = False
    cfg = _cfg(mtp=mtp, activation_checkpointing=True, mtp_mode=mode, packed=not mtp, **extra)
    recompute_worker = _reference(model_dir, cfg)
    config = recompute_worker.module.config
    assert config.recompute_granularity == ("selective" if selective else "full")
    if selective:
        assert config.recompute_modules == recompute and config.recompute_method is None
    layer = recompute_worker.module.decoder.layers[0]
    hooked = [layer] if not selective else [layer.get_submodule(RECOMPUTED[name]) for name in recompute]
    calls = [[] for _ in hooked]
    hooks = [m.register_forward_hook(lambda *a, c=c: c.append(torch.is_grad_enabled())) for m, c in zip(hooked, calls)]
    data = {**_batch(7, 1), "prev_logprobs": plain.get_logprobs(_batch(7, 1))}
    m_plain, m_recompute = plain.train(data), recompute_worker.train(data)
    for hook in hooks:
        hook.remove()
    micro_batches = 4 if mtp else 3  # 7 rows in pairs; packed: the 72 tokens in packs of at most 28
    assert m_recompute["num_micro_batches"] == micro_batches
    # each micro-batch: the forward without a graph, rerun with it in the backward
    assert calls == [[False, True] * micro_batches] * len(hooked)
    keys = [k for k in PG_KEYS + (MTP_KEYS if mtp else ()) if "_ref" not in k]
    _assert_metrics_close(m_recompute, m_plain, keys, rel=1e-7)
    assert _max_diff(_main_grads(recompute_worker), _main_grads(plain)) < 1e-7
    assert _max_diff(recompute_worker.export_megatron_weights(), plain.export_megatron_weights()) < 1e-7


def test_refusals_name_their_keys(model_dir, cluster):
    cfg = fm.base_recipe_section("policy")
    cfg["megatron_cfg"].update(pipeline_model_parallel_size=2, mtp_num_layers=1)
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size=2 cannot run with policy.megatron_cfg.mtp_num"):
        _reference(model_dir, PolicyConfig.model_validate(cfg))
    with pytest.raises(ValueError, match="3 policy workers is not a multiple of policy.megatron_cfg"):
        _policy(cluster, model_dir, 3, _cfg(tp=2))


def test_reference_policy_kl_at_tp2(cluster, model_dir, tmp_path):
    """Reference policy (``init_reference_model``) on a TP=2 group: its log-probs equal the policy's before
    any step (bitwise), stay at the initial values after two steps while the policy's move, scoring them leaves the
    policy untouched, and the loss's ``kl_penalty`` equals k3 computed here from the two log-prob tensors (with the recipe's input and
    output clamps, which act here: the tiny model's steps move some tokens' log-probs by > 10 nats); the
    checkpoint carries the reference (a reloaded group scores the same)."""
    loss_cfg = {**fm.base_recipe_section("loss_fn"), "reference_policy_kl_penalty": 0.5}
    kl_loss = ClippedPGLossFn(loss_cfg)
    d_max, k_max = loss_cfg["kl_input_clamp_value"], loss_cfg["kl_output_clamp_value"]  # NeMo-RL's 20 / 10
    policy = Policy(
        cluster,
        [0, 0],
        _cfg(tp=2),
        kl_loss,
        model_dir,
        SEED,
        num_cpus=0.5,
        env_vars={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        init_reference_model=True,
    )
    try:
        data = _batch(5, seed=11)
        initial = policy.get_logprobs(data)
        assert torch.equal(policy.get_reference_policy_logprobs(data), initial)
        kls = []
        for _step in range(2):
            current = policy.get_logprobs(data)
            ref = policy.get_reference_policy_logprobs(data)
            assert torch.equal(policy.get_logprobs(data), current)  # the swap puts the policy back bitwise
            metrics = policy.train({**data, "prev_logprobs": current, "reference_policy_logprobs": ref})
            mask = data["token_mask"] * data["sample_mask"].unsqueeze(1)
            d = torch.where(mask > 0, ref - current, 0.0).double().clamp(-d_max, d_max)
            k3 = (d.exp() - d - 1).clamp(max=k_max)
            kls.append((metrics["kl_penalty"], float(0.5 * (k3 * mask).sum() / mask.sum())))
        moved = (policy.get_logprobs(data) - initial).abs().max().item()
        assert moved > 1e-3
        assert torch.equal(policy.get_reference_policy_logprobs(data), initial)
        assert kls[0] == (0.0, 0.0) and kls[1][1] > 1e-7
        assert kls[1][0] == pytest.approx(kls[1][1], rel=1e-4)
        policy.save_checkpoint(str(tmp_path))
        saved = torch.load(tmp_path / "megatron_policy_tp1.pt", weights_only=False)["reference"]
    finally:
        policy.shutdown()
    fresh = Policy(
        cluster,
        [0, 0],
        _cfg(tp=2),
        kl_loss,
        model_dir,
        SEED,
        num_cpus=0.5,
        env_vars={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        init_reference_model=True,
    )
    try:
        fresh.load_checkpoint(str(tmp_path))
        assert not torch.equal(fresh.get_logprobs(data), initial)  # the trained weights came back ...
        assert torch.equal(fresh.get_reference_policy_logprobs(data), initial)  # ... and the reference stayed initial
        assert saved is not None and all(v.device.type == "cpu" for v in saved.values())
    finally:
        fresh.shutdown()


def _within_one_bf16_ulp(a: dict, b: dict) -> tuple[bool, float]:
    """(every element of a and b within one bf16 ulp of each other, fraction of elements that differ)."""
    differ = total = 0
    for k in a:
        gap = (a[k] - b[k]).abs()
        ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(a[k].abs(), b[k].abs())
        if not bool((gap <= ulp).all()):
            return False, 1.0
        differ, total = differ + int((gap > 0).sum()), total + gap.numel()
    return True, differ / total


def test_bf16_dp2_distributed_optimizer_equals_dp1_to_one_bf16_ulp(dp2_bf16_distopt):
    """bf16 DP=2 runs the same micro-batches as DP=1 in bf16; only the fp32 sum of main_grad over ranks is ordered
    differently (1e-7 relative), so the fp32 masters agree to fp32 rounding and the bf16 parameters, their rounding,
    agree except where a master sits within that much of a rounding midpoint: there they are one bf16 ulp apart
    (docs/design/precision.md, "Tolerances"). Checkpoint at DP=2 (sharded masters) -> DP=1 resumes the same."""
    run = dp2_bf16_distopt
    assert all(lay["distributed_optimizer"] == 1 for lay in run["layouts"])
    got, expected = run["logprobs"]
    assert torch.equal(got, expected)  # same weights, same micro-batches: the same bf16 forward
    for step, (m_dp2, m_dp1, w_dp2, w_dp1) in enumerate(run["steps"]):
        _assert_metrics_close(m_dp2, m_dp1, PG_KEYS, rel=1e-5, where=f"step {step}")
        close, differ = _within_one_bf16_ulp(w_dp2, w_dp1)
        assert close and differ < 1e-3, (step, differ)
        assert _max_diff(w_dp1, run["initial"]) > 1e-3
    assert _max_diff(run["resumed_weights"], run["steps"][-1][2]) == 0.0
    m_dp2, m_resumed, w_dp2, w_resumed = run["after_resume"]
    _assert_metrics_close(m_dp2, m_resumed, ("loss", "grad_norm"), rel=1e-5)
    close, differ = _within_one_bf16_ulp(w_dp2, w_resumed)
    assert close and differ < 1e-3, differ
