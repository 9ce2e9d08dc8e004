"""Refit transport seconds: Ray's object store against the collective broadcast, per weight set and engine count.

    python examples/bench_refit_transport.py --out docs/results/refit_transport/refit_transport.json
        [--sets tiny-qwen3 smollm2-135m-instruct synthetic:1024] [--engines 1 2] [--repeats 3] [--bucket-mb 256]

What is timed: moving one weight set from a sender actor (the trainer's rank 0) into E receiver actors (the engines),
from the driver's call until every receiver holds every tensor, the same Ray actors and processes for both
transports:

- ``ray`` (:class:`~nemo_rl_spec.algorithms.refit_transport.ObjectStoreTransport`'s path): the sender's method
  returns the tensors (Ray serialises them into the object store), each receiver is called with that object's ref
  (Ray fetches and deserialises a copy into the receiver);
- ``collective_broadcast`` / ``collective_chain`` (``refit_transport: nccl``, over gloo here): the sender sends
  ``--bucket-mb`` buckets over a :class:`~nemo_rl_spec.distributed.weight_broadcast.WeightBroadcastGroup` joined
  before the timing, with gloo's broadcast (the root sends every receiver the whole set) or the chain (each member
  forwards to the next).

Not timed: the export (TP gather, dtype cast) and the engine's own weight load (vLLM ``reload_weights``), which both
transports share. Weight sets: a built-in checkpoint's tensors as stored (``tiny-qwen3``, ``smollm2-135m-instruct``:
its real names, shapes, dtype), or ``synthetic:<MiB>``: fp32 matrices of 4096 x 4096 (64 MiB) up to that size.
Transports and engine counts run interleaved, ``--repeats`` rounds; each cell reports the median and every repeat.

Written JSON (``write_bench_json``: plus ``"machine"``)::

    {"bucket_mb", "repeats", "sets": {"<set>": {"bytes", "tensors"}},
     "cells": [{"set", "engines", "transport", "seconds" (median), "seconds_all"}],
     "ratios": [{"set", "engines", "transport", "over_ray" (median of per-repeat seconds ratios), "per_repeat"}]}

Also prints a table. On 2 shared CPU cores run it alone (``../shared/tools/heavy``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import ray
import torch
from safetensors.torch import load_file

from nemo_rl_spec.distributed.weight_broadcast import ALGORITHMS, WeightBroadcastGroup, node_address_and_free_port
from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.utils.machine import write_bench_json

MiB = 1 << 20
COLLECTIVES = tuple(f"collective_{a}" for a in ALGORITHMS)


def load_weight_set(name: str) -> dict[str, torch.Tensor]:
    """The tensors of weight set ``name`` (module docstring)."""
    if name.startswith("synthetic:"):
        total = int(float(name.split(":", 1)[1]) * MiB)
        side = 4096
        count = max(1, total // (side * side * 4))
        gen = torch.Generator().manual_seed(0)
        return {f"layers.{i}.weight": torch.randn(side, side, generator=gen) for i in range(count)}
    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(resolve_model(name)).glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


class Sender:
    """The trainer's rank 0 stand-in: holds a weight set, exports it through either transport."""

    def __init__(self, set_name: str) -> None:
        torch.set_num_threads(1)
        self.weights = load_weight_set(set_name)
        self.groups: dict[str, WeightBroadcastGroup] = {}

    def size(self) -> tuple[int, int]:
        return sum(t.numel() * t.element_size() for t in self.weights.values()), len(self.weights)

    def address(self) -> tuple[str, int]:
        return node_address_and_free_port()

    def join(self, host: str, port: int, world_size: int, algorithm: str) -> None:
        self.groups[algorithm] = WeightBroadcastGroup(host, port, 0, world_size, "gloo", 600, algorithm)

    def export(self) -> dict[str, torch.Tensor]:
        return self.weights

    def broadcast(self, bucket_bytes: int, algorithm: str) -> dict[str, float]:
        return self.groups[algorithm].send(self.weights, {"version": 1}, bucket_bytes)


