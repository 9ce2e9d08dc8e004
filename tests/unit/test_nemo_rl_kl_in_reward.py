"""``loss_fn.use_kl_in_reward`` (NeMo-RL's KL penalty in the reward, REINFORCE++) against hand-worked values: the
per-token KL estimate, the per-token REINFORCE++ advantages, the loss without its own KL term, the schema's rules and
the training step (``train_on_selection``, shared by the sync and the async loop).

Definition matched: NeMo-RL 7ea279ab nemo_rl/algorithms/advantage_estimator.py
(``ReinforcePlusPlusAdvantageEstimator.compute_advantage``), nemo_rl/algorithms/utils.py (``calculate_kl`` with its
default clamps), nemo_rl/algorithms/loss/loss_functions.py (``ClippedPGLossFn``: no KL term when it is in the reward).

The hand-worked example used throughout (2 responses of one prompt, 3 response-token slots, k1, beta = 0.5)::

    rewards r = [1, 0]                       group mean 0.5 -> a = [0.5, -0.5]
    mask      = [[1, 1, 1], [1, 1, 0]]       row 1's last slot is padding
    prev      = [[-1, -2, -1], [-1, -1, -1]]
    ref       = [[-1, -1, -3], [-2, -1, -9]]
    k1 = -(ref - prev) = prev - ref = [[0, -1, 2], [1, 0, 8]]
    beta * k1            = [[0, -0.5, 1], [0.5, 0, 4]]
    a - beta * k1        = [[0.5, 1.0, -0.5], [-1.0, -0.5, (-4.5, padding)]]
    over the 5 tokens in the mask: mu = (0.5 + 1 - 0.5 - 1 - 0.5) / 5 = -0.1
    deviations [0.6, 1.1, -0.4, -0.9, -0.4], var = (0.36 + 1.21 + 0.16 + 0.81 + 0.16) / 5 = 0.54
    sqrt(0.54) = 3 sqrt(6) / 10  ->  A = [[6, 11, -4], [-9, -4, 0]] / (3 sqrt(6))   (0 on padding)

A sign flip (adding the penalty) gives mu = 0.3 and different values; counting the padding slot (penalty 4) moves mu
to -0.833; dropping the KL gives the per-sequence values [0.5, -0.5] whitened.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from nemo_rl_spec.algorithms.advantages import (
    compute_reinforce_plus_plus_advantages,
    compute_reinforce_plus_plus_token_advantages,
    estimate_advantages,
    reward_kl_penalty,
)
from nemo_rl_spec.algorithms.grpo import train_on_selection
from nemo_rl_spec.algorithms.loss import ClippedPGLossFn
from nemo_rl_spec.utils.config import ConfigError, load_config
from nemo_rl_spec.utils.config_schema import GRPOConfig, LossConfig

TINY = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_tiny.yaml"
S6 = 3 * math.sqrt(6)
EXPECTED = [[6 / S6, 11 / S6, -4 / S6], [-9 / S6, -4 / S6, 0.0]]

REWARDS = torch.tensor([1.0, 0.0])
GROUPS = torch.tensor([0, 0])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
PREV = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0]])
REF = torch.tensor([[-1.0, -1.0, -3.0], [-2.0, -1.0, -9.0]])


def _close(got: torch.Tensor, expected, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), atol=atol, rtol=0)


def _grpo(**kw) -> GRPOConfig:
    base = dict(
        num_prompts_per_step=1,
        num_generations_per_prompt=2,
        max_num_steps=1,
        val_period=0,
        val_at_start=False,
        normalize_rewards=True,
        use_leave_one_out_baseline=False,
        seed=0,
        adv_estimator={"name": "reinforce_plus_plus"},
    )
    return GRPOConfig(**{**base, **kw})


# --- the per-token KL estimate --------------------------------------------------------------------------------------


def test_reward_kl_penalty_k1_k2_k3_with_nemo_rl_fixed_clamps():
    # d = ref - prev = [-1, 0, 30]: k1 = -d = [1, 0, -30 -> -10 (output clamp)], k2 = d^2 / 2 = [0.5, 0, 450 -> 10],
    # k3 = e^d - d - 1 = [e^-1, 0, huge -> 10]; times beta = 0.5. The clamps are NeMo-RL's fixed 20 / 10.
    prev, ref = torch.tensor([[-1.0, -1.0, -31.0]]), torch.tensor([[-2.0, -1.0, -1.0]])
    _close(reward_kl_penalty(prev, ref, 0.5, "k1"), [[0.5, 0.0, -5.0]])
    _close(reward_kl_penalty(prev, ref, 0.5, "k2"), [[0.25, 0.0, 5.0]])
    _close(reward_kl_penalty(prev, ref, 0.5, "k3"), [[0.5 * math.exp(-1.0), 0.0, 5.0]])
    _close(reward_kl_penalty(PREV, REF, 0.5, "k1"), [[0.0, -0.5, 1.0], [0.5, 0.0, 4.0]])  # the example's beta * k1
    with pytest.raises(ValueError, match="must be the same"):
        reward_kl_penalty(PREV, REF[:, :2], 0.5, "k1")


# --- the per-token REINFORCE++ advantages ---------------------------------------------------------------------------


def test_token_advantages_of_the_hand_worked_example():
    penalty = reward_kl_penalty(PREV, REF, 0.5, "k1")
    got = compute_reinforce_plus_plus_token_advantages(REWARDS, GROUPS, MASK, penalty, minus_baseline=True)
    _close(got, EXPECTED)
    # the example tells the broken variants apart: the penalty added instead of subtracted, the padding counted
    flipped = compute_reinforce_plus_plus_token_advantages(REWARDS, GROUPS, MASK, -penalty)
    unmasked = compute_reinforce_plus_plus_token_advantages(REWARDS, GROUPS, torch.ones_like(MASK), penalty)
    for wrong in (flipped, unmasked):  # mu 0.3 with the sign flipped, -0.833 with the padding's -4.5 counted
        assert not torch.allclose(wrong[0].double(), torch.tensor(EXPECTED[0], dtype=torch.float64))
    # minus_baseline false: a = r = [1, 0] -> A_raw = [[1, 1.5, 0], [-0.5, 0]], mu = 0.4,
    # deviations [0.6, 1.1, -0.4, -0.9, -0.4]: the same as above, so the same advantages
    got = compute_reinforce_plus_plus_token_advantages(REWARDS, GROUPS, MASK, penalty, minus_baseline=False)
    _close(got, EXPECTED)


def test_zero_penalty_is_the_per_sequence_estimator_on_every_token():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.tensor([[1.0] * 4, [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    per_seq = compute_reinforce_plus_plus_advantages(rewards, groups, mask.sum(1), minus_baseline=True)
    got = compute_reinforce_plus_plus_token_advantages(rewards, groups, mask, torch.zeros_like(mask))
    _close(got, (per_seq.unsqueeze(-1) * mask).tolist())
    none = compute_reinforce_plus_plus_token_advantages(rewards, groups, torch.zeros_like(mask), torch.ones_like(mask))
    assert torch.equal(none, torch.zeros_like(mask))  # no token in the loss: all 0


def test_estimate_advantages_per_token_then_clip_and_only_with_reinforce_plus_plus():
    penalty = reward_kl_penalty(PREV, REF, 0.5, "k1")
    tokens = MASK.sum(1)
    got = estimate_advantages(_grpo(), REWARDS, GROUPS, tokens, token_penalty=penalty, mask=MASK)
    assert got.shape == (2, 3)
    _close(got, EXPECTED)
    clipped = estimate_advantages(
        _grpo(advantage_clip_low=-1.0, advantage_clip_high=1.0),
        REWARDS,
        GROUPS,
        tokens,
        token_penalty=penalty,
        mask=MASK,
    )
    _close(clipped, [[6 / S6, 1.0, -4 / S6], [-1.0, -4 / S6, 0.0]])  # 11 / S6 = 1.497, -9 / S6 = -1.22
    with pytest.raises(ValueError, match="needs grpo.adv_estimator.name=reinforce_plus_plus"):
        estimate_advantages(
            _grpo(adv_estimator={"name": "grpo"}), REWARDS, GROUPS, tokens, token_penalty=penalty, mask=MASK
        )


# --- the loss -------------------------------------------------------------------------------------------------------

LOSS = dict(
    ratio_clip_min=0.2,
    ratio_clip_max=0.2,
    token_level_loss=True,
    reference_policy_kl_penalty=0.5,
    reference_policy_kl_type="k1",
    use_importance_sampling_correction=False,
    truncated_importance_sampling_ratio=None,
)


def test_the_loss_drops_its_kl_term_and_takes_per_token_advantages():
    # curr = prev: ratio 1, pg = -A per token. Per-token A = [[1, 2, 3], [4, 5, 6]], mask as the example (5 tokens):
    # loss = -(1 + 2 + 3 + 4 + 5) / 5 = -3. With use_kl_in_reward the loss has no KL term, whatever reference
    # log-probs the batch carries; without it the same batch adds its KL (below)
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    data = {
        "prev_logprobs": PREV,
        "token_mask": MASK,
        "sample_mask": torch.ones(2),
        "advantages": adv,
        "reference_policy_logprobs": REF,
    }
    in_reward = ClippedPGLossFn({**LOSS, "use_kl_in_reward": True})
    loss, metrics = in_reward(PREV.clone(), data, torch.tensor(5.0), torch.tensor(2.0))
    assert float(loss) == pytest.approx(-3.0) and metrics["kl_penalty"] == 0.0
    loss_kl, metrics_kl = ClippedPGLossFn(LOSS)(PREV.clone(), data, torch.tensor(5.0), torch.tensor(2.0))
    # the KL in the loss: beta * k1 = 0.5 * (curr - ref) = [[0, -0.5, 1], [0.5, 0]] over 5 tokens = 0.2
    assert float(loss_kl) == pytest.approx(-3.0 + 0.2) and metrics_kl["kl_penalty"] == pytest.approx(0.2)
    with pytest.raises(ValueError, match=r"advantages \(2, 2\) must be \[mb\]"):
        in_reward(PREV.clone(), {**data, "advantages": adv[:, :2]}, torch.tensor(5.0), torch.tensor(2.0))


# --- the schema -----------------------------------------------------------------------------------------------------


def test_schema_rules_name_the_key():
    with pytest.raises(ValidationError, match=r"loss_fn.use_kl_in_reward=true needs loss_fn.reference_policy_kl_pen"):
        LossConfig(**{**LOSS, "reference_policy_kl_penalty": 0.0, "use_kl_in_reward": True})
    assert LossConfig(**LOSS).use_kl_in_reward is False  # NeMo-RL's default
    with pytest.raises(ConfigError, match="use_kl_in_reward=true needs loss_fn.reference_policy_kl_penalty > 0"):
        load_config(TINY, ["loss_fn.use_kl_in_reward=true", "grpo.adv_estimator.name=reinforce_plus_plus"])
    with pytest.raises(ConfigError, match="use_kl_in_reward=true needs grpo.adv_estimator.name=reinforce_plus_plus"):
        load_config(TINY, ["loss_fn.use_kl_in_reward=true", "loss_fn.reference_policy_kl_penalty=0.01"])
    cfg = load_config(
        TINY,
        [
            "loss_fn.use_kl_in_reward=true",
            "loss_fn.reference_policy_kl_penalty=0.01",
            "grpo.adv_estimator.name=reinforce_plus_plus",
        ],
    )
    assert cfg.loss_fn.use_kl_in_reward and cfg.grpo.adv_estimator.name == "reinforce_plus_plus"


# --- the training step ----------------------------------------------------------------------------------------------

EOS = 9


class _NoTimer:
    def time(self, name):
        return nullcontext()


def test_step_puts_the_kl_of_pi_old_against_the_reference_in_per_token_advantages():
    # prompt [1, 2] then the responses [5, 5, EOS] and [5, EOS]: response slots are columns 2..4, so the example sits
    # there; columns 0-1 (prompt) carry a KL of 5 (k1) that the mask must keep out. pi_old = the fake trainer's
    # log-probs (the generation log-probs), the reference comes from get_reference_policy_logprobs.
    ids = torch.tensor([[1, 2, 5, 5, EOS], [1, 2, 5, EOS, 0]])
    prev = torch.cat([torch.zeros(2, 2), PREV], dim=1)
    ref = torch.cat([torch.full((2, 2), -5.0), REF], dim=1)
    payload = {
        "output_ids": ids,
        "input_lengths": torch.tensor([2, 2]),
        "sequence_lengths": torch.tensor([5, 4]),
        "generation_logprobs": prev,
    }
    selection = SimpleNamespace(
        results=[SimpleNamespace(payload=payload, rewards=REWARDS)], rewards=REWARDS, group_ids=GROUPS
    )
    trained, asked = {}, []

    def train(data, train_draft=False):
        trained.update(data)
        return {}

    def reference(data, temperature):
        asked.append(temperature)
        return ref.clone()

    overrides = [
        "grpo.adv_estimator.name=reinforce_plus_plus",
        "loss_fn.use_kl_in_reward=true",
        "loss_fn.reference_policy_kl_penalty=0.5",
        "loss_fn.reference_policy_kl_type=k1",
    ]
    s = SimpleNamespace(
        cfg=load_config(TINY, overrides),
        pad_token_id=0,
        tokenizer=SimpleNamespace(eos_token_id=EOS, decode=lambda ids: ""),
        policy=SimpleNamespace(
            get_logprobs=lambda data, t: data["generation_logprobs"].clone(),
            get_reference_policy_logprobs=reference,
            train=train,
        ),
        trains_draft=lambda step: False,
    )
    metrics = train_on_selection(s, selection, timer=_NoTimer(), step=0)
    assert len(asked) == 1
    assert trained["advantages"].shape == (2, 5) and trained["advantages"].dtype == torch.float32
    _close(trained["advantages"], [[0.0, 0.0, *EXPECTED[0]], [0.0, 0.0, *EXPECTED[1]]], atol=1e-6)
    # train/reward_kl_penalty: beta * k1 over the 5 tokens in the loss = (0 - 0.5 + 1 + 0.5 + 0) / 5 = 0.2
    assert metrics["train/reward_kl_penalty"] == pytest.approx(0.2)
