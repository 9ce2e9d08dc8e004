"""Pure parts of the vLLM generation layer (no engine start): merging per-engine outputs, per-engine environment,
engine arguments from the typed config, refit tensor handling, row-seed offsets."""

from __future__ import annotations

import copy
from pathlib import Path

import pydantic
import pytest
import torch
import yaml

from nemo_rl_spec.models.generation.refit_receiver import refit_tensor as _refit_tensor
from nemo_rl_spec.models.generation.runtime_env import (
    as_generation_config,
    engine_env_vars,
    engine_port_base,
)
from nemo_rl_spec.models.generation.vllm_generation import (
    EngineVersionMismatchError,
    _with_draft_dir,
    merge_generation_outputs,
)
from nemo_rl_spec.models.generation.vllm_worker import (
    derive_row_seeds,
    engine_kwargs_from_config,
)
from nemo_rl_spec.speculative.metrics import SpecDecodeCounters
from nemo_rl_spec.utils.config_schema import GenerationConfig

BASE_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_base.yaml"


def gen_cfg(**vllm_cfg) -> GenerationConfig:
    cfg = copy.deepcopy(yaml.safe_load(BASE_CONFIG.read_text())["policy"]["generation"])
    cfg["vllm_cfg"].update(vllm_cfg)
    return GenerationConfig.model_validate(cfg)


