"""Pilot-Commit allocator on synthetic prompt pools with known per-prompt success probabilities.

Scripted pools (rewards fixed by a prompt's kind: H = all wrong, E = all right, M = alternating 1, 0, ...) make
every pilot outcome deterministic, so selections, deferrals, evictions, buffer use and rollout counts are compared
with values computed by hand below. Bernoulli pools (a policy whose success rate rises with the number of training
steps, seeded per request) check the statistics against closed forms within sampling error.
"""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch
from pydantic import ValidationError

from nemo_rl_spec.algorithms.allocators import build_rollout_allocator
from nemo_rl_spec.algorithms.interfaces import RolloutResult, Stage
from nemo_rl_spec.algorithms.pilot_commit import PilotCommitAllocator
from nemo_rl_spec.algorithms.rollout_allocation import UniformAllocator
from nemo_rl_spec.utils.feature_configs import PilotCommitConfig

P_OF_KIND = {"H": 0.0, "M": 0.5, "E": 1.0}


def scripted_rewards(p: float, n: int) -> torch.Tensor:
    """p=0 -> zeros, p=1 -> ones, p=0.5 -> [1, 0, 1, 0, ...]."""
    if p == 0.5:
        return torch.tensor([float(i % 2 == 0) for i in range(n)])
    return torch.full((n,), p)


class Sim:
    """Synthetic policy. ``p_fn(prompt_id, version)`` is the success probability; ``version`` counts training steps
    (it advances after every step that trained on something). ``scripted`` uses :func:`scripted_rewards`, otherwise
    rewards ~ Bernoulli(p) from a torch.Generator seeded with the request's seed."""

    def __init__(self, p_fn, scripted: bool = False, lag: int = 0):
        self.p_fn, self.scripted, self.lag = p_fn, scripted, lag
        self.version = 0
        self.calls: list[list] = []

    def generate(self, requests):
        self.calls.append(list(requests))
        out = []
        for r in requests:
            gen_version = max(self.version - self.lag, 0)
            p = self.p_fn(r.prompt_id, gen_version)
            if self.scripted:
                rewards = scripted_rewards(p, r.n)
            else:
                g = torch.Generator().manual_seed(r.seed)
                rewards = torch.bernoulli(torch.full((r.n,), float(p)), generator=g)
            out.append(r.result(rewards, gen_version, payload={"seed": torch.tensor(r.seed)}))
        return out

    def run(self, alloc, steps: int):
        sels = []
        for _ in range(steps):
            sel = alloc.step(self.generate)
            if sel.groups:
                self.version += 1
            sels.append(sel)
        return sels


def kinds_fn(kinds: str):
    return lambda pid, v: P_OF_KIND[kinds[pid]]


def cfg(**kw) -> PilotCommitConfig:
    base = dict(
        n_pilot=2,
        n_commit=4,
        pilot_batch_size=4,
        rollout_budget_per_step=16,
        p_lower=0.1,
        p_upper=0.9,
        evict_after_consecutive_solved=2,
        max_off_steps=1,
        max_buffer_size=4,
    )
    base.update(kw)
    return PilotCommitConfig(**base)


def group_ids(sel):
    return [g.prompt_id for g in sel.groups]


def m(sel, key):
    return sel.metrics[key]


# --------------------------------------------------------------------------------------- fill_commit_budget
def test_commit_sizes_hand_values():
    big = dict(n_commit=6, pilot_batch_size=16, rollout_budget_per_step=62)  # K = (62 - 32) // 6 = 5
    alloc = PilotCommitAllocator(range(20), cfg(fill_commit_budget=True, **big), shuffle=False)
    assert alloc.commit_slots == 5
    assert [alloc.commit_sizes(n) for n in (0, 1, 2, 4, 5)] == [[], [30], [15, 15], [8, 8, 7, 7], [6] * 5]
    off = PilotCommitAllocator(range(20), cfg(**big), shuffle=False)
    assert off.commit_sizes(2) == [6, 6] and off.commit_sizes(5) == [6] * 5


