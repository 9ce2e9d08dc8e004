"""Acceptance length of a trained megatron-core MTP layer served as vLLM's ``mtp`` drafter.

``python examples/bench_mtp_acceptance.py --runs-dir results/occ_modes_testbed_runs --modes detach occ+ref
--seeds 43 44 --ks 1 3 --out docs/results/occ/occ_mtp_acceptance_testbed.json [--config configs/grpo_math_testbed_mtp.yaml]``

For each finished OCC run ``<runs-dir>/<mode>_seed<seed>/`` that kept its final checkpoint (``examples/bench_occ.py``
with ``checkpointing.enabled=true``): the checkpoint's trunk and MTP layer are written as a MiMo checkpoint
(:func:`~nemo_rl_spec.models.mtp_export.write_mimo_checkpoint`, pure tensor renaming, TP = 1), then, in a fresh
process per k, an fp32 vLLM engine serves it with ``speculative_config={method: mtp, num_speculative_tokens: k}``
and generates the recipe's held-out validation prompts with the recipe's sampling. Acceptance length = 1 + accepted
/ drafting rounds from the engine's counters, plus per-position rates and the answers' accuracy (a sanity check);
``--greedy`` adds a T = 0 pass at k = 1, the quantity closest to the training metric ``train/mtp/acceptance``.
Writes ``--out`` (per run and k, per mode with bootstrap 90% intervals over seeds, the machine); the JSON is
rewritten after every run and ``--reuse`` keeps the runs already in it.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

from nemo_rl_spec.environments.math_env import score_response
from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.models.hf_weight_mapping import megatron_to_hf, model_spec_from_hf_config
from nemo_rl_spec.models.mtp_export import install_post_norm_mtp_input, megatron_mtp_to_mimo, write_mimo_checkpoint
from nemo_rl_spec.speculative.metrics import read_spec_decode_counters
from nemo_rl_spec.testing.checks import make_llm, run_isolated, shutdown
from nemo_rl_spec.utils.bench_runs import mean_and_interval, read_metrics
from nemo_rl_spec.utils.config import load_config
from nemo_rl_spec.utils.machine import write_bench_json

CKPT_FILE = "megatron_policy_tp0.pt"


def final_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """(step, policy folder) of the highest ``ckpt/step_<N>`` of a bench run, or None."""
    found = [
        (int(m.group(1)), p)
        for p in (run_dir / "ckpt").glob("step_*")
        if (m := re.fullmatch(r"step_(\d+)", p.name)) and (p / "policy" / CKPT_FILE).is_file()
    ]
    if not found:
        return None
    step, path = max(found)
    return step, path / "policy"


def export_mimo(policy_dir: Path, model_path: str, out_dir: Path) -> Path:
    """Write the checkpoint in ``policy_dir`` (megatron names, TP = 1) as a MiMo checkpoint (trunk + MTP layers) with
    the tokenizer of ``model_path``; returns ``out_dir``."""
    from nemo_rl_spec.models.policy.megatron_model import MTP_PREFIX, load_hf_config  # lazy: loads megatron-core

    state = torch.load(policy_dir / CKPT_FILE, map_location="cpu", weights_only=False)
    if state["tp_size"] != 1:
        raise ValueError(f"{policy_dir}: TP={state['tp_size']}; only TP = 1 checkpoints are exported here")
    model = state["model"]
    spec = model_spec_from_hf_config(load_hf_config(model_path))
    trunk = megatron_to_hf({n: t for n, t in model.items() if not n.startswith(MTP_PREFIX)}, spec)
    mtp = megatron_mtp_to_mimo(model, spec)
    if not mtp:
        raise ValueError(f"{policy_dir}: no mtp.layers.* in the checkpoint (mtp_num_layers = 0?)")
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return write_mimo_checkpoint(trunk, cfg, mtp, out_dir, tokenizer_dir=model_path)


def measure(
    mimo_dir: str,
    prompts: list[list[int]],
    k: int,
    temperature: float,
    max_tokens: int,
    n: int,
    max_model_len: int,
    greedy: bool = False,
    seed: int = 0,
) -> dict:
    """In this (fresh) process: serve ``mimo_dir`` with vLLM's ``mtp`` drafter at ``k`` and sample ``n`` answers
    per prompt; with ``greedy`` also one T = 0 answer per prompt. Returns the counters per decode."""
    from vllm import SamplingParams, TokensPrompt  # lazy: vllm is slow to import

    llm = make_llm(mimo_dir, {"method": "mtp", "num_speculative_tokens": k}, max_model_len=max_model_len, seed=seed)
    hooked = install_post_norm_mtp_input(llm)
    decodes = {f"k{k}": SamplingParams(temperature=temperature, max_tokens=max_tokens, n=n, seed=seed)}
    if greedy:
        decodes[f"k{k}_greedy"] = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    out = {}
    for name, params in decodes.items():
        before = read_spec_decode_counters(llm)
        t0 = time.perf_counter()
        results = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        gen_s = time.perf_counter() - t0
        c = read_spec_decode_counters(llm) - before
        tokens = sum(len(o.token_ids) for r in results for o in r.outputs)
        out[name] = {
            "acceptance_length": c.acceptance_length,
            "acceptance_rate": c.acceptance_rate,
            "rate_pos": [a / c.num_drafts for a in c.accepted_per_pos] if c.num_drafts else [],
            "drafts": c.num_drafts,
            "accepted": c.num_accepted_tokens,
            "generate_s": gen_s,
            "tokens": tokens,
            "mtp_layers_hooked": hooked,
            "temperature": params.temperature,
            "texts": [[o.text for o in r.outputs] for r in results],
        }
    shutdown(llm)
    return out


def heldout_prompts(config: str, overrides: list[str]) -> tuple[list[list[int]], list[str], dict]:
    """Chat-formatted validation prompts of the recipe, their answers and the recipe's sampling settings."""
    from transformers import AutoTokenizer  # lazy

    from nemo_rl_spec.algorithms.grpo_setup import chat_prompt_ids, load_datasets  # lazy: loads ray or megatron-core

    cfg = load_config(config, overrides)
    model_path = resolve_model(cfg.policy.model_name)
    _, val = load_datasets(cfg)
    tok = AutoTokenizer.from_pretrained(model_path)
    gen = cfg.policy.generation
    temperature = gen.temperature if cfg.grpo.val_temperature is None else cfg.grpo.val_temperature
    return (
        chat_prompt_ids(cfg, tok, val),
        [p["answer"] for p in val],
        {
            "model_path": model_path,
            "temperature": float(temperature),
            "max_tokens": int(gen.max_new_tokens),
            "n": int(cfg.grpo.val_num_generations),
            "max_model_len": int(gen.vllm_cfg.max_model_len),
            "num_prompts": len(val),
        },
    )


