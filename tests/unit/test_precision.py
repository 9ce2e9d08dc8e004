"""policy.precision: auto, the engine dtype key, the refit tolerance by dtype pair, the consolidated export's dtype
(utils/precision.py, docs/guides/precision.md). Only the CPU capability probe is mocked."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from nemo_rl_spec.utils import precision as prec
from nemo_rl_spec.utils.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DEFAULT = CONFIGS / "grpo_math_smollm2_135m.yaml"
TINY = CONFIGS / "grpo_math_tiny.yaml"


@pytest.fixture
def no_native_bf16(monkeypatch):
    monkeypatch.setattr(prec, "native_bf16", lambda cpuinfo=prec.CPUINFO: (False, []))


@pytest.fixture
def native_bf16(monkeypatch):
    monkeypatch.setattr(prec, "native_bf16", lambda cpuinfo=prec.CPUINFO: (True, ["amx_bf16", "avx512_bf16"]))


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\nbogus\t: 1\n")
    assert prec.cpu_flags(info) == {"fpu", "sse", "avx512f", "avx512_bf16"}
    assert prec.native_bf16(info) == (True, ["avx512_bf16"])
    info.write_text("flags\t: fpu sse avx2\n")
    assert prec.native_bf16(info) == (False, [])
    assert prec.cpu_flags(tmp_path / "missing") == set()


def test_default_recipe_picks_fp32_without_native_bf16_and_says_so(no_native_bf16):
    cfg = load_config(DEFAULT)
    assert cfg.policy.precision == "float32" and cfg.policy.engine_precision == "float32"
    line = prec.precision_line(cfg.policy)
    assert line.startswith("precision: training float32 (auto: this CPU has no native bf16")
    assert "amx_bf16, avx512_bf16" in line and "refit tolerance 0.001 nats" in line


def test_default_recipe_picks_bf16_with_native_bf16(native_bf16):
    cfg = load_config(DEFAULT)
    assert (cfg.policy.precision, cfg.policy.engine_precision) == ("bfloat16", "bfloat16")
    assert cfg.policy.precision_reason == "auto: this CPU has native bf16 (amx_bf16, avx512_bf16)"
    assert cfg.policy.refit_threshold == prec.REFIT_TOLERANCE[("bfloat16", "bfloat16")]


def test_auto_is_bf16_on_gpu_whatever_the_cpu(no_native_bf16):
    assert prec.choose_precision("auto", on_gpu=True) == ("bfloat16", "auto: a GPU run")
    assert prec.choose_precision("float32", on_gpu=True) == ("float32", "set in the recipe")


def test_explicit_bf16_without_native_bf16_runs_with_a_warning(no_native_bf16):
    with pytest.warns(UserWarning, match="emulated, slower than float32"):
        cfg = load_config(TINY, ["policy.precision=bfloat16"])
    assert cfg.policy.precision == "bfloat16"


def test_explicit_bf16_with_native_bf16_is_quiet(native_bf16):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(TINY, ["policy.precision=bfloat16"]).policy.precision == "bfloat16"


def test_unknown_precision_is_an_error():
    with pytest.raises(ValueError, match="expected float32, bfloat16 or auto"):
        prec.choose_precision("float16", on_gpu=False)


@pytest.mark.parametrize(
    "overrides, engine, tol",
    [
        ([], "float32", 1e-3),
        (["policy.precision=bfloat16"], "bfloat16", prec.REFIT_TOLERANCE[("bfloat16", "bfloat16")]),
        (["policy.generation.vllm_cfg.precision=bfloat16"], "bfloat16", prec.REFIT_TOLERANCE[("float32", "bfloat16")]),
        (
            ["policy.precision=bfloat16", "policy.generation.vllm_cfg.precision=float32"],
            "float32",
            prec.REFIT_TOLERANCE[("bfloat16", "float32")],
        ),
        (["policy.refit.logprob_mismatch_threshold=0.5"], "float32", 0.5),
        (["policy.refit.logprob_mismatch_threshold=null"], "float32", None),
    ],
)
def test_engine_dtype_and_refit_tolerance(native_bf16, overrides, engine, tol):
    p = load_config(TINY, overrides).policy
    assert p.engine_precision == engine and p.refit_threshold == tol


def test_refit_tolerance_is_tight_for_fp32_and_wider_with_bf16():
    t = prec.REFIT_TOLERANCE
    assert t[("float32", "float32")] == 1e-3
    assert all(t[pair] > 10 * t[("float32", "float32")] for pair in t if "bfloat16" in pair)
    with pytest.raises(KeyError):
        prec.refit_tolerance("auto", "float32")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_consolidated_export_writes_the_tensors_dtype_into_config(tmp_path, dtype):
    from safetensors.torch import load_file

    from nemo_rl_spec.models.hf_export import write_consolidated_hf

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"tie_word_embeddings": False, "torch_dtype": "float32"}))
    weights = {"model.embed_tokens.weight": torch.randn(4, 2).to(dtype), "lm_head.weight": torch.randn(4, 2).to(dtype)}
    out = write_consolidated_hf(weights, model_dir, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix("torch.")
    loaded = load_file(str(out / "model.safetensors"))
    assert all(loaded[k].dtype == dtype and torch.equal(loaded[k], weights[k]) for k in weights)
