"""How a refit moves the trainer's weights into the generation engines (``policy.generation.refit_transport``).

- ``ray`` (the default, also for ``null``): rank 0 exports the TP-gathered HF tensors into Ray's object store once;
  every engine reads that copy (a serialisation and, on GPU, a device-to-host copy per refit).
- ``nccl``: a collective. The trainer's rank 0 and every engine join one process group
  (:class:`~nemo_rl_spec.distributed.weight_broadcast.WeightBroadcastGroup`: NCCL when the workers have GPUs, gloo on
  CPU) once, at the first refit; each refit is a bucketed broadcast from rank 0 (``refit_bucket_size_mb`` per
  bucket), the weight version travelling in the broadcast's header. Policy and drafter go the same way. With engine
  restarts on, rank 0 keeps what it last sent (a restarted engine is given it) and the group is rebuilt after a
  restart; an engine that dies during a broadcast still ends the run.

Either way the engines then load the weights with the same checks (every name present, versions recorded), and the
refitter's version check and log-prob probe run unchanged after.
"""

from __future__ import annotations

from typing import Any, Protocol

from nemo_rl_spec.distributed.worker_group import PendingCalls

__all__ = ["RefitTransport", "ObjectStoreTransport", "CollectiveTransport", "make_refit_transport"]

MiB = 1 << 20


class RefitTransport(Protocol):
    """Moves one export of weights from the policy workers into every engine; blocks until all have loaded."""

    def push_policy(self, version: int) -> None: ...

    def push_draft(self) -> list[dict[str, Any]]: ...

    def metrics(self) -> dict[str, float]: ...


class ObjectStoreTransport:
    """``ray``: one object-store copy of the export serves every engine.

    Args:
        policy, generation: the policy and generation controllers.
        engine_dtype: the dtype the trainer casts the weights to before sending (``float32`` | ``bfloat16``).
    """

    def __init__(self, policy, generation, engine_dtype: str) -> None:
        self.policy, self.generation, self.engine_dtype = policy, generation, engine_dtype

    def push_policy(self, version: int) -> None:
        """Export the policy as ``version`` and load it into every engine."""
        self.generation.update_weights(self.policy.export_hf_weights(version, self.engine_dtype), version)

    def push_draft(self) -> list[dict[str, Any]]:
        """Export the drafter and load it into every engine's drafter; each engine's result (rank order)."""
        return self.generation.update_draft_weights(self.policy.export_draft_weights(self.engine_dtype))

    def metrics(self) -> dict[str, float]:
        """No transport metrics."""
        return {}


class CollectiveTransport:
    """``nccl``: a bucketed broadcast from the trainer's rank 0 to every engine over one process group.

    The group (1 + E members) is created on the first push: rank 0 hosts its store on a free port of its node.

    Args:
        policy, generation: the controllers (the workers implement ``init_refit_group`` and the broadcast / receive
            methods).
        engine_dtype: as for :class:`ObjectStoreTransport`.
        backend: ``gloo`` (CPU workers) or ``nccl`` (GPU workers).
        bucket_bytes: bytes per broadcast bucket (a tensor larger than it travels alone).
        timeout_s: seconds any member waits for the others (joining, each broadcast) before the run fails.
    """

    def __init__(
        self, policy, generation, engine_dtype: str, backend: str, bucket_bytes: int, timeout_s: float = 600.0
    ) -> None:
        self.policy, self.generation, self.engine_dtype = policy, generation, engine_dtype
        self.backend, self.bucket_bytes, self.timeout_s = backend, int(bucket_bytes), float(timeout_s)
        # gloo's broadcast sends every receiver the whole set from the root; the chain measured 0.62x of the object
        # store against 0.75x at 1 GiB and 2 engines (docs/results/refit_transport.md); NCCL pipelines its own
        self.algorithm = "chain" if backend == "gloo" else "broadcast"
        self.joined = False
        self.policy_send: dict[str, float] = {}
        recovery = generation.recovery
        self.keep = recovery.enabled  # rank 0 keeps what it sent: a restarted engine is given it
        self.version: int | None = None  # the policy version every engine holds after the last push
        self.draft_pushed = False
        self.restarts_seen = recovery.restarts
        if self.keep:
            recovery.set_source(self._kept_policy, self._kept_draft)

    def _kept_policy(self):
        if self.version is None:
            return None
        return self.policy.sent_refit_weights("policy").ref(), self.version

    def _kept_draft(self):
        return self.policy.sent_refit_weights("draft").ref() if self.draft_pushed else None

    def _join(self) -> None:
        """Join the group at the first push, and again after an engine restart (a new engine is not a member: every
        member joins a new group)."""
        restarts = self.generation.recovery.restarts
        if self.joined and restarts == self.restarts_seen:
            return
        self.restarts_seen = restarts
        host, port = self.policy.refit_group_address()
        world_size = 1 + self.generation.num_engines
        args = (host, port, world_size, self.backend, self.timeout_s, self.algorithm)
        PendingCalls.wait_all(self.policy.init_refit_group_async(*args), self.generation.init_refit_group_async(*args))
        self.joined = True

    @staticmethod
    def _run(senders: PendingCalls, receivers: PendingCalls) -> tuple[list, dict[str, float]]:
        """Wait for both sides of one broadcast; returns (the receivers' results, rank 0's send stats)."""
        sent, received = PendingCalls.wait_all(senders, receivers)
        return received, sent[0]

    def push_policy(self, version: int) -> None:
        """Broadcast the policy export as ``version``; every engine loads it. Every engine is first asked for its
        versions, so an engine that died since the last call is restarted here (or, without restarts, stops the run
        naming ``max_generation_failures``), not found dead in the middle of a broadcast; the drafter push that
        follows in the same refit needs no second check."""
        self.generation.get_versions()
        self._join()
        _, self.policy_send = self._run(
            self.policy.broadcast_hf_weights_async(version, self.engine_dtype, self.bucket_bytes, self.keep),
            self.generation.receive_weights_async(),
        )
        self.version = int(version)

    def push_draft(self) -> list[dict[str, Any]]:
        """Broadcast the drafter export; each engine's load result (rank order)."""
        self._join()
        out = self._run(
            self.policy.broadcast_draft_weights_async(self.engine_dtype, self.bucket_bytes, self.keep),
            self.generation.receive_draft_weights_async(),
        )[0]
        self.draft_pushed = True
        return out

    def metrics(self) -> dict[str, float]:
        """The last policy broadcast: ``refit/broadcast_bytes`` (bucket bytes, alignment padding included) and
        ``refit/broadcast_buckets``."""
        return {f"refit/broadcast_{k}": float(v) for k, v in self.policy_send.items()}


def make_refit_transport(
    transport: str | None, policy, generation, engine_dtype: str, uses_gpus: bool, bucket_mb: float
) -> RefitTransport:
    """The transport ``policy.generation.refit_transport`` names (None: ``ray``); ``nccl`` runs over NCCL with GPU
    workers (``uses_gpus``) and over gloo otherwise, in buckets of ``bucket_mb`` MiB.

    Raises:
        ValueError: an unknown transport (the schema refuses it first).
    """
    if transport in (None, "ray"):
        return ObjectStoreTransport(policy, generation, engine_dtype)
    if transport == "nccl":
        backend = "nccl" if uses_gpus else "gloo"
        # at least one byte: any positive policy.refit.bucket_size_mb runs (below a tensor's size, one per bucket)
        return CollectiveTransport(policy, generation, engine_dtype, backend, max(1, int(bucket_mb * MiB)))
    raise ValueError(f"policy.generation.refit_transport must be ray or nccl, got {transport!r}")