@pytest.mark.parametrize("fill", [False, True])
def test_fill_commit_budget_spends_the_budget_on_the_committed_prompts(fill):
    """Pool 0..7 = M H H H M E H H, P = 4 x 2 pilots, K = 2 x 4 commits, budget 16: every pilot selects one prompt
    (0, then 4), so without the option a step spends 8 + 4 = 12 and trains on groups of 6; with it the one committed
    prompt gets all 8 commit rollouts: 16 a step, groups of 2 + 8 = 10 (cold start: + 8 pilot rollouts)."""
    sim = Sim(kinds_fn("MHHHMEHH"), scripted=True)
    alloc = PilotCommitAllocator(range(8), cfg(fill_commit_budget=fill), seed=0, shuffle=False)
    sels = sim.run(alloc, 2)
    commit_n = [[r.n for r in call if r.stage == Stage.COMMIT] for call in sim.calls]
    per_step = 16 if fill else 12
    assert commit_n == [[], [8 if fill else 4], [8 if fill else 4]]
    assert [group_ids(s) for s in sels] == [[0], [4]]
    assert [m(s, "rollout_alloc/step_rollouts") for s in sels] == [per_step + 8, per_step]
    assert [m(s, "pilot_commit/commit_rollouts") for s in sels] == [8 if fill else 4] * 2
    for s in sels:
        assert s.num_rollouts == (10 if fill else 6) == s.groups[0].size
        assert s.rewards.tolist() == [1, 0] + [1, 0] * (4 if fill else 2)


# ----------------------------------------------------------------------------------------------- hand-computed
# Pool 0..7 = M E H M M M E H, shuffle off, P=4 pilots x 2, K=(16-8)//4=2 commits x 4, binding on.
# step 0: pilot [0,1,2,3] -> sel 0,3; easy 1 (solved 1x); hard 2.  commit 0,3 + pilot [4,5,6,7]: sel 4,5; easy 6; hard 7
# step 1: commit 4,5 + pilot (epoch 1) [0,1,2,3]: 1 solved 2x -> evicted; hard 2; sel 0,3
# step 2: commit 0,3 + pilot [4,5,6,7]: 6 evicted; hard 7; sel 4,5
# step 3: commit 4,5 + pilot (epoch 2, pool 0 2 3 4 5 7) [0,2,3,4]: sel 0,3,4; hard 2
# step 4: commit 0,3; 4 -> buffer (target step 4) + pilot [5,7]: sel 5; hard 7        (12 rollouts)
# step 5: commit 5 + 4 from the buffer (age 1 <= max_off_steps) + pilot (epoch 3) [0,2,3,4]
HAND = [  # step: groups, step_rollouts, pilot, commit, selected, deferred, too_easy, evicted, pool, buffer, epoch
    (0, [0, 3], 24, 16, 8, 4, 2, 2, 0, 8, 0, 0),
    (1, [4, 5], 16, 8, 8, 2, 1, 0, 1, 7, 0, 1),
    (2, [0, 3], 16, 8, 8, 2, 1, 0, 1, 6, 0, 1),
    (3, [4, 5], 16, 8, 8, 3, 1, 0, 0, 6, 0, 2),
    (4, [0, 3], 12, 4, 8, 1, 1, 0, 0, 6, 1, 2),
    (5, [5, 4], 16, 8, 8, 3, 1, 0, 0, 6, 0, 3),
]


