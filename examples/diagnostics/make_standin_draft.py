"""A fresh EAGLE-3 head of the default recipe's draft shape, for measuring costs without ``make draft`` (about 13 min).

``python examples/diagnostics/make_standin_draft.py OUT_DIR``

The head is fresh (lm_head = the target's output rows) with a reduced draft vocabulary of 1160 rows, the size
``make draft`` measured for results/drafts/smollm2_135m_arith; its rows are the most frequent tokens of the first 320
chat-formatted training prompts and their answers, then the lowest ids (only 44 distinct tokens occur there). The
online draft's training cost depends on the vocabulary's size, not on which tokens it holds; its acceptance is low,
so use it for cost, never for acceptance (docs/results/spec_loop_default.md).

Writes the head to OUT_DIR (``Eagle3DraftHead.save_pretrained``) and prints the vocabulary's size. The recipe is the
repository's configs/grpo_math_smollm2_135m.yaml (found from this script's path, whatever the working directory).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_smollm2_135m.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", metavar="OUT_DIR", help="where to write the head (created; save_pretrained's files)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # imported after parsing, so --help and a usage error answer without loading torch and the project
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nemo_rl_spec.algorithms.grpo_setup import load_datasets
    from nemo_rl_spec.data.prompts import format_prompt
    from nemo_rl_spec.models.hf_assets import resolve_model
    from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead, draft_vocab_from_counts
    from nemo_rl_spec.utils.config import load_config

    cfg = load_config(RECIPE, [])
    path = resolve_model(cfg.policy.model_name)
    tok = AutoTokenizer.from_pretrained(path)
    train, _ = load_datasets(cfg)
    counts = torch.zeros(len(tok), dtype=torch.float64)
    kw = cfg.policy.tokenizer.chat_template_kwargs
    for p in train[:320]:
        ids = format_prompt(tok, cfg.data.system_prompt, p["question"], **kw)
        ids = list(ids) + tok.encode(f"The answer is \\boxed{{{p.get('answer', '')}}}.", add_special_tokens=False)
        for t in ids:
            counts[t] += 1
    vocab = draft_vocab_from_counts(counts, 1160, always_include=[tok.eos_token_id])
    target = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    Eagle3DraftHead.from_target(target, draft_vocab=vocab).save_pretrained(args.out_dir)
    print("wrote", args.out_dir, "vocab", vocab.numel(), "nonzero counts", int((counts > 0).sum()))


if __name__ == "__main__":
    main()
