"""Calibration key and step-cost tables of the batch-size-aware schedule (nemo_rl_spec/speculative/calibration.py):
hand-written /proc/cpuinfo texts and configs, hand-worked schedules, and the shipped table checked against its own
keys."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from nemo_rl_spec.speculative import calibration as cal
from nemo_rl_spec.speculative.adaptive_k import derive_schedule, schedule_from_config
from nemo_rl_spec.utils.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
SPEC_RECIPE = ROOT / "configs" / "grpo_math_smollm2_135m_spec.yaml"

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9654 96-Core Processor
flags\t\t: fpu sse sse2 avx2 fma avx avx512f avx512_bf16 avx512_vnni amx_tile sha_ni
bugs\t\t: sysret_ss_attrs spectre_v1

processor\t: 1
model name\t: another model (ignored: the first wins)
flags\t\t: fpu
"""
ARM = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd evtstrm aes sve bf16 i8mm
CPU part\t: 0xd4f
"""
TARGET_CFG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
}
VERSIONS = {"vllm": "0.32.0", "torch": "2.13.0+cpu"}


def _key(**changes):
    args = dict(
        cpu={"model": "M", "flags": ["avx2", "avx512f"]},
        num_threads=2,
        dtype="bfloat16",
        temperature=0.7,
        target=cal.target_identity(TARGET_CFG),
        draft=cal.draft_identity("eagle3", [1, 2, 3], "probabilistic", {"vocab_size": 49152, "draft_vocab_size": 1160}),
        versions=VERSIONS,
    )
    return cal.calibration_key(**(args | changes))


def test_cpu_identity_keeps_the_model_and_the_isa_flags_that_matter():
    assert cal.parse_cpu_identity(X86) == {
        "model": "AMD EPYC 9654 96-Core Processor",
        "flags": ["amx_tile", "avx", "avx2", "avx512_bf16", "avx512_vnni", "avx512f", "fma"],
    }
    assert cal.parse_cpu_identity(ARM) == {"model": "0xd4f", "flags": ["asimd", "bf16", "sve"]}
    assert cal.parse_cpu_identity("") == {"model": "unknown", "flags": []}


def test_target_and_draft_identity():
    assert cal.target_identity(TARGET_CFG) == {
        "architecture": "LlamaForCausalLM",
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
        "vocab_size": 49152,
    }
    no_gqa = {k: v for k, v in TARGET_CFG.items() if k not in ("num_key_value_heads", "architectures")}
    assert cal.target_identity(no_gqa)["num_key_value_heads"] == 9  # MHA: as many KV heads as heads
    assert cal.target_identity(no_gqa)["architecture"] == "llama"
    with pytest.raises(KeyError):
        cal.target_identity({k: v for k, v in TARGET_CFG.items() if k != "vocab_size"})

    assert cal.draft_identity("eagle3", [3, 1, 3, 2], None, {"vocab_size": 100, "draft_vocab_size": 40}) == {
        "method": "eagle3",
        "draft_vocab_rows": 40,
        "ks": [1, 2, 3],
        "draft_sample_method": "greedy",
    }
    assert cal.draft_identity("eagle3", [1], "probabilistic", {"vocab_size": 100})["draft_vocab_rows"] == 100
    assert cal.draft_identity("mtp", [1], None, None)["draft_vocab_rows"] is None
    for bad in ([], [0, 1]):
        with pytest.raises(ValueError, match="k >= 1"):
            cal.draft_identity("eagle3", bad)
    assert cal.candidate_ks(3) == [1, 2, 3]


def test_key_is_canonical_and_moves_with_what_moves_step_costs():
    key = _key()
    assert key["cpu"] == {"model": "M", "flags": ["avx2", "avx512f"], "threads": 2}
    assert key["sampling"] == "random"
    assert _key(cpu={"model": "M", "flags": ["avx512f", "avx2"]}) == key  # flag order does not matter
    digests = {
        cal.key_digest(_key(**change))
        for change in (
            {},
            {"dtype": "float32"},
            {"num_threads": 1},
            {"temperature": 0.0},
            {"cpu": {"model": "M", "flags": ["avx2", "avx512f", "amx_bf16"]}},
            {"versions": {"vllm": "0.33.0", "torch": "2.13.0+cpu"}},
            {"draft": cal.draft_identity("eagle3", [1, 2, 3], "probabilistic", {"vocab_size": 49152})},
        )
    }
    assert len(digests) == 7
    assert _key(temperature=0.0)["sampling"] == "greedy"
    assert _key(temperature=1.0) == key  # only T = 0 or not enters
    for bad, match in (
        ({"dtype": "fp32"}, "engine dtype"),
        ({"num_threads": 0}, "num_threads"),
        ({"temperature": -1.0}, "temperature"),
        ({"versions": {"vllm": "0.32.0"}}, "torch"),
    ):
        with pytest.raises(ValueError, match=match):
            _key(**bad)


def test_key_digest_and_differences_by_hand():
    # sha256(b'{"a":1,"b":[2,3]}')[:16], computed outside the module
    assert cal.key_digest({"b": [2, 3], "a": 1}) == "efbd0040190fb087"
    stored, current = _key(), _key(dtype="float32", num_threads=1)
    assert cal.key_differences(stored, current) == ["cpu.threads: 2 -> 1", "dtype: bfloat16 -> float32"]
    assert cal.key_differences({"a": 1}, {"a": 1, "b": 2}) == ["b: <absent> -> 2"]
    assert cal.key_differences(stored, stored) == []


def test_user_table_dir_env_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv(cal.ENV_DIR, raising=False)
    assert cal.user_table_dir() == tmp_path / "home" / ".cache" / "nemo_rl_spec" / "spec_step_costs"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cal.user_table_dir() == tmp_path / "xdg" / "nemo_rl_spec" / "spec_step_costs"
    monkeypatch.setenv(cal.ENV_DIR, str(tmp_path / "mine"))
    assert cal.user_table_dir() == tmp_path / "mine"
    assert cal.table_dirs() == [tmp_path / "mine", cal.SHIPPED_TABLE_DIR]


COSTS = {"ar_step_s": {1: 0.010, 8: 0.020}, "spec_step_s": {1: {1: 0.012, 8: 0.040}, 3: {1: 0.015, 8: 0.080}}}


def test_entries_round_trip_and_the_first_table_wins(tmp_path):
    key = _key()
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    assert cal.find_entry(key, [user, shipped]) is None
    in_shipped = cal.write_entry(shipped, key, COSTS, {"command": "x"})
    assert in_shipped == shipped / f"{cal.key_digest(key)}.json"
    assert cal.find_entry(key, [user, shipped]) == in_shipped
    in_user = cal.write_entry(user, key, COSTS, {"command": "y"})
    assert cal.find_entry(key, [user, shipped]) == in_user
    entry = json.loads(in_user.read_text())
    assert entry["key"] == key and entry["digest"] == cal.key_digest(key)
    assert entry["step_costs"]["spec_step_s"]["3"] == {"1": 0.015, "8": 0.080}
    # a file under the right name whose stored key is another one (hand-edited, or a digest collision) is skipped
    edited = dict(entry, key=_key(dtype="float32"))
    in_user.write_text(json.dumps(edited))
    assert cal.find_entry(key, [user, shipped]) == in_shipped
    with pytest.raises(ValueError, match="spec_step_s"):
        cal.write_entry(user, key, {"ar_step_s": {}}, {})


def test_step_costs_from_runs_keeps_the_quietest_run():
    runs = {
        "ar": {1: [{"step": 0.03}, {"step": 0.02}], 8: [{"step": 0.05}]},
        "k1": {1: [{"step": 0.04}, {"step": 0.06}], 8: [{"step": 0.09}, {"step": 0.08}]},
        "k3": {1: [{"step": 0.07}], 8: [{"step": 0.2}]},
    }
    assert cal.step_costs_from_runs(runs, {"ar": 0, "k3": 3, "k1": 1}) == {
        "ar_step_s": {1: 0.02, 8: 0.05},
        "spec_step_s": {1: {1: 0.04, 8: 0.08}, 3: {1: 0.07, 8: 0.2}},
    }
    with pytest.raises(ValueError, match="exactly one autoregressive"):
        cal.step_costs_from_runs(runs, {"ar": 0, "k1": 0, "k3": 3})
    with pytest.raises(ValueError, match="no runs at batch"):
        cal.step_costs_from_runs({**runs, "k3": {1: [], 8: [{"step": 0.2}]}}, {"ar": 0, "k1": 1, "k3": 3})


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A fixed CPU and versions, empty user and shipped tables under tmp_path, a target directory with TARGET_CFG."""
    monkeypatch.setattr(cal, "this_cpu", lambda: {"model": "M", "flags": ["avx2"]})
    monkeypatch.setattr(cal, "installed_versions", lambda: dict(VERSIONS))
    monkeypatch.setenv(cal.ENV_DIR, str(tmp_path / "user"))
    monkeypatch.setattr(cal, "SHIPPED_TABLE_DIR", tmp_path / "shipped")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TARGET_CFG))
    return str(model)


