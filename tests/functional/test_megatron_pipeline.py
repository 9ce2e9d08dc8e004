"""Pipeline parallelism of the Megatron policy (megatron-core's 1F1B and forward-only schedules, p2p over gloo) through
:class:`Policy` + :class:`RayWorkerGroup` against the single-worker path (PP = TP = DP = 1, in this process, the same
weights and batches); tiny random Qwen3 (2 layers: one per stage, q/k norms, tied embeddings: the last stage's copy of
the embedding matrix), fp32.

- PP=2 vs PP=1: log-probs, two GRPO steps (loss, grad norm, every parameter), the HF export (stages gathered); a
  checkpoint written at PP=2 resumes at PP=1 and the next step equals the PP=2 one (Adam state came through); a
  checkpoint written at PP=1 loads into the PP=2 group bit for bit.
- PP=2 x DP=2 (4 workers) vs DP=2 (2 workers), dynamic batching on (micro-batches of different lengths: the stages
  exchange every activation's shape), and PP=2 x TP=2 vs the single worker: log-probs and one step.

Tolerances: 1e-6 where only where the sums happen differs (PP moves no arithmetic between ranks except the tied
embedding's gradient, summed from two stages); 1e-5 with TP (as in test_megatron_parallel.py).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_megatron_parallel import (  # noqa: E402
    PG_KEYS,
    SEED,
    _assert_metrics_close,
    _batch,
    _cfg,
    _max_diff,
    _policy,
    _reference,
    _train_both,
    cluster,  # noqa: F401  (fixture)
    model_dir,  # noqa: F401  (fixture)
)

from nemo_rl_spec.utils.config_schema import PolicyConfig  # noqa: E402

pytestmark = pytest.mark.timeout(900)


def _pp(cfg: PolicyConfig, dynamic: bool = False, pp: int = 2) -> PolicyConfig:
    """``cfg`` at PP=``pp``; ``dynamic``: length-sorted micro-batches of up to 28 tokens (shapes differ per
    micro-batch)."""
    raw = cfg.model_dump()
    raw["megatron_cfg"]["pipeline_model_parallel_size"] = pp
    if dynamic:
        raw["max_total_sequence_length"] = 14  # the batches' width
        raw["dynamic_batching"] = dict(enabled=True, train_mb_tokens=28, logprob_mb_tokens=28, sequence_length_round=1)
    return PolicyConfig.model_validate(raw)


@pytest.fixture(scope="module")
def pp2(cluster, model_dir, tmp_path_factory):  # noqa: F811
    """PP=2 (2 workers) vs the single worker: log-probs, export, two steps, checkpoints both ways."""
    policy, reference = _policy(cluster, model_dir, 2, _pp(_cfg())), _reference(model_dir, _cfg())
    try:
        out = {
            "layouts": policy.layouts,
            "initial": reference.export_megatron_weights(),
            "initial_pp": policy.export_megatron_weights(),
            "logprobs": (policy.get_logprobs(_batch(7, 0)), reference.get_logprobs(_batch(7, 0))),
            "export": (policy.export_hf_weights(1).get(), reference.export_hf_weights(1)),
            "steps": [],
        }
        for data in (_batch(7, 1), _batch(5, 2)):
            metrics = _train_both(policy, reference, data)
            out["steps"].append((*metrics, policy.export_megatron_weights(), reference.export_megatron_weights()))
        ckpt = tmp_path_factory.mktemp("pp2_ckpt")
        policy.save_checkpoint(str(ckpt))
        out["ckpt_files"] = sorted(os.listdir(ckpt))
        resumed = _reference(model_dir, _cfg(), seed=SEED + 11)  # other init: everything must come from disk
        resumed.load_checkpoint(str(ckpt))
        out["resumed_weights"] = resumed.export_megatron_weights()
        metrics = _train_both(policy, resumed, _batch(7, 3))
        out["after_resume"] = (*metrics, policy.export_megatron_weights(), resumed.export_megatron_weights())
        pp1_ckpt = tmp_path_factory.mktemp("pp1_ckpt")
        reference.save_checkpoint(str(pp1_ckpt))  # PP=1, two steps behind the group: a different state
        policy.load_checkpoint(str(pp1_ckpt))
        out["loaded_pp1"] = (policy.export_megatron_weights(), reference.export_megatron_weights())
        out["after_load_pp1"] = _train_both(policy, reference, _batch(6, 4))
    finally:
        policy.shutdown()
    return out


def test_pp2_layout_logprobs_export_and_steps_equal_pp1(pp2):
    run = pp2
    assert [(lay["pp_rank"], lay["pp_size"], lay["dp_size"]) for lay in run["layouts"]] == [(0, 2, 1), (1, 2, 1)]
    assert _max_diff(run["initial_pp"], run["initial"]) == 0.0  # both stages loaded the HF weights, under global names
    got, expected = run["logprobs"]
    assert got.shape == expected.shape == (7, 14) and (got - expected).abs().max().item() < 1e-6
    export_pp, export_ref = run["export"]
    assert _max_diff(export_pp, export_ref) == 0.0  # the stages' layers gathered, lm_head = the embedding
    for step, (m_pp, m_ref, w_pp, w_ref) in enumerate(run["steps"]):
        _assert_metrics_close(m_pp, m_ref, PG_KEYS + ("num_micro_batches",), rel=1e-6, where=f"step {step}")
        assert _max_diff(w_pp, w_ref) < 1e-6, step
        assert _max_diff(w_ref, run["initial"]) > 1e-3  # the steps moved the weights


def test_checkpoint_saved_at_pp2_resumes_at_pp1_and_back(pp2):
    run = pp2
    assert run["ckpt_files"] == ["megatron_policy_tp0_pp0.pt", "megatron_policy_tp0_pp1.pt"]
    assert _max_diff(run["resumed_weights"], run["steps"][-1][2]) == 0.0
    m_pp, m_resumed, w_pp, w_resumed = run["after_resume"]
    _assert_metrics_close(m_pp, m_resumed, ("loss", "grad_norm"), rel=1e-6)
    assert _max_diff(w_pp, w_resumed) < 1e-6  # the Adam moments came through the stage files
    loaded, saved = run["loaded_pp1"]
    assert _max_diff(loaded, saved) == 0.0  # a PP=1 file split over two stages (tied output copy included)
    m_pp, m_ref = run["after_load_pp1"]
    _assert_metrics_close(m_pp, m_ref, ("loss", "grad_norm"), rel=1e-6)


def _run(group) -> dict:
    """Log-probs of one batch, one step on another (previous log-probs from ``group`` itself), the weights after."""
    out = {"logprobs": group.get_logprobs(_batch(7, 0))}
    data = _batch(7, 1)
    out["metrics"] = group.train({**data, "prev_logprobs": group.get_logprobs(data)})
    out["weights"] = group.export_megatron_weights()
    return out


def _four_workers(cluster, model_dir, parallel_cfg, reference_cfg, reference_workers):  # noqa: F811
    """4 workers against ``reference_workers`` (1: the in-process worker; 2: a DP=2 group, run before the 4 workers:
    the 2 CPUs of the test cluster hold one group at a time) on the same batches."""
    if reference_workers == 1:
        expected = _run(_reference(model_dir, reference_cfg))
    else:
        group = _policy(cluster, model_dir, reference_workers, reference_cfg)
        try:
            expected = _run(group)
        finally:
            group.shutdown()
    policy = _policy(cluster, model_dir, 4, parallel_cfg)
    try:
        return {"layouts": policy.layouts, "got": _run(policy), "expected": expected}
    finally:
        policy.shutdown()


@pytest.mark.parametrize(
    "tp, dynamic, reference_workers, coords, tol",
    [
        (1, True, 2, [(0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1)], 1e-6),  # PP=2 x DP=2 vs DP=2, dynamic batching
        (2, False, 1, [(0, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1)], 1e-5),  # PP=2 x TP=2 vs one worker
    ],
    ids=["pp2_dp2_dynamic", "pp2_tp2"],
)
def test_pp2_with_dp2_or_tp2_equals_the_layout_without_pp(
    cluster,  # noqa: F811
    model_dir,  # noqa: F811
    tp,
    dynamic,
    reference_workers,
    coords,
    tol,
):
    # the reference runs the same micro-batch plan on the same shards (each DP rank bins its own rows under dynamic
    # batching): only the pipeline split differs
    run = _four_workers(cluster, model_dir, _pp(_cfg(tp=tp), dynamic), _pp(_cfg(), dynamic, pp=1), reference_workers)
    assert [(lay["dp_rank"], lay["tp_rank"], lay["pp_rank"]) for lay in run["layouts"]] == coords
    got, expected = run["got"], run["expected"]
    assert (got["logprobs"] - expected["logprobs"]).abs().max().item() < tol
    _assert_metrics_close(got["metrics"], expected["metrics"], PG_KEYS, rel=tol)
    assert _max_diff(got["weights"], expected["weights"]) < tol
