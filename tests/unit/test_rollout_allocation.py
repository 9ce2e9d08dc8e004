"""Uniform GRPO and DAPO dynamic-sampling allocators, the prompt stream, the shared protocol and the factory.

Scripted pools (H = all wrong, E = all right, M = alternating 1, 0, ...) make every outcome deterministic; the
expected batches, kept/discarded groups and rollout counts are worked out by hand in the comments.
"""

from __future__ import annotations

import io

import pytest
import torch
from pydantic import ValidationError

from nemo_rl_spec.algorithms.allocators import build_rollout_allocator
from nemo_rl_spec.algorithms.interfaces import RolloutAllocator, RolloutRequest, RolloutResult, Stage, TrainGroup
from nemo_rl_spec.algorithms.rollout_allocation import (
    DynamicSamplingAllocator,
    PromptStream,
    UniformAllocator,
    group_reward_stats,
    mix_seed,
    requests_by_n,
)
from nemo_rl_spec.utils.feature_configs import DynamicSamplingConfig, PilotCommitConfig

P_OF_KIND = {"H": 0.0, "M": 0.5, "E": 1.0}


def scripted_generate(kinds: str, calls: list, version: int = 0):
    def generate(requests):
        calls.append(list(requests))
        out = []
        for r in requests:
            p = P_OF_KIND[kinds[r.prompt_id]]
            rewards = [float(i % 2 == 0) for i in range(r.n)] if p == 0.5 else [p] * r.n
            out.append(r.result(rewards, version))
        return out

    return generate


def ids(sel):
    return [g.prompt_id for g in sel.groups]


# ----------------------------------------------------------------------------------------------- stream
def test_prompt_stream_epochs_eviction_and_partial_batches():
    s = PromptStream(range(5), seed=0, shuffle=False)
    assert [s.next_batch(2) for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]  # no batch crosses an epoch
    assert s.epoch == 1
    s.evict(3)
    assert s.next_batch(2) == [2, 4]  # evicted 3 skipped in the running epoch
    assert s.next_batch(10) == [0, 1, 2, 4] and s.epoch == 2  # and gone from the next permutation
    for pid in (0, 1, 2, 4):
        s.evict(pid)
    assert s.next_batch(3) == [] and s.pool_size == 0 and s.epoch == 2
    t = PromptStream(range(4), seed=0, shuffle=False)
    assert t.next_batch(2) == [0, 1]
    t.evict(2), t.evict(3)  # the rest of the epoch is evicted:
    assert t.next_batch(2) == [0, 1] and t.epoch == 1  # [] would mean "pool empty", so start anew


def test_prompt_stream_shuffle_is_seeded_permutation_and_round_trips():
    a, b = PromptStream(range(50), seed=3), PromptStream(range(50), seed=3)
    first = a.next_batch(50)
    assert sorted(first) == list(range(50)) and first != list(range(50))
    assert first == b.next_batch(50)
    assert a.next_batch(50) != first  # a new permutation per epoch
    assert PromptStream(range(50), seed=4).next_batch(50) != first
    a.next_batch(7)
    c = PromptStream(range(50), seed=3)
    c.load_state_dict(a.state_dict())
    assert c.next_batch(100) == a.next_batch(100)
    with pytest.raises(ValueError, match="different pool|differs"):
        PromptStream(range(49), seed=3).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="empty"):
        PromptStream([], seed=0)
    with pytest.raises(ValueError, match="unique"):
        PromptStream([1, 1], seed=0)


def test_mix_seed_is_deterministic_and_spreads():
    assert mix_seed(1, 2, 3) == mix_seed(1, 2, 3)
    seeds = {
        mix_seed(7, step, rnd, stage, pid)
        for step in range(20)
        for rnd in range(3)
        for stage in range(3)
        for pid in range(20)
    }
    assert len(seeds) == 20 * 3 * 3 * 20
    assert all(0 <= s < 2**31 for s in seeds)


def test_requests_by_n_groups_indices():
    reqs = [RolloutRequest(i, n, Stage.PILOT, 0, 0) for i, n in enumerate([4, 4, 2, 2, 2])]
    assert requests_by_n(reqs) == {4: [0, 1], 2: [2, 3, 4]}


