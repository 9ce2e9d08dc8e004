"""Collective refit transport: the trainer's rank 0 broadcasts named weights to every generation engine in buckets.

One process group, outside the trainer's and the engines' own groups, joins the trainer's rank 0 (group rank 0, the
sender) and E engines (group ranks 1..E). It is built from a TCP store that rank 0 hosts (``host:port``), so neither
side needs a global ``torch.distributed`` world: gloo on CPU, NCCL on GPU (NeMo-RL's
``policy.generation.refit_transport: nccl``).

A transfer is self-describing: a header (names, shapes, dtypes, the bucket plan and the caller's metadata, e.g. the
weight version) goes first, as the length then the bytes of its pickle; then each bucket is one broadcast of a flat
byte buffer holding its tensors back to back, each starting at a multiple of :data:`ALIGN` bytes (so a byte slice can
be viewed as any dtype). A bucket holds whole tensors: it is closed when it reaches ``bucket_bytes``, so a tensor
larger than the bucket travels alone. Cost on the wire: sum of bytes + one header, in ceil(bytes / bucket) + 2
broadcasts; the sender's peak extra memory is one bucket.
"""

from __future__ import annotations

import datetime
import pickle
import socket
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ALIGN", "WeightBroadcastGroup", "bucket_plan", "TensorLayout", "node_address_and_free_port"]

ALGORITHMS = ("broadcast", "chain")
ALIGN = 16  # bytes: every tensor starts at a multiple of it inside a bucket (covers every dtype's element size)


