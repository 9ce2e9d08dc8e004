"""The MTP warm start's cache (nemo_rl_spec/algorithms/mtp_warm_start.py) and its config rules: the key changes with
every field it lists and with the model files, and only with them; entries are written atomically and read back only
for their own key fields; per-rank states map to TP ranks and back for any DP size; an enabled warm start without
MTP layers is refused naming the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nemo_rl_spec.algorithms.mtp_warm_start import (
    cache_key,
    cache_key_fields,
    load_cache,
    save_cache,
    states_by_tp_rank,
    states_per_rank,
    warm_start_config,
)
from nemo_rl_spec.utils.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
RECIPE = CONFIGS / "grpo_math_tiny_mtp.yaml"
WS = "policy.megatron_cfg.mtp_warm_start"


@pytest.fixture
def model_dir(tmp_path) -> Path:
    path = tmp_path / "model"
    (path / "sub").mkdir(parents=True)
    (path / "config.json").write_text('{"a": 1}')
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    (path / "sub" / "tokenizer.json").write_text("{}")
    return path


def _key(model_dir: Path, *overrides: str) -> str:
    return cache_key(cache_key_fields(load_config(RECIPE, overrides), model_dir))


def test_cache_key_changes_with_every_listed_field_and_only_with_them(model_dir):
    base = _key(model_dir)
    assert base == _key(model_dir) and len(base) == 64
    unrelated = (
        f"{WS}.cache_dir=/elsewhere",
        "grpo.max_num_steps=9",
        "logger.log_dir=/tmp/other_logs",
        "policy.megatron_cfg.mtp_loss_mode=detach",
        "policy.megatron_cfg.optimizer.lr=5.0e-4",  # RL's lr; the warm start has its own
        "policy.generation.vllm_cfg.num_threads=1",
    )
    for override in unrelated:
        assert _key(model_dir, override) == base, override
    listed = (
        "policy.megatron_cfg.mtp_num_layers=2",
        "grpo.seed=7",
        "policy.generation.temperature=0.7",
        "policy.generation.top_p=0.9",
        "policy.generation.top_k=5",
        "policy.generation.max_new_tokens=12",
        "policy.generation.stop_token_ids=[3]",
        "data.train.size=32",
        "data.system_prompt=other",
        "policy.tokenizer.chat_template_kwargs={enable_thinking: false}",
        "policy.megatron_cfg.tensor_model_parallel_size=2",
        "policy.precision=bfloat16",
        "policy.megatron_cfg.optimizer.clip_grad=0.5",
        "policy.megatron_cfg.optimizer.adam_beta2=0.95",
        f"{WS}.num_prompts=9",
        f"{WS}.samples_per_prompt=3",
        f"{WS}.holdout_fraction=0.25",
        f"{WS}.steps=11",
        f"{WS}.batch_size=4",
        f"{WS}.lr=2.0e-3",
        f"{WS}.enabled=false",
    )
    keys = {override: _key(model_dir, override) for override in listed}
    assert base not in keys.values()
    assert len(set(keys.values())) == len(listed)  # each change gives its own key


def test_cache_key_follows_every_model_file(model_dir):
    base = _key(model_dir)
    weights = model_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000] ^= 1  # one bit of the weights
    weights.write_bytes(bytes(data))
    flipped = _key(model_dir)
    assert flipped != base
    (model_dir / "sub" / "tokenizer.json").write_text("{ }")  # a file in a subdirectory
    assert _key(model_dir) not in (base, flipped)
    (model_dir / "sub" / "tokenizer.json").rename(model_dir / "sub" / "tokenizer2.json")  # a renamed file
    renamed = _key(model_dir)
    (model_dir / "extra.txt").write_text("")  # an added (empty) file
    assert _key(model_dir) != renamed


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("refuses to pickle")


def test_cache_entries_are_written_atomically_and_read_for_their_own_key(tmp_path):
    path = tmp_path / "cache" / "k.pt"
    assert load_cache(path, "fields") is None  # missing
    entry = {"states": [{"mtp.w": torch.arange(6.0).view(2, 3)}], "metrics": {"mtp_warm_start/ce_after": 1.5}}
    save_cache(path, {**entry, "key_fields": "fields"})
    assert os.listdir(path.parent) == ["k.pt"]  # no temporary file left
    loaded = load_cache(path, "fields")
    assert torch.equal(loaded["states"][0]["mtp.w"], entry["states"][0]["mtp.w"])
    assert loaded["metrics"] == entry["metrics"]
    assert load_cache(path, "other fields") is None  # another key's fields (a hash collision) are not reused
    save_cache(path, {**entry, "metrics": {"mtp_warm_start/ce_after": 2.0}, "key_fields": "fields"})  # overwrite
    assert load_cache(path, "fields")["metrics"] == {"mtp_warm_start/ce_after": 2.0}
    with pytest.raises(RuntimeError, match="refuses to pickle"):  # a failed write: old entry whole, no temporary file
        save_cache(path, {"states": [_Unpicklable()], "key_fields": "fields"})
    assert os.listdir(path.parent) == ["k.pt"]
    assert load_cache(path, "fields")["metrics"] == {"mtp_warm_start/ce_after": 2.0}
    path.write_bytes(b"not a torch file")
    with pytest.warns(UserWarning, match="unreadable"):
        assert load_cache(path, "fields") is None


def _layouts(dp: int, tp: int) -> list[dict]:
    return [{"rank": r, "tp_rank": r % tp, "dp_rank": r // tp, "pp_rank": 0} for r in range(dp * tp)]


def test_states_map_to_tp_ranks_and_back_for_any_dp_size():
    states = [{"w": torch.tensor([float(r)])} for r in range(4)]  # DP 2 x TP 2: ranks 2, 3 repeat ranks 0, 1
    by_tp = states_by_tp_rank(states, _layouts(2, 2))
    assert [float(s["w"]) for s in by_tp] == [0.0, 1.0]
    assert [float(s["w"]) for s in states_per_rank(by_tp, _layouts(1, 2))] == [0.0, 1.0]
    assert [float(s["w"]) for s in states_per_rank(by_tp, _layouts(3, 2))] == [0.0, 1.0] * 3
    with pytest.raises(ValueError, match="holds 2 TP ranks, the policy has 1"):
        states_per_rank(by_tp, _layouts(2, 1))


def test_enabled_warm_start_needs_mtp_layers():
    with pytest.raises(ConfigError, match=rf"{WS}.enabled=true needs mtp_num_layers >= 1 \(got 0\)"):
        load_config(RECIPE, ["policy.megatron_cfg.mtp_num_layers=0"])
    with pytest.raises(ConfigError, match=rf"{WS}.enabled=true needs mtp_num_layers"):
        load_config(
            CONFIGS / "grpo_math_tiny.yaml", [f"+{WS}={{steps: 3}}"]
        )  # enabled by default once the section is set
    off = load_config(RECIPE, ["policy.megatron_cfg.mtp_num_layers=0", f"{WS}.enabled=false"])
    assert warm_start_config(off) is None
    assert warm_start_config(load_config(CONFIGS / "grpo_math_tiny.yaml")) is None  # no section
    cfg = load_config(RECIPE)
    assert warm_start_config(cfg) is cfg.policy.megatron_cfg.mtp_warm_start and cfg.policy.megatron_cfg.mtp_num_layers
    for override, key in ((f"{WS}.holdout_fraction=1.0", "holdout_fraction"), (f"{WS}.steps=0", "steps")):
        with pytest.raises(ConfigError, match=key):
            load_config(RECIPE, [override])