def test_auto_without_an_entry_stops_with_the_key_and_the_command(machine):
    cfg = load_config(SPEC_RECIPE, ["policy.precision=float32"])
    assert cfg.policy.generation.dynamic_speculation.step_costs == "auto"
    key = cal.recipe_key(cfg, machine)
    assert key["dtype"] == "float32" and key["cpu"]["threads"] == cfg.policy.generation.vllm_cfg.num_threads
    assert key["draft"]["ks"] == [1, 2, 3]  # num_speculative_tokens: 3
    with pytest.raises(ConfigError) as err:
        cal.resolve_step_costs(cfg, machine)
    msg = str(err.value)
    assert cal.key_digest(key) in msg and '"dtype": "float32"' in msg
    assert f"python examples/calibrate_spec_schedule.py --config {SPEC_RECIPE} policy.precision=float32" in msg
    with pytest.raises(ValueError, match="auto was not resolved"):  # an engine never sees `auto`
        schedule_from_config(cfg.policy.generation.dynamic_speculation, 3)


def test_auto_finds_this_machines_entry_and_derives_the_schedule(machine):
    cfg = load_config(SPEC_RECIPE, ["policy.precision=float32"])
    cal.write_entry(cal.SHIPPED_TABLE_DIR, cal.recipe_key(cfg, machine), COSTS, {})
    cal.write_entry(  # the bf16 entry must not be picked for an fp32 engine
        cal.user_table_dir(),
        cal.recipe_key(load_config(SPEC_RECIPE, ["policy.precision=bfloat16"]), machine),
        {"ar_step_s": {1: 1.0}, "spec_step_s": {1: {1: 100.0}}},
        {},
    )
    path = cal.resolve_step_costs(cfg, machine)
    assert path == str(cal.SHIPPED_TABLE_DIR / f"{cal.key_digest(cal.recipe_key(cfg, machine))}.json")
    dyn = cfg.policy.generation.dynamic_speculation
    assert dyn.step_costs == path and dyn.acceptance_rate == 0.61 and dyn.max_batch_size == 32
    # By hand, a = 0.61: E_1 = 1.61, E_3 = 1 + 0.61 + 0.3721 + 0.226981 = 2.209081; costs linear between b = 1 and 8.
    # b = 1: k1 1.61 * 10 / 12 = 1.342, k3 2.209 * 10 / 15 = 1.473 -> 3.
    # b = 2: c_AR 11.43, c_1 16.0, c_3 24.29 ms: k1 1.150, k3 1.040 -> 1.   b = 3: c_AR 12.86, c_1 20.0: k1 1.035 -> 1.
    # b = 4: c_AR 14.29, c_1 24.0, c_3 42.86: k1 0.958, k3 0.736 -> 0 (below k = 0's 1.0), and so on up to 32.
    assert schedule_from_config(dyn.model_copy(update={"min_speedup": 1.0}), 3) == [(1, 1, 3), (2, 3, 1), (4, 32, 0)]
    # The recipe's min_speedup 1.3: b = 1 keeps k3 (1.473 >= 1.3); b = 2-3's best, k1 1.150 / 1.035, is below 1.3 -> 0.
    assert dyn.min_speedup == 1.3
    assert schedule_from_config(dyn, 3) == [(1, 1, 3), (2, 32, 0)]