def test_group_reward_stats_hand_values():
    g1 = TrainGroup(0, [RolloutResult(0, Stage.GROUP, [1.0, 0.0, 0.0, 0.0], 0)])  # var 3/16
    g2 = TrainGroup(1, [RolloutResult(1, Stage.GROUP, [1.0, 1.0, 1.0, 1.0], 0)])  # zero advantage
    assert group_reward_stats([g1, g2]) == (pytest.approx(3 / 32, abs=1e-7), 0.5, 4)
    assert group_reward_stats([]) == (0.0, 0.0, 0)


def test_train_selection_flat_views():
    from nemo_rl_spec.algorithms.interfaces import TrainSelection

    pilot = RolloutResult(3, Stage.PILOT, [1.0, 0.0], 4, payload="p3")
    commit = RolloutResult(3, Stage.COMMIT, [1.0, 1.0, 0.0], 5, payload="c3")
    other = RolloutResult(8, Stage.COMMIT, [0.0, 0.0, 1.0, 1.0, 0.0], 5, payload="c8")
    sel = TrainSelection(0, [TrainGroup(3, [pilot, commit]), TrainGroup(8, [other])])
    assert sel.rewards.tolist() == [1, 0, 1, 1, 0, 0, 0, 1, 1, 0]
    assert sel.policy_versions.tolist() == [4, 4, 5, 5, 5, 5, 5, 5, 5, 5]
    assert [r.payload for r in sel.results] == ["p3", "c3", "c8"]
    assert sel.group_size == 5 and sel.num_rollouts == 10 and sel.max_policy_lag(6) == 2
    with pytest.raises(ValueError, match="different sizes"):
        _ = TrainSelection(0, [TrainGroup(3, [pilot]), TrainGroup(8, [other])]).group_size
    empty = TrainSelection(1, [])
    assert (empty.rewards.numel(), empty.policy_versions.numel(), empty.group_size) == (0, 0, 0)
    assert empty.group_ids.tolist() == []


def test_train_selection_group_ids_unequal_groups_and_their_advantages():
    """Pilot-Commit's fill_commit_budget trains on groups of different sizes: the row -> group map and the GRPO
    advantages the training step computes from it (group means 3/5 and 1/3, hand-worked), with a masked row."""
    from nemo_rl_spec.algorithms.advantages import compute_grpo_advantages_by_group
    from nemo_rl_spec.algorithms.interfaces import TrainSelection

    a = TrainGroup(
        3, [RolloutResult(3, Stage.PILOT, [1.0, 0.0], 4), RolloutResult(3, Stage.COMMIT, [1.0, 1.0, 0.0], 5)]
    )
    b = TrainGroup(8, [RolloutResult(8, Stage.COMMIT, [0.0, 1.0, 0.0], 5)])
    sel = TrainSelection(0, [a, b])
    assert sel.group_ids.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    adv = compute_grpo_advantages_by_group(sel.rewards, sel.group_ids, False, False)
    want = [0.4, -0.6, 0.4, 0.4, -0.6, -1 / 3, 2 / 3, -1 / 3]
    assert adv.tolist() == pytest.approx(want, abs=1e-6)
    valid = torch.tensor([True, True, True, True, False, True, True, True])  # row 4 masked: group a = [1,0,1,1]
    adv = compute_grpo_advantages_by_group(sel.rewards, sel.group_ids, False, False, valid=valid)
    assert adv.tolist() == pytest.approx([0.25, -0.75, 0.25, 0.25, 0.0, -1 / 3, 2 / 3, -1 / 3], abs=1e-6)


def test_result_validation():
    with pytest.raises(ValueError, match="NaN"):
        RolloutResult(0, Stage.GROUP, [float("nan")], 0)
    with pytest.raises(ValueError, match="1-D"):
        RolloutResult(0, Stage.GROUP, [[1.0]], 0)
    with pytest.raises(ValueError, match="asked for 3 rollouts, got 2"):
        RolloutRequest(0, 3, Stage.GROUP, 0, 0).result([1.0, 0.0], 0)


