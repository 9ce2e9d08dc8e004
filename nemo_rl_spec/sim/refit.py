"""Refit transports: seconds to move B bytes of weights from the trainer to the generation engines.

Three paths, named as NeMo-RL's ``policy.generation.refit_transport`` (B bytes, E engines of d devices, b bucket):
    ray      sender B/h2d + B/ser, pulls E*B/store ("sender") or ceil(log2(E+1))*B/store ("tree"), load B/(d*h2d)
    nccl     ceil(B/b) * latency * ceil(log2(R+1)) + B/bus_bw, R = E*d receivers (pipelined tree/ring broadcast)
    cuda_ipc ceil(B/b) * ipc_bucket_s + B/copy_bw (colocated: device-local copies behind exchanged handles)
Every receiving worker gets the full (TP-gathered) weights and keeps its shard, as NeMo-RL's broadcast does; the
ray path counts one object-store pull per engine. Hardware defaults live in :class:`~.interfaces.RefitSpec`.
"""

from __future__ import annotations

import math

from nemo_rl_spec.sim.interfaces import EfficiencySpec, HardwareSpec, LayoutSpec, RefitSpec

NCCL_BUS_EFF = 0.8  # assumed fraction of link peak a large NCCL broadcast reaches (bus bandwidth)


def _positive(**values: float) -> None:
    for key, value in values.items():
        if not value > 0:
            raise ValueError(f"{key} must be > 0, got {value!r}")


def n_buckets(nbytes: float, bucket_bytes: float) -> int:
    """Buckets of at most ``bucket_bytes`` that hold ``nbytes`` bytes: ceil(nbytes / bucket_bytes) (0 for 0 bytes)."""
    _positive(bucket_bytes=bucket_bytes)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    return math.ceil(nbytes / bucket_bytes)


def tree_depth(receivers: int) -> int:
    """Levels of a binary broadcast tree over the sender and ``receivers`` ranks: ceil(log2(receivers + 1))."""
    if receivers < 1:
        raise ValueError(f"receivers must be >= 1, got {receivers!r}")
    return math.ceil(math.log2(receivers + 1))


def nccl_broadcast_seconds(
    nbytes: float, receivers: int, bucket_bytes: float, bus_bw: float, latency_s: float
) -> float:
    """Bucketed NCCL broadcast of ``nbytes`` bytes to ``receivers`` ranks, seconds.

    Formula: t = ceil(B / b) * latency_s * ceil(log2(R + 1)) + B / bus_bw. Each bucket pays one latency per tree
    level; the bytes stream pipelined, so the bandwidth term does not grow with R. Units: bytes, bytes/s, s.
    """
    _positive(bus_bw=bus_bw)
    per_bucket = latency_s * tree_depth(receivers)
    return n_buckets(nbytes, bucket_bytes) * per_bucket + nbytes / bus_bw


def ray_fetch_rounds(engines: int, fetch: str) -> int:
    """Full-copy transfers on the critical path of E engine pulls: E ("sender": the sender's node serves every
    pull) or ceil(log2(E + 1)) ("tree": every node holding a copy serves one more pull per round)."""
    if fetch not in ("sender", "tree"):
        raise ValueError(f"ray_fetch must be 'sender' or 'tree', got {fetch!r}")
    return engines if fetch == "sender" else tree_depth(engines)


def ray_object_store_seconds(
    nbytes: float,
    engines: int,
    devices_per_engine: int,
    host_device_bw: float,
    serialize_bw: float,
    store_bw: float,
    fetch: str = "sender",
) -> float:
    """Refit through Ray's object store, seconds: sender export, engine pulls, engine load.

    Formula: t = B / h2d + B / ser + n * B / store + B / (d * h2d), n = :func:`ray_fetch_rounds` (E or
    ceil(log2(E + 1))). Units: bytes, bytes/s, s.
    """
    _positive(host_device_bw=host_device_bw, serialize_bw=serialize_bw, store_bw=store_bw)
    if devices_per_engine < 1:
        raise ValueError(f"devices_per_engine must be >= 1, got {devices_per_engine!r}")
    export = nbytes / host_device_bw + nbytes / serialize_bw
    pulls = ray_fetch_rounds(engines, fetch) * nbytes / store_bw
    return export + pulls + nbytes / (devices_per_engine * host_device_bw)


def cuda_ipc_seconds(nbytes: float, bucket_bytes: float, copy_bw: float, bucket_s: float) -> float:
    """Colocated refit through CUDA IPC handles, seconds: t = ceil(B / b) * bucket_s + B / copy_bw.

    Every device copies the full gathered weights once, locally; ``copy_bw`` is a device-to-device copy's rate
    (HBM bandwidth / 2: each byte is read and written). Units: bytes, bytes/s, s.
    """
    _positive(copy_bw=copy_bw)
    return n_buckets(nbytes, bucket_bytes) * bucket_s + nbytes / copy_bw


def nccl_bus_bw(spec: RefitSpec, hardware: HardwareSpec, layout: LayoutSpec) -> float:
    """The broadcast's bus bytes/s: ``spec.nccl_bw``, or NCCL_BUS_EFF x (net_bw over the network, else link_bw)."""
    if spec.nccl_bw is not None:
        return spec.nccl_bw
    return NCCL_BUS_EFF * (hardware.net_bw if layout.refit_over_network else hardware.link_bw)


def transport_seconds(
    nbytes: float, spec: RefitSpec, hardware: HardwareSpec, layout: LayoutSpec, gen_devices: int
) -> float:
    """Seconds of ``spec.transport`` moving ``nbytes`` to ``gen_devices`` generation devices (engines of
    ``layout.gen_devices_per_engine``), without the fixed per-refit cost (:func:`fixed_seconds`)."""
    d = layout.gen_devices_per_engine
    engines = max(1, gen_devices // d)
    if spec.transport == "nccl":
        bw = nccl_bus_bw(spec, hardware, layout)
        return nccl_broadcast_seconds(nbytes, engines * d, spec.bucket_bytes, bw, spec.nccl_latency_s)
    if spec.transport == "ray":
        bws = (spec.host_device_bw, spec.serialize_bw, spec.store_bw)
        return ray_object_store_seconds(nbytes, engines, d, *bws, fetch=spec.ray_fetch)
    copy_bw = spec.ipc_copy_bw or hardware.mem_bw / 2
    return cuda_ipc_seconds(nbytes, spec.bucket_bytes, copy_bw, spec.ipc_bucket_s)


def fixed_seconds(spec: RefitSpec, efficiency: EfficiencySpec) -> float:
    """Fixed seconds per refit outside the transport: ``spec.fixed_s``, or ``efficiency.refit_overhead_s``."""
    return efficiency.refit_overhead_s if spec.fixed_s is None else spec.fixed_s
