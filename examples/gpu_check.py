"""GPU check of the Megatron policy worker: one GPU, tiny model, fp32 and bf16.

Two phases, driven by ``scripts/gpu_check.sh``:

``prepare --dir D`` (here, on CPU): copy the tiny-llama checkpoint into ``D/model``, build the fixed batch of
``D/batch.pt`` and write the CPU worker's fp32 log-probs of it and its metrics after one train step to
``D/cpu_reference.pt``.

``run --dir D`` (on the GPU machine, no Ray, no vLLM): build the worker in one process (world size 1, NCCL) in fp32
and in bf16, and check, for each:

- fp32: log-probs equal the CPU reference within 1e-4 (max abs over response tokens, nats); one train step gives a
  finite loss and grad norm, and its loss equals the CPU step's within 1e-4 relative;
- bf16: log-probs finite and within 0.1 nats of the fp32 reference on average; one train step finite.

Prints one table line per check and writes ``$OUT/gpu_check.json`` (or ``D/gpu_check.json``); exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "grpo_math_tiny.yaml"


def _policy_cfg(precision: str):
    from nemo_rl_spec.utils.config import load_config

    cfg = load_config(RECIPE, [f"policy.precision={precision}", "policy.model_name=tiny-llama"])
    return cfg.policy, cfg.loss_fn


def _worker(model_dir: str, precision: str):
    from nemo_rl_spec.algorithms.loss import ClippedPGLossFn
    from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker

    policy_cfg, loss_cfg = _policy_cfg(precision)
    return MegatronPolicyWorker(policy_cfg, ClippedPGLossFn(loss_cfg.model_dump()), model_dir, seed=0)


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    """4 rows of 24 tokens (prompt 8), random ids and advantages from a fixed generator."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4, 24), generator=gen)
    lengths = torch.tensor([24, 20, 17, 24])
    token_mask = torch.zeros(4, 24)
    for b, n in enumerate(lengths.tolist()):
        token_mask[b, 8:n] = 1.0
    return {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.ones(4),
        "advantages": torch.tensor([1.0, -0.5, 0.8, -1.3]),
        "generation_logprobs": torch.zeros(4, 24),
    }


def prepare(out: Path) -> None:
    from nemo_rl_spec.models.hf_assets import resolve_model

    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    if model.exists():
        shutil.rmtree(model)
    shutil.copytree(resolve_model("tiny-llama"), model)
    worker = _worker(str(model), "float32")
    data = _batch(worker.get_model_config()["vocab_size"])
    data["prev_logprobs"] = worker.get_logprobs(data)
    train = worker.train(data)
    torch.save(data, out / "batch.pt")
    torch.save({"logprobs": data["prev_logprobs"], "train": train}, out / "cpu_reference.pt")
    print(f"prepared {out}: model, batch.pt, cpu_reference.pt (CPU loss {train['loss']:.6g})")


def _check_precision(model_dir: str, precision: str, data: dict, ref: dict) -> list[dict]:
    start = time.perf_counter()
    worker = _worker(model_dir, precision)
    logprobs = worker.get_logprobs(data).float().cpu()
    mask = data["token_mask"].bool()
    diff = (logprobs - ref["logprobs"]).abs()[mask]
    train = worker.train({**data, "prev_logprobs": logprobs})
    finite = all(torch.isfinite(torch.tensor(float(train[k]))) for k in ("loss", "grad_norm"))
    rows = [
        {
            "check": f"{precision} log-probs vs CPU fp32",
            "value": float(diff.max()),
            "limit": 1e-4 if precision == "float32" else None,
            "ok": bool(diff.max() <= 1e-4) if precision == "float32" else bool(diff.mean() <= 0.1),
        },
        {"check": f"{precision} train step finite", "value": float(train["loss"]), "limit": None, "ok": finite},
    ]
    if precision == "float32":
        rel = abs(train["loss"] - ref["train"]["loss"]) / max(abs(ref["train"]["loss"]), 1e-12)
        rows.append({"check": "float32 train loss vs CPU", "value": rel, "limit": 1e-4, "ok": rel <= 1e-4})
    rows.append(
        {"check": f"{precision} worker seconds", "value": time.perf_counter() - start, "limit": None, "ok": True}
    )
    return rows


def run(directory: Path) -> int:
    if not torch.cuda.is_available():
        print("error: no CUDA device visible", file=sys.stderr)
        return 2
    data, ref = torch.load(directory / "batch.pt"), torch.load(directory / "cpu_reference.pt")
    data = {k: v for k, v in data.items() if k != "prev_logprobs"}
    rows = [{"check": "device", "value": torch.cuda.get_device_name(0), "limit": None, "ok": True}]
    for precision in ("float32", "bfloat16"):
        rows += _check_precision(str(directory / "model"), precision, data, ref)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
    for r in rows:
        print(f"{r['check']:<36} {r['value']!s:<24} limit={r['limit']!s:<8} {'ok' if r['ok'] else 'FAIL'}")
    out = Path(os.environ.get("OUT", directory)) / "gpu_check.json"
    out.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=["prepare", "run"])
    parser.add_argument("--dir", default=str(ROOT / ".gpu_check"))
    args = parser.parse_args(argv)
    if args.phase == "prepare":
        prepare(Path(args.dir))
        return 0
    return run(Path(args.dir))


if __name__ == "__main__":
    sys.exit(main())