# ----------------------------------------------------------------------------------------------- uniform
def test_uniform_grpo_hand_computed():
    calls: list = []
    alloc = UniformAllocator(range(5), num_prompts_per_step=2, num_generations_per_prompt=3, shuffle=False)
    gen = scripted_generate("MEHMM", calls)
    sels = [alloc.step(gen) for _ in range(4)]
    assert [ids(s) for s in sels] == [[0, 1], [2, 3], [4], [0, 1]]
    assert [s.metrics["rollout_alloc/step_rollouts"] for s in sels] == [6, 6, 3, 6]
    assert sels[-1].metrics["rollout_alloc/cumulative_rollouts"] == 21
    # M [1,0,1]: var 2/9; E: 0 (zero advantage). step 0: mean var 1/9, zero frac 1/2
    assert sels[0].metrics["rollout_alloc/mean_group_reward_var"] == pytest.approx(1 / 9, abs=1e-7)
    assert sels[0].metrics["rollout_alloc/zero_adv_group_frac"] == 0.5
    assert sels[1].metrics["rollout_alloc/zero_adv_group_frac"] == 0.5
    assert sels[2].metrics["rollout_alloc/zero_adv_group_frac"] == 0.0
    # useful rollouts: 3 (step 0) + 3 (step 1) + 3 + 3 = 12 of 21
    assert sels[-1].metrics["rollout_alloc/useful_rollout_frac"] == pytest.approx(12 / 21)
    assert [s.metrics["rollout_alloc/epoch"] for s in sels] == [0, 0, 0, 1]
    assert all(r.stage == Stage.GROUP and r.n == 3 for c in calls for r in c)


def test_uniform_pool_smaller_than_batch():
    alloc = UniformAllocator(range(3), num_prompts_per_step=4, num_generations_per_prompt=2, seed=2)
    calls: list = []
    sels = [alloc.step(scripted_generate("MMM", calls)) for _ in range(5)]
    assert all(sorted(ids(s)) == [0, 1, 2] for s in sels)
    assert [s.metrics["rollout_alloc/epoch"] for s in sels] == [0, 1, 2, 3, 4]


# ----------------------------------------------------------------------------------------------- DAPO
def test_dynamic_sampling_hand_computed():
    # pool H M E M H H, 2 prompts x 4 rollouts per batch, up to 3 batches
    # step 0: [0,1] keep 1 | [2,3] keep 3 -> full after 2 batches (16 rollouts)
    # step 1: [4,5] none | (epoch 1) [0,1] keep 1 | [2,3] keep 3 -> full after 3 batches (24 rollouts);
    #         discarded 4, 5, 0, 2: 4 of 6 generated groups had zero advantage
    calls: list = []
    alloc = DynamicSamplingAllocator(range(6), 2, 4, max_gen_batches=3, shuffle=False)
    gen = scripted_generate("HMEMHH", calls)
    s0, s1 = alloc.step(gen), alloc.step(gen)
    assert ids(s0) == [1, 3] and ids(s1) == [1, 3]
    assert [
        s0.metrics[k]
        for k in (
            "dynamic_sampling/gen_batches",
            "dynamic_sampling/kept_groups",
            "dynamic_sampling/discarded_groups",
            "dynamic_sampling/batch_incomplete",
        )
    ] == [2, 2, 2, 0]
    assert s0.metrics["rollout_alloc/step_rollouts"] == 16 and s1.metrics["rollout_alloc/step_rollouts"] == 24
    assert s1.metrics["rollout_alloc/cumulative_rollouts"] == 40
    assert s1.metrics["dynamic_sampling/discarded_groups"] == 4
    assert s1.metrics["dynamic_sampling/generated_zero_adv_frac"] == pytest.approx(4 / 6, abs=1e-12)
    assert s0.metrics["rollout_alloc/zero_adv_group_frac"] == 0.0  # only groups with a spread are trained
    assert [[r.prompt_id for r in c] for c in calls] == [[0, 1], [2, 3], [4, 5], [0, 1], [2, 3]]


def test_dynamic_sampling_stops_at_max_gen_batches():
    # max 2 batches: step 1 = [4,5] none, [0,1] keep 1 -> incomplete batch of 1 group, 16 rollouts
    alloc = DynamicSamplingAllocator(range(6), 2, 4, max_gen_batches=2, shuffle=False)
    gen = scripted_generate("HMEMHH", [])
    alloc.step(gen)
    s1 = alloc.step(gen)
    assert ids(s1) == [1]
    assert s1.metrics["dynamic_sampling/batch_incomplete"] == 1
    assert s1.metrics["rollout_alloc/step_rollouts"] == 16


