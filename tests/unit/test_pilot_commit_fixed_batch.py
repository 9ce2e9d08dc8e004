"""Pilot-Commit with a fixed training batch (``grpo.pilot_commit.fixed_train_batch``) and DAPO's ``batch_multiplier``,
on scripted prompt pools: every prompt's rewards are fixed by its kind, so every pilot outcome, round, group and
rollout count below is worked out by hand in the test's comments (no engine, no model).

Kinds (rewards of a request with n rollouts = the pattern repeated to length n): H all 0, E all 1, M 1, 0, 1, 0 ...,
Q 1, 0, 0, 0 (p_hat 0.25 with 4 pilots). ``K`` = grpo.num_prompts_per_step, groups of n = n_pilot + n_commit.
"""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from nemo_rl_spec.algorithms.allocators import build_rollout_allocator
from nemo_rl_spec.algorithms.interfaces import Stage
from nemo_rl_spec.algorithms.pilot_commit import PilotCommitAllocator, PilotEntry, pilot_std
from nemo_rl_spec.algorithms.pilot_commit_fixed import FixedBatchPilotCommitAllocator
from nemo_rl_spec.algorithms.rollout_allocation import DynamicSamplingAllocator, scaled_count
from nemo_rl_spec.utils.config import ConfigError, load_config
from nemo_rl_spec.utils.feature_configs import DynamicSamplingConfig, PilotCommitConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "grpo_math_tiny.yaml"  # K = 2, n = 4
FIXED = ROOT / "configs" / "grpo_math_testbed_pilot_commit_fixed.yaml"
PATTERN = {"H": [0.0], "E": [1.0], "M": [1.0, 0.0], "Q": [1.0, 0.0, 0.0, 0.0]}


class Scripted:
    """generate_fn with fixed rewards per prompt id (``kinds[pid]`` or ``table[pid]``); records every call's
    requests; results carry ``version`` (the test advances it after each step)."""

    def __init__(self, kinds: str = "", table: dict[int, list[float]] | None = None):
        self.table = table or {pid: PATTERN[k] for pid, k in enumerate(kinds)}
        self.calls: list[list] = []
        self.results: list[list] = []
        self.version = 0

    def __call__(self, requests):
        self.calls.append(list(requests))
        out = [r.result((self.table[r.prompt_id] * r.n)[: r.n], self.version) for r in requests]
        self.results.append(out)
        return out

    def steps(self, alloc, count: int):
        sels = []
        for _ in range(count):
            sels.append(alloc.step(self))
            self.version += 1
        return sels

    def ids_per_call(self):
        return [[r.prompt_id for r in call] for call in self.calls]


def fixed_cfg(**kw) -> PilotCommitConfig:
    base = dict(fixed_train_batch=True, bind_pilot_to_commit=False, n_pilot=2, n_commit=4, pilot_oversampling=1.5)
    base.update(kw)
    return PilotCommitConfig(**base)


def fixed_alloc(pool: int, k: int, **kw) -> FixedBatchPilotCommitAllocator:
    config = fixed_cfg(**kw)
    n = config.n_pilot + config.n_commit
    return FixedBatchPilotCommitAllocator(
        range(pool), config, num_prompts_per_step=k, num_generations_per_prompt=n, shuffle=False
    )


def ids(sel):
    return [g.prompt_id for g in sel.groups]


def m(sel, key):
    return sel.metrics[key]


