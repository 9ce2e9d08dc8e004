"""Acceptance survives refits: 10 cycles of (speculative generation -> policy + online draft training -> policy and
draft refit) on the real workers of the tiny speculative recipe (Megatron policy actor, vLLM eagle3 engine actor,
``WeightRefitter`` with draft sync), then a refit that loads wrong draft weights on purpose.

Workload. On the random tiny model with math prompts every draft gets acceptance ~1.0 (its sampled text is a hash of
the context; measured 1.00-1.06 over 10 GRPO steps of ``configs/grpo_math_tiny_spec.yaml`` at T = 1 and 0.4 with an
offline-initialised head), so this check uses prompts a draft can learn: words repeated 40 times (the tiny model
continues them with repeats). The head starts from a short offline initialisation on the policy's own samples
(reduced vocabulary), then trains online in the policy worker every cycle while the policy itself is updated.

Must hold: after every refit the acceptance length stays well above 1.0 and the alarm is silent; the sampled
tokens' log-probs under speculation equal the trainer's autoregressive log-probs (speculation changes nothing the
learner sees); after the broken draft refit, acceptance collapses and the alarm fires.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fixtures_models as fm  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from nemo_rl_spec.algorithms.grpo_setup import setup, teardown  # noqa: E402
from nemo_rl_spec.algorithms.rollouts import masked_mean_abs_diff  # noqa: E402
from nemo_rl_spec.models.hf_assets import resolve_model  # noqa: E402
from nemo_rl_spec.utils.config import load_config  # noqa: E402

# slow tier since the CI-budget trim (docs/guides/testing.md, "The slow tier"): 104 s in CI; refit exactness and
# the alarm stay in CI (test_speculative.py::test_eagle3_refit_exact_proposals_metrics_and_alarm), acceptance in the
# loop too (test_grpo_loop.py::test_three_steps_train_with_console_metrics_and_refit)
pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]
SPEC = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_tiny_spec.yaml"
WORDS = (" serving", " data", " model", " token")


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(w * 40, add_special_tokens=False) for w in WORDS]


def _offline_draft(out_dir: Path, prompts: list[list[int]]) -> Path:
    """A head trained briefly on the tiny policy's own samples for ``prompts`` (reduced vocabulary)."""
    from transformers import AutoModelForCausalLM

    from nemo_rl_spec.speculative.offline import train_draft_on_sequences

    model = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen3"), dtype=torch.float32).eval()
    torch.manual_seed(0)
    seqs, lens = [], []
    for p in prompts:
        out = model.generate(
            torch.tensor([p] * 4),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=32,
            pad_token_id=model.config.eos_token_id,
        )
        seqs += out.tolist()
        lens += [len(p)] * 4
    head, _ = train_draft_on_sequences(
        model,
        seqs,
        lens,
        draft_vocab_size=256,
        always_include=[model.config.eos_token_id],
        steps=100,
        batch_size=8,
        lr=3e-3,
        ttt_steps=3,
    )
    return head.save_pretrained(out_dir)


def test_acceptance_survives_refits_and_alarm_fires_on_broken_draft_refit(tmp_path):
    from transformers import AutoTokenizer

    prompts = _prompts(AutoTokenizer.from_pretrained(resolve_model("tiny-qwen3")))
    start = time.perf_counter()
    draft_dir = _offline_draft(tmp_path / "draft", prompts)
    print(f"\noffline draft init {time.perf_counter() - start:.0f} s")
    cfg = load_config(
        SPEC,
        [
            f"policy.draft.model_name={draft_dir}",
            f"logger.log_dir={tmp_path / 'logs'}",
            "checkpointing.enabled=false",
            "policy.generation.max_new_tokens=32",
            "policy.train_global_batch_size=16",
            "policy.logprob_batch_size=16",
            "policy.megatron_cfg.optimizer.lr=1.0e-4",
        ],
    )
    s = setup(cfg)
    lengths, alarms, lp_errors, versions = [], [], [], []
    try:
        for step in range(10):
            gen = s.generation.generate({"prompt_token_ids": prompts}, n=4, seed=step)
            m = s.spec_step_metrics(gen["spec_counters"])
            lengths.append(m["vllm/spec_acceptance_length"])
            alarms.append(m[s.spec.alarm.METRIC])
            data = fm.train_data_from_generation(s, gen, step)
            lp_errors.append(
                masked_mean_abs_diff(data["prev_logprobs"], gen["generation_logprobs"], data["token_mask"])
            )
            train = s.policy.train(data)
            assert train["draft_version"] == step + 1 and train["draft_loss"] > 0
            refit = s.refitter.refit(version=step + 1)
            s.spec.notify_refit()
            versions.append(s.generation.get_versions()[0])
            assert refit["refit/logprob_mismatch"] < 1e-4
        # break the draft refit on purpose: load random weights of the right names and shapes
        export = s.policy.export_draft_weights().get()
        gen_rng = torch.Generator().manual_seed(123)
        export["weights"] = {
            k: (torch.randn(v.shape, generator=gen_rng) * 0.02 if v.is_floating_point() else v)
            for k, v in export["weights"].items()
        }
        s.generation.update_draft_weights(export)
        s.spec.notify_refit()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            broken = s.spec_step_metrics(
                s.generation.generate({"prompt_token_ids": prompts}, n=2, seed=99)["spec_counters"]
            )
    finally:
        teardown(s)
    print("\nacceptance per cycle", [round(x, 3) for x in lengths], "broken", broken["vllm/spec_acceptance_length"])
    assert versions[-1] == {"policy_version": 10, "draft_version": 10, "draft_policy_version": 10}
    assert all(v["draft_policy_version"] == v["policy_version"] for v in versions)
    # every generation right after a refit: at or above the alarm floor (1.2), the alarm silent
    assert min(lengths[1:]) >= s.spec.alarm.floor and alarms[1:] == [0.0] * 9
    assert max(lp_errors) < 1e-4  # speculation leaves the sampled tokens' log-probs autoregressive
    assert broken["vllm/spec_acceptance_length"] < 1.1 and broken[s.spec.alarm.METRIC] == 1.0
    assert any("still being refit" in str(w.message) for w in caught)