def test_hand_computed_selections_deferrals_evictions_and_counts():
    sim = Sim(kinds_fn("MEHMMMEH"), scripted=True)
    alloc = PilotCommitAllocator(range(8), cfg(), seed=0, shuffle=False)
    sels = sim.run(alloc, len(HAND))
    cumulative = 0
    for sel, row in zip(sels, HAND):
        step, groups, rollouts, pilot, commit, selected, deferred, easy, evicted, pool, buf, epoch = row
        cumulative += rollouts
        assert sel.step == step
        assert group_ids(sel) == groups
        assert m(sel, "rollout_alloc/step_rollouts") == rollouts
        assert m(sel, "rollout_alloc/cumulative_rollouts") == cumulative
        assert (m(sel, "pilot_commit/pilot_rollouts"), m(sel, "pilot_commit/commit_rollouts")) == (pilot, commit)
        assert m(sel, "pilot_commit/selected") == selected
        assert m(sel, "pilot_commit/deferred") == deferred
        assert m(sel, "pilot_commit/too_easy") == easy
        assert m(sel, "pilot_commit/evicted") == evicted
        assert m(sel, "pilot_commit/pool_size") == pool
        assert m(sel, "pilot_commit/buffer_size") == buf
        assert m(sel, "rollout_alloc/epoch") == epoch
        assert m(sel, "pilot_commit/committed") == 2
        assert sel.group_size == 2 + 4 and sel.num_rollouts == m(sel, "rollout_alloc/train_rollouts") == 12
        for g in sel.groups:  # M prompts: pilot [1,0] + commit [1,0,1,0]; var 0.25, never zero-advantage
            assert g.rewards.tolist() == [1, 0, 1, 0, 1, 0]
        assert m(sel, "rollout_alloc/mean_group_reward_var") == 0.25
        assert m(sel, "rollout_alloc/zero_adv_group_frac") == 0.0
    assert sels[0].metrics["rollout_alloc/gen_rounds"] == 2 and sels[1].metrics["rollout_alloc/gen_rounds"] == 1
    assert [m(s, "pilot_commit/evicted_total") for s in sels] == [0, 1, 2, 2, 2, 2]
    # deferred this epoch: {2, 7} in the epoch's 2nd half, {2} right after a new epoch began
    assert [m(s, "pilot_commit/deferred_in_epoch") for s in sels] == [2, 1, 2, 1, 2, 1]
    assert m(sels[5], "pilot_commit/from_buffer") == 1
    # versions: step 5 trains prompt 5 (pilot v4, commit v5) and buffered prompt 4 (pilot v3, commit v5)
    assert sels[5].groups[0].policy_versions.tolist() == [4, 4, 5, 5, 5, 5]
    assert sels[5].groups[1].policy_versions.tolist() == [3, 3, 5, 5, 5, 5]
    assert m(sels[5], "rollout_alloc/max_policy_lag") == 2 and m(sels[1], "rollout_alloc/max_policy_lag") == 1
    assert sels[5].max_policy_lag(current_version=5) == 2
    # the generation calls themselves: step 1's single call = commit 4,5 (n=4) + pilot 0..3 (n=2) for step 2
    call = sim.calls[2]
    assert [(r.prompt_id, r.stage, r.n, r.target_step) for r in call] == [
        (4, Stage.COMMIT, 4, 1),
        (5, Stage.COMMIT, 4, 1),
        (0, Stage.PILOT, 2, 2),
        (1, Stage.PILOT, 2, 2),
        (2, Stage.PILOT, 2, 2),
        (3, Stage.PILOT, 2, 2),
    ]


def test_buffer_entry_expires_after_max_off_steps():
    sim = Sim(kinds_fn("MEHMMMEH"), scripted=True)
    alloc = PilotCommitAllocator(range(8), cfg(max_off_steps=0), seed=0, shuffle=False)
    sels = sim.run(alloc, 6)
    assert group_ids(sels[5]) == [5]  # buffered 4 is one step old > 0: expired
    assert m(sels[5], "pilot_commit/buffer_expired") == 1
    assert m(sels[5], "rollout_alloc/step_rollouts") == 4 + 8


def test_buffer_overflow_drops_oldest_and_fresh_pilot_supersedes():
    # pool of 8 M prompts, P=8 pilots x 2 = 16, budget 20 -> K=1: 7 surplus per step, buffer capacity 3
    config = cfg(pilot_batch_size=8, rollout_budget_per_step=20, max_buffer_size=3)
    unbound = PilotCommitAllocator(range(8), config.model_copy(update={"bind_pilot_to_commit": False}), shuffle=False)
    sel = Sim(lambda pid, v: 0.5, scripted=True).run(unbound, 1)[0]
    assert group_ids(sel) == [0]
    assert m(sel, "pilot_commit/buffer_dropped") == 4  # surplus 1..7, the oldest four dropped
    assert [e.prompt_id for e in unbound._buffer] == [5, 6, 7]
    assert m(sel, "pilot_commit/buffer_size") == 3
    bound = PilotCommitAllocator(range(8), config, shuffle=False)
    sel = Sim(lambda pid, v: 0.5, scripted=True).run(bound, 1)[0]
    assert m(sel, "pilot_commit/buffer_dropped") == 4
    assert m(sel, "pilot_commit/buffer_size") == 0  # step 0's bound pilot re-piloted 0..7