class Receiver:
    """An engine stand-in: receives a weight set and keeps it (as an engine does until its load)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.held: dict[str, torch.Tensor] = {}
        self.groups: dict[str, WeightBroadcastGroup] = {}

    def join(self, host: str, port: int, rank: int, world_size: int, algorithm: str) -> None:
        self.groups[algorithm] = WeightBroadcastGroup(host, port, rank, world_size, "gloo", 600, algorithm)

    def load(self, weights: dict[str, torch.Tensor]) -> int:
        self.held = weights
        return len(weights)

    def receive(self, algorithm: str) -> int:
        self.held, _ = self.groups[algorithm].recv()
        return len(self.held)

    def drop(self) -> None:
        self.held = {}


def time_once(sender, receivers: list, transport: str, bucket_bytes: int) -> float:
    """Seconds to move the sender's set into every receiver by ``transport`` (``ray`` or one of
    :data:`COLLECTIVES`)."""
    ray.get([r.drop.remote() for r in receivers])
    start = time.perf_counter()
    if transport == "ray":
        ref = sender.export.remote()
        counts = ray.get([r.load.remote(ref) for r in receivers])
    else:
        algorithm = transport.removeprefix("collective_")
        pending = [r.receive.remote(algorithm) for r in receivers]
        ray.get(sender.broadcast.remote(bucket_bytes, algorithm))
        counts = ray.get(pending)
    seconds = time.perf_counter() - start
    assert len(set(counts)) == 1 and counts[0] > 0, counts
    return seconds


def bench_set(set_name: str, engines: list[int], repeats: int, bucket_bytes: int) -> tuple[dict, list[dict]]:
    """Every (engines, transport) cell of one weight set, interleaved over ``repeats`` rounds; one sender and
    max(engines) receivers, a collective group per engine count (joined before the timing)."""
    remote = dict(num_cpus=0)
    sender = ray.remote(**remote)(Sender).remote(set_name)
    receivers = [ray.remote(**remote)(Receiver).remote() for _ in range(max(engines))]
    nbytes, ntensors = ray.get(sender.size.remote())
    times: dict[tuple[int, str], list[float]] = {}
    try:
        for _ in range(repeats):
            for e in engines:
                for algorithm in ALGORITHMS:
                    host, port = ray.get(sender.address.remote())
                    joins = [r.join.remote(host, port, i + 1, e + 1, algorithm) for i, r in enumerate(receivers[:e])]
                    ray.get([sender.join.remote(host, port, e + 1, algorithm)] + joins)
                for transport in ("ray", *COLLECTIVES):
                    times.setdefault((e, transport), []).append(
                        time_once(sender, receivers[:e], transport, bucket_bytes)
                    )
    finally:
        for actor in [sender, *receivers]:
            ray.kill(actor)
    cells = [
        {
            "set": set_name,
            "engines": e,
            "transport": t,
            "seconds": statistics.median(v),
            "seconds_all": v,
        }
        for (e, t), v in times.items()
    ]
    return {"bytes": nbytes, "tensors": ntensors}, cells


def ratios(cells: list[dict]) -> list[dict]:
    """collective / ray seconds per (set, engines, collective algorithm): the median of the per-repeat ratios (each
    repeat's two cells ran back to back) and each repeat's."""
    by = {(c["set"], c["engines"], c["transport"]): c for c in cells}
    out = []
    for (s, e, t), c in by.items():
        if t != "ray":
            continue
        for coll_name in COLLECTIVES:
            coll = by[(s, e, coll_name)]
            per = [b / a for a, b in zip(c["seconds_all"], coll["seconds_all"])]
            out.append(
                {"set": s, "engines": e, "transport": coll_name, "over_ray": statistics.median(per), "per_repeat": per}
            )
    return out


def print_table(sets: dict, cells: list[dict], rats: list[dict]) -> None:
    by = {(c["set"], c["engines"], c["transport"]): c["seconds"] for c in cells}
    print(f"{'weight set':<24} {'MiB':>8} {'engines':>7} {'ray s':>8} {'transport':>22} {'s':>8} {'/ray':>6}")
    for r in rats:
        s, e, t = r["set"], r["engines"], r["transport"]
        print(
            f"{s:<24} {sets[s]['bytes'] / MiB:>8.1f} {e:>7} {by[(s, e, 'ray')]:>8.3f} "
            f"{t:>22} {by[(s, e, t)]:>8.3f} {r['over_ray']:>6.2f}"
        )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write (its directory must exist)")
    p.add_argument("--sets", nargs="+", default=["tiny-qwen3", "smollm2-135m-instruct", "synthetic:1024"])
    p.add_argument("--engines", nargs="+", type=int, default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=256.0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    sets, cells = {}, []
    try:
        for name in args.sets:
            sets[name], more = bench_set(name, args.engines, args.repeats, int(args.bucket_mb * MiB))
            cells += more
    finally:
        ray.shutdown()
    rats = ratios(cells)
    print_table(sets, cells, rats)
    result = {"bucket_mb": args.bucket_mb, "repeats": args.repeats, "sets": sets, "cells": cells, "ratios": rats}
    write_bench_json(args.out, result)
    print(f"wrote {args.out}")
    return 0
