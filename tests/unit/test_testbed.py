"""The testbed policy builder (nemo_rl_spec/models/testbed.py): chains, schedule, tokenizer, determinism."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import pytest

from nemo_rl_spec.models import testbed as tb

SMALL = dataclasses.replace(
    tb.TESTBED,
    slip_rate=0.0,
    sft_examples=96,
    sft_steps=4,
    batch_size=8,
    warmup_steps=2,
    direct_steps=2,
    model=dict(
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        tie_word_embeddings=True,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
    ),
)


def test_chain_solution_by_hand():
    assert tb.chain_solution("4 - 1 - 7") == "4 - 1 = 3\n3 - 7 = -4\n\\boxed{-4}"
    assert tb.chain_solution("9 + 9") == "9 + 9 = 18\n\\boxed{18}"
    assert tb.chain_solution("0 - 5 + 2 - 8") == "0 - 5 = -5\n-5 + 2 = -3\n-3 - 8 = -11\n\\boxed{-11}"
    for bad in ("4 * 2", "4 -", "4"):
        with pytest.raises(ValueError, match="not a chain sum"):
            tb.chain_solution(bad)


def test_slipped_chain_by_hand():
    assert tb.chain_solution("4 - 1 - 7", [1, 0]) == "4 - 1 = 4\n4 - 7 = -3\n\\boxed{-3}"
    assert tb.chain_solution("4 - 1 - 7", [0, -1]) == "4 - 1 = 3\n3 - 7 = -5\n\\boxed{-5}"
    assert tb.chain_solution("9 + 9", [0]) == tb.chain_solution("9 + 9")
    with pytest.raises(ValueError, match="one entry per step"):
        tb.chain_solution("4 - 1 - 7", [1])


def test_slip_draws_follow_the_rate():
    import random

    rng = random.Random(7)
    draws = [x for _ in range(4000) for x in tb.draw_slips(3, 0.3, rng)]
    n = len(draws)
    rate = sum(x != 0 for x in draws) / n
    assert abs(rate - 0.3) < 4 * math.sqrt(0.3 * 0.7 / n)  # 4 standard errors
    assert set(draws) == {-1, 0, 1} and abs(draws.count(1) - draws.count(-1)) < 4 * math.sqrt(0.3 * n)
    assert tb.draw_slips(5, 0.0, random.Random(0)) == [0] * 5


def test_slipped_corpus_answers_are_wrong_at_the_slip_rate():
    import reasoning_gym

    from nemo_rl_spec.data.datasets import parse_generator
    from nemo_rl_spec.environments.math_env import score_response

    r = dataclasses.replace(SMALL, slip_rate=0.3, sft_examples=400)
    name, settings = parse_generator(r.generator)
    items = list(reasoning_gym.create_dataset(name, size=r.sft_examples, seed=r.seed, **settings))
    pairs = tb.sft_conversations(r)
    right = [score_response(a, item["answer"], None) for (_, a), item in zip(pairs, items)]
    # an independent expectation: a demonstration is right iff none of its steps slipped, P = 0.7 ** steps
    expected = sum(0.7 ** (len(item["metadata"]["expression"].split()) // 2) for item in items)
    assert abs(sum(right) - expected) < 4 * math.sqrt(expected * 0.5)
    assert [q for q, _ in pairs] == [item["question"] for item in items]


def test_corpus_answers_match_reasoning_gym_and_score_1():
    from nemo_rl_spec.environments.math_env import score_response

    pairs = tb.sft_conversations(SMALL)
    assert len(pairs) == SMALL.sft_examples
    import reasoning_gym

    from nemo_rl_spec.data.datasets import parse_generator

    name, settings = parse_generator(SMALL.generator)
    truth = [item["answer"] for item in reasoning_gym.create_dataset(name, size=8, seed=SMALL.seed, **settings)]
    assert [score_response(a, g, None) for (_, a), g in zip(pairs, truth)] == [1.0] * 8


def test_direct_answers_at_their_rate_and_right():
    """Stage 2's corpus: a bare ``\\boxed{truth}`` with probability direct_rate, else the chain of the same problem."""
    import reasoning_gym

    from nemo_rl_spec.data.datasets import parse_generator

    name, settings = parse_generator(SMALL.generator)
    n, rate = 600, 0.7
    items = list(reasoning_gym.create_dataset(name, size=n, seed=SMALL.seed + 2, **settings))
    pairs = tb.sft_conversations(SMALL, rate, SMALL.seed + 2, n)
    direct = [a == f"\\boxed{{{item['answer']}}}" for (_, a), item in zip(pairs, items)]
    chains = [a == tb.chain_solution(item["metadata"]["expression"]) for (_, a), item in zip(pairs, items)]
    assert all(d != c for d, c in zip(direct, chains))  # each answer is exactly one of the two forms
    assert abs(sum(direct) / n - rate) < 4 * math.sqrt(rate * (1 - rate) / n)
    assert [q for q, _ in pairs] == [item["question"] for item in items]


