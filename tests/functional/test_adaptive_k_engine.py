"""Batch-size-aware speculation through the generation worker (tiny-qwen3, EAGLE-3 head trained on its greedy
outputs): with ``policy.generation.dynamic_speculation`` the engine drafts k = k(running batch size) tokens each
step (recorded from vLLM's scheduler and compared with the schedule evaluated here), and greedy outputs stay
identical, token for token, to plain (non-speculative) greedy decoding.

Requests get different lengths (16, 32, ..., 128 tokens, ignore_eos) so the running batch shrinks from 8 to 1 and
the engine passes through every range of the schedule (k = 0 at batch >= 6, 1 at 3-5, 3 at 1-2).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm")

from nemo_rl_spec.speculative.adaptive_k import k_for_batch_size
from nemo_rl_spec.testing import checks
from nemo_rl_spec.testing.lossless import first_mismatch, record_scheduled_steps, require_acceptance

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # ~100 s on the shared 2-core machine

SCHEDULE = [[1, 2, 3], [3, 5, 1], [6, 256, 0]]
K_MAX = 3
NUM_PROMPTS = 8


def _generation_cfg(draft: str | None, drafter_pass_at_k0: bool = True, dynamic: dict | None = None):
    """The tiny recipe's typed ``policy.generation`` (max_model_len 1024); speculative, with the schedule (or the
    ``dynamic`` section given), if ``draft``."""
    from nemo_rl_spec.utils.config import load_config

    recipe = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_tiny.yaml"
    gen = load_config(recipe).policy.generation
    gen.vllm_cfg.max_model_len = 1024
    if draft is not None:
        gen.vllm_kwargs = {"speculative_config": {"method": "eagle3", "model": draft, "num_speculative_tokens": K_MAX}}
        gen.dynamic_speculation = dynamic or {
            "num_speculative_tokens_per_batch_size": SCHEDULE,
            "drafter_pass_at_k0": drafter_pass_at_k0,
        }
    return gen


DRAFTER_FORWARDS: list[int] = []


def _count_drafter_forwards(worker) -> None:
    worker.model_runner.drafter.model.register_forward_hook(lambda *_: DRAFTER_FORWARDS.append(1))


def _live_counts(lookup) -> dict:
    """A live-acceptance lookup's counts and its estimate's accepted / tried proposals."""
    return {**lookup.counts, "accepted": lookup.estimate.accepted, "tried": lookup.estimate.tried}


def greedy_scenario(
    model: str,
    draft: str | None,
    prompts: list[list[int]],
    lengths: list[int],
    drafter_pass_at_k0: bool = True,
    dynamic: dict | None = None,
) -> dict:
    """Worker engine (speculative with the schedule or ``dynamic``, or plain), greedy decode with per-request
    lengths; records (running batch size, k scheduled) of every engine step from vLLM's scheduler, the drafter's
    forward passes and, with live acceptance, the lookup's counts and acceptance estimate."""
    from vllm import SamplingParams, TokensPrompt

    from nemo_rl_spec.models.generation.vllm_worker import VllmGenerationWorker
    from nemo_rl_spec.speculative.metrics import (
        SpecDecodeCounters,
        read_spec_decode_counters,
    )

    worker = VllmGenerationWorker(_generation_cfg(draft, drafter_pass_at_k0, dynamic), model, seed=0)
    llm = worker.llm
    if draft is not None:
        llm.collective_rpc(_count_drafter_forwards)  # in-process engine: the hook appends to this module's list
    steps = record_scheduled_steps(llm)
    lookup = llm.llm_engine.engine_core.engine_core.scheduler.dynamic_sd_lookup
    live = hasattr(lookup, "estimate")  # live acceptance: its counts so far (the worker's warm-up)
    live_before = _live_counts(lookup) if live else {}
    spec_cfg = llm.llm_engine.vllm_config.speculative_config
    read = read_spec_decode_counters if draft is not None else (lambda _: SpecDecodeCounters())  # stats off
    before = read(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    counters = read(llm) - before
    result = {
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
        "steps": steps,
        "counters": counters,
        "engine_schedule": None if spec_cfg is None else spec_cfg.num_speculative_tokens_per_batch_size,
        "drafter_forwards": len(DRAFTER_FORWARDS),
    }
    if live:
        after = _live_counts(lookup)
        result["live"] = {key: after[key] - live_before[key] for key in after}
    worker.shutdown()
    return result


@pytest.mark.parametrize("drafter_pass_at_k0", [True, False])
def test_dynamic_speculation_is_lossless_and_follows_schedule(tmp_path, drafter_pass_at_k0):
    target, prompts, draft = checks.tiny_qwen3_with_trained_head(str(tmp_path / "draft"))
    test_prompts = prompts[:NUM_PROMPTS]
    # at most the 64 tokens the head was trained on (16 * (i + 1) drafted mostly past them: acceptance 1.37)
    lengths = [8 * (i + 1) for i in range(NUM_PROMPTS)]
    plain = checks.run_isolated(greedy_scenario, target, None, test_prompts, lengths)
    spec = checks.run_isolated(greedy_scenario, target, draft, test_prompts, lengths, drafter_pass_at_k0)

    assert [list(r) for r in spec["engine_schedule"]] == SCHEDULE
    require_acceptance(spec["counters"], "dynamic speculation (trained EAGLE-3 head)")  # else equality is vacuous
    for i, (a, b) in enumerate(zip(plain["outputs"], spec["outputs"])):
        assert len(a) == len(b) == lengths[i]
        assert a == b, f"prompt {i}: first mismatch at {first_mismatch(a, b)}"

    # every step drafted exactly the k the schedule gives its running batch (computed here, not by vLLM)
    decode_steps = spec["steps"]
    assert decode_steps and all(k == k_for_batch_size(SCHEDULE, b, K_MAX) for b, k in decode_steps), decode_steps
    seen = {k for _, k in decode_steps}
    assert seen == {0, 1, 3}, seen
    c = spec["counters"]
    print(
        f"\nsteps (batch, k): {decode_steps[:3]} ... {decode_steps[-3:]}; drafts {c.num_drafts}, draft tokens "
        f"{c.num_draft_tokens}, accepted {c.num_accepted_tokens}, acceptance length {c.acceptance_length:.2f}"
    )
    # proposals exist only for steps with k > 0: draft tokens = sum of k over requests of drafting steps
    expected_draft_tokens = sum(b * k for b, k in decode_steps[:-1])
    assert c.num_draft_tokens <= expected_draft_tokens
    assert c.num_drafts > 0 and c.num_accepted_tokens > 0
    assert all(k == 0 for b, k in decode_steps if b >= 6)
    # drafter forward passes per engine step: k of them (the first pass, then k - 1 more), and at k = 0 one
    # KV-keeping pass with vLLM's default or none with drafter_pass_at_k0: false
    per_step = [k if (k or not drafter_pass_at_k0) else 1 for _, k in decode_steps]
    assert spec["drafter_forwards"] == sum(per_step), (spec["drafter_forwards"], sum(per_step))


def test_live_acceptance_picks_k_from_measured_acceptance(tmp_path):
    """``live_acceptance``: vLLM's scheduler takes k from the live lookup every step (the recorded k sum is the
    lookup's), the estimate's counts are vLLM's own acceptance counters (half-life so long that nothing decays),
    the measured acceptance moves k below the schedule's, and outputs stay plain greedy's."""
    import json

    target, prompts, draft = checks.tiny_qwen3_with_trained_head(str(tmp_path / "draft"))
    test_prompts = prompts[:NUM_PROMPTS]
    lengths = [8 * (i + 1) for i in range(NUM_PROMPTS)]
    # AR 10 ms; k = 1 / 3 cost 11 / 14 ms at b = 1, 30 / 60 ms at b = 8: at the prior a = 0.8 the schedule drafts
    # k = 3 at b = 1-2, k = 1 at b = 3
    costs = tmp_path / "costs.json"
    spec_s = {"1": {"1": 0.011, "8": 0.030}, "3": {"1": 0.014, "8": 0.060}}
    costs.write_text(json.dumps({"ar_step_s": {"1": 0.010, "8": 0.010}, "spec_step_s": spec_s}))
    dynamic = {"step_costs": str(costs), "acceptance_rate": 0.8, "live_acceptance": True}
    dynamic["live_acceptance_half_life"] = 10**9
    plain = checks.run_isolated(greedy_scenario, target, None, test_prompts, lengths)
    spec = checks.run_isolated(greedy_scenario, target, draft, test_prompts, lengths, True, dynamic)

    for i, (a, b) in enumerate(zip(plain["outputs"], spec["outputs"])):
        assert a == b, f"prompt {i}: first mismatch at {first_mismatch(a, b)}"
    require_acceptance(spec["counters"], "live acceptance (trained EAGLE-3 head)")
    live, steps, c = spec["live"], spec["steps"], spec["counters"]
    schedule = [list(r) for r in spec["engine_schedule"]]
    print(f"\nschedule {schedule}; steps (batch, k) {steps}; live {live}; acceptance length {c.acceptance_length:.2f}")
    assert live["steps"] == len(steps) and live["k_sum"] == sum(k for _, k in steps)
    assert all(k <= k_for_batch_size(schedule, b, K_MAX) for b, k in steps)
    # the estimate counted what vLLM counted: every accepted token; tried = accepted + the drafts with a rejection
    assert live["accepted"] == pytest.approx(c.num_accepted_tokens, rel=1e-6)
    assert c.num_accepted_tokens < live["tried"] <= c.num_accepted_tokens + c.num_drafts + 1e-6
    # at b = 2 the measured acceptance (about 0.75 here) makes k = 1 (1.39x predicted) beat k = 3 (1.29x)
    assert any(0 < k < k_for_batch_size(schedule, b, K_MAX) for b, k in steps), steps  # k = 1 where k = 3 allowed