# ------------------------------------------------------------------------------------------------ re-pilot rounds
def test_re_pilot_rounds_fill_exactly_k_groups_across_an_epoch_boundary():
    """K = 2, groups of 2 pilots + 4 commits, oversampling 1.5. Pool 0..9 = H H M H E M M H H M (id order).
    Step 0: round 1 pilots ceil(1.5 x 2) = 3 prompts [0, 1, 2] -> 2 selected (1 missing); round 2 pilots
    ceil(1.5 x 1) = 2 [3, 4] -> none (4 too easy); round 3 [5, 6] -> both selected: 3 >= K, commit [2, 5], 6 to the
    buffer. Step 1: [7, 8, 9] -> 9; the epoch is used up, so round 2 starts epoch 1 with [0, 1] -> none; round 3
    [2, 3] -> 2: commit [9, 2] (buffered 6 is not needed)."""
    gen = Scripted("HHMHEMMHHM")
    alloc = fixed_alloc(10, 2)
    s0, s1 = gen.steps(alloc, 2)
    assert gen.ids_per_call() == [[0, 1, 2], [3, 4], [5, 6], [2, 5], [7, 8, 9], [0, 1], [2, 3], [9, 2]]
    assert [[r.n for r in call] for call in gen.calls[:4]] == [[2, 2, 2], [2, 2], [2, 2], [4, 4]]
    assert (ids(s0), ids(s1)) == ([2, 5], [9, 2])
    assert s0.group_size == s1.group_size == 6
    assert s0.groups[0].rewards.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]  # pilot [1, 0] then commit [1, 0, 1, 0]
    for sel in (s0, s1):
        assert (m(sel, "pilot_commit/pilot_rounds"), m(sel, "rollout_alloc/gen_rounds")) == (3, 4)
        assert (m(sel, "pilot_commit/short_groups"), m(sel, "rollout_alloc/train_groups")) == (0, 2)
        assert m(sel, "pilot_commit/buffer_size") == 1  # prompt 6, age 0 then 1 (<= max_off_steps 2)
    assert (m(s0, "pilot_commit/selected"), m(s0, "pilot_commit/deferred"), m(s0, "pilot_commit/too_easy")) == (3, 3, 1)
    assert (m(s1, "pilot_commit/deferred"), m(s1, "rollout_alloc/epoch")) == (5, 1)
    assert alloc.max_rounds_per_step == 11  # max_pilot_rounds 10 + the commit round


def test_rollouts_counted_every_pilot_re_pilot_and_commit():
    """The scenario above: each step pilots 7 prompts x 2 (those that did not pass included) and commits 2 x 4,
    22 rollouts; cumulative 44. Checked against an independent count: the sum of n over every request generated."""
    gen = Scripted("HHMHEMMHHM")
    alloc = fixed_alloc(10, 2)
    s0 = alloc.step(gen)
    after_step0 = sum(r.n for call in gen.calls for r in call)
    s1 = alloc.step(gen)
    generated = sum(r.n for call in gen.calls for r in call)
    assert (after_step0, generated) == (22, 44)
    assert [m(s, "rollout_alloc/step_rollouts") for s in (s0, s1)] == [22, 22]
    assert [m(s, "rollout_alloc/cumulative_rollouts") for s in (s0, s1)] == [22, 44]
    assert [(m(s, "pilot_commit/pilot_rollouts"), m(s, "pilot_commit/commit_rollouts")) for s in (s0, s1)] == [
        (14, 8),
        (14, 8),
    ]
    assert m(s1, "pilot_commit/cumulative_pilot_rollouts") == 28
    assert m(s1, "rollout_alloc/train_rollouts") == 12  # only 12 of the 22 are trained on
    # the useful share: both trained groups have a reward spread, 24 of 44 rollouts generated so far
    assert m(s1, "rollout_alloc/useful_rollout_frac") == pytest.approx(24 / 44, abs=1e-12)


def test_bound_reached_trains_a_short_batch():
    """Pool H H H M H H H H, K = 2, oversampling 1.0, max_pilot_rounds 3: rounds [0, 1] -> none, [2, 3] -> 3,
    [4] (1 missing) -> none; the bound is reached, the buffer is empty: one group, short 1.
    Rollouts: 5 pilots x 2 + 1 commit x 4 = 14."""
    gen = Scripted("HHHMHHHH")
    alloc = fixed_alloc(8, 2, pilot_oversampling=1.0, max_pilot_rounds=3)
    sel = alloc.step(gen)
    assert gen.ids_per_call() == [[0, 1], [2, 3], [4], [3]]
    assert ids(sel) == [3]
    assert (m(sel, "pilot_commit/pilot_rounds"), m(sel, "pilot_commit/short_groups")) == (3, 1)
    assert m(sel, "rollout_alloc/step_rollouts") == 14
    assert alloc.max_rounds_per_step == 4