def test_direct_rate_0_draws_only_the_slips():
    """At direct_rate 0 the corpus is the slipped chains with the slips drawn in order from Random(seed), as before
    stage 2 existed: the direct-answer coin is not tossed."""
    import random

    import reasoning_gym

    from nemo_rl_spec.data.datasets import parse_generator

    r = dataclasses.replace(SMALL, slip_rate=0.3, sft_examples=200)
    name, settings = parse_generator(r.generator)
    rng = random.Random(r.seed)
    expected = [
        tb.chain_solution(e, tb.draw_slips(len(e.split()) // 2, 0.3, rng))
        for e in (
            item["metadata"]["expression"]
            for item in reasoning_gym.create_dataset(name, size=200, seed=r.seed, **settings)
        )
    ]
    assert [a for _, a in tb.sft_conversations(r, 0.0)] == expected


def test_on_step_counts_over_both_stages():
    seen = []
    model, tok, losses = tb.train_testbed(
        SMALL, progress=False, on_step=lambda step, m, t: seen.append((step, t.eos_token))
    )
    assert seen == [(s, "<|im_end|>") for s in range(SMALL.sft_steps + SMALL.direct_steps)]
    assert len(losses) == SMALL.sft_steps + SMALL.direct_steps


def test_lr_schedule_by_hand():
    r = dataclasses.replace(tb.TESTBED, lr=1.0, warmup_steps=4, sft_steps=14, min_lr_ratio=0.1)
    assert [tb.lr_at(s, r) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert tb.lr_at(9, r) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)), abs=1e-12)
    assert tb.lr_at(14, r) == pytest.approx(0.1, abs=1e-12)
    assert tb.lr_at(100, r) == pytest.approx(0.1, abs=1e-12)


def test_tokenizer_digits_chat_template_and_round_trip():
    from nemo_rl_spec.data.prompts import format_prompt

    pairs = tb.sft_conversations(SMALL)
    tok = tb.train_tokenizer([f"{tb.SYSTEM_PROMPT}\n{q}\n{a}" for q, a in pairs], 300)
    assert len(tok) <= 300
    digits = [
        t
        for t in tok.convert_ids_to_tokens(tok.encode("12 - 345 = -333", add_special_tokens=False))
        if any(c.isdigit() for c in t)
    ]
    assert all(sum(c.isdigit() for c in t) == 1 for t in digits) and len(digits) == 8
    ids = format_prompt(tok, "sys", "What is 1 + 2?")
    assert (
        tok.decode(ids) == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    text = "7 - 9 = -2\n\\boxed{-2} and unseen text: é ∑"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def _digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def test_two_builds_bitwise_equal_and_loss_falls(tmp_path):
    a = tb.build_testbed(tmp_path / "a", SMALL, progress=False)
    b = tb.build_testbed(tmp_path / "b", SMALL, progress=False)
    assert a == b
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert a[-1] < a[0]
    record = json.loads((tmp_path / "a" / "sft.json").read_text())
    assert record["steps"] == SMALL.sft_steps + SMALL.direct_steps and record["recipe"]["seed"] == SMALL.seed
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert model.config.vocab_size % 128 == 0 and model.config.vocab_size >= len(tok)
    assert model.config.hidden_size // model.config.num_attention_heads == model.config.head_dim


def test_bf16_autocast_changes_the_bits_not_the_loss():
    """The flag reaches the SFT step: the first loss (initial weights, same batch) in bf16 autocast differs from the
    fp32 one in its bits but by under 1% (bf16 has 8 mantissa bits: ~0.4% per rounding, averaged over the batch)."""
    one = dataclasses.replace(SMALL, sft_steps=1, direct_rate=0.0)
    bf16 = tb.train_testbed(one, progress=False)[2]
    fp32 = tb.train_testbed(dataclasses.replace(one, bf16_autocast=False), progress=False)[2]
    assert len(bf16) == len(fp32) == 1
    assert bf16[0] != fp32[0] and bf16[0] == pytest.approx(fp32[0], rel=1e-2)


def test_build_recipe_uses_bf16_autocast_only_on_native_bf16(monkeypatch):
    """Without native bf16 the testbed build runs in fp32 (emulated bf16 is ~50x slower) and the cache marker says so,
    so a cached build made one way is never reused for the other; with native bf16 the recipe is TESTBED itself."""
    from nemo_rl_spec.models import hf_assets

    monkeypatch.setattr(hf_assets, "native_bf16", lambda: (True, ["amx_bf16"]))
    assert hf_assets.testbed_build_recipe() == tb.TESTBED
    native = hf_assets._recipe("testbed-llama")
    assert native["testbed"]["bf16_autocast"] is True
    monkeypatch.setattr(hf_assets, "native_bf16", lambda: (False, []))
    assert hf_assets.testbed_build_recipe() == dataclasses.replace(tb.TESTBED, bf16_autocast=False)
    emulated = hf_assets._recipe("testbed-llama")
    assert emulated["testbed"]["bf16_autocast"] is False
    assert {k: v for k, v in emulated["testbed"].items() if k != "bf16_autocast"} == {
        k: v for k, v in native["testbed"].items() if k != "bf16_autocast"
    }