def test_rising_success_rate_leads_to_eviction():
    # pool [0, 1] (= one batch, so every step is an epoch); prompt 0: M, then E from version 2; prompt 1: H at v0
    # then M. K=(8-4)//2=2.
    p = lambda pid, v: (0.5 if v < 2 else 1.0) if pid == 0 else (0.0 if v < 1 else 0.5)  # noqa: E731
    sim = Sim(p, scripted=True)
    alloc = PilotCommitAllocator([0, 1], cfg(n_commit=2, pilot_batch_size=2, rollout_budget_per_step=8), shuffle=False)
    sels = sim.run(alloc, 6)
    # step 0 (v0): pilot 0 sel, 1 hard; commit 0 + pilot v0 (0 sel, 1 hard)
    # step 1 (v1): commit 0 + pilot v1 (0 sel, 1 sel)   step 2 (v2): commit 0,1 + pilot v2 (0 solved 1x, 1 sel)
    # step 3 (v3): commit 1 + pilot v3 (0 solved 2x -> evicted, 1 sel)   steps 4, 5: commit 1 + pilot [1]
    assert [group_ids(s) for s in sels] == [[0], [0], [0, 1], [1], [1], [1]]
    assert [m(s, "pilot_commit/evicted") for s in sels] == [0, 0, 0, 1, 0, 0]
    assert [m(s, "pilot_commit/pool_size") for s in sels] == [2, 2, 2, 1, 1, 1]
    assert [m(s, "rollout_alloc/step_rollouts") for s in sels] == [4 + 2 + 4, 2 + 4, 4 + 4, 2 + 4, 2 + 2, 2 + 2]
    assert [m(s, "rollout_alloc/epoch") for s in sels] == [1, 2, 3, 4, 5, 6]


def fixed_rewards_generate(table: dict[int, list[float]]):
    """Pilot rewards from ``table[prompt_id]``; commits all 0.5 (irrelevant here)."""

    def generate(requests):
        return [r.result(table[r.prompt_id] if r.stage == Stage.PILOT else [0.5] * r.n, 0) for r in requests]

    return generate


def test_threshold_boundaries_follow_the_paper():
    # p_hat < p_lower too hard, p_hat > p_upper too easy, p_lower <= p_hat <= p_upper selected
    table = {0: [0, 0, 0, 0], 1: [1, 0, 0, 0], 2: [1, 1, 0, 0], 3: [1, 1, 1, 0], 4: [1, 1, 1, 1]}
    config = cfg(
        n_pilot=4,
        pilot_batch_size=5,
        rollout_budget_per_step=20 + 3 * 4,
        p_lower=0.25,
        p_upper=0.75,
        bind_pilot_to_commit=False,
    )
    alloc = PilotCommitAllocator(range(5), config, shuffle=False)
    sel = alloc.step(fixed_rewards_generate(table))
    assert group_ids(sel) == [1, 2, 3]
    assert (m(sel, "pilot_commit/deferred"), m(sel, "pilot_commit/too_easy")) == (1, 1)