@pytest.mark.parametrize("fallback, groups, rollouts", [("skip", [], 8), ("commit_top", [0, 1], 16)])
def test_everything_too_hard_after_the_bound_uses_the_fallback(fallback, groups, rollouts):
    """All H, K = 2, max_pilot_rounds 2: [0, 1], [2, 3] all deferred; skip trains nothing (short 2), commit_top
    commits the first two too-hard prompts (equal p_hat: pilot order), 4 pilots x 2 + 2 x 4 commits."""
    gen = Scripted("HHHHHH")
    alloc = fixed_alloc(6, 2, pilot_oversampling=1.0, max_pilot_rounds=2, all_too_hard_fallback=fallback)
    sel = alloc.step(gen)
    assert ids(sel) == groups
    assert m(sel, "pilot_commit/short_groups") == 2 - len(groups)
    assert m(sel, "pilot_commit/fallback_used") == 1
    assert m(sel, "rollout_alloc/step_rollouts") == rollouts


def test_a_prompt_piloted_twice_in_one_step_gives_one_group():
    """Pool M H H (smaller than the rounds need), K = 2, oversampling 1.0, max_pilot_rounds 4: [0, 1] -> 0;
    [2] -> none; epoch 1 starts: [0] again (its new pilot replaces the first); [1] -> none. One group of 2 + 4
    whose pilot is the round-3 one, short 1."""
    gen = Scripted("MHH")
    alloc = fixed_alloc(3, 2, pilot_oversampling=1.0, max_pilot_rounds=4)
    sel = alloc.step(gen)
    assert gen.ids_per_call() == [[0, 1], [2], [0], [1], [0]]
    assert ids(sel) == [0] and sel.groups[0].size == 6
    pilot, commit = sel.groups[0].results
    assert pilot is gen.results[2][0] and commit is gen.results[4][0]
    assert (pilot.stage, commit.stage) == (Stage.PILOT, Stage.COMMIT)
    assert m(sel, "pilot_commit/short_groups") == 1


def test_without_re_piloting_a_step_pilots_each_prompt_once():
    """The pool above (M H H, K = 2, oversampling 1.0, max_pilot_rounds 4) with repilot_within_step false: [0, 1] ->
    0; [2] (at most the 1 prompt not yet piloted) -> none; every prompt was piloted, so the rounds end after 2:
    commit [0], short 1, 3 x 2 + 4 = 10 rollouts (re-piloting: 4 pilot rounds, 14). The next step starts afresh:
    epoch 1 pilots [0, 1], then [2]."""
    gen = Scripted("MHH")
    alloc = fixed_alloc(3, 2, pilot_oversampling=1.0, max_pilot_rounds=4, repilot_within_step=False)
    s0, s1 = gen.steps(alloc, 2)
    assert gen.ids_per_call() == [[0, 1], [2], [0], [0, 1], [2], [0]]
    assert ids(s0) == ids(s1) == [0]
    assert (m(s0, "pilot_commit/pilot_rounds"), m(s0, "pilot_commit/short_groups")) == (2, 1)
    assert m(s0, "rollout_alloc/step_rollouts") == 10


def test_without_re_piloting_no_prompt_is_piloted_twice_in_a_step():
    """Shuffled pool of 23 random kinds, K = 4, oversampling 3, with eviction (after 1 solved pilot) shrinking the
    pool: in every step no prompt id appears in two pilot rounds and a step pilots at most the pool it started with.
    The same run with re-piloting does pilot some prompt twice in a step (the check can fail)."""

    def pilots_per_step(repilot: bool) -> list[list[int]]:
        kinds = "".join("HEMQ"[i] for i in torch.randint(0, 4, (23,), generator=torch.Generator().manual_seed(5)))
        gen = Scripted(kinds)
        config = fixed_cfg(
            pilot_oversampling=3.0, repilot_within_step=repilot, evict_after_consecutive_solved=1, n_pilot=4
        )
        alloc = FixedBatchPilotCommitAllocator(
            range(23), config, num_prompts_per_step=4, num_generations_per_prompt=8, seed=1
        )
        steps = []
        for _ in range(6):
            start = len(gen.calls)
            pool = alloc.stream.pool_size
            gen.steps(alloc, 1)
            piloted = [r.prompt_id for call in gen.calls[start:] for r in call if r.stage == Stage.PILOT]
            assert len(set(piloted)) <= pool
            steps.append(piloted)
        return steps

    assert all(len(p) == len(set(p)) for p in pilots_per_step(repilot=False))
    assert any(len(p) > len(set(p)) for p in pilots_per_step(repilot=True))


