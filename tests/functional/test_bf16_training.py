"""bfloat16 on CPU (docs/design/precision.md): Megatron's mixed precision against fp32, fp32 master weights, exact
resume, and the refit into a bf16 vLLM engine bit for bit.

Independent computations: the same step in fp32 (from the same bf16-representable weights), Adam's first-step rule
``-lr * g / (|g| + eps)`` on the fp32 masters, a second worker resumed from disk, and the sender's bf16 tensors read
back out of the engine through its own GEMM (``VllmGenerationWorker.engine_weights``).

Tolerances (docs/design/precision.md, "Tolerances"): bf16 keeps 8 significant bits, unit roundoff ``U = 2**-9``. A bf16
forward rounds every matmul / norm output once, so the logits carry a relative error of a few U compounded over the
layers; the budget is ``16 U`` of the largest |logit| (the 2-layer tiny Qwen3 measured 8.6 U), and a log-prob moves
by at most twice its logits' error. The loss (a masked mean of advantage-weighted log-probs) and the grad norm (a
sum of squares of fp32-accumulated ``main_grad``) average those errors: both within ``4 U`` relative (measured
8.8e-4 and 1.7e-4, i.e. 0.45 U and 0.09 U).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fixtures_models as fm  # noqa: E402

from nemo_rl_spec.models.policy import megatron_model as mm  # noqa: E402
from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker  # noqa: E402
from nemo_rl_spec.utils.config_schema import PolicyConfig  # noqa: E402

pytestmark = pytest.mark.timeout(900)
torch.set_num_threads(1)
U = 2.0**-9  # bf16 unit roundoff


def pg_loss(curr_logprobs, mb, global_valid_toks, global_valid_seqs):
    """-sum(advantage * logprob * mask) / global tokens: a loss whose value depends on the log-probs."""
    mask = mb["token_mask"] * mb["sample_mask"].unsqueeze(1)
    loss = -(curr_logprobs * mb["advantages"].unsqueeze(1) * mask).sum() / global_valid_toks
    return loss, {"num_valid_tokens": float(mask.sum())}


def _batch(seed: int = 0, rows: int = 5, seq: int = 14) -> dict:
    data = fm.random_token_batch([14, 9, 12, 5, 14][:rows], seq, seed)
    gen = data.pop("generator")
    return {
        **data,
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, generator=gen),
        "prev_logprobs": torch.zeros(rows, seq),
    }


def _cfg(precision: str, lr: float = 1e-2, mtp: bool = False) -> PolicyConfig:
    cfg = fm.base_recipe_section("policy")
    cfg.update(precision=precision, train_micro_batch_size=2, logprob_batch_size=3)
    cfg["megatron_cfg"]["optimizer"].update(lr=lr)
    if mtp:
        cfg["megatron_cfg"].update(mtp_num_layers=1, mtp_loss_mode="ce", mtp_loss_scaling_factor=0.5)
    return PolicyConfig.model_validate(cfg)


def _worker(path: str, precision: str, seed: int = 0, **kw) -> MegatronPolicyWorker:
    return MegatronPolicyWorker(_cfg(precision, **kw), pg_loss, path, seed=seed)


def _masters(worker: MegatronPolicyWorker) -> dict[str, torch.Tensor]:
    """Parameter name -> a copy of the fp32 master weight the optimizer steps (Float16OptimizerWithFloat16Params)."""
    (part,) = worker.optimizer.chained_optimizers
    names = {id(p): n for n, p in worker.module.named_parameters()}
    return {
        names[id(p)]: m.detach().clone()
        for group, masters in zip(part.float16_groups, part.fp32_from_float16_groups)
        for p, m in zip(group, masters)
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3 whose fp32 weights are bf16-representable, so both precisions start from equal weights."""
    path = tmp_path_factory.mktemp("tiny_qwen3_bf16")
    model = fm.build_hf_model(fm.tiny_hf_config("qwen3", True))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(str(path))
    return str(path)


def _valid(data: dict) -> torch.Tensor:
    pos = torch.arange(data["input_ids"].shape[1]).unsqueeze(0)
    return (pos >= 1) & (pos < data["input_lengths"].unsqueeze(1))


