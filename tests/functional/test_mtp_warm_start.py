"""CE warm start of the MTP layers on the Megatron policy worker (``policy.megatron_cfg.mtp_warm_start``; tiny random
Qwen3, CPU; docs/guides/occ.md).

Data: sequences the tiny HF model samples itself (T = 0.5), so the MTP head has something to learn. Covers: the held-out
CE falls, and the reported CE / acceptance before and after equal an independent computation on the same weights (a
separate model built from the checkpoint, per-token loops); no trunk parameter or trunk gradient changes (bitwise);
the MTP optimizer is fresh afterwards; ``load_mtp_state(mtp_state())`` on a fresh worker gives bitwise the same MTP
parameters and the same next ``train`` step; the bf16 MTP optimizer can be rebuilt over the same parameters; errors.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fixtures_models as fm  # noqa: E402

from nemo_rl_spec.algorithms.loss import ClippedPGLossFn  # noqa: E402
from nemo_rl_spec.models.policy import megatron_model as mm  # noqa: E402
from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker  # noqa: E402
from nemo_rl_spec.models.policy.mtp_warm_start import row_order  # noqa: E402
from nemo_rl_spec.utils.config_schema import PolicyConfig  # noqa: E402

torch.set_num_threads(1)
PROMPT, NEW = 4, 28  # prompt tokens (random), sampled tokens per sequence (rows then cut to random lengths)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model directory, the HF model itself: the sampler of the warm-start data)."""
    path = tmp_path_factory.mktemp("tiny_qwen3")
    return str(path), fm.save_tiny_model(path, "qwen3", True)