def test_eviction_and_deferral_across_epochs():
    """Pool E H M M, K = 2, oversampling 1.0, evict after 2 all-solved pilots. Step 0: [0, 1] -> 0 too easy (solved
    1), 1 deferred; [2, 3] -> commit [2, 3]. Step 1 (epoch 1): [0, 1] -> 0 evicted (solved 2), 1 deferred again;
    [2, 3]. Step 2 (epoch 2, pool 1 2 3): [1, 2] -> 2; [3] -> commit [2, 3]. Prompt 0 is never piloted again."""
    gen = Scripted("EHMM")
    alloc = fixed_alloc(4, 2, pilot_oversampling=1.0, evict_after_consecutive_solved=2)
    sels = gen.steps(alloc, 3)
    assert gen.ids_per_call() == [[0, 1], [2, 3], [2, 3], [0, 1], [2, 3], [2, 3], [1, 2], [3], [2, 3]]
    assert [ids(s) for s in sels] == [[2, 3]] * 3
    assert [m(s, "pilot_commit/evicted_total") for s in sels] == [0, 1, 1]
    assert [m(s, "pilot_commit/pool_size") for s in sels] == [4, 3, 3]
    assert [m(s, "pilot_commit/deferred_total") for s in sels] == [1, 2, 3]
    assert [m(s, "pilot_commit/deferred_in_epoch") for s in sels] == [1, 1, 1]
    assert [m(s, "rollout_alloc/epoch") for s in sels] == [0, 1, 2]


# --------------------------------------------------------------------------------------------------- thresholds
def test_thresholds_on_an_eight_pilot_grid_are_inclusive():
    """The reference's 0.125 <= p_hat <= 0.75 on n_pilot = 8: prompt k has k successes of 8 (p_hat = k/8). K = 6,
    oversampling 1.5: one round pilots 9 prompts; k = 1..6 selected (both edges), k = 0 deferred, 7, 8 too easy."""
    table = {k: [1.0] * k + [0.0] * (8 - k) for k in range(9)}
    gen = Scripted(table=table)
    alloc = fixed_alloc(9, 6, n_pilot=8, n_commit=8, p_lower=0.125, p_upper=0.75)
    sel = alloc.step(gen)
    assert gen.ids_per_call()[0] == list(range(9))
    assert ids(sel) == [1, 2, 3, 4, 5, 6]
    assert (m(sel, "pilot_commit/deferred"), m(sel, "pilot_commit/too_easy")) == (1, 2)


def test_thresholds_at_thirds_hit_the_grid_exactly():
    """n_pilot = 3, p_lower = 1/3, p_upper = 2/3: 1 and 2 successes are on the edges and selected (a float32 mean
    of [1, 1, 0] is 0.6666667 > 2/3, which would call it too easy)."""
    table = {k: [1.0] * k + [0.0] * (3 - k) for k in range(4)}
    alloc = fixed_alloc(4, 2, n_pilot=3, n_commit=3, pilot_oversampling=2.0, p_lower=1 / 3, p_upper=2 / 3)
    sel = alloc.step(Scripted(table=table))
    assert ids(sel) == [1, 2]
    assert (m(sel, "pilot_commit/deferred"), m(sel, "pilot_commit/too_easy")) == (1, 1)