def test_commit_top_fallback_prefers_highest_pilot_success_rate():
    # p_lower=0.6 makes p_hat 0, 1/4, 2/4 too hard; K=2 -> the fallback commits 2/4 (prompt 2) then 1/4 (prompt 0)
    table = {0: [1, 0, 0, 0], 1: [0, 0, 0, 0], 2: [1, 1, 0, 0], 3: [0, 0, 0, 0]}
    config = cfg(
        n_pilot=4,
        pilot_batch_size=4,
        rollout_budget_per_step=16 + 2 * 4,
        p_lower=0.6,
        p_upper=0.9,
        bind_pilot_to_commit=False,
    )
    alloc = PilotCommitAllocator(range(4), config, shuffle=False)
    sel = alloc.step(fixed_rewards_generate(table))
    assert group_ids(sel) == [2, 0]
    assert m(sel, "pilot_commit/fallback_used") == 1 and m(sel, "pilot_commit/deferred") == 4


# ----------------------------------------------------------------------------------------------- edge cases
def test_everything_too_hard_commit_top_fallback_runs_logged_and_bounded(caplog):
    # pool of 6 H prompts, P=4, K=2. Batches alternate [0,1,2,3] / [4,5]; the fallback commits the first two
    # (all p_hat tie at 0). Rollouts: step 0 = 8 + 2*4 + 2*2 = 20; odd steps 8 + 8 (pilot [0..3]); even 8 + 4.
    sim = Sim(lambda pid, v: 0.0, scripted=True)
    alloc = PilotCommitAllocator(range(6), cfg(), shuffle=False)
    with caplog.at_level(logging.WARNING, logger="nemo_rl_spec.algorithms.pilot_commit"):
        sels = sim.run(alloc, 40)
    assert len([r for r in caplog.records if "commit_top" in r.getMessage()]) == 40
    assert all(m(s, "pilot_commit/fallback_used") == 1 for s in sels)
    assert m(sels[-1], "pilot_commit/fallback_total") == 40
    assert [group_ids(s) for s in sels[:4]] == [[0, 1], [4, 5], [0, 1], [4, 5]]
    assert all(m(s, "rollout_alloc/zero_adv_group_frac") == 1.0 for s in sels)
    assert all(m(s, "rollout_alloc/gen_rounds") <= 2 for s in sels)
    assert m(sels[-1], "rollout_alloc/cumulative_rollouts") == 20 + 20 * 16 + 19 * 12
    assert m(sels[-1], "rollout_alloc/epoch") == 20  # step 39 drew the pilot of step 40: epoch 20
    assert m(sels[-1], "pilot_commit/pool_size") == 6  # deferred, never dropped


def test_everything_too_hard_skip_fallback_trains_nothing(caplog):
    sim = Sim(lambda pid, v: 0.0, scripted=True)
    alloc = PilotCommitAllocator(range(6), cfg(all_too_hard_fallback="skip"), shuffle=False)
    with caplog.at_level(logging.WARNING, logger="nemo_rl_spec.algorithms.pilot_commit"):
        sels = sim.run(alloc, 30)
    assert all(s.groups == [] and not s.exhausted for s in sels)
    assert len([r for r in caplog.records if "'skip'" in r.getMessage()]) == 30
    assert m(sels[-1], "rollout_alloc/cumulative_rollouts") == 8 + 4 + 15 * 8 + 14 * 4  # pilots only
    assert m(sels[-1], "pilot_commit/commit_rollouts") == 0 and sim.version == 0


def test_everything_too_hard_shuffled_unbound_is_bounded():
    alloc = PilotCommitAllocator(range(7), cfg(bind_pilot_to_commit=False), seed=3)
    sim = Sim(lambda pid, v: 0.0)
    sels = sim.run(alloc, 25)
    assert all(m(s, "rollout_alloc/gen_rounds") == 2 for s in sels)
    assert all(len(s.groups) == 2 for s in sels)  # commit_top fallback every step


def test_everything_solved_is_evicted_and_epoch_ends_cleanly():
    sim = Sim(lambda pid, v: 1.0, scripted=True)
    alloc = PilotCommitAllocator(range(5), cfg(evict_after_consecutive_solved=2), shuffle=False)
    sels = sim.run(alloc, 5)
    # step 0: pilot [0..3] (solved 1x) + pilot [4]; step 1: epoch 1 pilot [0..3] -> evicted; step 2: pilot [4]
    # -> evicted, pool empty -> exhausted; later steps generate nothing.
    assert [s.groups for s in sels] == [[]] * 5
    assert [m(s, "pilot_commit/evicted") for s in sels] == [0, 4, 1, 0, 0]
    assert [s.exhausted for s in sels] == [False, False, True, True, True]
    assert [m(s, "rollout_alloc/step_rollouts") for s in sels] == [10, 8, 2, 0, 0]
    assert len(sim.calls) == 4  # steps 3 and 4 never called generate_fn
    assert m(sels[-1], "rollout_alloc/epoch") == 1
    assert m(sels[-1], "pilot_commit/pool_size") == 0


