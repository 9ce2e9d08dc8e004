"""Consolidated HF checkpoints of the policy (NeMo-RL's ``checkpointing.save_consolidated``): the full HF-named
weights in one ``model.safetensors`` next to the policy model's ``config.json``, generation config and tokenizer
files, so ``transformers.AutoModelForCausalLM.from_pretrained``, vLLM and ``policy.model_name`` load it directly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from nemo_rl_spec.models.hf_assets import copy_tokenizer_files


def write_consolidated_hf(weights: dict[str, torch.Tensor], model_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``weights`` (HF names, e.g. :meth:`MegatronPolicyWorker.export_hf_weights`) as an HF checkpoint.

    Args:
        weights: full (TP-gathered) tensors; ``lm_head.weight`` is left out when the model ties it to the embedding
            (``tie_word_embeddings`` in ``model_dir/config.json``), as HF writes tied models.
        model_dir: the policy's HF model directory (its config and tokenizer files are copied; ``torch_dtype`` in the
            copied config.json is set to the tensors' dtype).
        out_dir: created; receives ``model.safetensors`` and the copied files.

    Returns ``out_dir``. Raises FileNotFoundError when ``model_dir`` has no ``config.json``; ValueError on an empty
    ``weights``.
    """
    model_dir, out = Path(model_dir), Path(out_dir)
    config = json.loads((model_dir / "config.json").read_text())
    if not weights:
        raise ValueError("write_consolidated_hf: no weights (call it with rank 0's export)")
    out.mkdir(parents=True, exist_ok=True)
    tied = bool(config.get("tie_word_embeddings", False))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in weights.items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tensors.values()}
    if len(dtypes) == 1:  # config.json says the dtype the tensors are in (transformers' torch_dtype / dtype)
        config["torch_dtype"] = dtypes.pop()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (model_dir / "generation_config.json").is_file():
        shutil.copy2(model_dir / "generation_config.json", out / "generation_config.json")
    copy_tokenizer_files(model_dir, out)
    return out
