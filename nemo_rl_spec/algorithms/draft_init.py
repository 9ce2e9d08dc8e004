"""Resumable offline EAGLE-3 draft initialisation at scale (``examples/init_draft.py``, ``make draft``).

Three stages under ``<out>/work/``, each resumable after an interruption:

1. **Samples** (``samples.jsonl``): the policy's own responses to in-domain prompts at the recipe's temperature,
   ``samples_per_prompt`` per prompt, appended one vLLM call at a time (a rerun skips the calls already written).
2. **Policy outputs** (in memory, rebuilt on resume): aux hidden states and draft-vocabulary log-probs of every
   sequence (:func:`~nemo_rl_spec.speculative.offline.build_policy_cache`).
3. **Training** (``train_state.pt``, written atomically every ``save_every`` steps): the full training-time-test
   unroll, with the estimated acceptance length on held-out prompts every ``eval_every`` steps (the
   acceptance-vs-steps curve); optional extra heads on the first N sequences give the acceptance-vs-data curve.

The draft vocabulary is sized by measurement: the smallest number of most-frequent response tokens covering
``vocab_coverage`` of the sampled response tokens (+ EOS), unless a size is given.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from nemo_rl_spec.models.generation.vllm_worker import VllmGenerationWorker
from nemo_rl_spec.speculative.acceptance import expected_acceptance
from nemo_rl_spec.speculative.draft_trainer import DraftTrainer
from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead, draft_vocab_from_counts
from nemo_rl_spec.speculative.offline import PolicyOutputCache, pad_sequences, response_token_counts

SAMPLES_FILE = "samples.jsonl"
STATE_FILE = "train_state.pt"


@dataclass
class Samples:
    """Sampled sequences: ``prompt_index[i]`` into the prompt list, ``sequences[i]`` = prompt + response ids."""

    prompt_index: list[int]
    sequences: list[list[int]]
    prompt_lengths: list[int]


def sample_to_file(
    gen_cfg: dict[str, Any],
    model_path: str,
    prompts: Sequence[Sequence[int]],
    samples_per_prompt: int,
    seed: int,
    max_new_tokens: int,
    prompts_per_call: int,
    path: str,
) -> int:
    """Stage 1: sample ``samples_per_prompt`` responses per prompt with the rollout engine
    (:class:`VllmGenerationWorker`, no speculation), ``prompts_per_call`` prompts per ``generate`` call with seed
    ``seed + call``, appending one JSON line per call to ``path``; calls already in the file are skipped.

    Runs in the calling process (wrap with ``checks.run_isolated`` for a fresh engine process).
    Returns the number of calls made now.
    """
    done = {json.loads(line)["call"] for line in Path(path).read_text().splitlines()} if Path(path).exists() else set()
    calls = [c for c in range(-(-len(prompts) // prompts_per_call)) if c not in done]
    if not calls:
        return 0
    worker = VllmGenerationWorker(gen_cfg, model_path, seed)
    try:
        bar = tqdm(
            total=len(prompts) * samples_per_prompt,
            initial=len(done) * prompts_per_call * samples_per_prompt,
            desc="sampling",
            unit="seq",
        )
        for c in calls:
            lo = c * prompts_per_call
            chunk = [list(p) for p in prompts[lo : lo + prompts_per_call]]
            out = worker.generate(
                {"prompt_token_ids": chunk}, n=samples_per_prompt, seed=seed + c, max_new_tokens=max_new_tokens
            )
            rows = []
            for r in range(out["output_ids"].shape[0]):
                p, e = int(out["input_lengths"][r]), int(out["unpadded_sequence_lengths"][r])
                rows.append([lo + r // samples_per_prompt, out["output_ids"][r, :e].tolist(), p])
            with open(path, "a") as fh:
                fh.write(json.dumps({"call": c, "rows": rows}) + "\n")
            bar.update(len(rows))
        bar.close()
    finally:
        worker.shutdown()
    return len(calls)


def read_samples(path: str | Path) -> Samples:
    """Stage-1 file -> :class:`Samples` in (call, row) order. Raises FileNotFoundError naming the file."""
    lines = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    rows = [r for line in sorted(lines, key=lambda d: d["call"]) for r in line["rows"]]
    return Samples([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def measured_vocab(
    sequences: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
    vocab_size: int,
    eos_ids: Sequence[int],
    coverage: float,
    size: int | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The draft vocabulary (sorted target ids) and its measured coverage of the response tokens of
    ``sequences`` (prompt + response ids; responses start at ``prompt_lengths``).

    ``size`` given: that many ids (EOS first, then the most frequent); else the smallest count of most-frequent
    ids reaching ``coverage``, plus EOS.
    Returns (ids [Vd] int64, {"draft_vocab_size", "coverage", "distinct_response_tokens"}).
    """
    counts = response_token_counts(sequences, prompt_lengths, vocab_size)
    ordered = counts.sort(descending=True).values
    cum = ordered.cumsum(0) / ordered.sum()
    n = size if size else int((cum < coverage).sum()) + 1 + len(eos_ids)
    n = max(min(n, vocab_size), 1)
    vocab = draft_vocab_from_counts(counts, n, eos_ids)
    covered = float(counts[vocab].sum() / counts.sum())
    return vocab, {"draft_vocab_size": n, "coverage": covered, "distinct_response_tokens": int((counts > 0).sum())}


def padded_batch(cache: PolicyOutputCache, samples: Samples, rows: Sequence[int]):
    """(aux [B, S, n_aux * H], log-probs [B, S, Vd], input_ids [B, S], response mask [B, S]) of ``rows``."""
    aux, target = cache.batch(rows)
    ids, mask = pad_sequences([samples.sequences[r] for r in rows], [samples.prompt_lengths[r] for r in rows])
    return aux, target, ids[:, : aux.shape[1]], mask[:, : aux.shape[1]]


