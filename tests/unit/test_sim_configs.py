"""Every shipped configs/sim/*.yaml validates and simulates; defaults inheritance; the run_sim CLI output."""

import json

import pytest

from nemo_rl_spec.cli import run_sim
from nemo_rl_spec.sim.config import (
    CONFIG_DIR,
    deep_merge,
    load_raw,
    load_scenario,
    scenario_files,
)
from nemo_rl_spec.sim.simulate import simulate


@pytest.mark.parametrize("path", scenario_files(), ids=lambda p: p.name)
def test_shipped_scenarios_validate_and_run(path):
    scn = load_scenario(path)
    r = simulate(scn)
    assert r.generation_speedup > 0 and r.e2e_speedup > 0


def test_defaults_inheritance():
    think = load_raw(CONFIG_DIR / "paper_8b_rl_think.yaml")
    zero = load_raw(CONFIG_DIR / "paper_8b_rl_zero.yaml")
    assert think["layout"] == zero["layout"] and think["speculative"]["k"] == 3
    assert think["speculative"]["acceptance_length"] == 2.05 and think["baseline"]["generation"] == 133.6
    assert deep_merge({"a": {"b": 1, "c": 2}}, {"a": {"c": 3}}) == {"a": {"b": 1, "c": 3}}


def test_defaults_cycle_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\nname: a\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\nname: b\n")
    with pytest.raises(ValueError, match="cycle"):
        load_raw(tmp_path / "a.yaml")


def test_invalid_speculative_spec_is_rejected():
    with pytest.raises(ValueError):
        load_scenario(CONFIG_DIR / "paper_8b_rl_zero.yaml", speculative={"alpha": 0.5})  # two acceptances


def test_run_sim_writes_speedups_per_scenario_and_plots(tmp_path):
    main = run_sim_main()
    out = tmp_path / "sim.json"
    assert main(["--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"paper_8b_rl_zero", "paper_8b_rl_think", "qwen3_235b_2048gb200_async", "cpu_smollm2_default"} <= set(
        doc["scenarios"]
    )
    for entry in doc["scenarios"].values():
        assert entry["generation_speedup"] > 0 and entry["e2e_speedup"] > 0
    assert doc["formulas"][0]["tokens_per_pass"] == pytest.approx(2.952)
    assert len(doc["plots"]) == 5 and all((tmp_path / p.split("/")[-1]).is_file() for p in doc["plots"])


def run_sim_main():
    """``examples/run_sim.py``'s main."""
    return run_sim.main