# -------------------------------------------------------------------------------------------------- replay buffer
@pytest.mark.parametrize("order, from_buffer", [("oldest", 2), ("pilot_std", 3)])
def test_buffer_fills_by_order_and_expires_by_age(order, from_buffer):
    """n_pilot 4, K = 2, oversampling 2.0, one pilot round a step, max_off_steps 1, fallback skip.
    Pool: 0 M, 1 M, 2 Q, 3 M, 4 M, 5..11 H. Step 0: [0..3] all selected (p_hat .5 .5 .25 .5): commit [0, 1], buffer
    [2 (std 0.433), 3 (std 0.5)]. Step 1: [4..7] -> 4 only; the bound is reached, one slot from the buffer: oldest
    -> 2 (inserted first), pilot_std -> 3 (higher std). Its pilot is one version old (lag 1). Step 2: [8..11] none;
    the other entry (pilot for step 0) is 2 steps old > 1: expired; nothing to train (short 2)."""
    kinds = "MMQMMHHHHHHH"
    gen = Scripted(kinds)
    alloc = fixed_alloc(
        12,
        2,
        n_pilot=4,
        pilot_oversampling=2.0,
        max_pilot_rounds=1,
        max_off_steps=1,
        all_too_hard_fallback="skip",
        buffer_order=order,
    )
    s0, s1, s2 = gen.steps(alloc, 3)
    assert (ids(s0), ids(s1), ids(s2)) == ([0, 1], [4, from_buffer], [])
    assert m(s0, "pilot_commit/buffer_size") == 2
    assert (m(s1, "pilot_commit/from_buffer"), m(s1, "rollout_alloc/max_policy_lag")) == (1, 1)
    assert (m(s2, "pilot_commit/buffer_expired"), m(s2, "pilot_commit/buffer_size")) == (1, 0)
    assert m(s2, "pilot_commit/short_groups") == 2


def test_pilot_std_rank_and_overflow_by_hand():
    """std: p_hat 0.5 -> 0.5, 0.25 and 0.75 -> sqrt(0.1875) = 0.4330 (equal), 0 -> 0. Rank: a (0.5, step 0) and
    c (0.5, step 1): c first (the more recent pilot); then b (0.25, step 1) before d (0.75, step 0); e last.
    Overflow to 2 entries keeps the two highest (c, a); ``oldest`` keeps the two newest insertions (d, e)."""
    assert pilot_std(0.25) == pilot_std(0.75) == pytest.approx(math.sqrt(0.1875), abs=1e-15)
    assert (pilot_std(0.5), pilot_std(0.0), pilot_std(1.0)) == (0.5, 0.0, 0.0)
    entries = [
        PilotEntry(pid, step, p, [])
        for pid, step, p in [(0, 0, 0.5), (1, 1, 0.25), (2, 1, 0.5), (3, 0, 0.75), (4, 1, 0.0)]
    ]
    for order, ranked, kept in [("pilot_std", [2, 0, 1, 3, 4], [2, 0]), ("oldest", [0, 1, 2, 3, 4], [3, 4])]:
        alloc = fixed_alloc(5, 1, buffer_order=order, max_buffer_size=2)
        assert [e.prompt_id for e in alloc._rank_buffer(entries)] == ranked
        alloc._buffer = list(entries)
        alloc._drop_overflow()
        assert [e.prompt_id for e in alloc._buffer] == kept


# ------------------------------------------------------------------------------------------------------- resume
def test_resume_reproduces_later_steps_and_refuses_a_budget_mode_state():
    kinds = "HMQMEHMMHQMHEMMH"
    a, b = (fixed_alloc(16, 3, n_pilot=4, buffer_order="pilot_std", pilot_oversampling=1.5) for _ in range(2))
    gen_a, gen_b = Scripted(kinds), Scripted(kinds)
    gen_a.steps(a, 2)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    gen_b.version = gen_a.version
    for sa, sb in zip(gen_a.steps(a, 5), gen_b.steps(b, 5)):
        assert (ids(sa), sa.metrics) == (ids(sb), sb.metrics)
    budget = PilotCommitAllocator(range(16), PilotCommitConfig(rollout_budget_per_step=16), shuffle=False)
    with pytest.raises(ValueError, match="allocator 'pilot_commit', this is 'pilot_commit_fixed'"):
        a.load_state_dict(budget.state_dict())


# --------------------------------------------------------------------------------------------------------- DAPO
def test_scaled_count_hand_values():
    assert [scaled_count(1.5, 3, round_up=r) for r in (True, False)] == [5, 4]
    assert scaled_count(1.1, 10, round_up=True) == 11  # 11.000000000000002 without the rounding
    assert scaled_count(1.15, 20, round_up=False) == 23  # 22.999999999999996 without the rounding
    assert scaled_count(3.0, 8, round_up=True) == scaled_count(3.0, 8, round_up=False) == 24


