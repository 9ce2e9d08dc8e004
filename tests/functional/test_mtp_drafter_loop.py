"""Native MTP drafter in the GRPO workers (``configs/grpo_math_tiny_mtp_spec.yaml``: tiny-llama policy with one
megatron-core MTP layer, vLLM ``method: mtp``, k = 1).

Setup writes the policy as a MiMo checkpoint (``<logger.log_dir>/mimo_policy``) and the engine starts from it; every
refit pushes the trunk (HF names; the zero q/k/v biases the Qwen2 layers need are added by the generation worker)
and then the MTP layer through the versioned draft refit. After a few train + refit cycles on the real Ray workers
(before the last refit, the policy actor also trains its MTP layer for a few seconds on the policy's own greedy
continuations, trunk frozen, so the drafter accepts: a near-random MTP layer accepts nothing and (b) would prove
nothing):

(c) a draft refit whose policy version differs from the engine's is refused and loads nothing;
(a) every MTP proposal the engine makes while decoding greedily equals megatron's MTP argmax of the *current* policy
    (computed in the policy actor, with MiMo's zeroed token embedding at position 0), and not that of the initial
    MTP layer (so a draft left un-refit would fail); the refit log-prob probe stays tiny;
(b) the engine's acceptance length on that decode is >= 1.5 (``require_acceptance``), and its speculative greedy
    outputs equal plain greedy outputs of a separate vLLM engine (no speculation) loaded with the current policy's
    HF weights.

The recipe's MTP warm start (``policy.megatron_cfg.mtp_warm_start``) runs in setup: trained (cache miss), logged at
step 0, and the engines refit at version 0 with the warm drafter paired with it; a second warm start on the same
setup hits the cache (same metrics, the cached weights loaded, versions unchanged).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fixtures_models as fm  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

from nemo_rl_spec.algorithms.grpo_setup import setup, teardown
from nemo_rl_spec.algorithms.mtp_warm_start import warm_start_mtp
from nemo_rl_spec.speculative.draft_refit import DraftVersionMismatchError
from nemo_rl_spec.testing import checks
from nemo_rl_spec.testing.lossless import first_mismatch, lossless_prompts, require_acceptance
from nemo_rl_spec.testing.mtp_checks import (
    megatron_mtp_argmax,
    mtp_params,
    replay_agreement,
    spec_greedy_with_proposals,
    train_mtp_on_own_greedy,
)
from nemo_rl_spec.utils.config import ConfigError, load_config

pytestmark = pytest.mark.timeout(1800)
RECIPE = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_tiny_mtp_spec.yaml"
NUM_PROMPTS, MAX_TOKENS, CYCLES = 4, 32, 2  # 2 train + refit cycles: CI tier (3 before, slow tier)


def _write_hf_dir(weights: dict[str, torch.Tensor], model_dir: str, out: Path) -> Path:
    """The policy's HF weights as a plain checkpoint directory (config and tokenizer of ``model_dir``)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    state = {k: v.contiguous() for k, v in weights.items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"))
    for f in Path(model_dir).iterdir():
        if f.name != "model.safetensors" and f.is_file():
            shutil.copy2(f, out / f.name)
    return out


def _check_warm_start(s, tmp_path: Path) -> None:
    """The warm start setup ran: trained and cached (one entry), logged at step 0, drafter refit at version 0; a second
    one hits the cache: the same metrics and the cached weights on every rank."""
    records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in records if "mtp_warm_start/ce_after" in r)
    assert first["step"] == 0 and first["mtp_warm_start/from_cache"] == 0.0
    assert first["mtp_warm_start/steps"] == 10 and first["mtp_warm_start/train_sequences"] == 14  # 7 prompts x 2
    assert first["mtp_warm_start/eval_sequences"] == 2  # round(0.125 x 8) = 1 prompt held out
    assert first["mtp_warm_start/train_ce_last"] < first["mtp_warm_start/train_ce_first"]
    assert first["refit/draft_version"] == 0 and first["refit/logprob_mismatch"] < 1e-4
    (entry,) = (tmp_path / "warm_start").iterdir()
    states = s.policy.mtp_states()
    s.policy.load_mtp_states([{k: torch.zeros_like(v) for k, v in st.items()} for st in states])  # the hit must load
    again = warm_start_mtp(s)
    assert again["mtp_warm_start/from_cache"] == 1.0
    assert {k: v for k, v in again.items() if k.startswith("mtp_warm_start/ce")} == {
        k: v for k, v in first.items() if k.startswith("mtp_warm_start/ce")
    }
    for loaded, saved in zip(s.policy.mtp_states(), states):
        assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    assert [p.name for p in (tmp_path / "warm_start").iterdir()] == [entry.name]
    assert s.generation.get_versions() == [{"policy_version": 0, "draft_version": 0, "draft_policy_version": 0}]


# --------------------------------------------------------------------------------------- tests
def test_mtp_drafter_needs_mtp_layers_and_a_mimo_compatible_model(tmp_path):
    with pytest.raises(ConfigError, match="policy.megatron_cfg.mtp_num_layers >= 1"):
        load_config(
            RECIPE, ["policy.megatron_cfg.mtp_num_layers=0", "policy.megatron_cfg.mtp_warm_start.enabled=false"]
        )
    with pytest.raises(ConfigError, match="speculative_config.model must be unset with method=mtp"):
        load_config(RECIPE, ["+policy.generation.vllm_kwargs.speculative_config.model=/x"])
    from nemo_rl_spec.algorithms.grpo_setup import check_mtp_drafter_model
    from nemo_rl_spec.models.hf_assets import resolve_model

    cfg = load_config(RECIPE, ["policy.model_name=tiny-qwen3"])  # validates: the model is checked at setup
    with pytest.raises(
        ConfigError,
        match=r"speculative_config.method=mtp .*policy.model_name='tiny-qwen3'.*"
        r"head_dim 32 != hidden_size / num_attention_heads = 64/4",
    ):
        check_mtp_drafter_model(cfg, resolve_model("tiny-qwen3"))
    check_mtp_drafter_model(load_config(RECIPE), resolve_model("tiny-llama"))