def test_pool_smaller_than_batch():
    # pool M M H, P=4: every pilot batch is the whole pool (a new epoch), no prompt twice in a batch
    sim = Sim(kinds_fn("MMH"), scripted=True)
    alloc = PilotCommitAllocator(range(3), cfg(), shuffle=False)
    sels = sim.run(alloc, 4)
    assert [group_ids(s) for s in sels] == [[0, 1]] * 4
    assert [m(s, "rollout_alloc/step_rollouts") for s in sels] == [6 + 8 + 6, 14, 14, 14]
    assert [m(s, "rollout_alloc/epoch") for s in sels] == [1, 2, 3, 4]
    assert [m(s, "pilot_commit/deferred_in_epoch") for s in sels] == [1, 1, 1, 1]
    shuffled = PilotCommitAllocator(range(3), cfg(), seed=5)
    sim2 = Sim(lambda pid, v: 0.5)
    sim2.run(shuffled, 10)
    for call in sim2.calls:
        pilots = [r.prompt_id for r in call if r.stage == Stage.PILOT]
        assert sorted(pilots) == [0, 1, 2]


# ----------------------------------------------------------------------------------------------- statistics
def bernoulli_pool(num: int):
    """p_i(v) = clip(0.02 + 0.96 i/(num-1) + 0.002 v, 0, 1): mixed difficulty, rising with training."""
    return lambda pid, v: min(1.0, 0.02 + 0.96 * pid / (num - 1) + 0.002 * v)


def test_pilot_selection_rate_matches_binomial_probability():
    # n_pilot=3, p_lower=0.2, p_upper=0.8: selected iff 1 or 2 of 3 succeed, probability 3p(1-p).
    # Fixed p (no training effect: lag makes every rollout use version 0).
    num = 40
    p0 = [0.05 + 0.9 * i / (num - 1) for i in range(num)]
    config = cfg(
        n_pilot=3,
        n_commit=4,
        pilot_batch_size=8,
        rollout_budget_per_step=40,
        p_lower=0.2,
        p_upper=0.8,
        evict_after_consecutive_solved=10**6,
    )
    alloc = PilotCommitAllocator(range(num), config, seed=11)
    sim = Sim(lambda pid, v: p0[pid], lag=10**9)
    sels = sim.run(alloc, 100)
    piloted = sum(m(s, "pilot_commit/piloted") for s in sels)
    selected = sum(m(s, "pilot_commit/selected") for s in sels)
    # every prompt is piloted once per epoch: count pilots per prompt from the generation calls
    counts = torch.zeros(num)
    for call in sim.calls:
        for r in call:
            if r.stage == Stage.PILOT:
                counts[r.prompt_id] += 1
    q = torch.tensor([3 * p * (1 - p) for p in p0], dtype=torch.float64)
    expected = float((counts * q).sum())
    sd = math.sqrt(float((counts * q * (1 - q)).sum()))
    assert piloted == counts.sum()
    assert abs(selected - expected) <= 4 * sd, (selected, expected, sd)