def test_a_step_cost_file_from_another_key_is_used_with_a_warning(machine, tmp_path, caplog):
    cfg_bf16 = load_config(SPEC_RECIPE, ["policy.precision=bfloat16"])
    other = cal.write_entry(tmp_path / "elsewhere", cal.recipe_key(cfg_bf16, machine), COSTS, {})
    cfg = load_config(
        SPEC_RECIPE, ["policy.precision=float32", f"policy.generation.dynamic_speculation.step_costs={other}"]
    )
    with caplog.at_level(logging.WARNING, logger=cal.__name__):
        assert cal.resolve_step_costs(cfg, machine) == str(other)
    assert "dtype: bfloat16 -> float32" in caplog.text and "calibrate_spec_schedule.py" in caplog.text
    legacy = tmp_path / "legacy.json"  # no key (the rollout benchmark's file): nothing to compare, no warning
    legacy.write_text(json.dumps({"step_costs": COSTS}))
    caplog.clear()
    cfg = load_config(SPEC_RECIPE, [f"policy.generation.dynamic_speculation.step_costs={legacy}"])
    with caplog.at_level(logging.WARNING, logger=cal.__name__):
        assert cal.resolve_step_costs(cfg, machine) == str(legacy)
    assert caplog.text == ""
    explicit = load_config(
        SPEC_RECIPE,
        [
            "policy.generation.dynamic_speculation.step_costs=null",
            "policy.generation.dynamic_speculation.num_speculative_tokens_per_batch_size=[[1,4,3]]",
        ],
    )
    assert cal.resolve_step_costs(explicit, machine) is None


