"""Engine-side step timing shared by ``examples/bench_spec_rollouts.py`` and the schedule calibration
(:mod:`nemo_rl_spec.speculative.calibration`, ``examples/calibrate_spec_schedule.py``).

Everything here drives an in-process ``vllm.LLM`` inside a :class:`~nemo_rl_spec.models.generation.vllm_worker.
VllmGenerationWorker` (the rollout path): :class:`StepTimer` times every engine step, :class:`ComponentTimer` its
parts (:mod:`nemo_rl_spec.bench.step_profile` names them), :func:`run_requests` runs one ``generate`` under those
timers, :func:`profile_components` measures step costs at constant running batch for several engines, interleaved.
:func:`fresh_draft` / :func:`never_matching_fresh_draft` write EAGLE-3 heads whose cost is that of any head of their
shape. vLLM is imported lazily.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from nemo_rl_spec.bench import step_profile as sp
from nemo_rl_spec.models.generation.vllm_worker import VllmGenerationWorker, derive_row_seeds
from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead
from nemo_rl_spec.speculative.metrics import SpecDecodeCounters, read_spec_decode_counters


class StepTimer:
    """Times every engine step of an in-process ``vllm.LLM`` and records its running batch and scheduled tokens."""

    def __init__(self, llm) -> None:
        self.core = llm.llm_engine.engine_core.engine_core
        self.records: list[tuple[float, int, int]] = []  # (seconds, requests scheduled, tokens scheduled)
        self._last: tuple[int, int] = (0, 0)
        self._schedule, self._step = self.core.scheduler.schedule, self.core.step_fn
        self.core.scheduler.schedule = self._wrapped_schedule
        self.core.step_fn = self._wrapped_step

    def _wrapped_schedule(self, *a, **kw):
        out = self._schedule(*a, **kw)
        self._last = (len(out.num_scheduled_tokens), int(out.total_num_scheduled_tokens))
        return out

    def _wrapped_step(self):
        self._last = (0, 0)
        t0 = time.perf_counter()
        out = self._step()
        if self._last[0]:
            self.records.append((time.perf_counter() - t0, *self._last))
        return out

    def remove(self) -> None:
        self.core.scheduler.schedule, self.core.step_fn = self._schedule, self._step


def build_worker(
    gen_cfg: dict,
    model_path: str,
    seed: int,
    spec: dict | None = None,
    dynamic: dict | None = None,
    precision: str = "float32",
) -> VllmGenerationWorker:
    """A :class:`VllmGenerationWorker` for ``gen_cfg`` (``policy.generation`` as a dict) with its
    ``speculative_config`` replaced by ``spec`` (None: autoregressive) and ``dynamic_speculation`` by ``dynamic``,
    in ``precision``."""
    cfg = json.loads(json.dumps(gen_cfg))
    cfg["vllm_kwargs"] = {k: v for k, v in cfg["vllm_kwargs"].items() if k != "speculative_config"}
    cfg["dynamic_speculation"] = dynamic
    if spec is not None:
        cfg["vllm_kwargs"]["speculative_config"] = spec
    return VllmGenerationWorker(cfg, model_path, seed, precision=precision)


def run_requests(
    worker,
    prompts: list[list[int]],
    seeds: list[int],
    temperature: float,
    max_tokens: int | Sequence[int],
    cap: int | None = None,
    ignore_eos: bool = False,
    logprobs: int | None = None,
) -> dict[str, Any]:
    """One ``llm.generate`` of ``prompts`` (at most ``cap`` running at once; ``logprobs`` as vLLM's sampling
    parameter, 0: the sampled token's log-prob, as the rollout asks; ``max_tokens``: one for all rows or one per row).
    Returns tokens, seconds, counters and the engine's step records."""
    from vllm import SamplingParams, TokensPrompt  # lazy: vllm is slow to import

    llm = worker.llm
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    saved_cap = sched.max_num_active_reqs
    if cap is not None:
        sched.max_num_active_reqs = cap
    caps = [int(max_tokens)] * len(seeds) if isinstance(max_tokens, int) else [int(m) for m in max_tokens]
    if len(caps) != len(seeds):
        raise ValueError(f"max_tokens: {len(caps)} values for {len(seeds)} rows")
    params = [
        SamplingParams(
            temperature=temperature,
            top_p=1.0,
            max_tokens=m,
            seed=s,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
        )
        for s, m in zip(seeds, caps)
    ]
    before = read_spec_decode_counters(llm) if worker.speculative else SpecDecodeCounters()
    timer = StepTimer(llm)
    try:
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
    finally:
        timer.remove()
        sched.max_num_active_reqs = saved_cap
    llm.reset_prefix_cache()
    counters = (read_spec_decode_counters(llm) - before) if worker.speculative else SpecDecodeCounters()
    return {
        "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "seconds": seconds,
        "counters": counters,
        "steps": timer.records,
    }


def time_rollout(worker, prompts: list[list[int]], n: int, seed: int) -> dict[str, Any]:
    """Time one GRPO rollout call, ``worker.generate(prompts, n=n, seed=seed)`` (natural lengths), step by step.

    Args:
        worker: a :class:`VllmGenerationWorker`.
        prompts: P prompts as token-id lists; the call generates P x ``n`` rows.
        n: generations per prompt.
        seed: the rollout seed (per-row seeds derive from it, as in the GRPO loop).

    Returns:
        ``seconds`` (wall), ``tokens`` (generated), ``response_tokens`` (per row, length P x n),
        ``acceptance_length`` (vLLM's counters over the call; None on an autoregressive engine) and
        ``seconds_by_batch`` ({running batch b: seconds of the engine steps that ran b requests}).
    """
    before = worker.spec_counters()
    timer = StepTimer(worker.llm)
    try:
        t0 = time.perf_counter()
        out = worker.generate({"prompt_token_ids": prompts}, n=n, seed=seed)
        seconds = time.perf_counter() - t0
    finally:
        timer.remove()
    lengths = (out["unpadded_sequence_lengths"] - out["input_lengths"]).tolist()
    counters = (worker.spec_counters() - before) if before is not None else None
    return {
        "seconds": seconds,
        "tokens": int(sum(lengths)),
        "response_tokens": [int(x) for x in lengths],
        "acceptance_length": counters.acceptance_length if counters else None,
        "seconds_by_batch": seconds_by_batch(timer.records),
    }


def seconds_by_batch(records) -> dict[int, float]:
    """``{running batch b: seconds of the engine steps that ran b requests}`` from :class:`StepTimer` records
    ``(seconds, b, tokens)``, sorted by b."""
    out: dict[int, float] = {}
    for s, b, _ in records:
        out[b] = out.get(b, 0.0) + s
    return dict(sorted(out.items()))


def time_matched_rollout(
    worker, prompts: list[list[int]], n: int, seed: int, temperature: float, lengths: Sequence[int]
) -> dict[str, Any]:
    """The rollout call of :func:`time_rollout` (P prompts x ``n`` rows, prompt-major, the GRPO loop's per-row seeds)
    with row r held to exactly ``lengths[r]`` generated tokens (``ignore_eos``): an autoregressive engine run at the
    lengths another engine sampled goes through that engine's running-batch profile, so the time ratio compares the
    engines on the same rollout shape, free of the sampled tails' lengths. (Speculative sampling draws other tokens
    than an autoregressive engine from the same seed, so natural lengths differ per row, and a rollout's time follows
    its longest row.)

    Returns:
        ``seconds``, ``tokens``, ``acceptance_length`` (None on an autoregressive engine), ``seconds_by_batch``.

    Raises:
        ValueError: ``lengths`` is not one value >= 1 per row.
    """
    rows = [list(p) for p in prompts for _ in range(n)]
    if len(lengths) != len(rows) or min(lengths, default=1) < 1:
        raise ValueError(f"lengths: need {len(rows)} values >= 1 (P x n rows), got {list(lengths)[:8]}...")
    res = run_requests(
        worker, rows, derive_row_seeds(seed, len(rows)), temperature, list(lengths), ignore_eos=True, logprobs=0
    )
    return {
        "seconds": res["seconds"],
        "tokens": res["tokens"],
        "acceptance_length": res["counters"].acceptance_length if worker.speculative else None,
        "seconds_by_batch": seconds_by_batch(res["steps"]),
    }


def never_matching_weights(draft_dir: str) -> tuple[dict, dict]:
    """(in-domain weights, the same with a zero lm_head): all draft logits equal, so the draft always proposes its
    first vocabulary entry (the smallest token id in its vocabulary)."""
    good = load_file(str(Path(draft_dir) / "model.safetensors"))
    bad = dict(good)
    bad["lm_head.weight"] = torch.zeros_like(good["lm_head.weight"])
    return good, bad


class ComponentTimer:
    """Times the parts of every engine step of an in-process ``vllm.LLM`` (the measured keys of
    :mod:`nemo_rl_spec.bench.step_profile`): the target forward (``_model_forward``), the target logits
    (``compute_logits``), sampling (``_sample``: vLLM's ``Sampler`` or its ``RejectionSampler``) and the drafter
    (``propose_draft_token_ids``); with ``detail`` (an engine with a drafter) also the rejection sampler's parts
    (its forward, the bonus ``Sampler`` call, ``apply_logits_processors``, ``apply_sampling_constraints``,
    ``rejection_sample``, ``_get_logprobs_tensors``) and the drafter's (its model's first forward of the step,
    its later forwards, ``_sample_draft_tokens``). ``records``: (step seconds, requests scheduled, tokens
    scheduled, components from :func:`~nemo_rl_spec.bench.step_profile.step_parts`). :meth:`remove` undoes every
    wrapper."""

    def __init__(self, llm, detail: bool = False) -> None:

        holder: list = []
        llm.collective_rpc(lambda worker: holder.append(worker.model_runner))  # in-process engine
        self.runner = runner = holder[0]
        keys = sp.MAIN + (sp.SPEC_DETAIL if detail else ())
        self.acc: dict[str, float] = dict.fromkeys(keys, 0.0)
        self.saved: list[tuple[Any, str, Any]] = []
        self._wrap(runner, "_model_forward", "target_forward")
        self._wrap(runner.model, "compute_logits", "target_logits")
        self._wrap(runner, "_sample", "sampling")
        self._wrap(runner, "propose_draft_token_ids", "drafter")
        if detail:
            import vllm.v1.sample.rejection_sampler as rs_mod  # lazy: vllm is slow to import

            rs = runner.rejection_sampler
            self._wrap(rs, "forward", "rs_forward")
            self._wrap(rs.sampler, "forward", "rs_bonus")
            self._wrap(rs, "apply_logits_processors", "rs_processors")
            self._wrap(rs, "_get_logprobs_tensors", "rs_logprobs")
            self._wrap(rs_mod, "apply_sampling_constraints", "rs_constraints")
            self._wrap(rs_mod, "rejection_sample", "rs_accept")
            drafter = runner.drafter
            self._wrap(drafter, "_sample_draft_tokens", "drafter_sample")
            self._wrap(drafter.model, "forward", "drafter_forward", first_key="drafter_kv_pass")
        self.steps = StepTimer(llm)
        self.records: list[tuple[float, int, int, dict[str, float]]] = []
        step = self.steps.core.step_fn

        def timed_step():
            for key in self.acc:
                self.acc[key] = 0.0
            self._calls = 0
            n0 = len(self.steps.records)
            out = step()
            if len(self.steps.records) > n0:
                seconds, n, tok = self.steps.records[-1]
                self.records.append((seconds, n, tok, sp.step_parts(seconds, self.acc)))
            return out

        self.steps.core.step_fn = timed_step

    def _wrap(self, obj, attr: str, key: str, first_key: str | None = None) -> None:
        """Time ``obj.attr`` into ``key`` (its first call of a step into ``first_key`` when given)."""
        had = attr in vars(obj)
        original = getattr(obj, attr)
        self._calls = 0

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            into = key
            if first_key is not None:
                into = first_key if self._calls == 0 else key
                self._calls += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.acc[into] += time.perf_counter() - t0

        object.__setattr__(obj, attr, timed)
        self.saved.append((obj, attr, original if had else None))

    def remove(self) -> None:
        self.steps.core.step_fn = self.steps._step
        self.steps.remove()
        for obj, attr, original in reversed(self.saved):
            if original is None:
                object.__delattr__(obj, attr)
            else:
                object.__setattr__(obj, attr, original)


def profile_components(
    workers: dict[str, Any],
    ks: dict[str, int],
    opts: dict[str, Any],
    detail: bool = False,
    log=print,
) -> tuple[dict[str, dict[int, list[dict[str, float]]]], dict[str, dict[int, list[float]]]]:
    """Per-component step costs of ``workers`` (name -> :class:`VllmGenerationWorker`) at constant batch: for each
    of ``opts["step_cost_repeats"]`` repeats and each b in ``opts["batches"]``, every engine (interleaved, order
    reversed on odd repeats) decodes b requests of ``opts["step_cost_tokens"]`` tokens (ignore_eos, at most b
    running, ``opts["logprobs"]`` when set) under a :class:`ComponentTimer`; the steps with all b requests
    decoding ``ks[name]`` drafts each (:func:`~nemo_rl_spec.bench.step_profile.keep_step`) give the run's median per component (seconds).

    Returns:
        ``({name: {b: [run summary per repeat]}}, {name: {b: [acceptance length per repeat]}})``, a summary being
        ``{component: seconds, "step": seconds, "n_steps": int, "run_s": the whole generate call's seconds,
        "steps_s": the seconds of all its engine steps (prefill and ramp included)}``; acceptance lengths (vLLM's
        counters) only for engines with ``ks[name] > 0``.

    Raises:
        ValueError: a run had no kept step.
    """

    prompts, T, M, seed = opts["prompts"], opts["temperature"], opts["step_cost_tokens"], opts["seed"]
    t_start = time.perf_counter()
    runs: dict[str, dict[int, list[dict[str, float]]]] = {n: {b: [] for b in opts["batches"]} for n in workers}
    acceptance: dict[str, dict[int, list[float]]] = {n: {b: [] for b in opts["batches"]} for n in workers if ks[n]}
    for rep in range(opts["step_cost_repeats"]):
        for b in opts["batches"]:
            for name in sp.interleaved_order(list(workers), rep):
                worker = workers[name]
                timer = ComponentTimer(worker.llm, detail=detail and ks[name] > 0)
                try:
                    res = run_requests(
                        worker,
                        prompts[:b],
                        derive_row_seeds(seed + 7 * b, b),
                        T,
                        M,
                        cap=b,
                        ignore_eos=True,
                        logprobs=opts.get("logprobs"),
                    )
                finally:
                    timer.remove()
                if ks[name]:
                    acceptance[name][b].append(res["counters"].acceptance_length)
                kept = [parts for s, n, tok, parts in timer.records if sp.keep_step(n, tok, b, ks[name])]
                whole = {"run_s": res["seconds"], "steps_s": sum(s for s, *_ in timer.records)}
                runs[name][b].append(sp.run_summary(kept) | whole)
        log(f"component repeat {rep + 1} [{time.perf_counter() - t_start:.0f} s]")
    return runs, acceptance


def fresh_draft(model_path: str, out_dir: str, draft_vocab_size: int | None = None) -> str:
    """A fresh EAGLE-3 head for the target (lm_head = the target's output rows), written to ``out_dir``: what an
    online run starts from; at k = 0 its quality does not enter the cost. ``draft_vocab_size``: a reduced draft
    vocabulary of that many rows (the target's first token ids: a stand-in with the cost of any head of that
    size, as ``make draft`` builds from response-token counts); None: the full vocabulary."""
    from transformers import AutoModelForCausalLM  # lazy: transformers is slow to import

    target = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32)
    vocab = None if draft_vocab_size is None else torch.arange(int(draft_vocab_size), dtype=torch.long)
    Eagle3DraftHead.from_target(target, draft_vocab=vocab).save_pretrained(out_dir)
    return out_dir


