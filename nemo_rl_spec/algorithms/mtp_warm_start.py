"""Driver of the MTP warm start (``policy.megatron_cfg.mtp_warm_start``; docs/guides/occ.md): before GRPO step 0, sample
the policy's own responses to a seeded subset of the training prompts, train the MTP layers on them with CE (trunk
frozen, :mod:`nemo_rl_spec.models.policy.mtp_warm_start`) and cache the result.

Samples: the first ``num_prompts`` prompts of a permutation of the training pool seeded with ``grpo.seed``, the last
``round(holdout_fraction * num_prompts)`` of them held out for the reported CE / acceptance (at least one prompt is
kept for training); ``samples_per_prompt`` responses each from the vLLM engines at the recipe's sampling settings.
Cache: ``<cache_dir>/<key>.pt`` with ``{"states": [MTP state of TP rank t], "metrics", "key_fields"}``; ``key`` is
the sha256 of the JSON of :func:`cache_key_fields` (model files, MTP layers, seed, sampling, data, TP size, precision,
the MTP optimizer's settings and every warm-start key except ``cache_dir``). A hit loads the weights and reuses the
cached metrics; entries are written atomically and kept per TP rank (a cache entry serves any DP size). When vLLM
drafts with the policy's MTP block (``speculative_config.method: mtp``) the engines are refit at version 0
afterwards, so the drafter starts from the warm weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nemo_rl_spec.algorithms.rollouts import response_mask
from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.utils.config_schema import MasterConfig, MTPWarmStartConfig

if TYPE_CHECKING:
    from nemo_rl_spec.algorithms.grpo_setup import GRPOSetup

CACHE_FORMAT = 1  # bump when the warm start's computation changes, so old cache entries are not reused


def warm_start_config(cfg: MasterConfig) -> MTPWarmStartConfig | None:
    """``policy.megatron_cfg.mtp_warm_start`` when set and enabled (the schema requires MTP layers then), else None."""
    ws = cfg.policy.megatron_cfg.mtp_warm_start
    return ws if ws is not None and ws.enabled else None


def model_files_sha256(model_dir: str | Path) -> str:
    """sha256 over every file under ``model_dir`` (sorted relative paths, each path and its bytes)."""
    digest, root = hashlib.sha256(), Path(model_dir)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def cache_key_fields(cfg: MasterConfig, model_dir: str | Path) -> dict[str, Any]:
    """Everything the warm-started MTP weights depend on, as JSON-able values (see the module docstring)."""
    mcfg, gen = cfg.policy.megatron_cfg, cfg.policy.generation
    opt = mcfg.optimizer
    return {
        "format": CACHE_FORMAT,
        "model_sha256": model_files_sha256(model_dir),
        "mtp_num_layers": mcfg.mtp_num_layers,
        # only when on, so the keys of caches written before the option existed stay valid
        **({"mtp_use_repeated_layer": True} if mcfg.mtp_use_repeated_layer else {}),
        "seed": cfg.grpo.seed,
        "sampling": {
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "top_k": gen.top_k,
            "max_new_tokens": gen.max_new_tokens,
            "stop_token_ids": gen.stop_token_ids,
            "stop_strings": gen.stop_strings,
        },
        "data": cfg.data.model_dump(mode="json"),
        "chat_template_kwargs": cfg.policy.tokenizer.chat_template_kwargs,
        "tensor_model_parallel_size": mcfg.tensor_model_parallel_size,
        "precision": [cfg.policy.precision, cfg.policy.engine_precision],
        "mtp_optimizer": [opt.adam_beta1, opt.adam_beta2, opt.adam_eps, opt.weight_decay, opt.clip_grad],
        "warm_start": mcfg.mtp_warm_start.model_dump(mode="json", exclude={"cache_dir"}),
    }


def cache_key(fields: dict[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of ``fields`` (sorted keys)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def save_cache(path: str | Path, entry: dict[str, Any]) -> None:
    """Write ``entry`` to ``path`` atomically (``torch.save`` to a temporary file beside it, then ``os.replace``), so a
    reader sees the old file or the whole new one; creates the directory."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # unique across hosts
    os.close(fd)
    tmp = Path(name)
    try:
        torch.save(entry, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_cache(path: str | Path, key_fields: str) -> dict[str, Any] | None:
    """The entry at ``path`` when it exists and was written for ``key_fields`` (the JSON of the key's fields), else
    None; an unreadable entry is warned about and treated as missing (it is then recomputed and overwritten)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        entry = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - a damaged cache entry must not stop the run
        warnings.warn(f"MTP warm-start cache {path} is unreadable ({exc}); recomputing it", stacklevel=2)
        return None
    if not isinstance(entry, dict) or not {"states", "metrics", "key_fields"} <= entry.keys():
        warnings.warn(f"MTP warm-start cache {path} lacks states / metrics / key_fields; recomputing it", stacklevel=2)
        return None
    return entry if entry["key_fields"] == key_fields else None


def states_by_tp_rank(states: list[dict], layouts: list[dict]) -> list[dict]:
    """Per-rank MTP states -> one per TP rank (those of DP rank 0), index = TP rank."""
    by_tp = {lay["tp_rank"]: st for lay, st in zip(layouts, states) if lay["dp_rank"] == 0 and lay["pp_rank"] == 0}
    return [by_tp[t] for t in sorted(by_tp)]


def states_per_rank(by_tp: list[dict], layouts: list[dict]) -> list[dict]:
    """Inverse of :func:`states_by_tp_rank` for any DP size: rank r gets the state of its TP rank.

    Raises:
        ValueError: the cache holds another number of TP ranks than the policy has.
    """
    tp_size = 1 + max(lay["tp_rank"] for lay in layouts)
    if len(by_tp) != tp_size:
        raise ValueError(f"MTP warm-start cache holds {len(by_tp)} TP ranks, the policy has {tp_size}")
    return [by_tp[lay["tp_rank"]] for lay in layouts]


def _generation_batch(gen: dict, rows: slice) -> dict[str, torch.Tensor]:
    """``rows`` of one ``generate`` output as warm-start data: input_ids [B, S], input_lengths [B] (sequence lengths),
    token_mask [B, S] (response tokens), sample_mask [B] (ones)."""
    ids = gen["output_ids"][rows].long()
    prompt_lens, seq_lens = gen["input_lengths"][rows].long(), gen["unpadded_sequence_lengths"][rows].long()
    return {
        "input_ids": ids,
        "input_lengths": seq_lens,
        "token_mask": response_mask(prompt_lens, seq_lens, ids.shape[1]),
        "sample_mask": torch.ones(ids.shape[0]),
    }


def sample_warm_start_data(s: GRPOSetup, ws: MTPWarmStartConfig) -> tuple[dict, dict]:
    """(train data, held-out data) of the warm start from the engines (module docstring), rows prompt-major."""
    seed = s.cfg.grpo.seed
    order = torch.randperm(len(s.train_problems), generator=torch.Generator().manual_seed(seed))
    chosen = [s.train_problems[i] for i in order[: ws.num_prompts].tolist()]
    n_eval = min(round(ws.holdout_fraction * len(chosen)), len(chosen) - 1)
    gen = s.generation.generate({"prompt_token_ids": s.prompt_ids(chosen)}, ws.samples_per_prompt, seed)
    split = (len(chosen) - n_eval) * ws.samples_per_prompt
    return _generation_batch(gen, slice(0, split)), _generation_batch(gen, slice(split, None))


def _train_and_cache(s: GRPOSetup, ws: MTPWarmStartConfig, path: Path, key_fields: str) -> dict[str, float]:
    """Sample, train, cache; the policy's metrics plus ``mtp_warm_start/sample_seconds`` (the generate call)."""
    start = time.perf_counter()
    train, held_out = sample_warm_start_data(s, ws)
    sample_s = time.perf_counter() - start
    metrics = s.policy.mtp_warm_start(train, held_out, ws.steps, ws.batch_size, ws.lr, s.cfg.grpo.seed)
    metrics["mtp_warm_start/sample_seconds"] = sample_s
    layouts = s.policy.layouts
    entry = {"states": states_by_tp_rank(s.policy.mtp_states(), layouts), "metrics": metrics, "key_fields": key_fields}
    save_cache(path, entry)
    return metrics


def warm_start_mtp(s: GRPOSetup) -> dict[str, float]:
    """Warm-start the policy's MTP layers (cache hit: load; miss: sample, train, cache), refit the engines when they
    draft with them, and log the ``mtp_warm_start/*`` metrics (plus ``from_cache`` and ``seconds``, this run's wall
    time of the whole warm start, refit included) at step 0. Call only when ``policy.megatron_cfg.mtp_warm_start.enabled`` and the run starts at step 0."""
    from nemo_rl_spec.algorithms.grpo_setup import serves_policy_mtp  # grpo_setup imports this module

    start, ws = time.perf_counter(), s.cfg.policy.megatron_cfg.mtp_warm_start
    fields = json.dumps(cache_key_fields(s.cfg, resolve_model(s.cfg.policy.model_name)), sort_keys=True)
    path = Path(ws.cache_dir) / f"{cache_key(json.loads(fields))}.pt"
    entry = load_cache(path, fields)
    if entry is not None:
        s.policy.load_mtp_states(states_per_rank(entry["states"], s.policy.layouts))
        metrics = dict(entry["metrics"])
    else:
        metrics = _train_and_cache(s, ws, path, fields)
    if serves_policy_mtp(s.cfg):  # the engines' MTP drafter starts from the warm weights
        metrics.update(s.refitter.refit(version=0))
        if s.spec is not None:
            s.spec.notify_refit()
    metrics.update(
        {"mtp_warm_start/from_cache": float(entry is not None), "mtp_warm_start/seconds": time.perf_counter() - start}
    )
    print(warm_start_line(metrics, path), flush=True)
    s.logger.log_metrics(metrics, step=0)
    return metrics


def warm_start_line(metrics: dict[str, float], path: Path) -> str:
    """The console line of a warm start, e.g. ``MTP warm start: held-out CE 7.10 -> 3.20, acceptance 0.000 -> 0.412
    (200 steps, 224 sequences); loaded from the cache results/mtp_warm_start/<key>.pt``."""
    m = {k.removeprefix("mtp_warm_start/"): v for k, v in metrics.items()}
    where = f"loaded from the cache {path}" if m["from_cache"] else f"trained in {m['seconds']:.1f} s, cached in {path}"
    return (
        f"MTP warm start: held-out CE {m['ce_before']:.3f} -> {m['ce_after']:.3f}, acceptance "
        f"{m['acceptance_before']:.3f} -> {m['acceptance_after']:.3f} ({int(m['steps'])} steps, "
        f"{int(m['train_sequences'])} sequences); {where}"
    )
