"""``policy.generation.stop_strings`` / ``stop_token_ids`` (NeMo-RL) on the real generation worker (tiny-qwen3):
greedy decoding with them ends each row exactly where an independent scan of the
unstopped greedy output says (first token that is a stop token or whose prefix text contains a stop string; that
token kept), and speculative decoding (a draft_model drafter, k=3) gives the same tokens (lossless). Both
engines run in one spawned process, one after the other.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm")

from nemo_rl_spec.models.hf_assets import resolve_model  # noqa: E402
from nemo_rl_spec.testing import checks  # noqa: E402

pytestmark = pytest.mark.timeout(900)

BASE = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_base.yaml"
QUESTIONS = ["What is 2 + 3?", "Name a prime number larger than 10.", "Hi"]
MAX_TOKENS = 32


def choose_stops(model: str, ref: list[list[int]]) -> dict:
    """Stops picked from the unstopped greedy rows: the text of row 0's tokens 8..9, and row 1's token 6."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return {"stop_strings": [tok.decode(ref[0][8:10], skip_special_tokens=True)], "stop_token_ids": [ref[1][6]]}


def stop_scenario(model: str, prompts: list[list[int]], specs: list[dict | None]) -> list[dict]:
    """One process, one engine per entry of ``specs`` (in turn): greedy rows without stops, then with the stops
    :func:`choose_stops` picks from the first engine's rows (set on the worker's config)."""
    from nemo_rl_spec.models.generation.vllm_worker import VllmGenerationWorker
    from nemo_rl_spec.utils.config_schema import GenerationConfig

    results, stops = [], None
    for spec in specs:
        raw = copy.deepcopy(yaml.safe_load(BASE.read_text())["policy"]["generation"])
        raw.update(temperature=0.0, max_new_tokens=MAX_TOKENS, vllm_kwargs={"speculative_config": spec} if spec else {})
        worker = VllmGenerationWorker(GenerationConfig.model_validate(raw), model, seed=0)

        def rows() -> tuple[list[list[int]], object]:  # called in this iteration only
            out = worker.generate({"prompt_token_ids": prompts}, n=1, seed=0)  # noqa: B023
            return [
                out["output_ids"][r, len(p) : int(out["unpadded_sequence_lengths"][r])].tolist()
                for r, p in enumerate(prompts)
            ], out["spec_counters"]

        ref, _ = rows()
        stops = stops or choose_stops(model, ref)
        worker.cfg = worker.cfg.model_copy(update=stops)
        stopped, counters = rows()
        worker.shutdown()
        results.append({"ref": ref, "stops": stops, "stopped": stopped, "counters": counters})
    return results


def expected_stop(tok, row: list[int], stops: dict) -> list[int]:
    """Independent scan: the row up to and including the first stop token / the token completing a stop string."""
    for j, t in enumerate(row):
        if t in stops["stop_token_ids"] or any(
            s in tok.decode(row[: j + 1], skip_special_tokens=True) for s in stops["stop_strings"]
        ):
            return row[: j + 1]
    return row


@pytest.fixture(scope="module")
def model() -> str:
    return resolve_model("tiny-qwen3")


def test_stop_strings_and_tokens_end_generation_and_stay_lossless_with_speculation(model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for q in QUESTIONS
    ]
    # the draft is the target itself: greedy proposals equal the target's argmax and are accepted, so accepted runs
    # of draft tokens cross the stop positions (a stop must cut inside an accepted chunk)
    plain, spec = checks.run_isolated(
        stop_scenario, model, prompts, [None, {"method": "draft_model", "model": model, "num_speculative_tokens": 3}]
    )
    stops = plain["stops"]
    print(
        f"\nstops {stops}; lengths unstopped {[len(r) for r in plain['ref']]} -> "
        f"{[len(r) for r in plain['stopped']]}; texts {[tok.decode(r) for r in plain['stopped']]}"
    )
    expected = [expected_stop(tok, r, stops) for r in plain["ref"]]
    assert plain["stopped"] == expected
    assert len(expected[0]) <= 10 and len(expected[1]) <= 7  # both stops act (row 0: string, row 1: token)
    assert expected[1][-1] in stops["stop_token_ids"]  # the stop token is kept as the last token
    assert stops["stop_strings"][0] in tok.decode(expected[0], skip_special_tokens=True)
    assert spec["ref"] == plain["ref"] and spec["stops"] == stops  # speculation: greedy-lossless without stops,
    assert spec["stopped"] == plain["stopped"]  # and with them
    counters = spec["counters"]
    print(
        f"drafts {counters.num_drafts}, accepted {counters.num_accepted_tokens}, "
        f"acceptance length {counters.acceptance_length:.2f}"
    )
    # greedy with draft == target: every proposal inside a row is accepted; only proposals past a row's end (stop or
    # max_new_tokens) can be lost, so acceptance length is well above 1 (1.0 would mean every draft rejected)
    assert counters.num_drafts > 0 and counters.num_accepted_tokens > 0
    assert counters.acceptance_length >= 2.0
