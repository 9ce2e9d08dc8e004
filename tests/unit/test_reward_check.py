"""Non-finite rewards: the reported failing case, a group of 8 with rewards [nan x 7, 1.0].

The rollout path under test is the real one (RolloutGenerator -> UniformAllocator -> advantages ->
build_train_data -> ClippedPGLossFn); only the two ends are stand-ins: a generation object returning fixed token
rows (no engine needed to score text) and an environment whose reward function returns NaN, as a broken one would.
"""

import math

import pytest
import torch

from nemo_rl_spec.algorithms.advantages import compute_grpo_advantages
from nemo_rl_spec.algorithms.loss.clipped_pg import ClippedPGLossFn
from nemo_rl_spec.algorithms.rollout_allocation import UniformAllocator
from nemo_rl_spec.algorithms.rollouts import RolloutGenerator, build_train_data, selection_reward_valid
from nemo_rl_spec.environments.interfaces import EnvironmentInterface
from nemo_rl_spec.environments.reward_check import NonFiniteRewardError, check_rewards
from nemo_rl_spec.utils.config import ConfigError, load_config

NAN = float("nan")
ISSUE_GROUP = [NAN] * 7 + [1.0]
SECOND_GROUP = [NAN, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
LOSS_CFG = {
    "ratio_clip_min": 0.2,
    "ratio_clip_max": 0.2,
    "token_level_loss": True,
    "reference_policy_kl_penalty": 0.0,
    "reference_policy_kl_type": "k3",
    "use_importance_sampling_correction": False,
    "truncated_importance_sampling_ratio": None,
}


class _FixedRows:
    """generate(): each prompt's ids followed by two response tokens, prompt-major, n rows per prompt."""

    def generate(self, prompts, n, seed, **overrides):
        rows = [ids + [7, 8] for ids in prompts["prompt_token_ids"] for _ in range(n)]
        width = max(map(len, rows))
        return {
            "output_ids": torch.tensor([r + [0] * (width - len(r)) for r in rows]),
            "input_lengths": torch.tensor([len(r) - 2 for r in rows]),
            "unpadded_sequence_lengths": torch.tensor([len(r) for r in rows]),
            "generation_logprobs": torch.full((len(rows), width), -0.5),
            "prompt_index": torch.arange(len(prompts["prompt_token_ids"])).repeat_interleave(n),
            "policy_version": 0,
            "draft_version": None,
            "spec_counters": None,
        }


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _ScriptedRewards(EnvironmentInterface):
    """Reward of each response = the script of its problem (``metadata['rewards']``), in row order."""

    def __init__(self):
        self.seen = {}

    def step(self, responses, metadata):
        out = []
        for meta in metadata:
            k = self.seen.get(meta["id"], 0)
            self.seen[meta["id"]] = k + 1
            out.append(meta["rewards"][k])
        return torch.tensor(out, dtype=torch.float32)


def _selection(groups: dict[int, list[float]], policy: str):
    pool = [{"id": i, "rewards": groups.get(i, [0.0] * 8)} for i in range(max(groups) + 1)]
    alloc = UniformAllocator(
        list(groups), num_prompts_per_step=len(groups), num_generations_per_prompt=8, shuffle=False
    )
    gen_fn = RolloutGenerator(
        _FixedRows(),
        _Tokenizer(),
        _ScriptedRewards(),
        pool,
        lambda problems: [[1, 2 + p["id"]] for p in problems],
        non_finite_reward=policy,
        version=0,
    )
    return alloc.step(gen_fn)


def _loss_and_grad(data):
    prev = torch.full(data["input_ids"].shape, -0.5)
    curr = (prev + 0.05 * torch.arange(prev.numel()).reshape(prev.shape).sin()).requires_grad_(True)
    data = {**data, "prev_logprobs": prev}
    toks = (data["token_mask"] * data["sample_mask"].unsqueeze(1)).sum()
    loss, _ = ClippedPGLossFn(LOSS_CFG)(curr, data, toks, data["sample_mask"].sum())
    loss.backward()
    return loss, curr.grad, curr.detach(), prev


def test_without_the_guard_the_issue_group_poisons_advantages_and_loss():
    """The hazard itself (control): NaN in one reward makes every advantage of its group and the loss NaN."""
    adv = compute_grpo_advantages(torch.tensor(ISSUE_GROUP), 8, False, True)
    assert torch.isnan(adv).all()
    mask = torch.ones(8, 4)
    data = {
        "input_ids": torch.zeros(8, 4, dtype=torch.long),
        "token_mask": mask,
        "sample_mask": torch.ones(8),
        "advantages": adv,
    }
    loss, grad, _, _ = _loss_and_grad(data)
    assert math.isnan(float(loss)) and torch.isnan(grad).all()


def test_error_mode_names_prompt_and_response():
    with pytest.raises(NonFiniteRewardError) as info:
        _selection({5: ISSUE_GROUP}, "error")
    msg = str(info.value)
    assert msg.startswith("7 non-finite reward(s)")
    assert all(f"prompt 5 response {j}: nan" in msg for j in range(7))
    assert "response 7" not in msg and "grpo.non_finite_reward=mask" in msg


@pytest.mark.numerics
def test_mask_mode_keeps_advantages_loss_and_gradients_finite():
    sel = _selection({2: ISSUE_GROUP, 5: SECOND_GROUP}, "mask")
    valid = selection_reward_valid(sel)
    assert [g.prompt_id for g in sel.groups] == [2, 5]
    assert valid.tolist() == [False] * 7 + [True] + [False] + [True] * 7
    assert torch.isfinite(sel.rewards).all()
    adv = compute_grpo_advantages(sel.rewards, 8, False, True, valid=valid)
    # group 2: one valid reward -> zero spread -> 0. Group 5, valid [1,0,1,1,0,0,0]: mean 3/7, Bessel std
    # sqrt((3 (4/7)^2 + 4 (3/7)^2) / 6) = sqrt(2/7); a 1 gets (4/7)/sqrt(2/7), a 0 gets -(3/7)/sqrt(2/7)
    hi, lo = (4 / 7) / math.sqrt(2 / 7), -(3 / 7) / math.sqrt(2 / 7)
    expected = [0.0] * 8 + [0.0] + [hi if r == 1.0 else lo for r in SECOND_GROUP[1:]]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)

    data = build_train_data(sel, adv, pad_token_id=0)
    assert data["sample_mask"].tolist() == valid.float().tolist()
    loss, grad, curr, prev = _loss_and_grad(data)
    assert math.isfinite(float(loss)) and torch.isfinite(grad).all()
    assert (grad[~valid] == 0).all() and (grad[valid] != 0).any()
    # independent: token-level clipped PG over the valid rows' response tokens only
    m = data["token_mask"][valid].bool()
    ratio = (curr[valid] - prev[valid]).exp()
    a = adv[valid].unsqueeze(1).expand_as(ratio)
    pg = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    # Same per-token terms, summed in another order (the loss adds zeros at masked tokens too): two orders of the n
    # terms differ by <= 2 n eps sum|terms| (docs/design/numerical_tolerances.md); the terms have both signs
    # (advantages sum to zero in a group), so the bound is on sum|terms| / n, not on the cancelling mean.
    n = int(m.sum())
    tol = 2 * n * torch.finfo(torch.float32).eps * float(pg[m].abs().mean())
    assert float(loss) == pytest.approx(float(pg[m].mean()), rel=0, abs=tol)