@dataclass(frozen=True)
class TensorLayout:
    """Where one tensor lies in its bucket: ``name``, ``shape``, ``dtype`` (its str, e.g. ``torch.float32``),
    ``offset`` and ``nbytes`` in bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


def node_address_and_free_port() -> tuple[str, int]:
    """(this node's IP address as Ray reports it, a TCP port free on it now): a rendezvous address hosted here."""
    import ray  # only where a Ray node runs this

    with socket.socket() as sock:
        sock.bind(("", 0))
        return ray.util.get_node_ip_address(), sock.getsockname()[1]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def bucket_plan(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[TensorLayout]]:
    """Split ``tensors`` (in their order) into buckets of whole tensors of about ``bucket_bytes`` each.

    A tensor joins the current bucket while the bucket holds fewer than ``bucket_bytes`` bytes; offsets are rounded up
    to :data:`ALIGN`. Each bucket's size is ``last.offset + last.nbytes``.

    Raises:
        ValueError: ``bucket_bytes`` < 1.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[TensorLayout]] = []
    size = bucket_bytes  # forces a first bucket
    for name, t in tensors.items():
        if size >= bucket_bytes:
            buckets.append([])
            size = 0
        offset = _aligned(size)
        nbytes = t.numel() * t.element_size()
        buckets[-1].append(TensorLayout(name, tuple(t.shape), str(t.dtype), offset, nbytes))
        size = offset + nbytes
    return buckets


def _bucket_size(bucket: list[TensorLayout]) -> int:
    return bucket[-1].offset + bucket[-1].nbytes if bucket else 0


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


class WeightBroadcastGroup:
    """A process group of one sender (rank 0: the trainer's rank 0) and ``world_size - 1`` receivers (the engines).

    Every member constructs it at the same time (the constructor blocks until all have joined): rank 0 hosts the TCP
    store at ``host:port``.

    Args:
        host, port: the TCP store's address (rank 0's node and a free port on it).
        rank: this member's rank (0: sender).
        world_size: 1 + the number of engines.
        backend: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors, on ``torch.cuda.current_device()``).
        timeout_s: seconds a member waits for the others (joining, each broadcast).
        algorithm: how a bucket reaches the receivers: ``broadcast`` (the backend's broadcast: NCCL pipelines it over
            a ring or tree; gloo's root sends the whole bucket to every receiver in turn) or ``chain`` (point-to-point
            along 0 -> 1 -> ... -> E: each receiver forwards a bucket while the next arrives, so every member sends
            each byte at most once; with B bytes in buckets of b, about B + (E - 1) b bytes of time).

    Raises:
        ValueError: an unknown backend, or ``rank`` outside ``[0, world_size)``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 600.0,
        algorithm: str = "broadcast",
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"refit group backend must be gloo or nccl, got {backend!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"refit group algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        self.algorithm = algorithm
        if not 0 <= rank < world_size:
            raise ValueError(f"refit group rank {rank} outside [0, {world_size})")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
        self._store = store  # the master's store must outlive the group
        prefixed = dist.PrefixStore("weight_broadcast/", store)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            self.device = torch.device("cpu")
        else:
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.rank, self.world_size, self.backend = rank, world_size, backend

    def _broadcast(self, buffer: torch.Tensor) -> None:
        self.group.broadcast(buffer, 0).wait()

    def _move(self, buffer: torch.Tensor, tag: int, outstanding: deque) -> None:
        """One bucket from rank 0 into ``buffer`` on every member (rank 0: its contents). ``chain``: receive from the
        previous rank, forward to the next without waiting; at most two forwards stay in flight (``outstanding``)."""
        if self.algorithm == "broadcast":
            self._broadcast(buffer)
            return
        if self.rank > 0:
            self.group.recv([buffer], self.rank - 1, tag).wait()
        if self.rank + 1 < self.world_size:
            outstanding.append((self.group.send([buffer], self.rank + 1, tag), buffer))
            while len(outstanding) > 2:
                outstanding.popleft()[0].wait()

    @staticmethod
    def _drain(outstanding: deque) -> None:
        while outstanding:
            outstanding.popleft()[0].wait()

    def _broadcast_object(self, obj: Any) -> Any:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if self.rank == 0 else None
        length = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64, device=self.device)
        self._broadcast(length)
        buffer = (
            payload.to(self.device)
            if payload is not None
            else torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        )
        self._broadcast(buffer)
        return obj if self.rank == 0 else pickle.loads(buffer.cpu().numpy().tobytes())

    def send(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], bucket_bytes: int) -> dict[str, float]:
        """Broadcast ``tensors`` and ``meta`` (small, picklable: e.g. the weight version) to every receiver.
        Rank 0 only. Returns ``{"bytes", "buckets"}``.

        Raises:
            RuntimeError: called on a receiver; a member failed or timed out (from the backend).
        """
        if self.rank != 0:
            raise RuntimeError("WeightBroadcastGroup.send is rank 0's (the trainer's); receivers call recv")
        plan = bucket_plan(tensors, bucket_bytes)
        self._broadcast_object({"buckets": plan, "meta": meta})
        outstanding: deque = deque()
        for k, bucket in enumerate(plan):
            buffer = torch.zeros(_bucket_size(bucket), dtype=torch.uint8, device=self.device)
            for item in bucket:
                src = tensors[item.name].detach().contiguous().reshape(-1).view(torch.uint8)
                buffer[item.offset : item.offset + item.nbytes].copy_(src)
            self._move(buffer, tag=k, outstanding=outstanding)
        self._drain(outstanding)
        return {"bytes": float(sum(_bucket_size(b) for b in plan)), "buckets": float(len(plan))}

    def recv(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Receive one :meth:`send`: ``(tensors, meta)``, tensors on this member's device in the sender's dtypes and
        shapes (views into the received buckets). Receivers only.

        Raises:
            RuntimeError: called on rank 0; a member failed or timed out (from the backend).
        """
        if self.rank == 0:
            raise RuntimeError("WeightBroadcastGroup.recv is a receiver's; rank 0 sends")
        header = self._broadcast_object(None)
        out: dict[str, torch.Tensor] = {}
        outstanding: deque = deque()
        for k, bucket in enumerate(header["buckets"]):
            buffer = torch.empty(_bucket_size(bucket), dtype=torch.uint8, device=self.device)
            self._move(buffer, tag=k, outstanding=outstanding)
            for item in bucket:
                raw = buffer[item.offset : item.offset + item.nbytes]
                out[item.name] = raw.view(_dtype(item.dtype)).view(item.shape)
        self._drain(outstanding)
        return out, header["meta"]
