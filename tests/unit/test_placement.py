"""Placement plan (nemo_rl_spec/distributed/placement.py): layouts worked by hand, rank coordinates against
megatron-core's own RankGenerator, resource accounting per node for every shipped recipe, refusals naming the key."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from nemo_rl_spec.distributed.placement import PlacementPlan, megatron_coordinates, plan_placement
from nemo_rl_spec.utils.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "grpo_math_tiny.yaml"
DP2, DP2_ASYNC = CONFIGS / "grpo_math_tiny_dp2.yaml", CONFIGS / "grpo_math_tiny_dp2_async.yaml"
GPU_RECIPES = sorted(CONFIGS.glob("grpo-*.yaml"))
RECIPES = sorted(CONFIGS.glob("*.yaml"))


def plan(path: Path, *overrides: str) -> PlacementPlan:
    return plan_placement(load_config(path, list(overrides)))


def test_tiny_recipe_is_one_rank_and_one_engine_sharing_one_slot():
    p = plan(TINY)
    assert (p.policy_nodes, p.policy_slots, p.engine_nodes, p.engine_slots) == ([0], [0], [0], [[0]])
    assert (p.dp_size, p.tp_size, p.pp_size, p.num_nodes, p.use_gpus) == (1, 1, 1, 1, False)
    assert (p.cpus_per_node, p.gpus_per_node, p.policy_num_cpus, p.generation_num_cpus) == (1.0, 0, 0.5, 0.5)
    assert p.policy_num_gpus == p.generation_num_gpus == 0.0


def test_dp2_colocated_two_slots_one_rank_and_one_engine_each():
    p = plan(DP2)
    assert p.colocated and p.slots_per_node == 2
    assert (p.policy_nodes, p.policy_slots, p.dp_rank_of) == ([0, 0], [0, 1], [0, 1])
    assert (p.engine_nodes, p.engine_slots) == ([0, 0], [[0], [1]])
    assert p.cpus_per_node == 2.0 == 2 * (0.5 + 0.5)


def test_dp2_async_split_one_node_policy_first_slots_engines_last():
    p = plan(DP2_ASYNC)
    assert not p.colocated and p.slots_per_node == 4
    assert (p.policy_nodes, p.policy_slots, p.dp_size) == ([0, 0], [0, 1], 2)
    assert (p.engine_nodes, p.engine_slots) == ([0, 0], [[2], [3]])
    assert p.cpus_per_node == 2 * 0.5 + 2 * 0.5


def test_two_nodes_colocated_one_rank_and_one_engine_per_node():
    p = plan(TINY, "cluster.num_nodes=2", "cluster.ray_address=auto")
    assert (p.policy_nodes, p.engine_nodes, p.dp_rank_of) == ([0, 1], [0, 1], [0, 1])
    assert p.cpus_per_node == 1.0


@pytest.mark.parametrize("tp, pp, world", [(1, 1, 4), (2, 1, 8), (2, 2, 8), (4, 2, 16), (1, 4, 8), (2, 3, 12)])
def test_rank_coordinates_match_megatron_rank_generator(tp, pp, world):
    """Megatron's own group construction (order tp-cp-ep-dp-pp) is the independent reference."""
    from megatron.core.parallel_state import RankGenerator

    dp = world // (tp * pp)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for axis, index in (("tp", 0), ("dp", 1), ("pp", 2)):
        for group in gen.get_ranks(axis):  # a group: ranks that differ only along `axis`, listed by that coordinate
            coords = [megatron_coordinates(r, tp, dp) for r in group]
            assert [c[index] for c in coords] == list(range(len(group)))
            assert len({tuple(c[i] for i in range(3) if i != index) for c in coords}) == 1


def test_megatron_coordinates_worked_example():
    assert megatron_coordinates(5, tp=2, dp=2) == (1, 0, 1)
    p = plan(
        TINY,
        "cluster.workers_per_node=8",
        "cluster.num_cpus=8",
        "policy.megatron_cfg.tensor_model_parallel_size=2",
        "policy.megatron_cfg.pipeline_model_parallel_size=2",
    )
    assert (p.tp_rank_of, p.dp_rank_of, p.pp_rank_of) == ([0, 1] * 4, [0, 0, 1, 1] * 2, [0] * 4 + [1] * 4)


