"""The paper's 8B measurements reproduced within 10% from its own inputs; the k sweep's shape; 235B drivers."""

import pytest

from nemo_rl_spec.sim.config import CONFIG_DIR, load_scenario
from nemo_rl_spec.sim.paper import compare_to_paper, k_sweep_shape, projection
from nemo_rl_spec.sim.simulate import simulate


def scenario(name: str, **overrides):
    return load_scenario(CONFIG_DIR / f"{name}.yaml", **overrides)


@pytest.fixture(scope="module")
def zero():
    s = scenario("paper_8b_rl_zero")
    return s, simulate(s)


@pytest.fixture(scope="module")
def think():
    s = scenario("paper_8b_rl_think")
    return s, simulate(s)


def _step_is_generation_plus_unchanged_rest(r):
    """Written out by hand (the YAML sets neither side): the end-to-end speedup is the ratio of the two simulated
    step times. (The former checks ar.generation == 100.0 / 133.6 and ar_step == 151.2 re-read the recipe's own
    baseline inputs; the paper's published spec numbers stay checked within 10% below.)"""
    assert r.e2e_speedup == pytest.approx(r.ar_step_s / r.spec_step_s, rel=1e-9)


def test_rl_zero_generation_and_step_within_10_percent(zero):
    scn, r = zero
    _step_is_generation_plus_unchanged_rest(r)
    assert r.spec.generation == pytest.approx(56.6, rel=0.10)
    assert r.spec_step_s == pytest.approx(107.5, rel=0.10)
    errors = compare_to_paper(scn, r)
    assert all(abs(v["error"]) < 0.10 for v in errors.values()), errors


def test_rl_think_generation_and_e2e_within_10_percent(think):
    scn, r = think
    _step_is_generation_plus_unchanged_rest(r)
    assert r.spec.generation == pytest.approx(87.0, rel=0.10)
    assert r.e2e_speedup == pytest.approx(1.35, rel=0.10)
    errors = compare_to_paper(scn, r)
    assert set(errors) >= {"generation_spec_s", "generation_speedup", "e2e_speedup"}
    assert all(abs(v["error"]) < 0.10 for v in errors.values()), errors


@pytest.mark.parametrize("name", ["paper_8b_rl_zero", "paper_8b_rl_think"])
def test_k_sweep_shape(name):
    shape = k_sweep_shape(scenario(name))
    assert shape["best_k"] == 3
    assert shape["k7_slower_than_k3"]


def test_swapped_acceptance_mapping_does_not_reproduce():
    """The secondary source lists 2.47 and 2.05 without an unambiguous mapping; the other assignment misses the
    RL-Think generation time by far more than 10% (docs/results/simulator_paper_8b.md)."""
    r = simulate(scenario("paper_8b_rl_think", speculative={"acceptance_length": 2.47}))
    assert abs(r.spec.generation - 87.0) / 87.0 > 0.15


def test_235b_projection_drivers():
    proj = projection(scenario("qwen3_235b_2048gb200_async"))
    rows = {row["k"]: row for row in proj["rows"]}
    zero_fraction = 100.0 / 151.2
    assert rows[3]["ar_generation_fraction"] > 0.85 > zero_fraction  # generation dominates more at scale
    assert rows[7]["generation_speedup"] > rows[3]["generation_speedup"]  # cheap drafts favour longer k
    assert rows[3]["bulk_draft_cost"] < 0.05  # draft vs 22B-active target
    assert rows[3]["tail_verify_cost"] > 1.2  # k+1 tokens touch more experts
    for row in rows.values():
        assert 1.5 < row["e2e_speedup"] < row["generation_speedup"]
        assert row["e2e_speedup_vs_sync_ar"] > row["e2e_speedup"]  # async adds its own gain
