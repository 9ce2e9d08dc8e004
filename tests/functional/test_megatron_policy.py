"""Megatron-core policy on tiny random Llama / Qwen3 checkpoints, checked against transformers (CPU, fp32).

Covers: logits parity, export -> import bit-identity, worker log-probs vs an independent transformers
log-softmax, one train step vs a hand-written clip + AdamW step on the transformers model, micro-batch
accumulation, the refit guarantee (exported weights reproduce the worker's log-probs in transformers) and
bitwise checkpoint resume.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fixtures_models as fm  # noqa: E402

from nemo_rl_spec.models.hf_weight_mapping import hf_to_megatron  # noqa: E402
from nemo_rl_spec.models.policy import megatron_model as mm  # noqa: E402
from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker  # noqa: E402
from nemo_rl_spec.utils.config_schema import PolicyConfig  # noqa: E402

torch.set_num_threads(1)
BASE_YAML = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "grpo_math_base.yaml")
ARCHS = [("llama", False), ("llama", True), ("qwen3", True), ("qwen3", False)]


def _policy_cfg(**optimizer) -> dict:
    with open(BASE_YAML) as f:
        cfg = yaml.safe_load(f)["policy"]
    cfg.update(train_micro_batch_size=2, logprob_batch_size=3)
    cfg["megatron_cfg"]["optimizer"].update(lr=1e-2, **optimizer)
    return cfg


def _worker(cfg: dict, path: str, seed: int = 0) -> MegatronPolicyWorker:
    return MegatronPolicyWorker(PolicyConfig.model_validate(cfg), pg_loss, path, seed=seed)


def pg_loss(curr_logprobs, mb, global_valid_toks, global_valid_seqs):
    """Test loss: -sum(advantage * logprob * mask) / global_valid_toks (token level, like the real one)."""
    mask = mb["token_mask"] * mb["sample_mask"].unsqueeze(1)
    loss = -(curr_logprobs * mb["advantages"].unsqueeze(1) * mask).sum() / global_valid_toks
    return loss, {"num_valid_tokens": float(mask.sum()), "lp_min_max": float(-curr_logprobs.detach().min())}


def _batch(seed: int = 0, batch: int = 5, seq: int = 14, vocab: int = 512) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([14, 9, 12, 5, 14][:batch])
    input_ids = torch.randint(1, vocab, (batch, seq), generator=gen)
    token_mask = torch.zeros(batch, seq)
    for b, n in enumerate(lengths.tolist()):
        input_ids[b, n:] = 0
        token_mask[b, 3:n] = 1.0
    return dict(
        input_ids=input_ids,
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0][:batch]),
        advantages=torch.randn(batch, generator=gen),
    )


@pytest.fixture
def tiny_model(tmp_path, request):
    arch, tied = getattr(request, "param", ("qwen3", True))
    hf_model = fm.save_tiny_model(tmp_path, arch, tied)
    return str(tmp_path), hf_model


@pytest.mark.parametrize("tiny_model", ARCHS, indirect=True, ids=[f"{a}-tied{t}" for a, t in ARCHS])
def test_megatron_logits_match_transformers(tiny_model):
    path, hf_model = tiny_model
    model, _ = mm.build_from_hf(path)
    input_ids = _batch()["input_ids"]
    with torch.no_grad():
        mcore_logits = mm.gpt_logits(model.eval(), input_ids)
        hf_logits = hf_model(input_ids=input_ids).logits
    assert hf_logits.abs().max() > 1.0  # logits are not trivially small
    assert (mcore_logits - hf_logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("tiny_model", ARCHS, indirect=True, ids=[f"{a}-tied{t}" for a, t in ARCHS])
def test_export_import_round_trip_bit_identical(tiny_model):
    path, hf_model = tiny_model
    model, spec = mm.build_from_hf(path)
    exported = mm.export_hf_state(model, spec)
    reference = hf_model.state_dict()
    assert set(exported) == set(reference) | {"lm_head.weight"}
    assert all(torch.equal(exported[k], reference[k]) for k in reference)
    if spec.tie_word_embeddings:
        assert torch.equal(exported["lm_head.weight"], exported["model.embed_tokens.weight"])
    reimported = hf_to_megatron(exported, spec)
    current = mm.megatron_param_state(model)
    assert set(reimported) == set(current)
    assert all(torch.equal(reimported[k], current[k]) for k in current)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_worker_logprobs_match_transformers(tiny_model, temperature):
    path, hf_model = tiny_model
    worker = _worker(_policy_cfg(), path, seed=0)
    data = _batch()
    logprobs = worker.get_logprobs(data, temperature=temperature)
    expected = fm.hf_token_logprobs(hf_model, data["input_ids"], data["input_lengths"], temperature)
    assert logprobs.dtype == torch.float32 and logprobs.shape == data["input_ids"].shape
    assert (logprobs - expected).abs().max().item() < 1e-5
    assert torch.all(logprobs[:, 0] == 0) and logprobs[1, 9:].abs().sum() == 0  # position 0 and padding


def _reference_adamw_step(hf_model, data, opt_cfg: dict) -> tuple[float, float]:
    """The same step done independently: transformers forward, clip_grad_norm_, torch AdamW."""
    mask = data["token_mask"] * data["sample_mask"].unsqueeze(1)
    logits = hf_model(input_ids=data["input_ids"]).logits
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None]).squeeze(-1)
    loss = -(logprobs * data["advantages"].unsqueeze(1) * mask[:, 1:]).sum() / mask.sum()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(hf_model.parameters(), opt_cfg["clip_grad"])
    optimizer = torch.optim.AdamW(
        hf_model.parameters(),
        lr=opt_cfg["lr"],
        eps=opt_cfg["adam_eps"],
        betas=(opt_cfg["adam_beta1"], opt_cfg["adam_beta2"]),
        weight_decay=0.0,
    )
    optimizer.step()
    return float(loss), float(grad_norm)


def test_train_step_matches_independent_adamw_and_changes_weights(tiny_model):
    # adam_eps=1e-3 keeps the first Adam update a smooth function of the gradient (with 1e-8 it is ~sign(g),
    # which amplifies 1e-8 gradient round-off on near-zero gradients into lr-sized weight differences).
    path, hf_model = tiny_model
    cfg = _policy_cfg(adam_eps=1e-3)
    worker = _worker(cfg, path, seed=0)
    before = worker.export_hf_weights()
    data = _batch()
    metrics = worker.train(data)
    ref_loss, ref_grad_norm = _reference_adamw_step(hf_model.train(), data, cfg["megatron_cfg"]["optimizer"])
    after = worker.export_hf_weights()
    assert abs(metrics["loss"] - ref_loss) < 1e-5
    assert ref_grad_norm > cfg["megatron_cfg"]["optimizer"]["clip_grad"]  # clipping is exercised
    assert abs(metrics["grad_norm"] - ref_grad_norm) < 1e-4 * ref_grad_norm
    assert metrics["lr"] == cfg["megatron_cfg"]["optimizer"]["lr"] and metrics["num_micro_batches"] == 3
    assert metrics["num_valid_tokens"] == data["token_mask"][[0, 1, 3, 4]].sum().item()
    reference = hf_model.state_dict()
    assert max((after[k] - before[k]).abs().max().item() for k in reference) > 5e-3
    assert max((after[k] - reference[k]).abs().max().item() for k in reference) < 1e-5


def test_micro_batch_size_does_not_change_the_step(tiny_model):
    path, _ = tiny_model
    exported = []
    for micro_batch in (1, 5):
        cfg = _policy_cfg(adam_eps=1e-3)  # smooth first Adam update (see the AdamW test)
        cfg.update(train_micro_batch_size=micro_batch, train_global_batch_size=5)  # global: schema needs a multiple
        worker = _worker(cfg, path, seed=0)
        metrics = worker.train(_batch())
        exported.append((metrics, worker.export_hf_weights()))
    (metrics_a, weights_a), (metrics_b, weights_b) = exported
    assert (metrics_a["num_micro_batches"], metrics_b["num_micro_batches"]) == (5, 1)
    assert abs(metrics_a["loss"] - metrics_b["loss"]) < 1e-6
    assert abs(metrics_a["grad_norm"] - metrics_b["grad_norm"]) < 1e-5 * metrics_b["grad_norm"]
    assert max((weights_a[k] - weights_b[k]).abs().max().item() for k in weights_a) < 1e-5


def test_refit_exported_weights_reproduce_logprobs_in_transformers(tiny_model):
    path, hf_model = tiny_model
    worker = _worker(_policy_cfg(), path, seed=0)
    data = _batch()
    worker.train(data)
    exported = worker.export_hf_weights()
    assert torch.equal(exported["lm_head.weight"], exported["model.embed_tokens.weight"])  # tied model
    refit = fm.load_hf_from_state(hf_model.config, exported)
    worker_logprobs = worker.get_logprobs(data)
    refit_logprobs = fm.hf_token_logprobs(refit, data["input_ids"], data["input_lengths"])
    stale_logprobs = fm.hf_token_logprobs(hf_model, data["input_ids"], data["input_lengths"])
    assert (worker_logprobs - refit_logprobs).abs().max().item() < 1e-4
    assert (worker_logprobs - stale_logprobs).abs().max().item() > 1e-2  # the step moved the policy


def test_checkpoint_resume_is_bitwise(tiny_model, tmp_path):
    path, _ = tiny_model
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    first = _worker(_policy_cfg(), path, seed=0)
    first.train(_batch(seed=1))
    first.save_checkpoint(str(ckpt))
    saved_rng = torch.get_rng_state()
    torch.manual_seed(1234)  # RNG state must come from the checkpoint, not from here
    expected = first.train(_batch(seed=2))
    expected_weights = first.export_hf_weights()

    resumed = _worker(_policy_cfg(), path, seed=7)  # seeds its own RNG: loading must restore the saved state
    resumed.load_checkpoint(str(ckpt))
    assert torch.equal(torch.get_rng_state(), saved_rng)
    got = resumed.train(_batch(seed=2))
    got_weights = resumed.export_hf_weights()
    assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]
    assert resumed.step == first.step == 2
    assert all(torch.equal(got_weights[k], expected_weights[k]) for k in expected_weights)


def test_get_model_config_reports_architecture(tiny_model):
    path, hf_model = tiny_model
    worker = _worker(_policy_cfg(), path, seed=0)
    config = worker.get_model_config()
    assert config["vocab_size"] == hf_model.config.vocab_size == 512
    assert config["architecture"] == "Qwen3ForCausalLM" and config["tie_word_embeddings"] is True


def test_unsupported_architecture_raises(tmp_path):
    from transformers import MistralConfig

    MistralConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        architectures=["MistralForCausalLM"],
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        _worker(_policy_cfg(), str(tmp_path), seed=0)


def test_worker_runs_inside_a_ray_actor(tiny_model):
    """The driver's usage: ray.remote(MegatronPolicyWorker) with the real clipped-PG loss."""
    ray = pytest.importorskip("ray")
    from nemo_rl_spec.algorithms.loss.clipped_pg import ClippedPGLossFn

    path, hf_model = tiny_model
    with open(BASE_YAML) as f:
        loss_cfg = yaml.safe_load(f)["loss_fn"]
    data = _batch()
    expected = fm.hf_token_logprobs(hf_model, data["input_ids"], data["input_lengths"])
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        actor = (
            ray.remote(MegatronPolicyWorker)
            .options(num_cpus=0.5)
            .remote(PolicyConfig.model_validate(_policy_cfg()), ClippedPGLossFn(loss_cfg), path, 0)
        )
        logprobs = ray.get(actor.get_logprobs.remote(data, 1.0))
        metrics = ray.get(actor.train.remote({**data, "prev_logprobs": logprobs}))
        exported = ray.get(actor.export_hf_weights.remote())
    finally:
        if started_here:
            ray.shutdown()
    assert (logprobs - expected).abs().max().item() < 1e-5
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["num_micro_batches"] == 3
    assert abs(metrics["probs_ratio"] - 1.0) < 1e-5  # first step: the policy equals pi_old
    assert "lm_head.weight" in exported


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches are inactive on CUDA")
def test_cpu_compat_is_idempotent_local_and_forks_cpu_rng():
    import megatron.core.transformer.utils as mcore_utils
    from megatron.core import tensor_parallel

    from nemo_rl_spec.models.policy.cpu_compat import apply_cpu_compat

    assert apply_cpu_compat() and apply_cpu_compat()
    assert mcore_utils.torch.cuda.current_device() == "cpu"
    assert torch.equal(mcore_utils.get_default_causal_mask(3), torch.ones(3, 3).triu(1).bool())
    with pytest.raises((AssertionError, RuntimeError)):  # the global torch is left alone
        torch.cuda.current_device()
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    outer = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer)  # fork restores the outer stream
    with tracker.fork():
        second = torch.rand(3)
    expected = torch.rand(6, generator=torch.Generator().manual_seed(5 + 2718))  # megatron's TP seed offset
    assert torch.equal(torch.cat([first, second]), expected)  # the named stream advances across forks