def test_4n8g_tp2_engines_keep_their_two_gpus_on_one_node():
    p = plan(CONFIGS / "grpo-qwen3-8b-4n8g-eagle3-sync.yaml")
    assert (p.num_nodes, p.gpus_per_node, p.dp_size, p.tp_size, p.num_engines) == (4, 8, 16, 2, 16)
    assert p.engine_slots[:4] == [[0, 1], [2, 3], [4, 5], [6, 7]] and p.engine_nodes == [e // 4 for e in range(16)]
    assert (p.policy_num_gpus, p.generation_num_gpus, p.generation_num_cpus) == (0.5, 0.0, 2.0)
    for r in range(0, 32, 2):  # a TP pair never straddles two nodes
        assert p.policy_nodes[r] == p.policy_nodes[r + 1] and p.dp_rank_of[r] == p.dp_rank_of[r + 1]


def test_8n4g_async_split_gives_generation_the_last_four_nodes():
    p = plan(CONFIGS / "grpo-qwen3-8b-8n4g-eagle3-async.yaml")
    assert p.policy_nodes == [r // 4 for r in range(16)] and p.engine_nodes == [4 + e // 4 for e in range(16)]
    assert (p.policy_num_gpus, p.generation_num_gpus, p.dp_size) == (1.0, 1.0, 16)
    assert p.cpus_per_node == 4.0


def test_gpu_split_engine_with_tp_asks_its_whole_gpus():
    p = plan(CONFIGS / "grpo-qwen3-8b-8n4g-eagle3-async.yaml", "policy.generation.vllm_cfg.tensor_parallel_size=2")
    assert (p.num_engines, p.generation_num_gpus, p.engine_slots[:2]) == (8, 2.0, [[0, 1], [2, 3]])


def _node_demand(p: PlacementPlan) -> list[tuple[float, float]]:
    """(CPUs, GPUs) asked from Ray by the workers placed on each node."""
    cpus, gpus = [0.0] * p.num_nodes, [0.0] * p.num_nodes
    for n in p.policy_nodes:
        cpus[n] += p.policy_num_cpus
        gpus[n] += p.policy_num_gpus
    for n in p.engine_nodes:
        cpus[n] += p.generation_num_cpus
        gpus[n] += p.generation_num_gpus
    return list(zip(cpus, gpus))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_fits_its_bundles_and_uses_every_slot_once(path):
    p = plan(path)
    for cpus, gpus in _node_demand(p):
        assert cpus <= p.cpus_per_node + 1e-9 and gpus <= p.gpus_per_node + 1e-9
    policy_slots = Counter(zip(p.policy_nodes, p.policy_slots))
    engine_slots = Counter((n, s) for n, slots in zip(p.engine_nodes, p.engine_slots) for s in slots)
    assert max(policy_slots.values()) == 1 and max(engine_slots.values()) == 1
    every = {(n, s) for n in range(p.num_nodes) for s in range(p.slots_per_node)}
    if p.colocated:
        assert set(policy_slots) == set(engine_slots) == every
    else:
        assert set(policy_slots) | set(engine_slots) == every and not set(policy_slots) & set(engine_slots)
    assert p.tp_size * p.pp_size * p.dp_size == p.policy_world_size
    assert all(len(s) == p.vllm_tp for s in p.engine_slots)


@pytest.mark.parametrize("path", GPU_RECIPES, ids=lambda p: p.name)
def test_cluster_recipe_plan_matches_its_name(path):
    """<algo>-<model>-<N>n<G>g-...: N nodes x G GPUs, every GPU holds a Megatron rank or an engine's share."""
    nodes, gpus = map(int, re.search(r"-(\d+)n(\d+)g-", path.name).groups())
    p = plan(path)
    assert (p.num_nodes, p.gpus_per_node, p.use_gpus) == (nodes, gpus, True)
    used = p.policy_world_size + (0 if p.colocated else p.num_engines * p.vllm_tp)
    assert used == nodes * gpus
    assert p.num_engines * p.vllm_tp == (nodes * gpus if p.colocated else used - p.policy_world_size)


def test_table_lists_every_worker_with_node_and_slot():
    text = plan(DP2_ASYNC).table()
    assert "split, 1 node(s) x 4 CPU slot(s); bundle per node: 2 CPU, 0 GPU" in text
    assert "DP=2 TP=1 PP=1" in text and "2 vLLM engine(s), TP=1" in text
    for line in (
        "slot 0: policy rank 0 (dp 0, tp 0, pp 0)",
        "slot 1: policy rank 1 (dp 1, tp 0, pp 0)",
        "slot 2: engine 0",
        "slot 3: engine 1",
    ):
        assert line in text
    gpu = plan(CONFIGS / "grpo-qwen3-8b-4n8g-eagle3-sync.yaml").table()
    assert "gpu 7: policy rank 31 (dp 15, tp 1, pp 0) | engine 15, tp rank 1 of 2" in gpu


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["cluster.workers_per_node=3", "cluster.num_cpus=3", "policy.megatron_cfg.tensor_model_parallel_size=2"],
            r"policy.megatron_cfg.tensor_model_parallel_size=2 x pipeline_model_parallel_size=1 = 2 does not divide the 3",
        ),
        (
            ["cluster.workers_per_node=3", "cluster.num_cpus=3", "policy.generation.vllm_cfg.tensor_parallel_size=2"],
            r"policy.generation.vllm_cfg.tensor_parallel_size=2 does not divide the 3 generation slot",
        ),
        (
            [
                "cluster.num_nodes=2",
                "cluster.workers_per_node=3",
                "cluster.ray_address=auto",
                "policy.generation.vllm_cfg.tensor_parallel_size=2",
            ],
            r"policy.generation.vllm_cfg.tensor_parallel_size=2 does not divide the 3 slots per node: an engine would span",
        ),
        (
            ["policy.generation.colocated.enabled=false"],
            r"policy.generation.colocated.resources.gpus_per_node=None: split placement on one node needs",
        ),
        (
            [
                "policy.generation.colocated.enabled=false",
                "cluster.workers_per_node=2",
                "policy.generation.colocated.resources.gpus_per_node=2",
            ],
            r"colocated.resources.gpus_per_node=2: .* 1 .. 1 of the node's 2 \(cluster.workers_per_node=2\)",
        ),
        (
            ["policy.generation.colocated.enabled=false", "cluster.num_nodes=2", "cluster.ray_address=auto"],
            r"policy.generation.colocated.resources.num_nodes=None: split placement on 2 nodes",
        ),
        (
            [
                "policy.generation.colocated.enabled=false",
                "cluster.num_nodes=2",
                "cluster.ray_address=auto",
                "policy.generation.colocated.resources.num_nodes=2",
            ],
            r"resources.num_nodes=2: .*set it to 1 .. 1",
        ),
        (
            [
                "policy.generation.colocated.enabled=false",
                "cluster.num_nodes=2",
                "cluster.ray_address=auto",
                "policy.generation.colocated.resources.num_nodes=1",
                "policy.generation.colocated.resources.gpus_per_node=3",
            ],
            r"resources.gpus_per_node=3: with several nodes generation takes whole nodes",
        ),
        (
            [
                "policy.generation.colocated.enabled=false",
                "cluster.workers_per_node=2",
                "policy.generation.colocated.resources.gpus_per_node=1",
                "policy.generation.colocated.resources.num_nodes=2",
            ],
            r"resources.num_nodes=2 with cluster.num_nodes=1",
        ),
        (["cluster.num_nodes=2"], r"cluster.num_nodes=2 with cluster.ray_address=null"),
        (
            ["cluster.workers_per_node=3"],
            r"needs 3 CPUs on the node .*cluster.workers_per_node=3\) but cluster.num_cpus=2",
        ),
    ],
)
def test_recipes_that_do_not_fit_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        plan(TINY, *overrides)


def test_cpu_fit_is_not_checked_against_num_cpus_on_a_joined_cluster():
    p = plan(TINY, "cluster.workers_per_node=3", "cluster.ray_address=auto")
    assert p.cpus_per_node == 3.0
