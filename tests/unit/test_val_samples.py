"""NeMo-RL's ``grpo.max_val_samples`` / ``grpo.val_batch_size``: the first max_val_samples problems of the
data.validation set are validated, in generate calls of val_batch_size prompts; bad combinations are ConfigErrors
naming the keys. The generation backend below returns fixed rows; validation's split and means are what is tested.
"""

from __future__ import annotations

import pytest
import torch

from nemo_rl_spec.algorithms.grpo_setup import load_datasets
from nemo_rl_spec.algorithms.validation import validate
from nemo_rl_spec.data.datasets import load_gsm8k_original
from nemo_rl_spec.environments.interfaces import EnvironmentInterface
from nemo_rl_spec.utils.config import ConfigError, load_config


class _Rows:
    """generate(): each prompt followed by (prompt's last id) response tokens; records the batch sizes."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, n, seed, **overrides):
        ids = prompts["prompt_token_ids"]
        self.calls.append(len(ids))
        rows = [p + [9] * p[-1] for p in ids]
        width = max(map(len, rows))
        return {
            "output_ids": torch.tensor([r + [0] * (width - len(r)) for r in rows]),
            "input_lengths": torch.tensor([len(p) for p in ids]),
            "unpadded_sequence_lengths": torch.tensor([len(r) for r in rows]),
            "generation_logprobs": torch.zeros(len(rows), width),
            "prompt_index": torch.arange(len(ids)),
            "policy_version": 0,
            "draft_version": None,
            "spec_counters": None,
        }


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Reward(EnvironmentInterface):
    def step(self, responses, metadata):
        return torch.tensor([m["reward"] for m in metadata], dtype=torch.float32)


def test_val_batch_size_splits_the_calls_and_keeps_the_means():
    problems = [{"reward": r} for r in (1.0, 0.0, 1.0, 1.0, 0.0)]
    prompt_ids = [[1, k] for k in (1, 2, 3, 4, 5)]  # response lengths 1..5
    split, whole = _Rows(), _Rows()
    m = validate(split, _Tok(), _Reward(), problems, prompt_ids, 8, batch_size=2)
    assert split.calls == [2, 2, 1]
    # hand: accuracy 3/5, mean response length (1+2+3+4+5)/5 = 3
    assert m["validation/accuracy"] == pytest.approx(0.6, abs=1e-7) and m["validation/mean_response_length"] == 3.0
    assert validate(whole, _Tok(), _Reward(), problems, prompt_ids, 8) == m and whole.calls == [5]


def test_max_val_samples_caps_the_validated_problems():
    cfg = load_config("configs/grpo_math_tiny.yaml", ["grpo.max_val_samples=3", "grpo.val_batch_size=3"])
    _, val = load_datasets(cfg)
    assert [p["question"] for p in val] == [p["question"] for p in load_gsm8k_original(4)[:3]]
    _, all_val = load_datasets(load_config("configs/grpo_math_tiny.yaml", []))
    assert len(all_val) == cfg.data.validation.max_samples == 4


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["grpo.max_val_samples=5"], r"grpo.max_val_samples=5 exceeds data.validation.max_samples=4"),
        (
            ["grpo.max_val_samples=4", "grpo.val_batch_size=3"],
            r"grpo.max_val_samples=4 is not a multiple of "
            r"grpo.val_batch_size=3",
        ),
        (["grpo.val_batch_size=0"], r"grpo.val_batch_size"),
    ],
)
def test_inconsistent_validation_sizes_are_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("configs/grpo_math_tiny.yaml", overrides)


class _SampledRows(_Rows):
    """Like _Rows, with n rows per prompt, rewarded in the order of a fixed list; records each call's keywords."""

    def __init__(self):
        super().__init__()
        self.kwargs = []

    def generate(self, prompts, n, seed, **overrides):
        self.kwargs.append(dict(n=n, seed=seed, **overrides))
        ids = [p for p in prompts["prompt_token_ids"] for _ in range(n)]
        out = super().generate({"prompt_token_ids": ids}, 1, seed)
        out["prompt_index"] = torch.arange(len(prompts["prompt_token_ids"])).repeat_interleave(n)
        return out


@pytest.mark.parametrize("val_temperature, expected_t", [("0.7", 0.7), ("null", 1.0)])
def test_sampled_validation_uses_the_keys_and_averages_pass_rates(val_temperature, expected_t):
    from types import SimpleNamespace

    from nemo_rl_spec.algorithms.validation import run_validation

    cfg = load_config(
        "configs/grpo_math_tiny.yaml",
        [f"grpo.val_temperature={val_temperature}", "grpo.val_num_generations=3", "policy.generation.temperature=1.0"],
    )
    gen = _SampledRows()
    problems = [{"reward": 1.0}, {"reward": 0.0}]  # every answer of problem 0 right, of problem 1 wrong
    s = SimpleNamespace(
        cfg=cfg, generation=gen, tokenizer=_Tok(), env=_Reward(), val_problems=problems, val_prompt_ids=[[1, 2], [1, 4]]
    )
    m = run_validation(s)
    assert gen.kwargs == [
        dict(n=3, seed=0, temperature=expected_t, max_new_tokens=cfg.policy.generation.max_new_tokens)
    ]
    # hand: rows 2,2,2,4,4,4 tokens, pass rates 1 and 0
    assert m["validation/accuracy"] == 0.5 and m["validation/mean_response_length"] == 3.0


def test_greedy_validation_with_several_answers_is_a_config_error():
    with pytest.raises(ConfigError, match=r"grpo.val_num_generations=4 with grpo.val_temperature=0"):
        load_config("configs/grpo_math_tiny.yaml", ["grpo.val_num_generations=4"])