def never_matching_fresh_draft(model_path: str, out_dir: str, draft_vocab_size: int | None = None) -> str:
    """A fresh EAGLE-3 head (:func:`fresh_draft`, ``draft_vocab_size`` rows or the full vocabulary) with a zero
    ``lm_head`` (:func:`never_matching_weights`), written to ``out_dir``: its proposals are (near-)never accepted,
    so every request carries k drafts on every decode step and the steps cost what verification costs; its
    vocabulary and layer shapes are the cost structure of any head of this shape (trained or not)."""
    fresh_draft(model_path, out_dir, draft_vocab_size)
    _, bad = never_matching_weights(out_dir)
    save_file(bad, str(Path(out_dir) / "model.safetensors"))
    return out_dir


def never_matching_copy(draft_dir: str, out_dir: str) -> str:
    """A copy of the EAGLE-3 head in ``draft_dir`` with a zero ``lm_head`` (:func:`never_matching_weights`),
    written to ``out_dir``: the head's exact shapes and vocabulary, never accepted (every decode step verifies k
    drafts per request)."""
    shutil.copytree(draft_dir, out_dir, dirs_exist_ok=True)
    _, bad = never_matching_weights(draft_dir)
    save_file(bad, str(Path(out_dir) / "model.safetensors"))
    return out_dir
