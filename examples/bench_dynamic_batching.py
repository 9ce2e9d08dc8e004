"""Training and log-prob phase seconds, padded micro-batches vs dynamic batching vs sequence packing, on one batch of
a recipe (the default one unless ``--config``).

    python examples/bench_dynamic_batching.py --out results/bench_dynamic_batching.json
        [--config configs/grpo_math_smollm2_135m.yaml] [--rounds 64 1] [--budgets 768:1536 ...]
        [--packing modified_first_fit_decreasing ...] [--repeats 1] [--seed 0] [key=value ...]

One :class:`~nemo_rl_spec.models.policy.megatron_worker.MegatronPolicyWorker` of the recipe's policy (its model,
threads, micro-batch sizes) in this process, no Ray and no vLLM. The batch has the recipe's shape
(``grpo.num_prompts_per_step`` prompts x ``num_generations_per_prompt`` rows): real training prompts of the recipe,
rendered by the model's chat template, each followed by random response tokens whose lengths are drawn (seeded) as
30% cut off at ``policy.generation.max_new_tokens`` and the rest uniform in [20, max_new_tokens - 10] (mean ~107
tokens for 160; the default recipe's first step measured a mean response length of 102).

Variants, timed on the same batch and the same weights (restored after every ``train``): ``padded`` (the recipe's
fixed micro-batches, each trimmed to its longest row) and ``dynamic_r<R>`` for each ``--rounds`` R
(``policy.dynamic_batching`` on, the recipe's token budgets, ``sequence_length_round=R``), or with ``--budgets
T:L`` ``dynamic_t<T>_l<L>_r<R>`` (``train_mb_tokens=T``, ``logprob_mb_tokens=L``), and for each ``--packing``
algorithm A ``packed_<A>`` (``policy.sequence_packing`` on with the same budgets as the first dynamic variant, round
1). Phases: ``logprob_s``
(``get_logprobs``, the GRPO step's ``policy_and_reference_logprobs`` phase without a reference model) and
``train_s`` (one ``train`` call on all rows: the recipe's ``train_global_batch_size`` is the whole step), each
the median over ``--repeats`` rounds (variants interleaved) after an untimed warm-up on two rows.

Written JSON::

    {"config", "overrides", "threads", "batch": {"rows", "seq_lengths", "prompt_lengths", "response_lengths"},
     "variants": {"<name>": {"dynamic_batching" / "sequence_packing" (the section used, null: not this plan),
                             "logprob_s", "train_s", "train_tokens", "logprob_tokens" (tokens computed, padding included),
                             "train_tokens_per_s", "logprob_tokens_per_s" (real tokens: sum of row lengths / seconds),
                             "logprob_s_all", "train_s_all" (every repeat),
                             "train_micro_batches", "logprob_micro_batches", "loss", "grad_norm",
                             "logprob_max_abs_diff" (vs padded, valid tokens)}},
     "ratios": {"<name>": {"logprob": padded / variant seconds, "train": ..., "both": ...}},
     "packed_vs_dynamic": {"packed_<A>": {"vs", "logprob", "train" (dynamic / packed seconds), per-repeat lists}},
     "machine": {...} (nemo_rl_spec.utils.machine.machine_info)}

Also prints a table. On 2 shared CPU cores run it alone (``../shared/tools/heavy``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def build_batch(cfg, tokenizer, seed: int) -> dict:
    """The recipe-shaped batch (module docstring). Shapes: [rows, S] tensors, [rows] lengths / masks."""
    import torch

    from nemo_rl_spec.data.datasets import load_train_problems
    from nemo_rl_spec.data.prompts import format_prompt

    n_prompts, n_gen = cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt
    problems = load_train_problems(cfg.data.train.generators, n_prompts, cfg.data.train.seed)
    prompts = [
        format_prompt(tokenizer, cfg.data.system_prompt, p["question"], **cfg.policy.tokenizer.chat_template_kwargs)
        for p in problems
    ]
    gen = torch.Generator().manual_seed(seed)
    max_new = cfg.policy.generation.max_new_tokens
    low = max(1, min(20, max_new // 4))  # [20, max_new - 10] for the default recipe; tiny recipes scale it down
    high = max(low + 1, max_new - 9)
    rows = []
    for prompt in prompts:
        for _ in range(n_gen):
            cut = bool(torch.rand((), generator=gen) < 0.3)
            resp = max_new if cut else int(torch.randint(low, high, (), generator=gen))
            rows.append((prompt, torch.randint(1, tokenizer.vocab_size, (resp,), generator=gen).tolist()))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    token_mask = torch.zeros(len(rows), width)
    for b, (prompt, resp) in enumerate(rows):
        ids[b, : len(prompt) + len(resp)] = torch.tensor(prompt + resp)
        token_mask[b, len(prompt) : len(prompt) + len(resp)] = 1.0
    lengths = torch.tensor([len(p) + len(r) for p, r in rows])
    return dict(
        input_ids=ids,
        input_lengths=lengths,
        token_mask=token_mask,
        sample_mask=torch.ones(len(rows)),
        advantages=torch.randn(len(rows), generator=gen),
        generation_logprobs=torch.zeros(len(rows), width),
        prompt_lengths=[len(p) for p, _ in rows],
        response_lengths=[len(r) for _, r in rows],
    )


def _variants(cfg, rounds: list[int], budgets: list[str] | None = None, packing: list[str] | None = None) -> dict:
    """``{"padded": (None, None), "dynamic_r<R>": (DynamicBatchingConfig, None)}`` with the recipe's token budgets, or
    with ``budgets`` ("<train_mb_tokens>:<logprob_mb_tokens>" each) ``"dynamic_t<T>_l<L>_r<R>"``; and
    ``"packed_<algorithm>": (None, SequencePackingConfig)`` with the first dynamic variant's budgets, round 1."""
    from nemo_rl_spec.utils.config_schema import DynamicBatchingConfig, SequencePackingConfig

    base = cfg.policy.dynamic_batching or DynamicBatchingConfig()
    out = {"padded": (None, None)}
    for pair in budgets or [None]:
        update, tag = {"enabled": True}, ""
        if pair is not None:
            train, logprob = (int(x) for x in pair.split(":"))
            update.update(train_mb_tokens=train, logprob_mb_tokens=logprob)
            tag = f"_t{train}_l{logprob}"
        for r in rounds:
            out[f"dynamic{tag}_r{r}"] = (base.model_copy(update={**update, "sequence_length_round": r}), None)
    first = next(dyn for dyn, _ in out.values() if dyn is not None)
    for algorithm in packing or []:
        pack = SequencePackingConfig(
            enabled=True,
            train_mb_tokens=first.train_mb_tokens,
            logprob_mb_tokens=first.logprob_mb_tokens,
            algorithm=algorithm,
            sequence_length_round=1,
        )
        out[f"packed_{algorithm}"] = (None, pack)
    return out


