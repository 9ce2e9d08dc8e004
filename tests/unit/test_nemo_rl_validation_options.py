"""NeMo-RL's validation and loop options, against hand-worked values: pass@k (``grpo.val_num_generations_per_prompt``),
the validation schedule (``grpo.val_period`` / ``val_start_at`` / ``val_at_end``), the early stop
(``grpo.stop_at_validation_metric`` / ``stop_at_validation_threshold``), sequence masking by log-prob error
(``grpo.seq_logprob_error_threshold``) and validation sampling (``grpo.val_top_p`` / ``val_top_k``, NeMo-RL's
``policy.generation.val_top_p`` / ``val_top_k``). The loop parts run the driver's own ``end_step`` /
``validate_at_start`` (shared by sync and async GRPO) with a real logger and stand-in validation."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nemo_rl_spec.algorithms.grpo import end_step, should_validate, validate_at_start
from nemo_rl_spec.algorithms.seq_logprob_mask import apply_seq_logprob_error_masking
from nemo_rl_spec.algorithms.validation import (
    pass_at_k,
    run_validation,
    validate,
    validation_pass_k,
    validation_stop_message,
)
from nemo_rl_spec.utils import nemo_rl_compat as compat
from nemo_rl_spec.utils.config import ConfigError, load_config
from nemo_rl_spec.utils.config_schema import VALIDATION_METRICS
from nemo_rl_spec.utils.logger import Logger
from tests.unit.test_val_samples import _Reward, _SampledRows, _Tok

ROOT = Path(__file__).resolve().parents[2]
MAIN_LAYOUT = ROOT / "tests" / "fixtures" / "nemo_rl" / "grpo_math_main_layout_tiny.yaml"


def _cfg(*overrides):
    return load_config("configs/grpo_math_tiny.yaml", ["checkpointing.save_period=100", *overrides])


# ---------------------------------------------------------------------------------------------------- pass@k
@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 1, 1, 1 / 5),  # pass@1 = c / n
        (4, 0, 2, 0.0),
        (3, 2, 2, 1.0),  # n - c < k: every pair holds a correct one
        (4, 1, 4, 1.0),  # k = n: any correct answer
        (6, 2, 3, 1 - 4 / 20),  # 1 - C(4,3)/C(6,3)
    ],
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="n=2, c=3"):
        pass_at_k(2, 3, 1)


def test_validation_pass_k_is_the_fraction_of_prompts_with_a_correct_answer():
    # 3 prompts x k=3 answers: prompt 0 one right, prompt 1 none, prompt 2 a partial reward (> 0 counts, as NeMo-RL)
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.0])
    assert validation_pass_k(rewards, 3) == pytest.approx(2 / 3)


def test_validate_reports_pass_k_and_nemo_rl_names_only_with_several_answers():
    problems = [{"reward": 1.0}, {"reward": 0.0}]  # every answer of problem 0 right, of problem 1 wrong
    m3 = validate(_SampledRows(), _Tok(), _Reward(), problems, [[1, 2], [1, 4]], 8, temperature=1.0, num_generations=3)
    # hand: accuracy 3/6, pass_k 1/2, rows of 2,2,2,4,4,4 tokens
    assert (m3["validation/accuracy"], m3["validation/pass_k"]) == (0.5, 0.5)
    assert m3["validation/avg_length"] == m3["validation/mean_response_length"] == 3.0
    m1 = validate(_SampledRows(), _Tok(), _Reward(), problems, [[1, 2], [1, 4]], 8)
    assert "validation/pass_k" not in m1
    assert {k.removeprefix("validation/") for k in m3} <= set(VALIDATION_METRICS)


def test_max_val_samples_counts_prompts_with_k_answers_each():
    cfg = _cfg("grpo.max_val_samples=2", "grpo.val_num_generations=3", "grpo.val_temperature=1.0")
    gen = _SampledRows()
    s = SimpleNamespace(
        cfg=cfg, generation=gen, tokenizer=_Tok(), env=_Reward(), val_problems=[{"reward": 1.0}] * 2,
        val_prompt_ids=[[1, 2], [1, 3]],
    )  # fmt: skip
    run_validation(s)
    assert gen.calls == [2 * 3]  # 2 prompts (max_val_samples) x 3 answers = 6 rollouts


# ---------------------------------------------------------------------------------------------- top-p / top-k
def test_validation_top_p_top_k_reach_the_engine_only_when_set():
    cfg = _cfg("grpo.val_temperature=1.0", "grpo.val_top_p=0.9", "grpo.val_top_k=5")
    gen = _SampledRows()
    s = SimpleNamespace(
        cfg=cfg,
        generation=gen,
        tokenizer=_Tok(),
        env=_Reward(),
        val_problems=[{"reward": 1.0}],
        val_prompt_ids=[[1, 2]],
    )
    run_validation(s)
    assert (gen.kwargs[0]["top_p"], gen.kwargs[0]["top_k"]) == (0.9, 5)
    s.cfg, s.generation = _cfg("grpo.val_temperature=1.0"), _SampledRows()
    run_validation(s)  # null: the rollout values, left to the engine's configuration
    assert "top_p" not in s.generation.kwargs[0] and "top_k" not in s.generation.kwargs[0]


def test_the_engine_samples_validation_with_the_overrides():
    from nemo_rl_spec.models.generation.vllm_worker import VllmGenerationWorker

    cfg = _cfg("policy.generation.top_p=0.95").policy.generation
    w = SimpleNamespace(cfg=cfg, max_model_len=64)
    w._stop_kwargs = lambda t, k=None: VllmGenerationWorker._stop_kwargs(w, t, k)
    params = VllmGenerationWorker._sampling_params(w, 0, 4, 1.0, 8, top_p=0.5, top_k=7)
    assert (params.top_p, params.top_k) == (0.5, 7)
    rollout = VllmGenerationWorker._sampling_params(w, 0, 4, 1.0, 8)
    assert rollout.top_p == pytest.approx(0.95) and rollout.top_k in (0, -1)  # vLLM's "no top-k"


def test_val_top_k_with_speculation_is_refused_naming_both_keys():
    spec = (
        "+policy.generation.vllm_kwargs.speculative_config={method: draft_model, model: x, num_speculative_tokens: 2}"
    )
    with pytest.raises(ConfigError, match=r"grpo.val_top_k=3 with policy.generation.vllm_kwargs.speculative_config"):
        _cfg("grpo.val_top_k=3", spec)


# ------------------------------------------------------------------------------------------------- schedule
def _schedule(max_steps, val_period, val_start_at, val_at_end):
    return [
        d for d in range(1, max_steps + 1) if should_validate(d, val_period, val_start_at, val_at_end, d == max_steps)
    ]


@pytest.mark.parametrize(
    "max_steps, period, start_at, at_end, expected",
    [
        (22, 5, 12, True, [15, 20, 22]),  # 5 and 10 precede val_start_at
        (22, 5, -1, True, [5, 10, 15, 20, 22]),
        (22, 5, -1, False, [5, 10, 15, 20]),
        (20, 5, 15, True, [15, 20]),  # the last step is a period step: validated once
        (22, 0, -1, True, [22]),
        (22, 0, -1, False, []),
        (10, 3, 10, False, []),  # no multiple of 3 in [10, 10]
    ],
)
def test_validation_schedule(max_steps, period, start_at, at_end, expected):
    assert _schedule(max_steps, period, start_at, at_end) == expected


class _Run:
    """What end_step / validate_at_start read of a GRPOSetup: the config, a real logger and the resume point."""

    def __init__(self, cfg, log_dir):
        self.cfg, self.logger = cfg, Logger(log_dir, tensorboard_enabled=False)
        self.state = SimpleNamespace(start_step=0)


def _loop(run, accuracies=()):
    """The driver's per-step tail over max_num_steps steps with stand-in validation (accuracies in call order);
    returns (validated steps, checkpointed steps, steps run)."""
    validated, saved, acc = [], [], iter(accuracies)

    def val(step):
        validated.append(step)
        return {"validation/accuracy": next(acc, 0.0), "validation/mean_response_length": 1.0}

    for step in range(run.cfg.grpo.max_num_steps):
        if end_step(run, step, {}, False, lambda d=step + 1: val(d), lambda m, d=step + 1: saved.append(d)):
            return validated, saved, step + 1
    return validated, saved, run.cfg.grpo.max_num_steps


def test_the_loop_validates_on_the_schedule(tmp_path):
    cfg = _cfg("grpo.max_num_steps=7", "grpo.val_period=2", "grpo.val_start_at=3", "grpo.val_at_end=true")
    assert _loop(_Run(cfg, tmp_path))[:2] == ([4, 6, 7], [7])
    off = _cfg("grpo.max_num_steps=7", "grpo.val_period=0", "grpo.val_at_end=false")
    assert _loop(_Run(off, tmp_path / "off"))[0] == []


def test_val_at_end_defaults_to_nemo_rl_false_and_this_projects_recipes_set_it():
    base = load_config("configs/grpo_math_base.yaml", [])
    assert (base.grpo.val_at_end, base.grpo.val_start_at) == (False, -1)
    assert _cfg().grpo.val_at_end is True


# ------------------------------------------------------------------------------------------------ early stop
def test_early_stop_after_the_first_validation_at_the_threshold(tmp_path):
    cfg = _cfg(
        "grpo.max_num_steps=10", "grpo.val_period=2", "grpo.stop_at_validation_metric=accuracy",
        "grpo.stop_at_validation_threshold=0.5",
    )  # fmt: skip
    # validations at steps 2, 4, 6 see 0.2, 0.4, 0.5: 0.5 >= 0.5 stops after step 6, which is checkpointed
    validated, saved, ran = _loop(_Run(cfg, tmp_path), [0.2, 0.4, 0.5, 0.9])
    assert (validated, saved, ran) == ([2, 4, 6], [6], 6)


def test_early_stop_at_start_trains_no_step(tmp_path):
    cfg = _cfg("grpo.stop_at_validation_metric=validation/accuracy", "grpo.stop_at_validation_threshold=0.25")
    assert validate_at_start(_Run(cfg, tmp_path), lambda: {"validation/accuracy": 0.25})
    assert not validate_at_start(_Run(cfg, tmp_path / "b"), lambda: {"validation/accuracy": 0.24})


def test_stop_message_takes_nemo_rl_names_and_names_a_missing_metric():
    m = {"validation/accuracy": 0.4, "validation/pass_k": 0.8}
    assert validation_stop_message(m, "pass_k", 0.75) is not None
    assert validation_stop_message(m, "accuracy", 0.75) is None
    assert validation_stop_message(m, None, None) is None
    with pytest.raises(ValueError, match=r"grpo.stop_at_validation_metric='avg_length'.*\['accuracy', 'pass_k'\]"):
        validation_stop_message(m, "avg_length", 1.0)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["grpo.stop_at_validation_metric=accuracy"], r"needs grpo.stop_at_validation_threshold"),
        (
            ["grpo.stop_at_validation_metric=pass_k", "grpo.stop_at_validation_threshold=0.5"],
            r"grpo.stop_at_validation_metric=pass_k needs grpo.val_num_generations_per_prompt",
        ),
        (["grpo.stop_at_validation_metric=acc", "grpo.stop_at_validation_threshold=0.5"], r"=acc is not one of"),
        (["grpo.seq_logprob_error_threshold=0.5"], r"grpo.seq_logprob_error_threshold"),
    ],
)
def test_bad_option_combinations_are_config_errors_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(*overrides)


# ------------------------------------------------------------------------------------------ log-prob masking
def _lp_data():
    """4 rows of 2 prompt + 2 response positions; |gen - prev| on the response tokens gives err_i by hand:
    row 0: (e^0 + e^0)/2 = 1; row 1: (2 + 4)/2 = 3; row 2: (1.5 + 1.5)/2 = 1.5; row 3 out of the loss already."""
    d = torch.tensor([[0, 0], [math.log(2), math.log(4)], [math.log(1.5), -math.log(1.5)], [math.log(10)] * 2])
    prev = torch.zeros(4, 4)
    gen = torch.cat([torch.full((4, 2), 5.0), d], dim=1)  # prompt positions differ too, outside the mask
    token_mask = torch.tensor([[0, 0, 1, 1]] * 4, dtype=torch.float32)
    return {
        "prev_logprobs": prev,
        "generation_logprobs": gen,
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 1.0, 0.0]),
    }


def test_sequences_above_the_threshold_leave_the_loss():
    data = _lp_data()
    m = apply_seq_logprob_error_masking(data, torch.tensor([1.0, 1.0, 0.0, 1.0]), 2.0)
    assert data["sample_mask"].tolist() == [1.0, 0.0, 1.0, 0.0]  # row 1 (err 3) masked; row 3 was out already
    assert m["train/num_masked_seqs_by_logprob_error"] == 1.0 and m["train/masked_correct_pct"] == 1.0
    assert (m["train/max_seq_mult_prob_error"], m["train/min_seq_mult_prob_error"]) == pytest.approx((3.0, 1.0))
    assert m["train/mean_seq_mult_prob_error"] == pytest.approx(5.5 / 3)
    assert m["train/max_seq_mult_prob_error_after_mask"] == pytest.approx(1.5)
    assert m["train/mean_seq_mult_prob_error_after_mask"] == pytest.approx(1.25)


def test_no_threshold_only_measures_and_the_bound_keeps_equal_errors():
    data = _lp_data()
    m = apply_seq_logprob_error_masking(data, torch.ones(4), None)
    assert data["sample_mask"].tolist() == [1.0, 1.0, 1.0, 0.0] and m["train/num_masked_seqs_by_logprob_error"] == 0
    assert m["train/max_seq_mult_prob_error_after_mask"] == m["train/max_seq_mult_prob_error"] == pytest.approx(3.0)
    data = _lp_data()
    apply_seq_logprob_error_masking(data, torch.ones(4), 1.0)  # row 0's err is exactly 1 <= 1: kept (NeMo-RL's <=)
    assert data["sample_mask"].tolist() == [1.0, 0.0, 0.0, 0.0]


# ------------------------------------------------------------------------------------------- NeMo-RL layout
def test_nemo_rl_layout_turns_the_options_on():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", compat.NemoRLCompatWarning)
        cfg = load_config(
            MAIN_LAYOUT,
            [
                "grpo.val_start_at=4", "grpo.val_at_end=true", "grpo.val_num_generations_per_prompt=4",
                "grpo.stop_at_validation_metric=pass_k", "grpo.stop_at_validation_threshold=0.9",
                "grpo.seq_logprob_error_threshold=2.0", "policy.generation.val_top_p=0.8",
                "policy.generation.val_top_k=null",
            ],
        )  # fmt: skip
    g = cfg.grpo
    assert (g.val_start_at, g.val_at_end, g.val_num_generations) == (4, True, 4)
    assert (g.stop_at_validation_metric, g.stop_at_validation_threshold) == ("pass_k", 0.9)
    assert (g.seq_logprob_error_threshold, g.val_top_p, g.val_top_k) == (2.0, 0.8, None)