def test_dapo_batch_multiplier_generates_more_and_discards_the_surplus():
    """K = 2, n = 4, batch_multiplier 2: one batch of 4 prompts [0..3] = M M M H keeps 3 groups, trains on [0, 1],
    discards 1 surplus (counted) and 1 zero-spread group; all 16 rollouts count."""
    gen = Scripted("MMMHHHHH")
    alloc = DynamicSamplingAllocator(range(8), 2, 4, max_gen_batches=3, shuffle=False, batch_multiplier=2.0)
    sel = alloc.step(gen)
    assert gen.ids_per_call() == [[0, 1, 2, 3]]
    assert ids(sel) == [0, 1]
    assert (m(sel, "dynamic_sampling/surplus_groups"), m(sel, "dynamic_sampling/discarded_groups")) == (1, 1)
    assert (m(sel, "rollout_alloc/step_rollouts"), m(sel, "rollout_alloc/train_rollouts")) == (16, 8)
    assert m(sel, "dynamic_sampling/gen_batches") == 1


def test_dapo_batch_multiplier_from_config_floors():
    """Factory: K = 3, batch_multiplier 1.5 -> floor(4.5) = 4 prompts a batch; pool H H M M | M H H H: batch 1
    keeps 2 and 3, batch 2 keeps 4 -> [2, 3, 4], 2 batches x 4 prompts x 4 = 32 rollouts."""
    gen = Scripted("HHMMMHHH")
    ds = DynamicSamplingConfig(max_gen_batches=5, batch_multiplier=1.5)
    alloc = build_rollout_allocator(
        range(8), num_prompts_per_step=3, num_generations_per_prompt=4, seed=0, dynamic_sampling=ds, shuffle=False
    )
    sel = alloc.step(gen)
    assert gen.ids_per_call() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ids(sel) == [2, 3, 4] and m(sel, "rollout_alloc/step_rollouts") == 32
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        DynamicSamplingConfig(batch_multiplier=0.5)


# ------------------------------------------------------------------------------------------------ config refusals
@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"bind_pilot_to_commit": True}, "fixed_train_batch=true with grpo.pilot_commit.bind_pilot_to_commit=true"),
        ({"rollout_budget_per_step": 64}, "fixed_train_batch=true with grpo.pilot_commit.rollout_budget_per_step=64"),
        ({"fill_commit_budget": True}, "fixed_train_batch=true with grpo.pilot_commit.fill_commit_budget=true"),
        ({"pilot_oversampling": 0.5}, "greater than or equal to 1"),
        ({"max_pilot_rounds": 0}, "greater than or equal to 1"),
        ({"buffer_order": "random"}, "'oldest' or 'pilot_std'"),
    ],
)
def test_fixed_batch_section_refusals(kw, msg):
    with pytest.raises(ValidationError, match=msg):
        fixed_cfg(**kw)


def test_factory_builds_the_fixed_allocator_and_checks_the_group_size():
    config = fixed_cfg(max_pilot_rounds=5)
    alloc = build_rollout_allocator(
        range(8), num_prompts_per_step=2, num_generations_per_prompt=6, seed=0, pilot_commit=config
    )
    assert isinstance(alloc, FixedBatchPilotCommitAllocator)
    assert (alloc.commit_slots, alloc.rollout_budget, alloc.max_rounds_per_step) == (2, None, 6)
    with pytest.raises(ValueError, match="n_pilot \\+ n_commit = 2 \\+ 4 equal to grpo.num_generations_per_prompt = 8"):
        build_rollout_allocator(
            range(8), num_prompts_per_step=2, num_generations_per_prompt=8, seed=0, pilot_commit=config
        )
    with pytest.raises(ValueError, match="needs grpo.pilot_commit.fixed_train_batch=true"):
        FixedBatchPilotCommitAllocator(
            range(8), PilotCommitConfig(), num_prompts_per_step=2, num_generations_per_prompt=6
        )


