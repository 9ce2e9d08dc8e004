"""Drafter catch-up on a real vLLM engine (tiny-qwen3, fp32, EAGLE-3 head trained on its greedy outputs).

Three speculative engines run the same greedy requests with a batch-size-aware schedule (k = 0 at >= 6 running
requests, 1 at 3-5, 3 at 1-2; lengths 8..64 tokens, so the batch shrinks through every range):

- ``full``: vLLM's drafter pass on every step (its KV cache complete: the reference);
- ``catch_up``: the pass skipped on k = 0 decode steps and the skipped positions replayed when drafting resumes;
- ``skip``: the pass skipped, nothing replayed (the negative control: stale drafter KV).

Catch-up is right when its drafts equal the reference's at every drafting step (the drafter then read the same KV
cache); the control must differ somewhere, or the comparison could not tell the two apart. All three stay lossless
(greedy outputs equal), and the replayed token count and drafter forward passes equal what the recorded schedule
gives (computed here).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm")

from nemo_rl_spec.testing import checks
from nemo_rl_spec.testing.lossless import first_mismatch, record_scheduled_steps, require_acceptance

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # ~2 min on the 2-core machine

SCHEDULE = [[1, 2, 3], [3, 5, 1], [6, 256, 0]]
NUM_PROMPTS = 8
MODES = {
    "full": {"drafter_pass_at_k0": True},
    "catch_up": {"drafter_pass_at_k0": False, "drafter_catch_up": True},
    "skip": {"drafter_pass_at_k0": False},
}
DRAFTER_FORWARDS: list[int] = []


def _generation_cfg(draft: str, mode: str):
    from nemo_rl_spec.utils.config import load_config

    gen = load_config(Path(__file__).resolve().parents[2] / "configs" / "grpo_math_tiny.yaml").policy.generation
    gen.vllm_cfg.max_model_len = 1024
    gen.vllm_cfg.precision = "float32"
    gen.vllm_kwargs = {"speculative_config": {"method": "eagle3", "model": draft, "num_speculative_tokens": 3}}
    gen.dynamic_speculation = {"num_speculative_tokens_per_batch_size": SCHEDULE, **MODES[mode]}
    return gen


def _count_drafter_forwards(worker) -> None:
    worker.model_runner.drafter.model.register_forward_hook(lambda *_: DRAFTER_FORWARDS.append(1))


def _replayed_tokens(worker) -> int:
    store = getattr(worker.model_runner.drafter, "_nemo_rl_spec_catch_up", None)
    return -1 if store is None else store.replayed_tokens


def scenario(model: str, draft: str, prompts: list[list[int]], lengths: list[int], mode: str) -> dict:
    """One speculative engine in ``mode``: greedy outputs, (running batch, k) per engine step from vLLM's scheduler,
    the drafts of every drafting step, drafter forward passes and replayed tokens."""
    from vllm import SamplingParams, TokensPrompt

    from nemo_rl_spec.models.generation.vllm_worker import VllmGenerationWorker
    from nemo_rl_spec.speculative.metrics import read_spec_decode_counters
    from nemo_rl_spec.testing.lossless import install_proposal_recorder, recorded_proposals

    worker = VllmGenerationWorker(_generation_cfg(draft, mode), model, seed=0)
    llm = worker.llm
    llm.collective_rpc(_count_drafter_forwards)
    install_proposal_recorder(llm)
    steps = record_scheduled_steps(llm)
    before = read_spec_decode_counters(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "steps": steps,
        "counters": read_spec_decode_counters(llm) - before,
        "drafts": [p.tolist() for p in recorded_proposals(llm) if p.shape[1] > 0],
        "drafter_forwards": len(DRAFTER_FORWARDS),
        "replayed": llm.collective_rpc(_replayed_tokens)[0],
    }
    worker.shutdown()
    return result


def test_catch_up_gives_the_full_pass_drafts_and_stays_lossless(tmp_path):
    target, prompts, draft = checks.tiny_qwen3_with_trained_head(str(tmp_path / "draft"))
    lengths = [8 * (i + 1) for i in range(NUM_PROMPTS)]
    runs = {m: checks.run_isolated(scenario, target, draft, prompts[:NUM_PROMPTS], lengths, m) for m in MODES}
    full, catch_up, skip = runs["full"], runs["catch_up"], runs["skip"]

    for mode, run in runs.items():
        require_acceptance(run["counters"], f"catch-up test, {mode}")
        for i, (a, b) in enumerate(zip(full["outputs"], run["outputs"])):
            assert len(b) == lengths[i] and a == b, f"{mode}, prompt {i}: first mismatch at {first_mismatch(a, b)}"

    # the drafter read the same KV cache as with the pass on every step: the same drafts at every drafting step
    assert full["steps"] == catch_up["steps"]
    assert catch_up["drafts"] == full["drafts"], "catch-up drafts differ from the full-pass drafts"
    # the control: without the replay the stale KV changes some drafts (else this test could not fail)
    differing = sum(a != b for a, b in zip(full["drafts"], skip["drafts"])) + abs(
        len(full["drafts"]) - len(skip["drafts"])
    )
    assert differing > 0, "skipping without catch-up left every draft unchanged: the comparison is vacuous"

    # replayed tokens: every skipped decode step (k = 0, one token per request; the first step is the prefill)
    # times the requests still running when drafting resumes (all of them were in every skipped step)
    steps = catch_up["steps"]
    first_drafting = next(i for i, (_, k) in enumerate(steps) if k > 0)
    skipped = first_drafting - 1
    assert skipped > 0 and all(k == 0 for _, k in steps[:first_drafting])
    assert catch_up["replayed"] == steps[first_drafting][0] * skipped, (catch_up["replayed"], steps[:first_drafting])
    assert skip["replayed"] == -1 and full["replayed"] == -1  # no store without catch-up
    # drafter forwards: k per drafting step; at k = 0 the prefill's pass (catch-up keeps prefill passes) and, with
    # catch-up, one replay pass (all runs fit one pass); the control runs none at k = 0
    drafting = sum(k for _, k in steps)
    assert catch_up["drafter_forwards"] == drafting + 1 + 1, (catch_up["drafter_forwards"], drafting)
    assert skip["drafter_forwards"] == sum(k for _, k in skip["steps"])
    print(
        f"\nskipped decode steps {skipped}, replayed {catch_up['replayed']} tokens; drafting steps "
        f"{len(full['drafts'])}, drafts differing without catch-up {differing}; acceptance length full / catch-up / "
        f"skip {full['counters'].acceptance_length:.2f} / {catch_up['counters'].acceptance_length:.2f} / "
        f"{skip['counters'].acceptance_length:.2f}"
    )