def run(
    cfg, rounds: list[int], repeats: int, seed: int, budgets: list[str] | None = None, packing: list[str] | None = None
) -> dict:
    """Time both phases per variant (module docstring); returns the JSON body."""
    import torch
    from transformers import AutoTokenizer

    from nemo_rl_spec.algorithms.loss import ClippedPGLossFn
    from nemo_rl_spec.models.hf_assets import resolve_model
    from nemo_rl_spec.models.policy import megatron_model as mm
    from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker

    path = resolve_model(cfg.policy.model_name)
    batch = build_batch(cfg, AutoTokenizer.from_pretrained(path), seed)
    meta = {k: batch.pop(k) for k in ("prompt_lengths", "response_lengths")}
    worker = MegatronPolicyWorker(
        cfg.policy.model_copy(deep=True), ClippedPGLossFn(cfg.loss_fn.model_dump()), path, seed=0
    )
    variants = _variants(cfg, rounds, budgets, packing)
    real_tokens = int(batch["input_lengths"].sum())
    weights = {k: v.detach().clone() for k, v in mm.megatron_param_state(worker.module).items()}
    mask = batch["token_mask"].bool()
    times = {name: {"logprob_s": [], "train_s": []} for name in variants}
    results = {name: {} for name in variants}
    warm = {k: v[:2] for k, v in batch.items()}  # untimed warm-up: one forward and one step on two rows
    worker.train({**warm, "prev_logprobs": worker.get_logprobs(warm)})
    mm.load_megatron_state(worker.module, weights)
    reference_lp = None
    for rep in range(1, repeats + 1):
        for name, (dyn, pack) in variants.items():
            worker.cfg.dynamic_batching = worker.cfg.sequence_packing = None  # (validated: one plan at a time)
            worker.cfg.dynamic_batching, worker.cfg.sequence_packing = dyn, pack
            start = time.perf_counter()
            lp = worker.get_logprobs(batch)
            logprob_s = time.perf_counter() - start
            if reference_lp is None:
                reference_lp = lp
            data = {**batch, "prev_logprobs": reference_lp}
            start = time.perf_counter()
            metrics = worker.train(data)
            train_s = time.perf_counter() - start
            mm.load_megatron_state(worker.module, weights)  # the next variant starts from the same weights
            times[name]["logprob_s"].append(logprob_s)
            times[name]["train_s"].append(train_s)
            plans = {phase: worker.micro_batch_plan(batch, phase) for phase in ("train", "logprob")}
            results[name] = {
                "dynamic_batching": None if dyn is None else dyn.model_dump(),
                "sequence_packing": None if pack is None else pack.model_dump(),
                "train_tokens": sum(mb.num_tokens for mb in plans["train"]),
                "logprob_tokens": sum(mb.num_tokens for mb in plans["logprob"]),
                "train_micro_batches": len(plans["train"]),
                "logprob_micro_batches": len(plans["logprob"]),
                "loss": metrics["loss"],
                "grad_norm": metrics["grad_norm"],
                "logprob_max_abs_diff": float((lp - reference_lp)[mask].abs().max()),
            }
            print(f"round {rep} {name}: logprob {logprob_s:.2f}s train {train_s:.2f}s", flush=True)
    for name in variants:
        results[name].update({k: statistics.median(v) for k, v in times[name].items()})
        results[name].update({f"{k}_all": v for k, v in times[name].items()})
        results[name].update(
            train_tokens_per_s=real_tokens / results[name]["train_s"],
            logprob_tokens_per_s=real_tokens / results[name]["logprob_s"],
        )
    pad = results["padded"]
    ratios = {
        name: {
            "logprob": pad["logprob_s"] / r["logprob_s"],
            "train": pad["train_s"] / r["train_s"],
            "both": (pad["logprob_s"] + pad["train_s"]) / (r["logprob_s"] + r["train_s"]),
        }
        for name, r in results.items()
        if name != "padded"
    }
    return {
        "threads": cfg.policy.megatron_cfg.num_threads,
        "repeats": repeats,
        "seed": seed,
        "batch": {"rows": int(batch["input_ids"].shape[0]), "seq_lengths": batch["input_lengths"].tolist(), **meta},
        "variants": results,
        "ratios": ratios,
        "packed_vs_dynamic": _packed_vs_dynamic(results),
        "torch_threads": torch.get_num_threads(),
    }