def engine_output(
    prompts: list[list[int]],
    responses: list[list[int]],
    n: int,
    version: int = 0,
    counters: SpecDecodeCounters | None = None,
) -> dict:
    """What one engine returns for ``prompts`` (rows prompt-major), pad 0, log-prob of token t = -t/100."""
    rows = [(prompts[r // n], responses[r]) for r in range(len(prompts) * n)]
    width = max(len(p) + len(t) for p, t in rows)
    ids, lps = torch.zeros(len(rows), width, dtype=torch.int64), torch.zeros(len(rows), width)
    for r, (p, t) in enumerate(rows):
        ids[r, : len(p) + len(t)] = torch.tensor(p + t)
        lps[r, len(p) : len(p) + len(t)] = -torch.tensor(t, dtype=torch.float32) / 100
    return dict(
        output_ids=ids,
        generation_logprobs=lps,
        input_lengths=torch.tensor([len(p) for p, _ in rows]),
        unpadded_sequence_lengths=torch.tensor([len(p) + len(t) for p, t in rows]),
        prompt_index=torch.tensor([r // n for r in range(len(rows))]),
        policy_version=version,
        draft_version=None if counters is None else version,
        spec_counters=counters,
    )


def test_merge_equals_one_engine_output():
    prompts = [[1, 2], [3], [4, 5, 6]]
    responses = [[7], [8, 9, 10], [11, 12], [13], [14, 15, 16, 17], [18]]  # n = 2
    whole = engine_output(prompts, responses, 2)
    c0, c1 = SpecDecodeCounters(3, 9, 4, (2, 1, 1)), SpecDecodeCounters(2, 6, 1, (1,))
    parts = [
        engine_output(prompts[:2], responses[:4], 2, counters=c0),
        engine_output(prompts[2:], responses[4:], 2, counters=c1),
    ]
    merged = merge_generation_outputs(parts, prompt_starts=[0, 2], pad_token_id=0)
    for key in ("output_ids", "generation_logprobs", "input_lengths", "unpadded_sequence_lengths", "prompt_index"):
        assert torch.equal(merged[key], whole[key]), key
    assert merged["spec_counters"] == SpecDecodeCounters(5, 15, 5, (3, 1, 1))
    assert merged["policy_version"] == 0 and merged["draft_version"] == 0


def test_merge_pads_with_pad_id_and_refuses_mixed_versions():
    a = engine_output([[1]], [[2]], 1)
    b = engine_output([[3, 4]], [[5, 6, 7]], 1)
    merged = merge_generation_outputs([a, b], [0, 1], pad_token_id=99)
    assert merged["output_ids"].tolist() == [[1, 2, 99, 99, 99], [3, 4, 5, 6, 7]]
    assert merged["spec_counters"] is None
    with pytest.raises(EngineVersionMismatchError, match="engine 0: 0, engine 3: 1"):
        merge_generation_outputs([a, engine_output([[3]], [[5]], 1, version=1)], [0, 1], 0, engines=[0, 3])
    with pytest.raises(ValueError, match="no engine outputs"):
        merge_generation_outputs([], [], 0)


def test_row_offset_keeps_one_engine_seeds():
    seeds = derive_row_seeds(7, 15)
    assert derive_row_seeds(7, 9 + 6)[9:] == seeds[9:]
    assert len(set(seeds)) == 15


def test_engine_env_port_bands_and_tensor_parallel():
    one = engine_env_vars(gen_cfg().vllm_cfg)
    assert "VLLM_PORT" not in one and "VLLM_CPU_OMP_THREADS_BIND" not in one
    assert [engine_env_vars(gen_cfg().vllm_cfg, e)["VLLM_PORT"] for e in range(3)] == ["7000", "7100", "7200"]
    tp = engine_env_vars(gen_cfg(tensor_parallel_size=2, num_threads=2).vllm_cfg, 1)
    assert tp["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and tp["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    assert tp["OMP_NUM_THREADS"] == "2"
    with pytest.raises(ValueError, match="VLLM_PORT band"):
        engine_port_base(-1)
    with pytest.raises(ValueError, match="VLLM_PORT band"):
        engine_port_base(600)


def test_engine_kwargs_from_typed_config():
    cfg = gen_cfg(tensor_parallel_size=2)
    cfg.vllm_kwargs = {"speculative_config": {"method": "eagle3", "model": "/d", "num_speculative_tokens": 2}}
    kwargs = engine_kwargs_from_config(cfg, "/m", 3, "bfloat16")
    assert kwargs["dtype"] == "bfloat16" and kwargs["seed"] == 3 and kwargs["model"] == "/m"
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["distributed_executor_backend"] == "mp"
    assert kwargs["kv_cache_memory_bytes"] == int(cfg.vllm_cfg.kv_cache_space_gb * (1 << 30))
    kwargs["speculative_config"]["model"] = "/other"  # a copy: the config is untouched
    assert cfg.vllm_kwargs["speculative_config"]["model"] == "/d"
    assert "tensor_parallel_size" not in engine_kwargs_from_config(gen_cfg(), "/m", 0, "float32")
    with pytest.raises(ValueError, match="policy.precision"):
        engine_kwargs_from_config(gen_cfg(), "/m", 0, "float16")
    cfg.vllm_kwargs = {"dtype": "float16"}
    with pytest.raises(ValueError, match=r"policy.generation.vllm_kwargs may not set \['dtype'\]"):
        engine_kwargs_from_config(cfg, "/m", 0, "float32")


def test_typed_config_from_mapping_names_the_bad_key():
    raw = gen_cfg().model_dump()
    assert as_generation_config(raw) == gen_cfg()
    raw["vllm_cfg"]["num_thread"] = 1
    with pytest.raises(pydantic.ValidationError, match="num_thread"):
        as_generation_config(raw)


def test_draft_dir_replaces_the_speculative_model():
    cfg = gen_cfg()
    assert _with_draft_dir(cfg, None) is cfg
    with pytest.raises(ValueError, match="speculative_config is not set"):
        _with_draft_dir(cfg, "/draft")
    cfg.vllm_kwargs = {"speculative_config": {"method": "eagle3", "model": "/old", "num_speculative_tokens": 2}}
    new = _with_draft_dir(cfg, "/draft")
    assert new.vllm_kwargs["speculative_config"] == {"method": "eagle3", "model": "/draft", "num_speculative_tokens": 2}
    assert cfg.vllm_kwargs["speculative_config"]["model"] == "/old"


def test_refit_tensor_on_cpu_takes_the_engine_dtype():
    w = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3).t()  # non-contiguous bf16
    out = _refit_tensor(w, torch.float32)
    assert out.dtype == torch.float32 and out.is_contiguous() and torch.equal(out, w.float())
    assert _refit_tensor(w.float(), torch.bfloat16).dtype == torch.bfloat16