def test_equal_budget_zero_advantage_uniform_matches_formula_and_pilot_commit_is_lower():
    num, steps, budget = 48, 150, 32
    p_fn = bernoulli_pool(num)
    # uniform GRPO: 4 prompts x 8 rollouts; its zero-advantage group count vs sum over groups of p^n + (1-p)^n
    uni = UniformAllocator(range(num), num_prompts_per_step=4, num_generations_per_prompt=8, seed=1)
    usim = Sim(p_fn)
    expected = var = uni_var = 0.0
    zero = groups = 0
    for _ in range(steps):
        v = usim.version
        sel = uni.step(usim.generate)
        usim.version += 1
        uni_var += m(sel, "rollout_alloc/mean_group_reward_var") / steps
        for g in sel.groups:
            p = p_fn(g.prompt_id, v)
            z = p**8 + (1 - p) ** 8
            expected, var = expected + z, var + z * (1 - z)
            zero += int(g.rewards.max() == g.rewards.min())
            groups += 1
    assert abs(zero - expected) <= 4 * math.sqrt(var), (zero, expected, math.sqrt(var))
    uni_frac = zero / groups
    assert uni_frac > 0.2  # the test pool wastes a lot under uniform GRPO
    # Pilot-Commit at the same budget: 8 pilots x 2 = 16, 4 commits x 4 = 16
    pc = PilotCommitAllocator(
        range(num),
        cfg(
            n_pilot=2,
            n_commit=4,
            pilot_batch_size=8,
            rollout_budget_per_step=budget,
            max_off_steps=2,
            max_buffer_size=16,
        ),
        seed=1,
    )
    psim = Sim(p_fn)
    sels = psim.run(pc, steps)
    assert all(m(s, "rollout_alloc/step_rollouts") <= budget for s in sels[1:])
    assert m(sels[-1], "rollout_alloc/cumulative_rollouts") <= steps * budget + 16  # cold start: one extra pilot
    pc_groups = sum(len(s.groups) for s in sels)
    pc_zero = sum(m(s, "rollout_alloc/zero_adv_group_frac") * len(s.groups) for s in sels)
    assert pc_zero / pc_groups < uni_frac / 5
    pc_var = sum(m(s, "rollout_alloc/mean_group_reward_var") for s in sels) / steps
    assert pc_var > 1.2 * uni_var  # the paper: higher within-group variance
    # metric bookkeeping: uniform groups all have 8 rollouts, so useful share = 1 - zero-advantage share
    assert m(sel, "rollout_alloc/useful_rollout_frac") == pytest.approx(1 - uni_frac, abs=1e-12)
    useful = sum(g.size for s in sels for g in s.groups if g.rewards.max() > g.rewards.min())
    assert m(sels[-1], "rollout_alloc/cumulative_useful_rollouts") == useful
    assert m(sels[-1], "rollout_alloc/cumulative_rollouts") == sum(r.n for c in psim.calls for r in c)


# ----------------------------------------------------------------------------------------------- resume
def pilot_commit_trace(sels):
    return [
        (s.step, [(g.prompt_id, g.rewards.tolist(), g.policy_versions.tolist()) for g in s.groups], s.metrics)
        for s in sels
    ]