SHIPPED = sorted(cal.SHIPPED_TABLE_DIR.glob("*.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_entry_is_named_by_its_key_and_derives_a_schedule(path):
    entry = json.loads(path.read_text())
    key = entry["key"]
    assert path.stem == cal.key_digest(key) == entry["digest"]  # not hand-edited after it was written
    assert key["key_version"] == cal.KEY_VERSION
    costs = entry["step_costs"]
    batches = sorted(int(b) for b in costs["ar_step_s"])
    assert sorted(int(k) for k in costs["spec_step_s"]) == key["draft"]["ks"]
    for k, by_b in costs["spec_step_s"].items():
        assert sorted(int(b) for b in by_b) == batches
        for b, s in by_b.items():  # verifying k drafts per request never costs much less than a plain step (noise)
            assert 0.9 * costs["ar_step_s"][b] < s < 10.0, (k, b)
    # at the largest batch verification dominates: the step grows with k, and every k costs more than a plain step
    top = str(max(batches))
    at_top = [costs["ar_step_s"][top]] + [costs["spec_step_s"][str(k)][top] for k in key["draft"]["ks"]]
    assert at_top == sorted(at_top) and len(set(at_top)) == len(at_top), at_top
    schedule = derive_schedule(costs["ar_step_s"], costs["spec_step_s"], 0.61, max(batches))
    assert schedule[0][0] == 1 and schedule[-1][1] == max(batches)


def test_the_shipped_table_covers_the_default_spec_recipe_in_both_dtypes():
    dtypes = {json.loads(p.read_text())["key"]["dtype"] for p in SHIPPED}
    assert {"float32", "bfloat16"} <= dtypes
