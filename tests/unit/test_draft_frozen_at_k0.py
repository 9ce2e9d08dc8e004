"""An online EAGLE-3 draft is not trained when the batch-size-aware schedule never drafts
(nemo_rl_spec/algorithms/grpo_setup.py ``freeze_draft_without_drafting``): the resolved config says
``policy.draft.online: false`` for schedules with k = 0 at every reachable running batch size, and keeps it true
for schedules with some k > 0 there; hand-built schedules, the spec recipe's own config, and the
``speculative@k0`` mode of examples/bench_sync_vs_async.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from nemo_rl_spec.algorithms import grpo_setup
from nemo_rl_spec.algorithms.grpo_setup import freeze_draft_without_drafting
from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead
from nemo_rl_spec.speculative.online import build_draft_head, write_fresh_draft_head
from nemo_rl_spec.utils.config import load_config
from nemo_rl_spec.utils.config_schema import DraftConfig

ROOT = Path(__file__).resolve().parents[2]
SPEC_RECIPE = ROOT / "configs" / "grpo_math_smollm2_135m_spec.yaml"
SCHEDULE = "policy.generation.dynamic_speculation.num_speculative_tokens_per_batch_size"
NO_COSTS = "policy.generation.dynamic_speculation.step_costs=null"


def _cfg(*overrides: str):
    return load_config(SPEC_RECIPE, list(overrides))


def _explicit(schedule: str, *more: str):
    return _cfg(f"{SCHEDULE}={schedule}", NO_COSTS, *more)


@pytest.mark.parametrize(
    "schedule,frozen",
    [
        ("[[1,32,0]]", True),  # k = 0 at every batch size
        ("[[1,1024,0]]", True),  # the loop benchmark's speculative@k0 variant
        ("[[1,4,0],[5,32,0]]", True),
        ("[[1,4,3],[5,32,0]]", False),  # the default spec recipe's shape: drafts in the tail
        ("[[1,1,3],[2,4,2],[5,32,0]]", False),  # the calibrated bf16 schedule
        ("[[1,8,0],[9,32,1]]", False),  # drafts above 8 running requests
    ],
)
def test_the_resolved_config_freezes_the_draft_only_when_no_batch_size_drafts(schedule, frozen, caplog):
    cfg = _explicit(schedule)
    assert cfg.policy.draft.online  # the recipe trains the draft online
    with caplog.at_level(logging.WARNING, logger=grpo_setup.__name__):
        message = freeze_draft_without_drafting(cfg)
    assert cfg.policy.draft.online is not frozen
    assert (message is not None) is frozen
    warnings = [r for r in caplog.records if r.name == grpo_setup.__name__ and r.levelno == logging.WARNING]
    assert len(warnings) == int(frozen)
    if frozen:
        assert str(json.loads(schedule)) in message  # names the schedule ...
        assert "policy.generation.dynamic_speculation" in message and "k = 0" in message  # ... its key and why
        assert "frozen" in message and "policy.draft.online=false" in message
        assert warnings[0].getMessage() == message
        assert freeze_draft_without_drafting(cfg) is None  # decided once: nothing left to freeze


def test_max_num_seqs_bounds_the_reachable_batch_sizes():
    """Drafting only above the engines' max_num_seqs is never reached."""
    cfg = _explicit("[[1,8,0],[9,32,1]]", "+policy.generation.vllm_kwargs.max_num_seqs=8")
    assert "1..8 (max_num_seqs)" in freeze_draft_without_drafting(cfg)
    assert not cfg.policy.draft.online
    cfg = _explicit("[[1,8,0],[9,32,1]]", "+policy.generation.vllm_kwargs.max_num_seqs=9")
    assert freeze_draft_without_drafting(cfg) is None and cfg.policy.draft.online


def test_a_derived_schedule_is_judged_after_its_step_costs(tmp_path):
    """A schedule derived from step costs: frozen where the derivation gives k = 0 up to max_batch_size (and the
    tail keeps it), trained where some batch size drafts. Costs: plain 1.0 / 2.0 s at b = 1 / 9, k = 1 1.2 / 3.0 s,
    k = 3 1.5 / 6.0 s (tests/unit/test_adaptive_k.py, test_derive_schedule_by_hand)."""
    path = tmp_path / "costs.json"
    costs = {"ar_step_s": {1: 1.0, 9: 2.0}, "spec_step_s": {1: {1: 1.2, 9: 3.0}, 3: {1: 1.5, 9: 6.0}}}
    path.write_text(json.dumps({"step_costs": costs}))
    dyn = "policy.generation.dynamic_speculation"
    # acceptance 0: no k > 0 ever pays -> [(1, 32, 0)]
    cfg = _cfg(f"{dyn}.step_costs={path}", f"{dyn}.acceptance_rate=0.0")
    assert "[[1, 32, 0]]" in freeze_draft_without_drafting(cfg)
    assert not cfg.policy.draft.online
    # acceptance 0.6: k = 3 at b = 1, k = 1 at 2..10 (min_speedup 1.05) -> trained
    cfg = _cfg(f"{dyn}.step_costs={path}", f"{dyn}.acceptance_rate=0.6", f"{dyn}.min_speedup=1.05")
    assert freeze_draft_without_drafting(cfg) is None and cfg.policy.draft.online