def evaluate(
    head: Eagle3DraftHead,
    cache: PolicyOutputCache,
    samples: Samples,
    rows: Sequence[int],
    num_steps: int,
    batch_size: int = 16,
) -> dict[str, float]:
    """Chain-weighted mean of :func:`expected_acceptance` over ``rows`` at the cache's temperature."""
    sums: dict[str, float] = {}
    total = 0.0
    for lo in range(0, len(rows), batch_size):
        part = list(rows[lo : lo + batch_size])
        aux, _, ids, mask = padded_batch(cache, samples, part)
        res = expected_acceptance(head, aux, ids, mask, cache.tempered_logprobs(part), cache.temperature, num_steps)
        n = res.pop("chains")
        total += n
        for k, v in res.items():
            sums[k] = sums.get(k, 0.0) + v * n
    return {"chains": total, **{k: v / max(total, 1.0) for k, v in sums.items()}}


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """Row order of one epoch: a permutation of range(n) from (seed, epoch) alone, so a resumed run draws the
    same batches."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()


def batch_rows(train_rows: Sequence[int], batch_size: int, seed: int, step: int) -> list[int]:
    """Training rows of optimizer step ``step`` (epochs of ``train_rows`` without replacement)."""
    per_epoch = max(len(train_rows) // batch_size, 1)
    epoch, k = divmod(step, per_epoch)
    order = epoch_order(len(train_rows), seed, epoch)
    return [train_rows[i] for i in order[k * batch_size : (k + 1) * batch_size]]


def train(
    trainer: DraftTrainer,
    cache: PolicyOutputCache,
    samples: Samples,
    train_rows: Sequence[int],
    eval_rows: Sequence[int],
    steps: int,
    batch_size: int,
    seed: int,
    eval_every: int,
    state: dict[str, Any],
    save: Callable[[dict[str, Any]], None] | None = None,
    save_every: int = 0,
    desc: str = "training",
) -> dict[str, Any]:
    """Stage 3: train from ``state["step"]`` to ``steps``; ``state`` holds ``step``, ``history`` (per-step
    metrics) and ``curve`` (held-out estimates every ``eval_every`` steps and at the end). ``save(state)`` is
    called every ``save_every`` steps and at the end. Returns ``state``."""
    bar = tqdm(total=steps, initial=state["step"], desc=desc, unit="step")
    while state["step"] < steps:
        rows = batch_rows(train_rows, batch_size, seed, state["step"])
        aux, target, ids, mask = padded_batch(cache, samples, rows)
        metrics = trainer.step(aux, ids, mask, target)
        state["step"] += 1
        state["history"].append(metrics)
        bar.update(1)
        bar.set_postfix(loss=f"{metrics['train/draft_loss']:.3f}")
        if state["step"] % eval_every == 0 or state["step"] == steps:
            point = {"step": state["step"], **evaluate(trainer.head, cache, samples, eval_rows, trainer.ttt_steps)}
            state["curve"].append(point)
            bar.write(
                f"step {state['step']}: held-out acceptance length (k={trainer.ttt_steps}) greedy "
                f"{point['greedy/acceptance_length']:.3f}, probabilistic "
                f"{point['probabilistic/acceptance_length']:.3f}"
            )
        if save is not None and (state["step"] == steps or (save_every and state["step"] % save_every == 0)):
            save(state)
    bar.close()
    return state


def save_state(path: str | Path, trainer: DraftTrainer, state: dict[str, Any]) -> None:
    """Write ``{"trainer", "step", "history", "curve"}`` atomically (a temp file renamed over ``path``)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"trainer": trainer.state_dict(), **state}, tmp)
    os.replace(tmp, path)


def load_state(path: str | Path, trainer: DraftTrainer) -> dict[str, Any]:
    """Restore a :func:`save_state` file into ``trainer``; a missing file gives a fresh state."""
    path = Path(path)
    if not path.is_file():
        return {"step": 0, "history": [], "curve": []}
    saved = torch.load(path, weights_only=False)
    trainer.load_state_dict(saved.pop("trainer"))
    return saved


def plot_curves(summary: dict[str, Any], path: str | Path) -> None:
    """Two panels: held-out estimated acceptance length vs optimizer steps, and vs training sequences (greedy and
    probabilistic drafting, with the greedy oracle), from an ``init_draft.json`` summary. Writes a PNG."""
    import matplotlib  # lazy: matplotlib only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib only for the plot

    k = summary["ttt_steps"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, points, x_key, x_label in (
        (axes[0], summary["acceptance_vs_steps"], "step", "draft optimizer steps"),
        (axes[1], summary["acceptance_vs_data"], "train_sequences", "training sequences (policy samples)"),
    ):
        xs = [p[x_key] for p in points]
        for key, label in (
            ("probabilistic", "probabilistic drafting"),
            ("greedy", "greedy drafting"),
            ("oracle_greedy", "greedy oracle (target's mode)"),
        ):
            ax.plot(
                xs,
                [p[f"{key}/acceptance_length"] for p in points],
                marker="o",
                label=label,
                linestyle="--" if key.startswith("oracle") else "-",
            )
        ax.set_xlabel(x_label)
        ax.set_ylabel(f"held-out acceptance length, k = {k}")
        ax.grid(alpha=0.3)
    axes[1].set_xscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{summary['model']}, T = {summary['temperature']}: estimated acceptance (teacher-forced)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
