"""``examples/init_draft.py`` on the tiny recipe: the written directory loads as an EAGLE-3 head, the head learned
(teacher-forced accuracy on the sampled data above a fresh head's, computed here independently of the command's
own metrics) and bad input fails with a message naming the flag or file.

The sampled data are greedy (``policy.generation.temperature=0``): tiny-qwen3 is a random model whose T=1
samples are close to noise, while its greedy continuations are learnable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm")

from nemo_rl_spec.cli import init_draft
from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead
from nemo_rl_spec.speculative.offline import _policy_outputs, pad_sequences

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "configs/grpo_math_tiny.yaml"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "examples/init_draft.py", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=800,
    )


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("init_draft") / "draft"
    res = _run(
        "--config",
        RECIPE,
        "--out",
        str(out),
        "--num-prompts",
        "8",
        "--steps",
        "40",
        "--batch-size",
        "4",
        "--max-new-tokens",
        "24",
        "--draft-vocab-size",
        "1024",
        "policy.generation.temperature=0",
    )
    print(res.stdout)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "draft loss" in res.stdout
    return out


def _teacher_forced_acc(head: Eagle3DraftHead, policy, sequences, prompt_lengths) -> list[float]:
    ids, mask = pad_sequences(sequences, prompt_lengths)
    aux, _ = _policy_outputs(policy, head, ids, soft_targets=False)
    with torch.no_grad():
        _, metrics = head.ttt_loss(aux, ids, mask, 3)
    return [metrics[f"draft_acc_step{j}"] for j in range(3)]


def test_written_draft_loads_and_beats_fresh_head(draft_dir):
    from transformers import AutoModelForCausalLM

    for name in ("config.json", "model.safetensors", "draft_trainer.pt", "init_draft.json"):
        assert (draft_dir / name).is_file(), name
    cfg = json.loads((draft_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 1024
    summary = json.loads((draft_dir / "init_draft.json").read_text())
    assert summary["num_prompts"] == 8 and len(summary["sequences"]) == 8

    policy = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-qwen3"), dtype=torch.float32).eval()
    trained = Eagle3DraftHead.from_pretrained(draft_dir, policy.get_input_embeddings().weight).eval()
    assert trained.cfg.aux_layer_ids == (0, 1, 2)
    state = torch.load(draft_dir / "draft_trainer.pt", weights_only=True)
    assert state["draft_version"] == 40
    # a fresh head with the same vocabulary and init the command started from
    fresh = Eagle3DraftHead.from_target(
        policy, aux_layer_ids=trained.cfg.aux_layer_ids, draft_vocab=trained.draft_ids, seed=summary["seed"]
    ).eval()
    seqs, plens = summary["sequences"], summary["prompt_lengths"]
    acc_trained = _teacher_forced_acc(trained, policy, seqs, plens)
    acc_fresh = _teacher_forced_acc(fresh, policy, seqs, plens)
    print(f"teacher-forced accuracy per step: fresh {acc_fresh}, trained {acc_trained}")
    assert acc_trained[0] > acc_fresh[0] + 0.1
    assert acc_trained[2] > acc_fresh[2]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--config", "configs/no_such_recipe.yaml"], "no_such_recipe.yaml"),
        (["--config", RECIPE, "--num-prompts", "0"], "--num-prompts"),
        (["--config", RECIPE, "--num-prompts", "100000"], "--num-prompts"),
        (["--config", RECIPE, "--max-new-tokens", "5000"], "--max-new-tokens"),
        (["--config", RECIPE, "policy.generation.no_such_key=1"], "no_such_key"),
    ],
)
def test_bad_input_names_the_flag_or_file(tmp_path, capsys, monkeypatch, args, needle):
    monkeypatch.chdir(ROOT)
    rc = init_draft.main([*args, "--out", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err, err
    assert err[-1].startswith("error:") and needle in err[-1], err[-5:]
    assert not (tmp_path / "d").exists()