def test_nothing_to_freeze_without_an_online_draft_or_a_schedule():
    cfg = _explicit("[[1,32,0]]", "policy.draft.online=false")  # a frozen draft already: no warning
    assert freeze_draft_without_drafting(cfg) is None and not cfg.policy.draft.online
    cfg = _explicit(
        "[[1,32,0]]", "policy.draft.enabled=false", "policy.generation.vllm_kwargs.speculative_config.model=/d"
    )
    assert freeze_draft_without_drafting(cfg) is None
    cfg = _cfg("policy.generation.dynamic_speculation=null")  # fixed k = 3 at every batch size
    assert freeze_draft_without_drafting(cfg) is None and cfg.policy.draft.online
    cfg = _cfg()  # step_costs: auto not resolved yet: not judged here (preflight resolves it first)
    assert freeze_draft_without_drafting(cfg) is None and cfg.policy.draft.online


@pytest.mark.parametrize("schedule,trained", [("[[1,32,0]]", False), ("[[1,4,3],[5,32,0]]", True)])
def test_the_refit_and_the_policy_worker_follow_the_resolved_config(schedule, trained):
    """What the workers are built from: the refit syncs the draft, and the policy worker builds an online draft
    (capture hooks, soft targets, its training step), only when the schedule can draft."""
    from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker  # lazy: loads megatron-core

    cfg = _explicit(schedule)
    freeze_draft_without_drafting(cfg)
    assert grpo_setup.syncs_draft(cfg) is trained  # WeightRefitter(sync_draft=...): no draft refit when frozen
    worker = type("Worker", (), {"cfg": cfg.policy})()  # _online_draft returns before touching anything else
    if not trained:
        assert MegatronPolicyWorker._online_draft(worker, 0) is None
    assert cfg.policy.generation.speculative_config.method == "eagle3"  # the engine keeps its drafter either way


def test_the_loop_benchmarks_k0_mode_runs_with_the_draft_frozen(tmp_path):
    """examples/bench_sync_vs_async.py's speculative@k0 variant (docs/results/spec_loop_default.md) resolves to a frozen
    draft; the recipe's own speculative mode keeps training it."""
    from nemo_rl_spec.bench import sync_vs_async as bench

    args = bench.parse_args(
        [
            "--out",
            str(tmp_path / "out.json"),
            "--config",
            "configs/grpo_math_smollm2_135m.yaml",
            "--spec-recipe",
            str(SPEC_RECIPE),
            "--modes",
            "sync",
            "--decoding",
            "autoregressive",
            "speculative@after",
            "speculative@k0",
            "--spec-variant",
            "after",
            "policy.generation.dynamic_speculation.plain_step_at_k0=true",
            "policy.generation.dynamic_speculation.num_speculative_tokens_per_batch_size=[[1,4,3],[5,32,0]]",
            NO_COSTS,
            "--spec-variant",
            "k0",
            f"{SCHEDULE}=[[1,1024,0]]",
            NO_COSTS,
            "--steps",
            "3",
            "grpo.val_at_start=false",
            "checkpointing.enabled=false",
        ]
    )
    spec = bench.speculative_config(args, "unused", tmp_path)
    frozen = {}
    for key in ("sync/speculative@after", "sync/speculative@k0"):
        cfg = load_config(*bench.mode_recipe(args, key, spec, tmp_path))
        freeze_draft_without_drafting(cfg)
        frozen[key] = not cfg.policy.draft.online
    assert frozen == {"sync/speculative@after": False, "sync/speculative@k0": True}


def _tiny_checkpoint(path: Path, tied: bool) -> Path:
    """A Llama-shaped HF directory holding only what write_fresh_draft_head reads: config.json, the embedding and
    (untied) the output layer."""
    path.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 40,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": tied,
    }
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(40, 16, generator=gen)}
    if not tied:
        tensors["lm_head.weight"] = torch.randn(40, 16, generator=gen)
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("tied", [True, False])
def test_a_frozen_fresh_head_is_written_from_the_checkpoint(tmp_path, tied):
    """Without policy.draft.model_name the frozen engine starts from the head the online run would have built
    (fresh layers from the seed, lm_head = the policy's output layer), written without a policy worker."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    model = _tiny_checkpoint(tmp_path / "model", tied)
    out = write_fresh_draft_head(DraftConfig(online=False), str(model), tmp_path / "draft", seed=7)
    assert out == str(tmp_path / "draft")
    stored = load_file(str(model / "model.safetensors"))
    output = stored["lm_head.weight" if not tied else "model.embed_tokens.weight"]
    head = Eagle3DraftHead.from_pretrained(out, target_embeddings=stored["model.embed_tokens.weight"])
    assert torch.equal(head.lm_head.weight, output)
    expected = build_draft_head(
        DraftConfig(), AutoConfig.from_pretrained(model), stored["model.embed_tokens.weight"], output, seed=7
    )
    for name, value in expected.state_dict().items():
        assert torch.equal(head.state_dict()[name], value), name


def test_the_engine_draft_dir_of_a_frozen_run(tmp_path):
    """The frozen run's engines start from policy.draft.model_name when set, else from a fresh head written to
    <logger.log_dir>/draft_init; no policy worker is asked for a draft (it has none)."""
    model = _tiny_checkpoint(tmp_path / "model", tied=True)
    cfg = _explicit("[[1,32,0]]", f"logger.log_dir={tmp_path / 'logs'}")
    freeze_draft_without_drafting(cfg)
    assert grpo_setup._engine_draft_dir(cfg, None, str(model)) == "results/drafts/smollm2_135m_arith"
    cfg = _explicit("[[1,32,0]]", f"logger.log_dir={tmp_path / 'logs'}", "policy.draft.model_name=null")
    freeze_draft_without_drafting(cfg)
    out = grpo_setup._engine_draft_dir(cfg, None, str(model))
    assert out == str((tmp_path / "logs" / "draft_init").resolve())
    assert (Path(out) / "config.json").is_file() and (Path(out) / "model.safetensors").is_file()
