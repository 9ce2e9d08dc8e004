"""Refit transports of the simulator (nemo_rl_spec.sim.refit): hand-worked seconds, growth with the engine count,
errors that name the key, and the per-transport projection table."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from nemo_rl_spec.sim import model_math as mm
from nemo_rl_spec.sim.interfaces import LayoutSpec, RefitSpec, ScenarioSpec
from nemo_rl_spec.sim.phases import refit_seconds
from nemo_rl_spec.sim.presets import resolve_profile
from nemo_rl_spec.sim.refit import (
    cuda_ipc_seconds,
    n_buckets,
    nccl_broadcast_seconds,
    ray_object_store_seconds,
    transport_seconds,
)
from nemo_rl_spec.sim.refit_projection import format_table, main, transport_rows
from nemo_rl_spec.sim.step import resolve, scenario_lengths, train_side

GIB, MIB = 2**30, 2**20


def test_nccl_by_hand():
    """1 GiB in 256 MiB buckets over 25 GB/s, 50 us per bucket per tree level:
    4 buckets; bytes term 2**30 / 25e9 = 0.04294967296 s.
    1 receiver: depth ceil(log2 2) = 1 -> 4 * 50e-6 = 2e-4 s; total 0.04314967296 s.
    7 receivers: depth ceil(log2 8) = 3 -> 6e-4 s; total 0.04354967296 s.
    1000 receivers: depth ceil(log2 1001) = 10 -> 2e-3 s; total 0.04494967296 s."""
    t = lambda r: nccl_broadcast_seconds(GIB, r, 256 * MIB, 25e9, 50e-6)
    assert t(1) == pytest.approx(0.04314967296, rel=1e-12)
    assert t(7) == pytest.approx(0.04354967296, rel=1e-12)
    assert t(1000) == pytest.approx(0.04494967296, rel=1e-12)


def test_partial_last_bucket_counts_as_one():
    """1 GiB + 1 byte needs 5 buckets of 256 MiB; 0 bytes needs none."""
    assert n_buckets(GIB, 256 * MIB) == 4
    assert n_buckets(GIB + 1, 256 * MIB) == 5
    assert n_buckets(0, 256 * MIB) == 0


def test_ray_by_hand():
    """1 GiB, 4 engines of 2 devices, device<->host 25 GB/s, serialise 10 GB/s, object store 10 GB/s:
    export 2**30/25e9 + 2**30/10e9 = 0.04294967296 + 0.1073741824;
    sender pulls 4 * 0.1073741824 = 0.4294967296 (tree: ceil(log2 5) = 3 -> 0.3221225472);
    load 2**30 / (2 * 25e9) = 0.02147483648.
    Total 0.60129542144 s (sender), 0.49392123904 s (tree)."""
    args = (GIB, 4, 2, 25e9, 10e9, 10e9)
    assert ray_object_store_seconds(*args) == pytest.approx(0.60129542144, rel=1e-12)
    assert ray_object_store_seconds(*args, fetch="tree") == pytest.approx(0.49392123904, rel=1e-12)


def test_cuda_ipc_by_hand():
    """1 GiB in 256 MiB buckets, 1 ms per bucket, copy at 8 TB/s / 2 = 4e12 B/s:
    4 * 1e-3 + 2**30 / 4e12 = 0.004 + 0.000268435456 = 0.004268435456 s."""
    assert cuda_ipc_seconds(GIB, 256 * MIB, 4e12, 1e-3) == pytest.approx(0.004268435456, rel=1e-12)


def test_ray_grows_with_engines_and_nccl_stays_nearly_flat():
    """From 1 to 256 engines: ray (sender pulls) grows strictly and more than 50x; nccl's broadcast to 8 to 2048
    receivers grows by the latency term only (< 10% at 470 GB in 256 MiB buckets)."""
    engines = [1, 2, 4, 16, 64, 256]
    ray = [ray_object_store_seconds(470e9, e, 8, 25e9, 10e9, 10e9) for e in engines]
    assert all(b > a for a, b in zip(ray, ray[1:]))
    assert ray[-1] / ray[0] > 50
    nccl = [nccl_broadcast_seconds(470e9, 8 * e, 256 * MIB, 40e9, 50e-6) for e in engines]
    assert all(b >= a for a, b in zip(nccl, nccl[1:]))
    assert nccl[-1] / nccl[0] < 1.1
    assert nccl[-1] < ray[1]  # two engines through the object store already cost more than 2048 receivers


def test_transport_defaults_come_from_the_hardware():
    """nccl with nccl_bw unset: 0.8 x net_bw when the refit crosses the network, else 0.8 x link_bw (GB200: 50e9,
    900e9); cuda_ipc with ipc_copy_bw unset: mem_bw / 2. 1 GiB to 16 devices in 8-GPU engines."""
    hw = resolve_profile("gb200").hardware
    net, nvl = LayoutSpec(total_devices=16, gen_devices_per_engine=8), LayoutSpec(total_devices=16)
    net = net.model_copy(update={"refit_over_network": True})
    nccl = RefitSpec(transport="nccl")
    depth16 = 5  # ceil(log2 17)
    assert transport_seconds(GIB, nccl, hw, net, 16) == pytest.approx(4 * 50e-6 * depth16 + GIB / 40e9)
    assert transport_seconds(GIB, nccl, hw, nvl, 16) == pytest.approx(4 * 50e-6 * depth16 + GIB / 720e9)
    ipc = RefitSpec(transport="cuda_ipc")
    assert transport_seconds(GIB, ipc, hw, nvl, 16) == pytest.approx(4 * 1e-3 + GIB / 4e12)


def test_lumped_model_is_unchanged_without_a_transport():
    prof = resolve_profile("gb200", {"refit_overhead_s": 1.0, "refit_bw_eff": 0.5})
    lay = LayoutSpec(total_devices=8, gen_devices_per_engine=2)
    assert refit_seconds(10**9, 2.0, prof, lay) == pytest.approx(1.0 + 1e9 / 450e9)


def _scenario(total: int, refit: dict | None, colocated: bool = True) -> ScenarioSpec:
    return ScenarioSpec(
        name="refit",
        model="qwen3-8b",
        hardware="gb200",
        layout=LayoutSpec(total_devices=total, colocated=colocated, gen_devices=None if colocated else total // 2),
        workload={"num_prompts": 4, "generations_per_prompt": 2, "prompt_tokens": 16, "response": _resp()},
        speculative={"k": 3, "alpha": 0.7},
        refit=refit,
    )


def _resp() -> dict:
    return {"median_tokens": 32, "sigma": 0.5, "max_tokens": 64}


def test_the_step_uses_the_transport():
    """Qwen3-8B (8.19e9 params, bf16) colocated on 8 GB200 (8 engines of 1): the AR train side's refit is the
    fixed 1.0 s (GPU refit_overhead_s) + nccl over 0.8 x 900e9 B/s to 8 receivers (depth ceil(log2 9) = 4)."""
    res = resolve(_scenario(8, {"transport": "nccl"}))
    nbytes = mm.total_params(res.model) * 2.0
    expected = 1.0 + n_buckets(nbytes, 256 * MIB) * 50e-6 * 4 + nbytes / 720e9
    assert train_side(res, scenario_lengths(res), 8, False)[2] == pytest.approx(expected, rel=1e-12)


def test_more_engines_raise_the_ray_refit_of_a_step_and_barely_move_nccl():
    """Qwen3-8B (16.4 GB) colocated, 1-GPU engines, no fixed cost. ray 4 -> 64 engines: 2.3 s export + 0.66 s load
    + 4 (64) pulls of 1.64 s: 9.5 s -> 108 s. nccl at 40 GB/s: 0.41 s + 61 buckets x 50 us x depth 3 (7)."""

    def refit(total: int, transport: str) -> float:
        res = resolve(_scenario(total, {"transport": transport, "fixed_s": 0.0, "nccl_bw": 40e9}))
        return train_side(res, scenario_lengths(res), total, False)[2]

    assert refit(64, "ray") > 8 * refit(4, "ray")
    assert refit(64, "nccl") < 1.1 * refit(4, "nccl")


@pytest.mark.parametrize(
    ("refit", "key"),
    [
        ({"transport": "gloo"}, "transport"),
        ({"transport": "nccl", "bucket_bytes": 0}, "bucket_bytes"),
        ({"transport": "nccl", "nccl_bw": -1.0}, "nccl_bw"),
        ({"transport": "ray", "store_bw": 0}, "store_bw"),
        ({"transport": "ray", "ray_fetch": "broadcast"}, "ray_fetch"),
        ({"transport": "nccl", "bucket_size": 1}, "bucket_size"),
    ],
)
def test_bad_refit_keys_are_named(refit, key):
    with pytest.raises(ValidationError, match=key):
        _scenario(8, refit)


def test_cuda_ipc_needs_a_colocated_layout():
    with pytest.raises(ValidationError, match=r"refit\.transport cuda_ipc needs layout\.colocated"):
        _scenario(8, {"transport": "cuda_ipc"}, colocated=False)


@pytest.mark.parametrize(
    ("call", "key"),
    [
        (lambda: nccl_broadcast_seconds(GIB, 0, MIB, 1e9, 0.0), "receivers"),
        (lambda: nccl_broadcast_seconds(GIB, 1, 0, 1e9, 0.0), "bucket_bytes"),
        (lambda: nccl_broadcast_seconds(GIB, 1, MIB, 0.0, 0.0), "bus_bw"),
        (lambda: ray_object_store_seconds(GIB, 1, 0, 1e9, 1e9, 1e9), "devices_per_engine"),
        (lambda: ray_object_store_seconds(GIB, 1, 1, 1e9, 1e9, 1e9, fetch="x"), "ray_fetch"),
        (lambda: cuda_ipc_seconds(-1.0, MIB, 1e9, 0.0), "nbytes"),
    ],
)
def test_bad_formula_arguments_are_named(call, key):
    with pytest.raises(ValueError, match=key):
        call()


def test_projection_rows_cover_each_transport(tmp_path):
    """A small async split scenario: its own layout has no cuda_ipc row, the colocated variant has one; every
    share is refit / step; ray with sender pulls costs more than nccl; the JSON carries the note."""
    rows = transport_rows(_scenario(16, None, colocated=False).model_copy(update={"mode": "async"}))
    by = {(r["layout"], r["transport"]): r for r in rows}
    assert ("async, split", "cuda_ipc") not in by and ("sync, colocated", "cuda_ipc") in by
    for r in rows:
        assert r["ar_refit_share"] == pytest.approx(r["ar_refit_s"] / r["ar_step_s"])
    assert by[("async, split", "ray (sender pulls)")]["ar_refit_s"] > by[("async, split", "nccl")]["ar_refit_s"]
    assert format_table(rows).count("\n") == len(rows) + 1
    scn = tmp_path / "s.yaml"
    data = _scenario(16, None, colocated=False).model_dump(exclude_none=True) | {"mode": "async"}
    scn.write_text(json.dumps(data))  # JSON is YAML
    assert main(["--config", str(scn), "--out", str(tmp_path / "r.json")]) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert "not a measurement" in doc["note"] and len(doc["rows"]) == len(rows)
