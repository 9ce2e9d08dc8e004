"""resolve_model: built-in checkpoints are built once, cached atomically, reproducible and faithful."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from nemo_rl_spec.models import hf_assets  # noqa: E402
from nemo_rl_spec.models.hf_assets import BUILTIN_MODELS, resolve_model  # noqa: E402


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return Path(resolve_model("tiny-qwen3", cache_dir=str(tmp_path_factory.mktemp("cache"))))


def test_tiny_qwen3_layout_and_config(tiny_dir: Path):
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "nemo_rl_spec_asset.json",
    ):
        assert (tiny_dir / name).is_file(), name
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    expected = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=128,
        tie_word_embeddings=True,
        vocab_size=49152,
    )
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["dtype"] == "float32"


def test_tiny_qwen3_loads_in_transformers_with_chat_template(tiny_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    assert len(tok) == 49152
    text = tok.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\n2+2?<|im_end|>" in text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    assert (
        sum(p.numel() for p in model.parameters())
        == 49152 * 64 + 2 * (64 * 128 + 2 * 64 * 64 + 128 * 64 + 3 * 64 * 128 + 2 * 64 + 2 * 32) + 64
    )


def test_built_once_then_cached(tiny_dir: Path, monkeypatch):
    before = (tiny_dir / "model.safetensors").stat().st_mtime_ns

    def must_not_build(out_dir):
        raise AssertionError("cached model rebuilt")

    monkeypatch.setitem(BUILTIN_MODELS, "tiny-qwen3", must_not_build)
    assert resolve_model("tiny-qwen3", cache_dir=str(tiny_dir.parent)) == str(tiny_dir)
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == before
    # the environment variable selects the cache root when no cache_dir is given
    monkeypatch.setenv("NEMO_RL_SPEC_CACHE", str(tiny_dir.parent))
    assert resolve_model("tiny-qwen3") == str(tiny_dir)
    # an existing checkpoint directory resolves to itself
    assert resolve_model(str(tiny_dir)) == str(tiny_dir)


def test_build_is_reproducible(tiny_dir: Path, tmp_path: Path):
    other = Path(resolve_model("tiny-qwen3", cache_dir=str(tmp_path)))
    assert other != tiny_dir
    assert _sha256(other / "model.safetensors") == _sha256(tiny_dir / "model.safetensors")


def test_interrupted_build_leaves_nothing(tmp_path: Path, monkeypatch):
    def dies_halfway(out_dir: Path):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as if killed mid-conversion

    monkeypatch.setitem(BUILTIN_MODELS, "tiny-qwen3", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        resolve_model("tiny-qwen3", cache_dir=str(tmp_path))
    assert not (tmp_path / "tiny-qwen3").exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_stale_version_is_rebuilt(tmp_path: Path, monkeypatch):
    target = tmp_path / "tiny-qwen3"
    target.mkdir()
    (target / "config.json").write_text("{}")
    (target / "nemo_rl_spec_asset.json").write_text(json.dumps({"version": -1}))
    built = []

    def fake_build(out_dir: Path):
        built.append(out_dir)
        (out_dir / "config.json").write_text('{"fresh": true}')

    monkeypatch.setitem(BUILTIN_MODELS, "tiny-qwen3", fake_build)
    assert resolve_model("tiny-qwen3", cache_dir=str(tmp_path)) == str(target.resolve())
    assert len(built) == 1 and json.loads((target / "config.json").read_text()) == {"fresh": True}
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["tiny-qwen3"]


def test_bad_path_error_names_path_and_builtins(tmp_path: Path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as err:
        resolve_model(str(missing))
    msg = str(err.value)
    assert str(missing) in msg and "tiny-qwen3" in msg and "smollm2-135m-instruct" in msg
    (tmp_path / "empty").mkdir()  # a directory without config.json is not a checkpoint
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_smollm2_conversion_matches_gguf_logits():
    """The fp32 safetensors conversion gives the logits transformers computes from the GGUF itself.

    Slow on first use (~35 s conversion into the shared cache) plus ~30 s to de-quantise the GGUF.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    path = resolve_model("smollm2-135m-instruct")
    cfg = json.loads(Path(path, "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "float32"
    assert "quantization_config" not in cfg
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 7 times 6?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    converted = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits_converted = converted(ids).logits
    del converted
    gguf = hf_assets.smollm2_gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        logits_direct = direct(ids).logits
    assert logits_converted.shape == (1, ids.shape[1], 49152)
    assert torch.equal(logits_converted, logits_direct)
