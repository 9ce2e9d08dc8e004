"""The collective refit's bucketed broadcast (nemo_rl_spec.distributed.weight_broadcast) over a real gloo group.

The bucket plan is checked against offsets worked by hand; the broadcast, with 1 sender and 2 receivers in separate
processes, must deliver every tensor bit for bit (a copy: no arithmetic, so no tolerance) in its dtype and shape,
mixed dtypes and a tensor larger than the bucket included, plus the header's metadata.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from nemo_rl_spec.distributed.weight_broadcast import ALIGN, WeightBroadcastGroup, bucket_plan


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=g),  # 60 bytes
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),  # 14 bytes: the next offset must be re-aligned
        "c.weight": torch.randn(40, 10, generator=g),  # 1600 bytes: larger than the bucket below, travels alone
        "d.count": torch.arange(3, dtype=torch.int64),  # 24 bytes
        "e.scalar": torch.tensor(2.5),  # 0-d
    }


def plan_expected():
    # a (60 B) opens bucket 0; 60 < 100, so b joins at offset 64 (60 rounded up to ALIGN=16), size 78; 78 < 100, so
    # c joins at 80 (size 1680 >= 100: the bucket closes); d opens bucket 1; 24 < 100, e joins at 32 (size 36)
    return [
        [("a.weight", 0, 60), ("b.bias", 64, 14), ("c.weight", 80, 1600)],
        [("d.count", 0, 24), ("e.scalar", 32, 4)],
    ]


def test_bucket_plan_closes_buckets_at_the_size():
    plan = bucket_plan(_tensors(), bucket_bytes=100)
    assert ALIGN == 16
    assert [[(t.name, t.offset, t.nbytes) for t in b] for b in plan] == plan_expected()
    one_each = bucket_plan(_tensors(), bucket_bytes=1)
    assert [[t.name for t in b] for b in one_each] == [[n] for n in _tensors()]
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket_plan(_tensors(), bucket_bytes=0)


def _member(rank: int, world: int, port: int, bucket_bytes: int, algorithm: str, results) -> None:
    group = WeightBroadcastGroup("127.0.0.1", port, rank, world, "gloo", timeout_s=30, algorithm=algorithm)
    if rank == 0:
        stats = group.send(_tensors(), {"version": 7}, bucket_bytes)
        with pytest.raises(RuntimeError, match="rank 0 sends"):
            group.recv()
        results.put((rank, stats))
        return
    with pytest.raises(RuntimeError, match="receivers call recv"):
        group.send({}, {}, 1)
    tensors, meta = group.recv()
    results.put((rank, ({k: v.clone() for k, v in tensors.items()}, meta)))


@pytest.mark.parametrize("algorithm", ["broadcast", "chain"])
def test_broadcast_delivers_every_tensor_bitwise(algorithm, bucket_bytes=100):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, 3, port, bucket_bytes, algorithm, results)) for r in range(3)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    sent = _tensors()
    assert got[0] == {"bytes": 1680.0 + 36.0, "buckets": 2.0}  # plan_expected(): bucket sizes 80 + 1600, 32 + 4
    for rank in (1, 2):
        tensors, meta = got[rank]
        assert meta == {"version": 7} and list(tensors) == list(sent)
        for name, t in sent.items():
            assert tensors[name].dtype == t.dtype and tensors[name].shape == t.shape, name
            assert torch.equal(tensors[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_bad_rank_and_backend_are_refused():
    with pytest.raises(ValueError, match="backend"):
        WeightBroadcastGroup("127.0.0.1", 1, 0, 2, backend="mpi")
    with pytest.raises(ValueError, match="algorithm must be one of"):
        WeightBroadcastGroup("127.0.0.1", 1, 0, 2, algorithm="ring")
    with pytest.raises(ValueError, match="rank 2 outside"):
        WeightBroadcastGroup("127.0.0.1", 1, 2, 2)


def test_refit_transport_keys_validate():
    from nemo_rl_spec.utils.config import load_config

    base = "configs/grpo_math_tiny.yaml"
    cfg = load_config(base, ["policy.generation.refit_transport=nccl", "policy.refit.bucket_size_mb=64"])
    assert cfg.policy.generation.refit_transport == "nccl" and cfg.policy.refit.bucket_size_mb == 64
    assert load_config(base, []).policy.generation.refit_transport is None  # null: the object store (ray)
    with pytest.raises(ValueError, match="cuda_ipc .* not implemented; use nccl"):
        load_config(base, ["policy.generation.refit_transport=cuda_ipc"])
    with pytest.raises(ValueError, match="bucket_size_mb"):
        load_config(base, ["policy.refit.bucket_size_mb=0"])


def test_any_positive_bucket_size_gives_a_runnable_transport():
    """policy.refit.bucket_size_mb validates for any value > 0; below one byte the transport still sends (one tensor
    per bucket) instead of failing at the first refit."""
    from nemo_rl_spec.algorithms.refit_transport import make_refit_transport

    class _Generation:
        class recovery:  # noqa: N801 - a stand-in for VllmGeneration.recovery
            enabled, restarts = False, 0

    transport = make_refit_transport("nccl", object(), _Generation(), "float32", uses_gpus=False, bucket_mb=1e-9)
    assert transport.bucket_bytes == 1 and transport.backend == "gloo" and transport.algorithm == "chain"
