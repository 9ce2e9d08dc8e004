"""Trainer against engine log-probs under each sampling option the schema accepts, measured on a recipe in fp32.

``python examples/bench_sampling_agreement.py [--out docs/results/sampling_agreement/sampling_agreement.json]
[--config RECIPE] [--steps 1] [--work-dir DIR] [--reuse] [key=value ...]``

The engine samples from ``softmax(filter(logits / T))`` and returns each sampled token's log-prob under it
(``processed_logprobs``); the trainer's previous log-probs must be of that same distribution, or every importance
ratio is biased. Per option (:data:`OPTIONS`: plain sampling, temperature, top-p, top-k, both, stop strings), one
``examples/run_grpo.py`` subprocess on the recipe with ``policy.precision=float32`` (trainer and engine), ``--steps``
steps, no validation before or between steps and no checkpoints. Per option the table gives, averaged over the
steps: ``train/token_mult_prob_error`` (NeMo-RL's mean of exp|logp_trainer - logp_engine| over response tokens; 1.0
is perfect), ``mult_err - 1``, an upper bound on the mean |delta logp| in nats, against the goal :data:`GOAL_NATS`,
and ``train/importance_ratio_max_abs_dev`` (max |exp(d) - 1|). A CPU measurement (the machine goes into the JSON
under ``machine``). Writes ``--out`` (every run's per-step values, the summary, the commands) and prints the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.utils.bench_runs import read_metrics, result_paths, run_grpo_subprocess
from nemo_rl_spec.utils.config import load_config
from nemo_rl_spec.utils.machine import write_bench_json

#: (name, overrides) of the sampling options measured; ``plain`` is the reference setting. The ``spec_`` options
#: add speculative decoding (:func:`options`): the recipe's own model as its draft, k = 3.
OPTIONS: list[tuple[str, list[str]]] = [
    ("plain", []),
    ("temperature_0.7", ["policy.generation.temperature=0.7"]),
    ("top_p_0.8", ["policy.generation.top_p=0.8"]),
    ("top_k_5", ["policy.generation.top_k=5"]),
    ("top_k_5_top_p_0.8", ["policy.generation.top_k=5", "policy.generation.top_p=0.8"]),
    ("temperature_0.7_top_p_0.9", ["policy.generation.temperature=0.7", "policy.generation.top_p=0.9"]),
    ("stop_strings", ["policy.generation.stop_strings=[' ','.']"]),
]
SPEC_OPTIONS = ["plain", "top_p_0.8", "temperature_0.7_top_p_0.9"]


def options(model: str) -> list[tuple[str, list[str]]]:
    """:data:`OPTIONS`, then each of :data:`SPEC_OPTIONS` again with speculative decoding, ``model`` (a path) as
    the draft model (top-k under speculation is refused by the schema, so it is not among them)."""
    spec = (
        "+policy.generation.vllm_kwargs.speculative_config={method: draft_model, model: %s, num_speculative_tokens: 3}"
    )
    by_name = dict(OPTIONS)
    return OPTIONS + [(f"spec_{n}", [*by_name[n], spec % model]) for n in SPEC_OPTIONS]


#: the goal on the mean |logp_trainer - logp_engine| per response token, nats (the plain-decoding bound)
GOAL_NATS = 1e-3
METRICS = [
    ("token_mult_prob_error", "train/token_mult_prob_error"),
    ("importance_ratio_max_abs_dev", "train/importance_ratio_max_abs_dev"),
]


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/results/sampling_agreement/sampling_agreement.json")
    p.add_argument("--config", default="configs/grpo_math_tiny.yaml")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--work-dir", default="results/sampling_agreement_runs", help="run directories")
    p.add_argument("--reuse", action="store_true", help="keep runs whose run.json records return code 0")
    p.add_argument("--only", nargs="*", default=None, help="option names to run (default: all of OPTIONS)")
    return p.parse_known_args(argv)


def run_overrides(steps: int, option: list[str], extra: list[str]) -> list[str]:
    """One run's overrides: fp32 trainer and engine, ``steps`` steps, no validation before / between, no checkpoints,
    the option's keys, then ``extra``."""
    return [
        f"grpo.max_num_steps={steps}",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "checkpointing.enabled=false",
        "policy.precision=float32",
        "policy.generation.vllm_cfg.precision=float32",
        *option,
        *extra,
    ]


def summarize(records: list[dict]) -> dict:
    """Means over a run's steps of :data:`METRICS`, and ``mean_abs_logp_bound`` = token_mult_prob_error - 1 (nats,
    an upper bound on the mean |delta logp|) with ``meets_goal`` against :data:`GOAL_NATS`. Empty without steps."""
    steps = [r for r in records if METRICS[0][1] in r]
    if not steps:
        return {}
    out = {name: statistics.fmean(float(r[key]) for r in steps) for name, key in METRICS}
    out["mean_abs_logp_bound"] = out["token_mult_prob_error"] - 1.0
    out["meets_goal"] = out["mean_abs_logp_bound"] < GOAL_NATS
    return out


def table(rows: dict[str, dict]) -> str:
    head = f"{'option':<32} {'mult_prob_err':>14} {'|dlogp| bound':>14} {'max |ratio-1|':>14}  goal <{GOAL_NATS:g}"
    lines = [head, "-" * len(head)]
    for name, row in rows.items():
        s = row.get("summary") or {}
        if not s:
            lines.append(f"{name:<32} failed (returncode {row['run']['returncode']})")
            continue
        lines.append(
            f"{name:<32} {s['token_mult_prob_error']:>14.7f} {s['mean_abs_logp_bound']:>14.2e} "
            f"{s['importance_ratio_max_abs_dev']:>14.2e}  {'yes' if s['meets_goal'] else 'NO'}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    out, work = result_paths(args.out, args.work_dir)
    model = resolve_model(load_config(args.config, extra).policy.model_name)
    chosen = [(n, o) for n, o in options(model) if args.only is None or n in args.only]
    rows: dict[str, dict] = {}
    for name, option in chosen:
        run_dir = work / name
        overrides = run_overrides(args.steps, option, extra)
        info = run_grpo_subprocess(args.config, overrides, run_dir, label=name, timeout_s=1800, reuse=args.reuse)
        records = read_metrics(run_dir / "logs" / "metrics.jsonl")
        rows[name] = {"overrides": overrides, "run": info, "steps": records, "summary": summarize(records)}
        write_bench_json(out, {"config": args.config, "goal_nats": GOAL_NATS, "options": rows})
    print(table(rows))
    print(f"wrote {out}")
    return 0 if all(r["summary"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