FIXED_ON = ["grpo.pilot_commit.fixed_train_batch=true", "grpo.pilot_commit.bind_pilot_to_commit=false"]


def test_recipe_config_fixed_mode_resolves_n_commit_and_refuses_mismatches():
    """Tiny recipe: K = 2, n = 4. n_commit left out -> 4 - 2 = 2; set to 3 -> refused naming the three keys; n_pilot
    4 (no commit left) -> refused. The shipped fixed recipe validates with Pilot-Commit on."""
    assert load_config(TINY, FIXED_ON).grpo.pilot_commit.n_commit == 2
    with pytest.raises(ConfigError, match="n_pilot=2 \\+ grpo.pilot_commit.n_commit=3 must equal grpo.num_gen"):
        load_config(TINY, [*FIXED_ON, "grpo.pilot_commit.n_commit=3"])
    with pytest.raises(ConfigError, match="grpo.num_generations_per_prompt=4 must exceed grpo.pilot_commit.n_pilot=4"):
        load_config(TINY, [*FIXED_ON, "grpo.pilot_commit.n_pilot=4"])
    with pytest.raises(ConfigError, match="bind_pilot_to_commit=true"):
        load_config(TINY, ["grpo.pilot_commit.fixed_train_batch=true"])
    pc = load_config(FIXED, ["grpo.pilot_commit.enabled=true"]).grpo.pilot_commit
    assert (pc.fixed_train_batch, pc.n_commit, pc.buffer_order, pc.p_lower, pc.p_upper) == (
        True,
        6,
        "pilot_std",
        0.125,
        0.75,
    )


def test_nemo_rl_dynamic_sampling_spellings_map_onto_the_section():
    g = load_config(
        TINY, ["grpo.use_dynamic_sampling=true", "grpo.dynamic_sampling_max_gen_batches=4", "grpo.batch_multiplier=2"]
    ).grpo
    assert (g.dynamic_sampling.enabled, g.dynamic_sampling.max_gen_batches, g.dynamic_sampling.batch_multiplier) == (
        True,
        4,
        2.0,
    )
    # NeMo-RL's base values with dynamic sampling off: accepted, nothing turned on
    off = load_config(
        TINY, ["grpo.use_dynamic_sampling=false", "grpo.dynamic_sampling_max_gen_batches=10", "grpo.batch_multiplier=1"]
    ).grpo
    assert off.dynamic_sampling is None
    same = load_config(FIXED, ["grpo.dynamic_sampling.enabled=true", "grpo.batch_multiplier=3"]).grpo.dynamic_sampling
    assert (same.enabled, same.batch_multiplier, same.max_gen_batches) == (True, 3.0, 10)


@pytest.mark.parametrize(
    "recipe, overrides, msg",
    [
        (
            FIXED,
            ["grpo.use_dynamic_sampling=true"],
            "grpo.use_dynamic_sampling=true conflicts with grpo.dynamic_sampling.enabled=false",
        ),
        (
            FIXED,
            ["grpo.dynamic_sampling.enabled=true", "grpo.use_dynamic_sampling=false"],
            "grpo.use_dynamic_sampling=false conflicts with grpo.dynamic_sampling.enabled=true",
        ),
        (
            FIXED,
            ["grpo.dynamic_sampling.enabled=true", "grpo.dynamic_sampling_max_gen_batches=3"],
            "grpo.dynamic_sampling_max_gen_batches=3 conflicts with grpo.dynamic_sampling.max_gen_batches=10",
        ),
        (
            FIXED,
            ["grpo.dynamic_sampling.enabled=true", "grpo.batch_multiplier=2"],
            "grpo.batch_multiplier=2 conflicts with grpo.dynamic_sampling.batch_multiplier=3.0",
        ),
        (TINY, ["grpo.batch_multiplier=2"], "grpo.batch_multiplier=2.0 needs DAPO dynamic sampling"),
        (
            FIXED,
            ["grpo.pilot_commit.enabled=true", "grpo.dynamic_sampling.enabled=true"],
            "grpo.pilot_commit and grpo.dynamic_sampling .* are both enabled",
        ),
    ],
)
def test_conflicting_dynamic_sampling_keys_are_refused_naming_both(recipe, overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(recipe, overrides)
