"""``policy.generation.top_k`` / ``stop_token_ids`` / ``stop_strings`` (NeMo-RL): what the generation worker hands
vLLM's SamplingParams, and the refused top_k + speculation combination (a ConfigError naming both keys)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nemo_rl_spec.models.generation.vllm_worker import VllmGenerationWorker
from nemo_rl_spec.utils.config import ConfigError, load_config

SPEC = "+policy.generation.vllm_kwargs.speculative_config={method: draft_model, model: x, num_speculative_tokens: 2}"


def _kwargs(*overrides, temperature=1.0):
    cfg = load_config("configs/grpo_math_tiny.yaml", list(overrides)).policy.generation
    return VllmGenerationWorker._stop_kwargs(SimpleNamespace(cfg=cfg), temperature)


def test_sampling_kwargs_follow_the_keys():
    assert _kwargs() == {}  # defaults: all off
    got = _kwargs(
        "policy.generation.top_k=5",
        "policy.generation.stop_token_ids=[7, 9]",
        "policy.generation.stop_strings=['</answer>']",
    )
    assert got == {"top_k": 5, "stop_token_ids": [7, 9], "stop": ["</answer>"]}
    assert "top_k" not in _kwargs("policy.generation.top_k=5", temperature=0.0)  # greedy validation: no top-k
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=4, **got)
    assert (params.top_k, params.stop_token_ids, params.stop) == (5, [7, 9], ["</answer>"])


def test_top_k_with_speculation_is_refused_naming_both_keys():
    with pytest.raises(
        ConfigError,
        match=r"policy.generation.top_k=5 with policy.generation.vllm_kwargs."
        r"speculative_config",
    ):
        load_config("configs/grpo_math_tiny.yaml", ["policy.generation.top_k=5", SPEC])
    load_config("configs/grpo_math_tiny.yaml", [SPEC, "policy.generation.stop_strings=['x']"])  # stops are fine


@pytest.mark.parametrize(
    "override, key",
    [
        ("policy.generation.top_k=0", "policy.generation.top_k"),
        ("policy.generation.stop_strings=['']", "policy.generation.stop_strings"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config("configs/grpo_math_tiny.yaml", [override])