def test_bf16_step_matches_fp32_within_bf16_rounding(model_dir):
    data, out = _batch(), {}
    for precision in ("float32", "bfloat16"):
        w = _worker(model_dir, precision)
        with torch.no_grad():
            logits = mm.gpt_logits(w.model, data["input_ids"]).float()
        out[precision] = (w.get_logprobs(data), logits, w.train(data), w)
    lp32, z32, m32, _ = out["float32"]
    lp16, z16, m16, w16 = out["bfloat16"]
    valid = _valid(data)
    dlp = (lp32 - lp16)[valid].abs()
    assert dlp.max() > 1e-4  # bf16 really computed (an fp32 forward would give 0)
    assert (z32 - z16).abs().max() <= 16 * U * z32.abs().max()
    assert dlp.max() <= 2 * 16 * U * z32.abs().max()
    assert m16["loss"] == pytest.approx(m32["loss"], rel=4 * U)
    assert m16["grad_norm"] == pytest.approx(m32["grad_norm"], rel=4 * U)
    assert m16["update_successful"] == 1.0
    # Megatron's mixed precision: bf16 parameters, fp32 main_grad, fp32 masters and Adam state
    params = [p for p in w16.module.parameters() if p.requires_grad]
    assert params and all(p.dtype == torch.bfloat16 and p.main_grad.dtype == torch.float32 for p in params)
    (part,) = w16.optimizer.chained_optimizers
    assert type(part).__name__ == "Float16OptimizerWithFloat16Params"
    masters = [m for group in part.fp32_from_float16_groups for m in group]
    assert len(masters) == len(params) and all(m.dtype == torch.float32 for m in masters)
    assert all(v.dtype == torch.float32 for st in part.optimizer.state.values() for k, v in st.items() if k != "step")


def test_master_weights_take_fp32_updates_below_bf16_resolution(model_dir):
    """Adam's first step moves every element by lr * g / (|g| + eps) ~ lr = 1e-5 in fp32, far below a bf16 ulp of the
    weights (~1e-3 at |w| ~ 0.15): the masters move by it, the bf16 parameters stay their rounding. Applied in bf16,
    the update would round away."""
    lr = 1e-5
    w = _worker(model_dir, "bfloat16", lr=lr)
    before = _masters(w)
    w.train(_batch(seed=1))
    after = _masters(w)
    params = dict(w.module.named_parameters())
    moved = checked = 0
    for name, m0 in before.items():
        p = params[name]
        g = p.main_grad  # the fp32 gradient the step used (left in the buffer until the next train())
        # Adam step 1: m_hat = g, v_hat = g^2, so delta = -lr * g / (|g| + eps); clipping rescales g, not the step
        expected = -lr * g / (g.abs() + w.cfg.megatron_cfg.optimizer.adam_eps)
        fp32_ulp = torch.finfo(torch.float32).eps * torch.maximum(m0.abs(), after[name].abs())
        strong = g.abs() > 1e-6  # elements where the eps term changes the step by < 1%
        assert ((after[name] - m0) - expected)[strong].abs().le(1e-2 * lr + fp32_ulp[strong]).all(), name
        assert torch.equal(p.detach(), after[name].to(torch.bfloat16)), name  # the parameter is the master's rounding
        moved += int((p.detach().float() != m0.to(torch.bfloat16).float()).sum())
        checked += int(strong.sum())
    assert checked > 0.9 * sum(m.numel() for m in before.values())
    assert moved < 0.1 * checked  # the bf16 parameters mostly did not move at all


def test_bf16_resume_reproduces_the_next_step_exactly(model_dir, tmp_path):
    """Masters, Adam state, the MTP block's own fp32 masters and the RNG come back from the checkpoint: the step
    after resuming equals the step of the run that never stopped, bit for bit."""
    first = _worker(model_dir, "bfloat16", mtp=True)
    first.train(_batch(seed=1))
    first.save_checkpoint(str(tmp_path))
    saved = torch.load(tmp_path / "megatron_policy_tp0.pt", weights_only=False)
    assert all(entry["master"].dtype == torch.float32 for entry in saved["adam"].values())
    assert all(m is None or m.dtype == torch.float32 for m in saved["mtp_optimizer"]["masters"])
    expected = first.train(_batch(seed=2))
    expected_weights, expected_masters = first.export_megatron_weights(), _masters(first)

    resumed = _worker(model_dir, "bfloat16", seed=7, mtp=True)
    resumed.load_checkpoint(str(tmp_path))
    got = resumed.train(_batch(seed=2))
    assert (got["loss"], got["grad_norm"], got["mtp/grad_norm"]) == (
        expected["loss"],
        expected["grad_norm"],
        expected["mtp/grad_norm"],
    )
    got_weights, got_masters = resumed.export_megatron_weights(), _masters(resumed)
    assert any(k.startswith(mm.MTP_PREFIX) for k in got_weights)
    assert all(torch.equal(got_weights[k], expected_weights[k]) for k in expected_weights)
    assert all(torch.equal(got_masters[k], expected_masters[k]) for k in expected_masters)
    mtp_masters = [m for m in resumed.mtp_optimizer.masters]
    assert mtp_masters and all(m.dtype == torch.float32 for m in mtp_masters)