def test_dynamic_sampling_all_hard_terminates_with_empty_batch():
    alloc = DynamicSamplingAllocator(range(5), 2, 4, max_gen_batches=4, seed=1)
    calls: list = []
    sels = [alloc.step(scripted_generate("HHHHH", calls)) for _ in range(10)]
    assert all(s.groups == [] for s in sels)
    assert all(s.metrics["dynamic_sampling/gen_batches"] == 4 for s in sels)
    # each step: 4 batches of the 2-2-1 epoch pattern; total rollouts = 4 rollouts x prompts generated
    assert sels[-1].metrics["rollout_alloc/cumulative_rollouts"] == 4 * sum(len(c) for c in calls)
    assert len(calls) == 40


def test_dynamic_sampling_discards_surplus_groups():
    # pool M H M M, 2 per batch: [0,1] keep 0 | [2,3] keep 2, 3 -> kept 3, train on [0, 2], 1 surplus
    alloc = DynamicSamplingAllocator(range(4), 2, 4, max_gen_batches=5, shuffle=False)
    sel = alloc.step(scripted_generate("MHMM", []))
    assert ids(sel) == [0, 2]
    assert sel.metrics["dynamic_sampling/surplus_groups"] == 1
    assert sel.metrics["rollout_alloc/step_rollouts"] == 16


def test_dynamic_sampling_resume_round_trip():
    gen_a, gen_b = scripted_generate("HMEMHHMEHM", []), scripted_generate("HMEMHHMEHM", [])
    a = DynamicSamplingAllocator(range(10), 3, 4, max_gen_batches=3, seed=9)
    for _ in range(3):
        a.step(gen_a)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    b = DynamicSamplingAllocator(range(10), 3, 4, max_gen_batches=3, seed=9)
    b.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    for _ in range(6):
        sa, sb = a.step(gen_a), b.step(gen_b)
        assert (ids(sa), sa.metrics) == (ids(sb), sb.metrics)


def test_uniform_resume_and_misuse():
    a = UniformAllocator(range(7), 3, 2, seed=4)
    gen = scripted_generate("MMMMMMM", [])
    a.step(gen)
    b = UniformAllocator(range(7), 3, 2, seed=4)
    b.load_state_dict(a.state_dict())
    for _ in range(5):
        assert ids(a.step(gen)) == ids(b.step(gen))
    reqs = a.plan()
    with pytest.raises(RuntimeError, match="between steps"):
        a.state_dict()
    with pytest.raises(ValueError, match="duplicate result"):
        a.observe([reqs[0].result([1.0, 0.0], 0)] * 2 + [r.result([1.0, 0.0], 0) for r in reqs[1:]])
    with pytest.raises(ValueError, match="allocator 'dynamic_sampling'"):
        b.load_state_dict(DynamicSamplingAllocator(range(7), 3, 2, 2).state_dict())


def test_step_raises_when_an_allocator_never_finishes():
    class Stuck(UniformAllocator):
        def observe(self, results):
            self._take(results)
            return None

    with pytest.raises(RuntimeError, match="within 1 rounds"):
        Stuck(range(3), 1, 2).step(scripted_generate("MMM", []))


# ----------------------------------------------------------------------------------------------- config/factory
def test_dynamic_sampling_config():
    assert DynamicSamplingConfig().max_gen_batches == 10
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        DynamicSamplingConfig(max_gen_batches=0)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        DynamicSamplingConfig(max_gen_batch=3)


def test_factory_selects_method():
    kw = dict(num_prompts_per_step=4, num_generations_per_prompt=4, seed=0)
    assert isinstance(build_rollout_allocator(range(8), **kw), UniformAllocator)
    ds = build_rollout_allocator(range(8), dynamic_sampling=DynamicSamplingConfig(max_gen_batches=3), **kw)
    assert isinstance(ds, DynamicSamplingAllocator) and ds.max_rounds_per_step == 3
    off = DynamicSamplingConfig(enabled=False)
    assert isinstance(build_rollout_allocator(range(8), dynamic_sampling=off, **kw), UniformAllocator)
    with pytest.raises(ValueError, match="both enabled"):
        build_rollout_allocator(
            range(8), dynamic_sampling=DynamicSamplingConfig(), pilot_commit=PilotCommitConfig(), **kw
        )
    assert all(isinstance(a, RolloutAllocator) for a in (ds,))