def _sampled(hf_model, rows: int, seed: int, temperature: float = 0.5) -> dict:
    """``rows`` sequences sampled from ``hf_model`` after random prompts, cut to random lengths (padding 0), response
    mask after the prompt. Shapes: input_ids / token_mask [rows, PROMPT + NEW]; input_lengths / sample_mask [rows]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, fm.TINY_DIMS["vocab_size"], (rows, PROMPT), generator=gen)
    with torch.no_grad():
        for _ in range(NEW):
            probs = torch.softmax(hf_model(input_ids=ids).logits[:, -1].float() / temperature, dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], dim=1)
    lengths = torch.randint(PROMPT + NEW // 2, PROMPT + NEW + 1, (rows,), generator=gen)
    token_mask = torch.zeros(ids.shape)
    for b, n in enumerate(lengths.tolist()):
        ids[b, n:] = 0
        token_mask[b, PROMPT:n] = 1.0
    return {"input_ids": ids, "input_lengths": lengths, "token_mask": token_mask, "sample_mask": torch.ones(rows)}


def _worker(model_dir: str, precision: str = "float32", mtp_num_layers: int = 1) -> MegatronPolicyWorker:
    cfg = fm.base_recipe_section("policy")
    cfg.update(train_micro_batch_size=2, logprob_batch_size=4, precision=precision)
    cfg["megatron_cfg"]["optimizer"].update(lr=1e-3)
    cfg["megatron_cfg"].update(mtp_num_layers=mtp_num_layers)
    loss_fn = ClippedPGLossFn(fm.base_recipe_section("loss_fn"))
    return MegatronPolicyWorker(PolicyConfig.model_validate(cfg), loss_fn, model_dir, seed=3)


def _params(worker, mtp: bool) -> dict[str, torch.Tensor]:
    return {n: p for n, p in worker.module.named_parameters() if n.startswith(mm.MTP_PREFIX) == mtp}


@torch.no_grad()
def _independent_ce_acceptance(worker, data: dict) -> tuple[float, float, int]:
    """MTP head 0's CE (nats per target), greedy acceptance and number of targets on ``data`` under a copy of the worker's weights in a
    separately built model, by per-token loops: target s (a response token, 2 <= s < length) is predicted from
    position s - 2 by the MTP head and from s - 1 by the main head."""
    ref, _ = mm.build_from_hf(worker.model_path, mtp_num_layers=1, seed=3)
    mm.load_megatron_state(ref, {k: v.detach().clone() for k, v in mm.megatron_param_state(worker.module).items()})
    ids = data["input_ids"]
    trunk = mm.gpt_trunk_forward(ref, ids)
    main_logits = mm.output_logits(ref, trunk.hidden)
    mtp_logits = mm.output_logits(ref, mm.mtp_hidden_states(ref, ids, trunk, trunk.hidden, ref.embedding)[0])
    logp = torch.log_softmax(mtp_logits.double() / worker.train_temperature, dim=-1)
    nll, agree, count = 0.0, 0, 0
    for b in range(ids.shape[0]):
        for s in range(2, int(data["input_lengths"][b])):
            if data["token_mask"][b, s] > 0:
                nll -= float(logp[b, s - 2, ids[b, s]])
                agree += int(mtp_logits[b, s - 2].argmax() == main_logits[b, s - 1].argmax())
                count += 1
    return nll / count, agree / count, count


def test_warm_start_lowers_held_out_ce_and_leaves_the_trunk_bitwise(tiny):
    model_dir, hf_model = tiny
    train, held_out = _sampled(hf_model, 64, seed=0), _sampled(hf_model, 16, seed=1)
    worker = _worker(model_dir)
    trunk0 = {n: p.detach().clone() for n, p in _params(worker, mtp=False).items()}
    grads0 = {n: p.main_grad.clone() for n, p in _params(worker, mtp=False).items()}
    mtp0 = {n: p.detach().clone() for n, p in _params(worker, mtp=True).items()}
    ce0, acc0, count = _independent_ce_acceptance(worker, held_out)
    lr0 = worker.mtp_optimizer.param_groups[0]["lr"]

    m = worker.mtp_warm_start(train, held_out, steps=40, batch_size=8, lr=3e-3, seed=0)

    ce1, acc1, _ = _independent_ce_acceptance(worker, held_out)
    print(f"\nheld-out MTP CE {ce0:.4f} -> {ce1:.4f}, acceptance {acc0:.4f} -> {acc1:.4f}; metrics {m}")
    # fp32 sums of ~400 targets against float64 loops: 1e-5 relative is ~100x the rounding
    assert m["mtp_warm_start/ce_before"] == pytest.approx(ce0, rel=1e-5)
    assert m["mtp_warm_start/ce_before_0"] == m["mtp_warm_start/ce_before"]
    assert m["mtp_warm_start/ce_after"] == pytest.approx(ce1, rel=1e-5)
    # argmaxes: at most one near-tie target may flip between the two models' (differently batched) fp32 logits
    assert m["mtp_warm_start/acceptance_before"] == pytest.approx(acc0, abs=1.01 / count)
    assert m["mtp_warm_start/acceptance_after"] == pytest.approx(acc1, abs=1.01 / count)
    assert acc1 > acc0
    assert ce1 < ce0 - 0.4  # measured 6.90 -> 6.08 (the tiny model's own samples at T = 0.5)
    assert m["mtp_warm_start/train_ce_last"] < m["mtp_warm_start/train_ce_first"] - 1.0
    assert (m["mtp_warm_start/steps"], m["mtp_warm_start/train_sequences"]) == (40.0, 64.0)
    assert m["mtp_warm_start/eval_sequences"] == 16.0
    for name, param in _params(worker, mtp=False).items():  # trunk: weights and gradient buffers untouched
        assert torch.equal(param, trunk0[name]), name
        assert torch.equal(param.main_grad, grads0[name]) and param.grad is None, name
    assert all(not torch.equal(p, mtp0[n]) for n, p in _params(worker, mtp=True).items())
    opt = worker.mtp_optimizer  # fresh: no Adam state, the original lr, masters are the parameters (fp32)
    assert opt.optimizer.state == {} and opt.param_groups[0]["lr"] == lr0
    assert all(m_ is p for m_, p in zip(opt.masters, opt.params))
    assert all(p.grad is None for p in opt.params)


def test_mtp_state_round_trip_gives_the_same_next_train_step(tiny):
    model_dir, hf_model = tiny
    warm = _worker(model_dir)
    warm.mtp_warm_start(_sampled(hf_model, 16, seed=2), _sampled(hf_model, 4, seed=3), 5, 8, 3e-3, seed=1)
    state = warm.mtp_state()
    assert set(state) == set(_params(warm, mtp=True)) and all(v.device.type == "cpu" for v in state.values())
    fresh = _worker(model_dir)
    assert any(not torch.equal(p, state[n]) for n, p in _params(fresh, mtp=True).items())
    fresh.load_mtp_state(state)
    for name, param in _params(fresh, mtp=True).items():
        assert torch.equal(param, state[name]), name
    state["mtp.layers.0.eh_proj.weight"].zero_()  # a clone: the worker's parameter is not aliased
    assert not torch.equal(
        _params(fresh, mtp=True)["mtp.layers.0.eh_proj.weight"], state["mtp.layers.0.eh_proj.weight"]
    )

    data = fm.on_policy(warm, fm.train_batch(seed=5))
    m_warm, m_fresh = warm.train(data), fresh.train(data)
    assert m_warm.keys() == m_fresh.keys()
    for key, value in m_warm.items():
        assert value == m_fresh[key] or (math.isnan(value) and math.isnan(m_fresh[key])), key
    fresh_params = dict(fresh.module.named_parameters())
    for name, param in warm.module.named_parameters():
        assert torch.equal(param, fresh_params[name]), name


def test_bf16_warm_start_then_train(tiny):
    """bf16: the warm start builds two more MTP optimizers over the same bf16 parameters; each gradient must still
    reach ``main_grad`` exactly once (one accumulation hook per parameter), so the next ``train`` matches a worker
    that loaded the same weights without a warm start."""
    model_dir, hf_model = tiny
    warm = _worker(model_dir, precision="bfloat16")
    warm.mtp_warm_start(_sampled(hf_model, 8, seed=4), _sampled(hf_model, 4, seed=5), 3, 4, 3e-3, seed=2)
    loaded = _worker(model_dir, precision="bfloat16")
    loaded.load_mtp_state(warm.mtp_state())
    data = fm.on_policy(warm, fm.train_batch(seed=6))
    m_warm, m_loaded = warm.train(data), loaded.train(data)
    assert math.isfinite(m_warm["mtp/grad_norm"]) and m_warm["mtp/grad_norm"] > 0
    assert m_warm["mtp/grad_norm"] == m_loaded["mtp/grad_norm"]
    loaded_params = dict(loaded.module.named_parameters())
    for name, param in warm.module.named_parameters():
        assert torch.equal(param, loaded_params[name]), name


def test_errors_and_row_order(tiny):
    model_dir, _ = tiny
    plain = _worker(model_dir, mtp_num_layers=0)
    for call in (lambda: plain.mtp_state(), lambda: plain.load_mtp_state({})):
        with pytest.raises(RuntimeError, match="mtp_num_layers=0"):
            call()
    worker = _worker(model_dir)
    state = worker.mtp_state()
    zeros = {n: torch.zeros_like(v) for n, v in state.items()}  # would change every parameter if loaded
    bad_name = {**zeros, "mtp.layers.0.extra": torch.zeros(1)}
    bad_shape = {**zeros, "mtp.layers.0.eh_proj.weight": torch.zeros(3, 3)}
    for bad in (bad_name, bad_shape):
        with pytest.raises(ValueError, match="names or shapes differ"):
            worker.load_mtp_state(bad)
    assert all(torch.equal(p, state[n]) for n, p in _params(worker, mtp=True).items())  # nothing loaded
    # epoch permutations: every row once per epoch, seeded
    order = row_order(5, 12, seed=7)
    assert [sorted(order[i : i + 5].tolist()) for i in (0, 5)] == [list(range(5))] * 2
    assert torch.equal(order, row_order(5, 12, seed=7)) and not torch.equal(order, row_order(5, 12, seed=8))
    with pytest.raises(ValueError, match="at least one training sequence"):
        row_order(0, 4, seed=0)
