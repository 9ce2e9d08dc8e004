"""A recipe in the layout of NeMo-RL main (tests/fixtures/nemo_rl/grpo_math_main_layout_tiny.yaml: the math GRPO base
config with the online EAGLE-3 recipe on top, ``nemo_rl_compat: true``) runs two GRPO steps of the tiny recipe end to
end (Ray + vLLM + Megatron, one subprocess): one warning lists the ignored keys, NeMo-RL's keys act
(train_global_batch_size 4 of 8 rollouts: two optimizer steps; the scheduler's warmup lr; validation of
max_val_samples problems), ``policy.draft.enabled: true`` trains the EAGLE-3 draft online and refits it each step
(NeMo-RL's meaning), ``policy.sequence_packing.enabled: true`` (NeMo-RL's base default) packs the training and
log-prob rows, and save_consolidated writes an HF checkpoint of the trained policy."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "nemo_rl" / "grpo_math_main_layout_tiny.yaml"

pytestmark = pytest.mark.timeout(900)


def test_nemo_rl_main_layout_recipe_runs_and_trains_its_draft(tmp_path):
    from transformers import AutoModelForCausalLM

    from nemo_rl_spec.models.hf_assets import resolve_model

    cmd = [
        sys.executable,
        str(ROOT / "examples" / "run_grpo.py"),
        "--config",
        str(FIXTURE),
        f"logger.log_dir={tmp_path}/logs",
        f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
        "logger.progress_bar=false",
        # the checks of NeMo-RL keys below: two optimizer steps a GRPO step, a two-step warmup, a consolidated HF
        # checkpoint every step (no overlong filtering: the random tiny model's responses all run to max_new_tokens,
        # so it would mask every row, and the draft would train on nothing)
        "policy.train_global_batch_size=4",
        "policy.megatron_cfg.scheduler.lr_warmup_iters=2",
        "checkpointing.enabled=true",
        "checkpointing.save_period=1",
        "checkpointing.save_consolidated=true",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_LEVEL", "NEMO_RL_SPEC_VERBOSE")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert (proc.stdout + proc.stderr).count("NeMo-RL keys ignored") == 1
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines())}
    step = records[1]
    assert step["train/num_optimizer_steps"] == 2.0
    assert step["train/lr"] == pytest.approx(1e-4 + (1e-3 - 1e-4) * 1 / 2, rel=1e-9)  # warmup step 1 of 2
    assert "validation/accuracy" in records[2]
    # the draft trains online (NeMo-RL's policy.draft.enabled) and each step's refit carries a new draft version
    assert all(records[s]["train/draft_loss"] > 0 for s in (1, 2))
    assert records[2]["refit/draft_version"] > records[1]["refit/draft_version"]

    consolidated = tmp_path / "ckpt" / "step_1" / "policy" / "consolidated"
    trained = AutoModelForCausalLM.from_pretrained(str(consolidated), dtype=torch.float32).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen3"), dtype=torch.float32).state_dict()
    assert trained.keys() == initial.keys()
    assert max(float((trained[k] - initial[k]).abs().max()) for k in initial) > 1e-5  # the trained weights