def _packed_vs_dynamic(results: dict) -> dict:
    """``{"packed_<A>": {"vs": <first dynamic variant>, "logprob": dynamic / packed seconds, "train": ...,
    "train_per_repeat": [...]}}`` (repeats are interleaved, so per-repeat ratios pair runs taken side by side)."""
    dynamic = next((n for n in results if n.startswith("dynamic")), None)
    if dynamic is None:
        return {}
    d = results[dynamic]
    return {
        name: {
            "vs": dynamic,
            "logprob": d["logprob_s"] / r["logprob_s"],
            "train": d["train_s"] / r["train_s"],
            "train_per_repeat": [a / b for a, b in zip(d["train_s_all"], r["train_s_all"])],
            "logprob_per_repeat": [a / b for a, b in zip(d["logprob_s_all"], r["logprob_s_all"])],
        }
        for name, r in results.items()
        if name.startswith("packed_")
    }


def print_table(result: dict) -> None:
    pad = result["variants"]["padded"]
    print(
        f"\n{'variant':36s} {'logprob_s':>9s} {'train_s':>8s} {'lp_tokens':>9s} {'tr_tokens':>9s} {'tr_mbs':>6s} "
        f"{'x logprob':>9s} {'x train':>8s} {'loss':>11s} {'grad_norm':>10s} {'lp_diff':>8s}"
    )
    for name, r in result["variants"].items():
        ratio = result["ratios"].get(name, {"logprob": 1.0, "train": 1.0})
        print(
            f"{name:36s} {r['logprob_s']:9.2f} {r['train_s']:8.2f} {r['logprob_tokens']:9d} {r['train_tokens']:9d} "
            f"{r['train_micro_batches']:6d} {ratio['logprob']:9.3f} {ratio['train']:8.3f} {r['loss']:11.3e} "
            f"{r['grad_norm']:10.4e} {r['logprob_max_abs_diff']:8.1e}"
        )
    print(
        f"(padded loss {pad['loss']:.6e}, grad_norm {pad['grad_norm']:.6e}; rows {result['batch']['rows']}, "
        f"lengths {min(result['batch']['seq_lengths'])}-{max(result['batch']['seq_lengths'])})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default="configs/grpo_math_smollm2_135m.yaml")
    parser.add_argument("--rounds", nargs="+", type=int, default=[64, 1], help="sequence_length_round values")
    parser.add_argument("--repeats", type=int, default=1, help="timed rounds (after a two-row warm-up)")
    parser.add_argument("--packing", nargs="*", default=None, help="sequence packing algorithms to add as variants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--budgets",
        nargs="+",
        default=None,
        help="train_mb_tokens:logprob_mb_tokens pairs (default: the recipe's policy.dynamic_batching)",
    )
    args, extra = parser.parse_known_args(argv)
    from nemo_rl_spec.utils.config import load_config
    from nemo_rl_spec.utils.machine import write_bench_json

    cfg = load_config(args.config, extra)
    result = {
        "config": args.config,
        "overrides": extra,
        **run(cfg, args.rounds, args.repeats, args.seed, args.budgets, args.packing),
    }
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_bench_json(out, result)
    print(json.dumps({"out": str(out), "ratios": result["ratios"], "packed_vs_dynamic": result["packed_vs_dynamic"]}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