# ---- refit into a bf16 engine ------------------------------------------------------------------------------------
def _vllm_names(hf: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """HF tensors under vLLM's Qwen3 parameter names (q/k/v and gate/up fused along the output dimension)."""
    out = {}
    for name, t in hf.items():
        if name == "lm_head.weight" and tied:
            continue
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name or ".mlp.up_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            base = name.replace(".q_proj.", ".{}.")
            out[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat(
                [hf[base.format(k)] for k in ("q_proj", "k_proj", "v_proj")]
            )
        elif ".mlp.gate_proj." in name:
            out[name.replace(".gate_proj.", ".gate_up_proj.")] = torch.cat([t, hf[name.replace("gate_", "up_")]])
        else:
            out[name] = t
    return out


def _start_engine(ray, precision: str):
    from nemo_rl_spec.models.generation.vllm_worker import VllmGenerationWorker, vllm_runtime_env
    from nemo_rl_spec.models.hf_assets import resolve_model

    path = resolve_model("tiny-qwen3")
    gen = _cfg(precision).generation
    actor = ray.remote(num_cpus=0.5, runtime_env=vllm_runtime_env(gen.vllm_cfg))(VllmGenerationWorker).remote(
        gen, path, 0, precision=precision
    )
    return actor, path


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def bf16_engine(ray_session):
    actor, path = _start_engine(ray_session, "bfloat16")
    yield ray_session, actor, path
    ray_session.get(actor.shutdown.remote())
    ray_session.kill(actor)


def _refit(ray, engine, sent: dict[str, torch.Tensor], version: int, transport: str) -> None:
    """Load ``sent`` into ``engine`` as ``version`` through the object store (``ray``) or the collective transport
    (``nccl``: this process, the trainer, is rank 0 of a gloo group with the engine, 64 KiB buckets so the weights
    span several broadcasts)."""
    if transport == "ray":
        ray.get(engine.update_weights.remote(sent, version))
        return
    from nemo_rl_spec.distributed.weight_broadcast import WeightBroadcastGroup, node_address_and_free_port

    host, port = node_address_and_free_port()
    joined = engine.init_refit_group.remote(host, port, 1, 2, "gloo", 120, "chain")
    group = WeightBroadcastGroup(host, port, 0, 2, "gloo", timeout_s=120, algorithm="chain")
    ray.get(joined)
    received = engine.receive_weights.remote()
    stats = group.send(sent, {"version": version}, bucket_bytes=1 << 16)
    ray.get(received)
    assert stats["buckets"] > 1


def _assert_engine_holds(ray, engine, sent: dict[str, torch.Tensor], dtype: torch.dtype, version: int) -> None:
    held = ray.get(engine.engine_weights.remote())
    expected = _vllm_names(sent, tied="lm_head.weight" not in held)
    assert set(held) == set(expected), sorted(set(held) ^ set(expected))[:6]
    for name, t in expected.items():
        assert held[name].dtype == dtype and torch.equal(held[name], t), name
    assert ray.get(engine.get_versions.remote())["policy_version"] == version


@pytest.mark.parametrize("trainer,transport", [("bfloat16", "ray"), ("float32", "ray"), ("float32", "nccl")])
def test_refit_into_bf16_engine_holds_the_senders_bf16_weights_bit_for_bit(bf16_engine, trainer, transport):
    ray, engine, path = bf16_engine
    policy = _worker(path, trainer)
    policy.train(_batch(seed=3))  # weights that differ from the checkpoint the engine started from
    sent = policy.export_hf_weights(version=1, dtype="bfloat16")  # cast once, on the sender
    assert all(t.dtype == torch.bfloat16 for t in sent.values())
    version = {"ray": 1, "nccl": 2}[transport]  # the module's engine is shared: a new version per transport
    _refit(ray, engine, sent, version, transport)
    _assert_engine_holds(ray, engine, sent, torch.bfloat16, version)


def test_collective_refit_into_fp32_engine_is_bit_for_bit(ray_session):
    """fp32 trainer -> fp32 engine over the collective transport: the engine computes with the sender's tensors."""
    engine, path = _start_engine(ray_session, "float32")
    try:
        policy = _worker(path, "float32")
        policy.train(_batch(seed=4))
        sent = policy.export_hf_weights(version=3, dtype="float32")
        _refit(ray_session, engine, sent, 3, "nccl")
        _assert_engine_holds(ray_session, engine, sent, torch.float32, 3)
    finally:
        ray_session.get(engine.shutdown.remote())
        ray_session.kill(engine)