def summarise(runs: dict, ks: list[str]) -> dict:
    out = {}
    for mode, seeds in runs.items():
        out[mode] = {}
        for key in ks + ["train_mtp_acceptance"]:
            per_seed = {
                s: (r[key]["acceptance_length"] if isinstance(r.get(key), dict) else r.get(key))
                for s, r in seeds.items()
                if key in r
            }
            out[mode][key] = {"per_seed": per_seed, **mean_and_interval(list(per_seed.values()))}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default="configs/grpo_math_testbed_mtp.yaml")
    parser.add_argument("--modes", nargs="+", default=["detach", "ce", "policy", "occ+ref"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[43, 44])
    parser.add_argument("--ks", nargs="+", type=int, default=[1, 3])
    parser.add_argument("--greedy", action="store_true", help="also decode greedily with the k = 1 engine")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reuse", action="store_true")
    args, overrides = parser.parse_known_args(argv)

    out = Path(args.out)
    result = json.loads(out.read_text()) if args.reuse and out.is_file() else {}
    result.update({"config": args.config, "overrides": overrides, "runs": result.get("runs", {})})
    prompts, answers, sampling = heldout_prompts(args.config, overrides)
    result["sampling"] = sampling
    print(f"{len(prompts)} held-out prompts, {sampling}", flush=True)
    keys = [f"k{k}" for k in args.ks] + (["k1_greedy"] if args.greedy and 1 in args.ks else [])
    for mode in args.modes:
        for seed in args.seeds:
            run_dir = Path(args.runs_dir) / f"{mode}_seed{seed}"
            done = result["runs"].get(mode, {}).get(str(seed), {})
            if all(k in done for k in keys):
                continue
            ckpt = final_checkpoint(run_dir)
            if ckpt is None:
                print(f"{mode} seed {seed}: no checkpoint in {run_dir / 'ckpt'}, skipped", flush=True)
                continue
            step, policy_dir = ckpt
            mimo = export_mimo(policy_dir, sampling["model_path"], run_dir / f"mimo_step{step}")
            records = read_metrics(run_dir / "logs" / "metrics.jsonl")
            train_acc = [r["train/mtp/acceptance"] for r in records if "train/mtp/acceptance" in r]
            rec = {"step": step, "train_mtp_acceptance": train_acc[-1] if train_acc else None}
            for k in args.ks:
                t0 = time.perf_counter()
                got = run_isolated(
                    measure,
                    str(mimo),
                    prompts,
                    k,
                    sampling["temperature"],
                    sampling["max_tokens"],
                    sampling["n"],
                    sampling["max_model_len"],
                    greedy=args.greedy and k == 1,
                    threads=args.threads,
                )
                for decode in got.values():  # sanity: the served policy's accuracy (cf. the run's validation)
                    texts = decode.pop("texts")
                    decode["accuracy"] = sum(
                        score_response(t, a, None) for ts, a in zip(texts, answers) for t in ts
                    ) / sum(len(ts) for ts in texts)
                rec.update(got)
                print(
                    f"{mode} seed {seed} step {step} k={k}: acceptance length "
                    f"{rec[f'k{k}']['acceptance_length']:.3f} (pos rates "
                    f"{[round(x, 3) for x in rec[f'k{k}']['rate_pos']]}), "
                    + (f"greedy {rec['k1_greedy']['acceptance_length']:.3f}, " if f"k{k}_greedy" in rec else "")
                    + f"answers' accuracy {rec[f'k{k}']['accuracy']:.3f}, train/mtp/acceptance {rec['train_mtp_acceptance']}; {time.perf_counter() - t0:.0f} s",
                    flush=True,
                )
            result["runs"].setdefault(mode, {})[str(seed)] = rec
            result["per_mode"] = summarise(result["runs"], keys)
            out.parent.mkdir(parents=True, exist_ok=True)
            write_bench_json(out, result)
    result["per_mode"] = summarise(result["runs"], keys)
    write_bench_json(out, result)
    for mode, st in result["per_mode"].items():
        print(mode, {k: (v["mean"], v["interval90"]) for k, v in st.items()}, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