def test_resume_mid_epoch_reproduces_every_later_decision():
    num = 20
    config = cfg(
        n_pilot=4, n_commit=4, pilot_batch_size=8, rollout_budget_per_step=40, max_off_steps=2, max_buffer_size=5
    )
    p_fn = bernoulli_pool(num)
    ref = PilotCommitAllocator(range(num), config, seed=7)
    sim = Sim(p_fn)
    sim.run(ref, 6)
    buf = io.BytesIO()
    torch.save(ref.state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert state["buffer"] and state["pending"] and state["deferred"]  # a non-trivial moment to resume at
    assert 0 < state["stream"]["pos"] < len(state["stream"]["order"])  # in the middle of an epoch
    resumed = PilotCommitAllocator(range(num), config, seed=7)
    resumed.load_state_dict(state)
    sim2 = Sim(p_fn)
    sim2.version = sim.version
    n_calls = len(sim.calls)
    a, b = sim.run(ref, 12), sim2.run(resumed, 12)
    assert pilot_commit_trace(a) == pilot_commit_trace(b)
    assert [[(r.prompt_id, r.stage, r.n, r.seed) for r in c] for c in sim.calls[n_calls:]] == [
        [(r.prompt_id, r.stage, r.n, r.seed) for r in c] for c in sim2.calls
    ]
    assert ref.state_dict()["buffer"][0]["results"][0]["payload"]["seed"].dtype == torch.int64


def test_state_dict_mid_step_and_protocol_misuse_raise():
    alloc = PilotCommitAllocator(range(4), cfg(), shuffle=False)
    reqs = alloc.plan()
    with pytest.raises(RuntimeError, match="between steps"):
        alloc.state_dict()
    with pytest.raises(RuntimeError, match="twice"):
        alloc.plan()
    with pytest.raises(ValueError, match="missing result for prompt 3"):
        alloc.observe([r.result([1.0, 0.0], 0) for r in reqs[:3]])
    with pytest.raises(ValueError, match=r"rewards in \[0, 1\]"):
        alloc.observe([r.result([2.0, 0.0], 0) for r in reqs])
    with pytest.raises(ValueError, match="expected 2 rewards"):
        alloc.observe([RolloutResult(r.prompt_id, r.stage, [1.0, 0.0, 1.0], 0) for r in reqs])
    with pytest.raises(ValueError, match="not requested"):
        alloc.observe([r.result([1.0, 0.0], 0) for r in reqs] + [RolloutResult(9, Stage.PILOT, [1.0, 0.0], 0)])
    assert alloc.observe([r.result([1.0, 0.0], 0) for r in reqs]) is None  # the failed calls changed nothing
    with pytest.raises(RuntimeError, match="without a pending plan"):
        alloc.observe([])
    with pytest.raises(ValueError, match="allocator 'uniform'"):
        alloc.load_state_dict(UniformAllocator(range(4), 2, 2).state_dict())


def test_lagged_policy_versions_pass_through_for_async():
    # async generation: rollouts come from a policy two versions behind; the selection reports the lag
    sim = Sim(kinds_fn("MMMM"), scripted=True, lag=2)
    alloc = PilotCommitAllocator(range(4), cfg(), shuffle=False)
    sels = sim.run(alloc, 5)
    last = sels[-1]
    assert last.groups[0].policy_versions.tolist() == [1, 1, 2, 2, 2, 2]  # sim.version was 4 during step 4
    assert last.max_policy_lag(current_version=4) == 3


# ----------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"p_lower": 0.6, "p_upper": 0.4}, "0 <= p_lower < p_upper <= 1"),
        ({"p_lower": 0.5, "p_upper": 0.5}, "0 <= p_lower < p_upper <= 1"),
        ({"p_upper": 1.5}, r"p_upper=1.5 must lie in \[0, 1\]"),
        ({"p_lower": -0.1}, r"p_lower=-0.1 must lie in \[0, 1\]"),
        ({"n_pilot": 1}, "cannot show a reward spread"),
        ({"rollout_budget_per_step": 10}, "leaves no commit slot"),
        ({"n_commit": 0}, "greater than or equal to 1"),
        ({"max_off_steps": -1}, "greater than or equal to 0"),
        ({"all_too_hard_fallback": "retry"}, "commit_top"),
        ({"n_pilots": 3}, "Extra inputs are not permitted"),
    ],
)
def test_config_errors_are_clear(kw, msg):
    with pytest.raises(ValidationError, match=msg):
        cfg(**kw)


def test_factory_selects_pilot_commit_with_uniform_budget():
    config = PilotCommitConfig(n_pilot=2, n_commit=4, pilot_batch_size=4)
    alloc = build_rollout_allocator(
        range(10), num_prompts_per_step=4, num_generations_per_prompt=4, seed=0, pilot_commit=config
    )
    assert isinstance(alloc, PilotCommitAllocator)
    assert (alloc.rollout_budget, alloc.commit_slots) == (16, 2)
    with pytest.raises(ValueError, match="leaves no commit slot"):
        build_rollout_allocator(
            range(10), num_prompts_per_step=2, num_generations_per_prompt=4, seed=0, pilot_commit=config
        )
    off = PilotCommitConfig(enabled=False)
    assert isinstance(
        build_rollout_allocator(
            range(10), num_prompts_per_step=4, num_generations_per_prompt=4, seed=0, pilot_commit=off
        ),
        UniformAllocator,
    )
