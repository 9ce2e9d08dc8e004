"""nemo_rl_spec.utils.machine: what a benchmark JSON records about the machine (keys, types, the CPU model against an
independent parse of /proc/cpuinfo, CUDA left uninitialised), the writer every benchmark uses, and a benchmark
(loop_seeds, the cheapest) whose output carries its inputs' machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_rl_spec.bench import loop_seeds
from nemo_rl_spec.utils import machine

CPUINFO = Path("/proc/cpuinfo")
TYPES = {
    "cpu_model": str,
    "isa_flags": (list, type(None)),
    "logical_cpus": (int, type(None)),
    "nproc": int,
    "loadavg": (list, type(None)),
    "torch_version": str,
    "torch_cpu_capability": str,
    "cuda_available": bool,
    "cuda_initialized": bool,
    "cuda_device": (str, type(None)),
    "cpu_env": dict,
}


def _first(field: str) -> str | None:
    """The first ``field : value`` of /proc/cpuinfo, parsed here independently of the module (None without one)."""
    if not CPUINFO.is_file():
        return None
    for line in CPUINFO.read_text().splitlines():
        if ":" in line and line.split(":", 1)[0].strip() == field:
            return line.split(":", 1)[1].strip()
    return None


def test_machine_info_keys_and_types():
    info = machine.machine_info()
    assert list(info) == list(TYPES)
    for key, typ in TYPES.items():
        assert isinstance(info[key], typ), (key, info[key])
    assert info["torch_version"] == torch.__version__
    assert info["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert 1 <= info["nproc"] <= (info["logical_cpus"] or info["nproc"])
    assert info["loadavg"] is None or len(info["loadavg"]) == 3
    assert info["cuda_available"] == (torch.cuda.device_count() > 0)
    if not info["cuda_available"]:
        assert info["cuda_device"] is None
    json.dumps(info)  # JSON-ready as it is


def test_machine_info_does_not_initialise_cuda():
    if torch.cuda.is_initialized():
        pytest.skip("CUDA already initialised in this process by an earlier test")
    machine.machine_info()
    assert not torch.cuda.is_initialized()


def test_cpu_model_and_flags_match_proc_cpuinfo():
    model, flags = _first("model name"), _first("flags")
    if model is None:
        pytest.skip("no 'model name' in /proc/cpuinfo (not Linux x86)")
    assert machine.cpu_model() == model
    assert machine.machine_info()["cpu_model"] == model
    assert machine.isa_flags() == [f for f in machine.ISA_FLAGS if f in (flags or "").split()]


def test_isa_flags_and_model_from_a_hand_written_cpuinfo(tmp_path):
    epyc = tmp_path / "epyc"
    epyc.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC 9R14 96-Core Processor\n"
        "flags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n\nprocessor\t: 1\nflags\t\t: fpu\n"
    )
    assert machine.cpu_model(epyc) == "AMD EPYC 9R14 96-Core Processor"
    assert machine.isa_flags(epyc) == ["avx512_bf16", "avx512f", "avx2"]  # ISA_FLAGS order, the first processor's
    xeon = tmp_path / "xeon"
    xeon.write_text(
        "model name\t: Intel(R) Xeon(R) Platinum 8488C\nflags\t: avx2 amx_tile avx512f amx_bf16 avx512_bf16\n"
    )
    assert machine.isa_flags(xeon) == list(machine.ISA_FLAGS)
    missing = tmp_path / "missing"
    assert machine.isa_flags(missing) is None  # unknown, not "none of them"
    assert isinstance(machine.cpu_model(missing), str) and machine.cpu_model(missing)  # platform fallback


def test_cpu_env_records_only_the_overrides_that_are_set(monkeypatch):
    for name in machine.CPU_ENV_OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    assert machine.machine_info()["cpu_env"] == {}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert machine.machine_info()["cpu_env"] == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
    }


def test_write_bench_json_adds_the_machine_at_the_top_level(tmp_path):
    result = {"modes": {"a": {"s": 1.0}}, "machine": "stale"}
    path = machine.write_bench_json(tmp_path / "r.json", result, indent=2, default=str)
    doc = json.loads(path.read_text())
    assert doc["modes"] == {"a": {"s": 1.0}} and list(doc) == ["modes", "machine"]
    assert doc["machine"]["cpu_model"] == machine.cpu_model() and set(doc["machine"]) == set(TYPES)
    assert result["machine"] == "stale"  # the caller's dict is left alone
    given = {"cpu_model": "x"}
    machine.write_bench_json(tmp_path / "g.json", {"a": 1}, machine=given)
    assert json.loads((tmp_path / "g.json").read_text()) == {"a": 1, "machine": given}


def test_sources_machine_common_or_per_source():
    a = {"cpu_model": "EPYC", "isa_flags": ["avx512_bf16"], "loadavg": [1.0, 1.0, 1.0]}
    a_busier = {**a, "loadavg": [3.0, 2.0, 1.0]}  # the load is the moment's, not the machine's
    b = {"cpu_model": "Xeon", "isa_flags": ["amx_bf16"], "loadavg": [0.0, 0.0, 0.0]}
    assert machine.sources_machine([{"machine": a}, {"machine": a_busier}]) == a
    assert machine.sources_machine([{"machine": a}, {"machine": b}]) == {"sources": [a, b]}
    assert machine.sources_machine([{"machine": a}, {}]) == {"sources": [a, None]}
    assert machine.sources_machine([{}]) == {"sources": [None]}


def _bench_output(machine_info: dict | None) -> dict:
    doc = {
        "modes": {
            "sync/autoregressive": {"tokens_per_s": 100.0, "exposed_generation_s": 10.0, "mean_reward": 0.5},
            "sync/speculative": {"tokens_per_s": 150.0, "exposed_generation_s": 8.0, "mean_reward": 0.5},
        },
        "ratios_vs_autoregressive": {"sync/speculative": {"generation": {"of_means": 0.8}, "step": {"of_means": 0.9}}},
    }
    return doc if machine_info is None else {**doc, "machine": machine_info}


def test_a_bench_output_records_its_inputs_machine(tmp_path):
    here = machine.machine_info()
    a, b, out = tmp_path / "seed3.json", tmp_path / "seed4.json", tmp_path / "summary.json"
    a.write_text(json.dumps(_bench_output(here)))
    b.write_text(json.dumps(_bench_output(here)))
    assert loop_seeds.main(["--out", str(out), str(a), str(b)]) == 0
    doc = json.loads(out.read_text())
    assert doc["machine"] == here and set(doc["modes"]) == {"sync/speculative"}
    b.write_text(json.dumps(_bench_output(None)))  # a file from before benchmarks recorded the machine
    assert loop_seeds.main(["--out", str(out), str(a), str(b)]) == 0
    assert json.loads(out.read_text())["machine"] == {"sources": [here, None]}
