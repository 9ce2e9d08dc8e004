"""Held-out accuracy of a testbed build against SFT steps: how the testbed recipe (nemo_rl_spec/models/testbed.py)
was chosen.

``python examples/testbed_sft_sweep.py --out results/testbed_sweep.jsonl --at 200,350,500,600 [field=value ...]``

Trains the testbed from scratch with :data:`TESTBED` changed by the ``field=value`` arguments (values parsed as
JSON when they parse, e.g. ``lr=2e-3 sft_steps=300 direct_steps=0``), and after each step in ``--at`` (counted over
both SFT stages from 1) samples answers to ``--problems`` held-out chain sums (reasoning-gym seed 100000, the testbed
recipe's validation seed) with HF ``generate``: one greedy and ``--n`` at T = 1. Scored with the math environment's
``score_response``. Per evaluation it prints and appends one JSON line: accuracy, the share of direct answers
(responses that start with ``\\boxed``), accuracy of chains and of direct answers, share of prompts neither always
nor never solved at T = 1, and (in the file only) the machine (:func:`~nemo_rl_spec.utils.machine.machine_info`).
``--save DIR`` writes the final model as the build does (``testbed.save_testbed``: an
HF checkpoint and ``sft.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from nemo_rl_spec.data.datasets import parse_generator
from nemo_rl_spec.data.prompts import format_prompt
from nemo_rl_spec.environments.math_env import score_response
from nemo_rl_spec.models import testbed as tb
from nemo_rl_spec.models.testbed import TESTBED
from nemo_rl_spec.utils.machine import with_machine


def parse_overrides(pairs: list[str]) -> dict:
    """``["lr=1e-3", "model.hidden_size=128"]`` -> ``{"lr": 0.001, "model": {"hidden_size": 128}}``.

    Raises:
        SystemExit: an argument without ``=`` or a field :class:`TestbedRecipe` does not have (message names it)."""
    names = {f.name for f in dataclasses.fields(TESTBED)}

    out: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            sys.exit(f"error: expected field=value, got {pair!r}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        head, _, sub = key.partition(".")
        if head not in names or (sub and head != "model"):
            sys.exit(f"error: TestbedRecipe has no field {key!r}")
        if sub:
            out.setdefault("model", dict(TESTBED.model))[sub] = value
        else:
            out[head] = value
    return out


def eval_steps(spec: str, recipe) -> set[int]:
    """``"200,350"`` -> ``{200, 350}``, checked against the recipe's SFT steps (stage 1 + stage 2).

    Raises:
        SystemExit: a value that is not a positive integer, or beyond the last SFT step."""
    total = recipe.sft_steps + recipe.stage2_steps
    try:
        steps = {int(x) for x in spec.split(",")}
    except ValueError:
        sys.exit(f"error: --at expects comma-separated step numbers, got {spec!r}")
    bad = sorted(x for x in steps if not 1 <= x <= total)
    if bad:
        sys.exit(f"error: --at {bad} outside the recipe's SFT steps 1..{total}")
    return steps


def sample(model, tokenizer, prompts: list[list[int]], n: int, greedy: bool, seed: int) -> list[str]:
    """``n`` answers per prompt (prompt-major), left-padded batch, at most 48 new tokens, T = 1 or greedy."""
    import torch  # lazy: this module imports without torch

    ids = [p for p in prompts for _ in range(n)]
    width = max(map(len, ids))
    x = torch.full((len(ids), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(x)
    for i, p in enumerate(ids):
        x[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=mask,
            max_new_tokens=48,
            do_sample=not greedy,
            temperature=None if greedy else 1.0,
            top_p=1.0,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    return [tokenizer.decode(row[width:], skip_special_tokens=True) for row in out]


def score(texts: list[str], answers: list[str], n: int) -> dict[str, float]:
    """Accuracy, share of direct answers, accuracy of chains / direct answers, share of mixed prompts."""
    right = [score_response(t, answers[i // n], None) for i, t in enumerate(texts)]
    direct = [t.strip().startswith("\\boxed") for t in texts]
    n_direct = sum(direct)
    per_prompt = [sum(right[i * n : (i + 1) * n]) / n for i in range(len(answers))]
    return {
        "accuracy": sum(right) / len(right),
        "p_direct": n_direct / len(right),
        "chain_accuracy": sum(r for r, d in zip(right, direct) if not d) / max(1, len(right) - n_direct),
        "direct_accuracy": sum(r for r, d in zip(right, direct) if d) / max(1, n_direct),
        "share_mixed": sum(0 < p < 1 for p in per_prompt) / len(per_prompt),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSONL file the evaluations are appended to")
    parser.add_argument("--at", required=True, help="evaluate after these SFT steps (comma-separated, from 1)")
    parser.add_argument("--problems", type=int, default=96)
    parser.add_argument("--n", type=int, default=4, help="T = 1 answers per problem")
    parser.add_argument("--save", default=None, help="write the final model here")
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)

    import reasoning_gym  # lazy: reasoning-gym is slow to import

    recipe = dataclasses.replace(tb.TESTBED, **overrides)
    at = eval_steps(args.at, recipe)
    name, settings = parse_generator(recipe.generator)
    problems = list(reasoning_gym.create_dataset(name, size=args.problems, seed=100000, **settings))
    answers = [p["answer"] for p in problems]
    t0 = time.time()

    def on_step(step: int, model, tok) -> None:
        if step + 1 not in at:
            return
        model.eval()
        prompts = [format_prompt(tok, tb.SYSTEM_PROMPT, p["question"]) for p in problems]
        row = {"step": step + 1, "sft_s": round(time.time() - t0, 1), "overrides": overrides}
        for label, n, greedy in (("greedy", 1, True), ("t1", args.n, False)):
            for key, value in score(sample(model, tok, prompts, n, greedy, step), answers, n).items():
                row[f"{label}_{key}"] = round(value, 4)
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(with_machine(row)) + "\n")

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    model, tokenizer, losses = tb.train_testbed(recipe, progress=False, on_step=on_step)
    if args.save:
        tb.save_testbed(Path(args.save), model, tokenizer, recipe, losses)
    print(f"{len(losses)} SFT steps in {time.time() - t0:.0f} s, final loss {losses[-1]:.4f}")
    return 0
