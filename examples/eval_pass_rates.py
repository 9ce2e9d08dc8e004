"""Per-prompt pass rates of a recipe's policy on its training family, before any training.

``python examples/eval_pass_rates.py --config configs/grpo_math_testbed.yaml [--problems 64] [--n 8] [key=value ...]``

Samples ``--n`` responses per problem at the recipe's ``policy.generation.temperature`` (and one greedy answer) on an
in-process vLLM engine, scores them with the math environment and prints greedy accuracy, the mean pass rate at the
sampling temperature, and how the per-prompt pass rates spread over [0, 1] (the fraction strictly inside (0, 1) is
the fraction of GRPO groups with a non-zero advantage), overall and per problem source. Problems: the recipe's
held-out validation set (``data.validation``; ``--problems`` overrides its size), or with ``--split train`` its
training pool (the first ``--problems``). Writes the numbers as JSON with ``--out``.
Used to choose the default recipe's task mix and to check the testbed policy (README, "Learning").
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def pass_rate_summary(rewards, n: int) -> dict[str, float]:
    """Summary of ``rewards`` [P * n] (prompt-major, in {0, 1}): mean, share of prompts never / always / sometimes
    solved, and the histogram of per-prompt pass rates over 5 equal bins of [0, 1]."""
    import torch

    per_prompt = rewards.view(-1, n).float().mean(1)
    hist = torch.histc(per_prompt, bins=5, min=0.0, max=1.0) / per_prompt.numel()
    return {
        "mean_pass_rate": float(per_prompt.mean()),
        "share_zero": float((per_prompt == 0).float().mean()),
        "share_one": float((per_prompt == 1).float().mean()),
        "share_mixed": float(((per_prompt > 0) & (per_prompt < 1)).float().mean()),
        "share_at_least_0.95": float((per_prompt >= 0.95).float().mean()),
        "share_at_most_0.05": float((per_prompt <= 0.05).float().mean()),
        "histogram_5_bins": [round(float(h), 4) for h in hist],
    }


def per_source_summary(rewards, sources: list[str], n: int) -> dict[str, dict[str, float]]:
    """:func:`pass_rate_summary` of each problem source (``sources[i]`` of prompt i; ``rewards`` prompt-major)."""
    rows = rewards.view(-1, n)
    out = {}
    for source in dict.fromkeys(sources):
        pick = [i for i, s in enumerate(sources) if s == source]
        out[source] = {"problems": len(pick), **pass_rate_summary(rows[pick].reshape(-1), n)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--problems", type=int, default=None, help="validation problems (default data.validation)")
    parser.add_argument("--n", type=int, default=8, help="samples per problem at the recipe temperature")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument(
        "--split", choices=("validation", "train"), default="validation", help="the problems: held-out or the pool"
    )
    args, overrides = parser.parse_known_args(argv)

    from nemo_rl_spec.utils.config import load_config
    from nemo_rl_spec.utils.machine import write_bench_json

    if args.problems is not None:
        overrides = [*overrides, f"data.validation.max_samples={args.problems}"]
    cfg = load_config(args.config, overrides)

    from transformers import AutoTokenizer

    from nemo_rl_spec.algorithms.grpo_setup import load_datasets
    from nemo_rl_spec.algorithms.rollouts import generate_rollouts
    from nemo_rl_spec.data.prompts import format_prompt
    from nemo_rl_spec.environments.math_env import MathEnvironment
    from nemo_rl_spec.models.generation.vllm_worker import VllmGenerationWorker
    from nemo_rl_spec.models.hf_assets import resolve_model

    model_path = resolve_model(cfg.policy.model_name)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train, val = load_datasets(cfg)
    problems = list(val) if args.split == "validation" else list(train)[: args.problems]
    prompts = [
        format_prompt(tokenizer, cfg.data.system_prompt, p["question"], **cfg.policy.tokenizer.chat_template_kwargs)
        for p in problems
    ]
    engine = VllmGenerationWorker(cfg.policy.generation, model_path, seed=cfg.grpo.seed, precision=cfg.policy.precision)
    env = MathEnvironment({"num_workers": cfg.env.math.num_workers})
    start = time.perf_counter()
    greedy = generate_rollouts(engine, tokenizer, env, problems, prompts, n=1, seed=0, temperature=0.0)
    sampled = generate_rollouts(engine, tokenizer, env, problems, prompts, n=args.n, seed=cfg.grpo.seed)
    lengths = (sampled.generation["unpadded_sequence_lengths"] - sampled.generation["input_lengths"]).float()
    result = {
        "config": args.config,
        "overrides": overrides,
        "model": cfg.policy.model_name,
        "problems": len(problems),
        "n": args.n,
        "temperature": cfg.policy.generation.temperature,
        "greedy_accuracy": float(greedy.rewards.mean()),
        **pass_rate_summary(sampled.rewards, args.n),
        "per_source": per_source_summary(sampled.rewards, [p["source"] for p in problems], args.n),
        "mean_response_tokens": float(lengths.mean()),
        "response_tokens_p10_p50_p90_max": [float(lengths.quantile(q)) for q in (0.1, 0.5, 0.9)]
        + [float(lengths.max())],
        "share_at_max_new_tokens": float((lengths >= cfg.policy.generation.max_new_tokens).float().mean()),
        "seconds": round(time.perf_counter() - start, 1),
        "example_response": sampled.responses[0][:300],
    }
    for key, value in result.items():
        print(f"{key:>22}: {value}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_bench_json(args.out, result)
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
