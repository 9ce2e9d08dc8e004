"""Pipeline-parallel placement (nemo_rl_spec/distributed/placement.py): the TP / DP / PP rank groups of the plan, of
its printout and of the worker's ``ParallelLayout.of_rank`` equal megatron-core's own ``RankGenerator`` (order
tp-cp-ep-dp-pp), for the 70B TP 4 x PP 4 recipe and small layouts; a wrong order is told apart (negative control)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nemo_rl_spec.distributed.placement import PlacementPlan, plan_placement
from nemo_rl_spec.models.policy.parallel import ParallelLayout
from nemo_rl_spec.utils.config import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TINY = CONFIGS / "grpo_math_tiny.yaml"
RECIPE_70B = CONFIGS / "grpo-llama3.1-70b-instruct-8n4g-tp4-pp4.yaml"
AXES = ("tp", "dp", "pp")
MEGATRON_ORDER = "tp-cp-ep-dp-pp"


def cpu_plan(tp: int, pp: int, world: int) -> PlacementPlan:
    """One CPU node with ``world`` colocated slots, Megatron TP ``tp`` x PP ``pp`` (DP = the rest)."""
    overrides = [f"cluster.workers_per_node={world}", f"cluster.num_cpus={world}"]
    overrides += [f"policy.megatron_cfg.tensor_model_parallel_size={tp}"]
    overrides += [f"policy.megatron_cfg.pipeline_model_parallel_size={pp}"]
    return plan_placement(load_config(TINY, overrides))


def rank_generator(p: PlacementPlan, order: str = MEGATRON_ORDER):
    from megatron.core.parallel_state import RankGenerator  # lazy: megatron-core is slow to import

    return RankGenerator(tp=p.tp_size, ep=1, dp=p.dp_size, pp=p.pp_size, cp=1, order=order)


def groups_of(coords: list[dict[str, int]], axis: str) -> list[list[int]]:
    """Ranks sharing every coordinate but ``axis`` (``coords[r]``: rank r's {"tp", "dp", "pp"}), each group listed
    by its ``axis`` coordinate, groups by first rank."""
    groups: dict[tuple[int, ...], dict[int, int]] = {}
    for rank, c in enumerate(coords):
        groups.setdefault(tuple(c[a] for a in AXES if a != axis), {})[c[axis]] = rank
    return sorted([g[i] for i in range(len(g))] for g in groups.values())


def plan_coords(p: PlacementPlan) -> list[dict[str, int]]:
    return [{"tp": t, "dp": d, "pp": q} for t, d, q in zip(p.tp_rank_of, p.dp_rank_of, p.pp_rank_of)]


def layout_coords(p: PlacementPlan) -> list[dict[str, int]]:
    """The worker's own coordinates (ParallelLayout.of_rank), asked rank by rank."""
    w = p.policy_world_size
    return [{k[:2]: v for k, v in ParallelLayout.of_rank(r, p.tp_size, p.pp_size, w).items()} for r in range(w)]


def expand(span: str) -> list[int]:
    """Inverse of the printout's rank spans: "4", "0-3", "0,8,..,56", "0,4,9"."""
    if "-" in span:
        lo, hi = map(int, span.split("-"))
        return list(range(lo, hi + 1))
    if ",..," in span:
        head, last = span.split(",..,")
        a, b = map(int, head.split(","))
        return list(range(a, int(last) + 1, b - a))
    return [int(x) for x in span.split(",")]


def printed_groups(text: str, axis: str) -> list[list[int]] | None:
    m = re.search(rf"^  {axis} groups: (.*)$", text, re.M)
    return None if m is None else [expand(s) for s in re.findall(r"\[([^\]]+)\]", m.group(1))]


LAYOUTS = [
    pytest.param(lambda: plan_placement(load_config(RECIPE_70B)), (4, 4, 2), id="70b-8n4g-tp4-pp4-dp2"),
    pytest.param(lambda: cpu_plan(2, 2, 8), (2, 2, 2), id="w8-tp2-pp2-dp2"),
    pytest.param(lambda: cpu_plan(4, 4, 32), (4, 4, 2), id="w32-tp4-pp4-dp2"),
    pytest.param(lambda: cpu_plan(1, 2, 4), (1, 2, 2), id="w4-tp1-pp2-dp2"),
    pytest.param(lambda: cpu_plan(2, 4, 8), (2, 4, 1), id="w8-tp2-pp4-dp1"),
]


@pytest.mark.parametrize("make, sizes", LAYOUTS)
def test_groups_match_megatron_rank_generator(make, sizes):
    p = make()
    assert (p.tp_size, p.pp_size, p.dp_size) == sizes
    gen = rank_generator(p)
    for axis in AXES:
        expected = gen.get_ranks(axis)
        assert groups_of(plan_coords(p), axis) == expected, axis  # the plan's per-rank coordinates
        assert groups_of(layout_coords(p), axis) == expected, axis  # the worker's ParallelLayout.of_rank
        assert p.groups(axis) == expected, axis  # what the printout lists


@pytest.mark.parametrize("make, sizes", LAYOUTS)
def test_printout_lists_megatron_groups_and_stages(make, sizes):
    p = make()
    text, gen = p.table(), rank_generator(p)
    for axis, size in zip(AXES, (p.tp_size, p.dp_size, p.pp_size)):
        assert printed_groups(text, axis) == (gen.get_ranks(axis) if size > 1 else None), axis
    stages = re.findall(r"^  pp stage (\d+): policy ranks (\S+) on node\(s\) (\S+)$", text, re.M)
    assert [int(s) for s, _, _ in stages] == list(range(p.pp_size))
    for stage, ranks, nodes in stages:
        in_stage = [r for r in range(p.policy_world_size) if p.pp_rank_of[r] == int(stage)]
        assert expand(ranks) == in_stage
        assert expand(nodes) == sorted({p.policy_nodes[r] for r in in_stage})


def test_wrong_rank_order_is_told_apart():
    """Negative control: megatron's other order (PP before DP) gives other PP and DP groups for PP > 1, DP > 1, so
    the comparisons above can fail."""
    for p in (cpu_plan(2, 2, 8), cpu_plan(1, 2, 4), plan_placement(load_config(RECIPE_70B))):
        wrong = rank_generator(p, "tp-cp-ep-pp-dp")
        assert wrong.get_ranks("pp") != p.groups("pp") and wrong.get_ranks("dp") != p.groups("dp")
        assert wrong.get_ranks("tp") == p.groups("tp")  # TP stays fastest in both orders


def test_70b_recipe_keeps_tp_in_a_node_and_stages_on_whole_nodes():
    p = plan_placement(load_config(RECIPE_70B))
    assert (p.num_nodes, p.gpus_per_node, p.policy_world_size, p.colocated) == (8, 4, 32, True)
    assert (p.num_engines, p.vllm_tp) == (8, 4) and p.engine_nodes == list(range(8))
    assert all(len({p.policy_nodes[r] for r in g}) == 1 for g in p.groups("tp"))  # TP all-reduces over NVLink
    for stage in range(4):  # stage s: ranks 8s .. 8s+7 on nodes 2s, 2s+1
        assert [r for r in range(32) if p.pp_rank_of[r] == stage] == list(range(8 * stage, 8 * stage + 8))
        assert {p.policy_nodes[r] for r in range(32) if p.pp_rank_of[r] == stage} == {2 * stage, 2 * stage + 1}
    text = p.table()
    assert "  pp stage 3: policy ranks 24-31 on node(s) 6-7" in text
    assert "  pp groups: [0,8,16,24] [1,9,17,25] " in text and "  tp groups: [0-3] [4-7] " in text


def test_unit_size_axes_print_no_groups_and_bad_axis_raises():
    p = plan_placement(load_config(TINY))
    assert "groups:" not in p.table() and "pp stage" not in p.table()
    assert p.groups("pp") == [[0]]
    with pytest.raises(ValueError, match="axis must be 'tp', 'dp' or 'pp', got 'cp'"):
        p.groups("cp")


def test_dry_run_prints_the_70b_pipeline_plan(capsys, monkeypatch):
    import ray

    from nemo_rl_spec.cli import run_grpo

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started by --dry-run"))
    assert run_grpo.main(["--config", str(RECIPE_70B), "--dry-run"]) == 0
    out = capsys.readouterr()
    assert out.err == "" and "runs on this build" in out.out
    assert plan_placement(load_config(RECIPE_70B)).table() in out.out
    assert "policy: 32 Megatron rank(s), DP=2 TP=4 PP=4" in out.out