def test_check_rewards_passes_finite_rewards_through_and_masks_inf():
    r = torch.tensor([0.0, 1.0, float("inf"), -float("inf")])
    same, valid = check_rewards(r[:2], 2, "error")
    assert same.tolist() == [0.0, 1.0] and valid.all()
    masked, valid = check_rewards(r, 2, "mask")
    assert masked.tolist() == [0.0, 1.0, 0.0, 0.0] and valid.tolist() == [True, True, False, False]
    with pytest.raises(NonFiniteRewardError, match="prompt 9 response 0: inf; prompt 9 response 1: -inf"):
        check_rewards(r, 2, "error", prompt_ids=[4, 9])


def test_bad_policy_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="grpo.non_finite_reward"):
        load_config("configs/grpo_math_tiny.yaml", ["grpo.non_finite_reward=ignore"])
    assert load_config("configs/grpo_math_tiny.yaml", []).grpo.non_finite_reward == "error"


def test_validation_counts_a_non_finite_reward_as_wrong_in_mask_mode():
    """Validation honours grpo.non_finite_reward: with mask, a NaN/inf reward is a wrong answer (still in the
    denominator) counted in validation/non_finite_rewards; with error, it stops the run naming the problem."""
    from nemo_rl_spec.algorithms.validation import validate

    script = [[1.0], [NAN], [0.0], [1.0], [float("inf")]]
    problems = [{"id": i, "rewards": r} for i, r in enumerate(script)]
    prompt_ids = [[1, 2 + i] for i in range(len(problems))]
    m = validate(_FixedRows(), _Tokenizer(), _ScriptedRewards(), problems, prompt_ids, 2, "mask")
    # hand: rewards [1, 0 (masked nan), 0, 1, 0 (masked inf)] -> accuracy 2/5; 2 non-finite; 2 tokens per answer
    assert m == {
        "validation/accuracy": pytest.approx(0.4, abs=1e-7),
        "validation/mean_response_length": 2.0,
        "validation/avg_length": 2.0,  # NeMo-RL's name of the same mean
        "validation/non_finite_rewards": 2.0,
    }
    clean = validate(_FixedRows(), _Tokenizer(), _ScriptedRewards(), problems[:1] + problems[2:4], prompt_ids[:3], 2)
    assert clean["validation/non_finite_rewards"] == 0.0
    assert clean["validation/accuracy"] == pytest.approx(2 / 3, abs=1e-7)
    with pytest.raises(NonFiniteRewardError, match="prompt 1 response 0: nan; prompt 4 response 0: inf"):
        validate(_FixedRows(), _Tokenizer(), _ScriptedRewards(), problems, prompt_ids, 2, "error")