def test_mtp_drafter_follows_refits_lossless_and_versioned(tmp_path):
    from transformers import AutoTokenizer

    cfg = load_config(
        RECIPE,
        [
            f"logger.log_dir={tmp_path / 'logs'}",
            "checkpointing.enabled=false",
            "policy.megatron_cfg.optimizer.lr=1.0e-2",
            f"policy.megatron_cfg.mtp_warm_start.cache_dir={tmp_path / 'warm_start'}",
        ],
    )
    t0 = time.perf_counter()
    s = setup(cfg)
    try:
        mimo = tmp_path / "logs" / "mimo_policy"
        assert json.loads((mimo / "config.json").read_text())["architectures"] == ["MiMoForCausalLM"]
        assert (mimo / "tokenizer.json").is_file() and (mimo / "tokenizer_config.json").is_file()
        assert s.generation.get_versions() == [{"policy_version": 0, "draft_version": 0, "draft_policy_version": 0}]
        _check_warm_start(s, tmp_path)
        prompts = lossless_prompts(AutoTokenizer.from_pretrained(str(mimo)), NUM_PROMPTS)
        initial_mtp = s.policy.run_function(mtp_params)[0]
        mismatches, mtp_acc, opt_steps = [], [], 0  # draft_version = the MTP block's optimizer steps so far
        for step in range(CYCLES):
            gen = s.generation.generate({"prompt_token_ids": prompts}, n=2, seed=step, max_new_tokens=MAX_TOKENS)
            train = s.policy.train(fm.train_data_from_generation(s, gen, step))
            mtp_acc.append(train["mtp/acceptance"])
            opt_steps += int(train["num_optimizer_steps"])  # policy.train_global_batch_size mini-batches
            if step == CYCLES - 1:  # the drafter the last refit pushes must accept, or (b) proves nothing
                fit = s.policy.run_function(train_mtp_on_own_greedy, prompts, MAX_TOKENS)[0]
            refit = s.refitter.refit(version=step + 1)
            mismatches.append(refit["refit/logprob_mismatch"])
            assert refit["refit/draft_version"] == opt_steps
        assert s.generation.get_versions() == [
            {"policy_version": CYCLES, "draft_version": opt_steps, "draft_policy_version": CYCLES}
        ]
        print(
            f"\nsetup+{CYCLES} cycles {time.perf_counter() - t0:.0f} s; refit mismatch {mismatches}; "
            f"train mtp/acceptance {mtp_acc}; MTP fit loss {fit['losses'][0]:.2f} -> {fit['losses'][-1]:.2f}, "
            f"argmax accuracy {fit['accuracy']:.3f}"
        )
        assert max(mismatches) < 1e-4

        # (c) a draft paired with another policy version is refused, and nothing is loaded
        export = s.policy.export_draft_weights().get()
        assert export["policy_version"] == CYCLES and export["draft_version"] == opt_steps
        assert all(k.startswith("model.mtp_layers.0.") for k in export["weights"])
        gen_rng = torch.Generator().manual_seed(7)
        bad = {
            **export,
            "policy_version": CYCLES - 1,
            "weights": {k: torch.randn(v.shape, generator=gen_rng) for k, v in export["weights"].items()},
        }
        with pytest.raises(
            DraftVersionMismatchError,
            match=f"policy version {CYCLES - 1} offered to an engine at policy version {CYCLES}",
        ):
            s.generation.update_draft_weights(bad)
        assert s.generation.get_versions()[0]["draft_version"] == opt_steps

        # (a) the engine's MTP proposals are the current policy's MTP argmax
        outputs, proposals, counters = s.generation.run_function(spec_greedy_with_proposals, prompts, MAX_TOKENS)[0]
        sequences = [p + o for p, o in zip(prompts, outputs)]
        current = s.policy.run_function(megatron_mtp_argmax, sequences)[0]
        initial = s.policy.run_function(megatron_mtp_argmax, sequences, initial_mtp)[0]
        agree, total = replay_agreement(prompts, outputs, proposals, current)
        agree_initial, _ = replay_agreement(prompts, outputs, proposals, initial)
        print(
            f"MTP proposals == current megatron MTP argmax {agree}/{total}; == initial MTP layer's "
            f"{agree_initial}/{total}; engine acceptance length {counters.acceptance_length:.3f} "
            f"({counters.num_accepted_tokens} accepted in {counters.num_drafts} drafts)"
        )
        assert total >= NUM_PROMPTS * MAX_TOKENS // 2 and agree == total
        assert agree_initial < total  # a drafter left at the initial MTP layer would be caught
        hf_weights = s.policy.export_hf_weights().get()
    finally:
        teardown(s)
    # (b) lossless: the drafter accepted, and speculative greedy == plain greedy of the same weights (separate engine,
    # no speculation)
    require_acceptance(counters, "mtp drafter after the refits (MTP layer trained in the policy actor)")
    from nemo_rl_spec.models.hf_assets import resolve_model

    plain_dir = _write_hf_dir(hf_weights, resolve_model(cfg.policy.model_name), tmp_path / "plain")
    plain = checks.run_isolated(checks.greedy_generate, str(plain_dir), prompts, MAX_TOKENS)
    assert first_mismatch(plain["outputs"], outputs) is None
