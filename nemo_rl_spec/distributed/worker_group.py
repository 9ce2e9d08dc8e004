"""A group of N Ray actors of one class, optionally in one ``torch.distributed`` world (NeMo-RL's RayWorkerGroup,
our own code).

Worker ``r`` is scheduled into the bundle of node ``nodes[r]`` of a :class:`RayVirtualCluster` and gets, in its
``runtime_env``, ``RANK=r``, ``WORLD_SIZE=N``, ``LOCAL_RANK`` (its index among the group's workers on that node),
``MASTER_ADDR`` / ``MASTER_PORT`` (published from rank 0's node: a free port probed there) and the caller's own
environment variables. The actor's ``__init__`` then calls :func:`init_process_group_from_env` (gloo on CPU, NCCL
on GPU). Groups of independent actors (one vLLM engine per worker) pass ``torch_distributed=False``: no world, no
rendezvous variables.

Methods run on all workers or on a subset (``ranks``); :meth:`run_all_workers_sharded_data` splits a batch by
data-parallel rank (:func:`~nemo_rl_spec.distributed.batch.shard_batch`): every worker of DP rank ``d`` (its TP/PP
peers too) receives shard ``d``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import ray
import torch

from nemo_rl_spec.distributed.batch import shard_batch
from nemo_rl_spec.distributed.virtual_cluster import RayVirtualCluster

RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def init_process_group_from_env(timeout_minutes: float = 30.0) -> tuple[int, int]:
    """Initialise the default ``torch.distributed`` group from the rendezvous variables a worker group set (gloo on
    CPU, NCCL when CUDA is available); a process without them gets a world of size 1 on a free local port.

    Returns:
        (rank, world_size).
    Raises:
        RuntimeError: from ``torch.distributed`` when peers do not join within ``timeout_minutes``.
    """
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1))
    timeout = timedelta(minutes=timeout_minutes)
    if "WORLD_SIZE" not in os.environ:  # a world of one on a free local port; os.environ is left untouched (a Ray
        # started later from this process would hand the variables to its actors)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.distributed.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=timeout
        )
        return 0, 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.distributed.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    return rank, world


class RemoteValue:
    """A value one worker group produced that stays in Ray's object store until someone needs it: the controllers
    hand it to another worker group (the policy's exported weights to every vLLM engine: one copy serves all, none
    passes through the driver) without exposing the Ray handle to the drivers. :meth:`get` fetches the value."""

    def __init__(self, ref: ray.ObjectRef) -> None:
        self._ref = ref

    def get(self) -> Any:
        """The value (fetched from the object store; blocks until it exists).

        Raises:
            ray.exceptions.RayError: the producing task failed.
        """
        return ray.get(self._ref)

    def ref(self) -> ray.ObjectRef:
        """The object ref, for controllers that pass the value on to actors (never for drivers)."""
        return self._ref

    @staticmethod
    def ref_of(value: Any) -> ray.ObjectRef:
        """An object ref for ``value``: its own for a :class:`RemoteValue`, else ``ray.put(value)``."""
        return value.ref() if isinstance(value, RemoteValue) else ray.put(value)


class PendingCalls:
    """Calls already running on workers (a controller's ``*_async`` method), for drivers that must let two worker
    groups work at once (the two sides of a collective) without holding Ray handles; :meth:`wait_all` collects them."""

    def __init__(self, refs: list[ray.ObjectRef]) -> None:
        self._refs = list(refs)

    @staticmethod
    def wait_all(*pending: "PendingCalls") -> list[list[Any]]:
        """Each one's results (worker order), in argument order. A failed call raises its error as soon as it fails,
        whatever the order (calls still running on the other side are left to their own timeout).

        Raises:
            ray.exceptions.RayError: the first call to fail.
        """
        left = [r for p in pending for r in p._refs]
        while left:
            done, left = ray.wait(left, num_returns=1)
            ray.get(done)
        return [ray.get(p._refs) for p in pending]


class RayWorkerGroup:
    """N actors of ``actor_cls`` placed on ``cluster`` nodes.

    Args:
        cluster: the virtual cluster whose bundles host the workers.
        actor_cls: a plain class (wrapped with ``ray.remote`` here).
        nodes: node index of each worker (``len(nodes)`` = N workers), e.g. ``[0, 0, 1, 1]``.
        init_args: ``init_args(rank) -> (args, kwargs)`` for each worker's constructor.
        num_cpus, num_gpus: per-worker Ray resources (fractions of their node's bundle).
        env_vars: per-worker environment (``env_vars(rank) -> dict``) merged under the rendezvous variables.
        torch_distributed: set the rendezvous variables (one ``torch.distributed`` world of N ranks).
        name: prefix of the actors' names (``<name>-<rank>``, shown by ``ray list actors``).

    Raises:
        ValueError: empty ``nodes``.
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        actor_cls: type,
        nodes: Sequence[int],
        init_args: Callable[[int], tuple[tuple, dict]],
        num_cpus: float,
        num_gpus: float = 0.0,
        env_vars: Callable[[int], dict[str, str]] | None = None,
        torch_distributed: bool = True,
        name: str = "worker",
    ):
        if not nodes:
            raise ValueError("a worker group needs at least one worker (nodes is empty)")
        self.cluster, self.nodes, self.name = cluster, list(nodes), name
        self._remote_cls, self._init_args, self._env_vars = ray.remote(actor_cls), init_args, env_vars
        self._resources = {"num_cpus": num_cpus, "num_gpus": num_gpus}
        self._rendezvous = cluster.node_address(self.nodes[0]) if torch_distributed else None
        self._incarnations = [0] * len(self.nodes)
        self.workers = [self._spawn(rank) for rank in range(len(self.nodes))]

    def _spawn(self, rank: int):
        node = self.nodes[rank]
        env = dict(self._env_vars(rank) if self._env_vars is not None else {})
        if self._rendezvous is not None:
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(len(self.nodes)),
                LOCAL_RANK=str(self.nodes[:rank].count(node)),
                MASTER_ADDR=self._rendezvous[0],
                MASTER_PORT=str(self._rendezvous[1]),
            )
        args, kwargs = self._init_args(rank)
        suffix = f"-r{self._incarnations[rank]}" if self._incarnations[rank] else ""
        return self._remote_cls.options(
            **self._resources,
            scheduling_strategy=self.cluster.scheduling(node),
            runtime_env={"env_vars": env},
            name=f"{self.name}-{rank}-{os.getpid()}-{id(self):x}{suffix}",
        ).remote(*args, **kwargs)

    def restart(self, rank: int, timeout: float | None = None) -> None:
        """Replace worker ``rank`` (dead or alive: it is killed first) by a new actor built as the first was, in the
        same placement-group bundle; blocks until its constructor has finished. Only for groups without a
        ``torch.distributed`` world (a new rank could not rejoin its peers' process group).

        Raises:
            RuntimeError: the group has a ``torch.distributed`` world.
            ray.exceptions.RayError: the new actor's constructor failed.
        """
        if self._rendezvous is not None:
            raise RuntimeError(f"{self.name}: a worker of a torch.distributed group cannot be restarted alone")
        ray.kill(self.workers[rank], no_restart=True)
        self._incarnations[rank] += 1
        self.workers[rank] = self._spawn(rank)
        ray.get(self.workers[rank].__ray_ready__.remote(), timeout=timeout)

    @property
    def world_size(self) -> int:
        """Number of workers."""
        return len(self.workers)

    def _targets(self, ranks: Sequence[int] | None) -> list[int]:
        return list(range(self.world_size)) if ranks is None else list(ranks)

    def run_all_workers_single_data(
        self, method: str, *args, ranks: Sequence[int] | None = None, **kwargs
    ) -> list[ray.ObjectRef]:
        """Call ``method(*args, **kwargs)`` on every worker (or on ``ranks``); returns the futures in rank order."""
        return [getattr(self.workers[r], method).remote(*args, **kwargs) for r in self._targets(ranks)]

    def run_all_workers_multiple_data(
        self, method: str, per_worker: Sequence[tuple[tuple, dict]], ranks: Sequence[int] | None = None
    ) -> list[ray.ObjectRef]:
        """Call ``method(*args_i, **kwargs_i)`` on worker ``ranks[i]`` (default: rank i) for each ``per_worker[i]``.

        Raises:
            ValueError: ``per_worker`` and the targeted ranks differ in length.
        """
        targets = self._targets(ranks)
        if len(per_worker) != len(targets):
            raise ValueError(f"{len(per_worker)} argument sets for {len(targets)} workers")
        return [getattr(self.workers[r], method).remote(*a, **k) for r, (a, k) in zip(targets, per_worker)]

    def run_all_workers_sharded_data(
        self, method: str, data: dict[str, Any], dp_rank_of: Sequence[int], dp_size: int, *args, **kwargs
    ) -> list[ray.ObjectRef]:
        """Shard ``data`` into ``dp_size`` contiguous row blocks and call ``method(shard, *args, **kwargs)`` on every
        worker, worker ``r`` receiving shard ``dp_rank_of[r]`` (its TP/PP peers get the same shard). Each shard is
        put in the object store once."""
        shards = [ray.put(s) for s in shard_batch(data, dp_size)]
        return [getattr(w, method).remote(shards[dp_rank_of[r]], *args, **kwargs) for r, w in enumerate(self.workers)]

    @staticmethod
    def get(refs: list[ray.ObjectRef] | ray.ObjectRef, timeout: float | None = None):
        """``ray.get`` (the controllers' one place that blocks on workers)."""
        return ray.get(refs, timeout=timeout)

    def run_function(self, fn: Callable[..., Any], *args, ranks: Sequence[int] | None = None) -> list:
        """``fn(worker_instance, *args)`` inside every worker (or ``ranks``), results in rank order (Ray's
        ``__ray_call__``); for checks that read a worker's internals. ``fn`` must be importable (Ray pickles
        module-level functions by reference)."""
        return ray.get([self.workers[r].__ray_call__.remote(fn, *args) for r in self._targets(ranks)])

    def node_ids(self) -> list[str]:
        """The Ray node id each worker runs on (rank order)."""
        return ray.get(
            [w.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for w in self.workers]
        )

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every worker's constructor has finished (re-raises a constructor's error)."""
        ray.get([w.__ray_ready__.remote() for w in self.workers], timeout=timeout)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask every worker to ``shutdown()`` at once (those that have the method), wait up to ``timeout`` s for all
        of them together, then kill every actor (so N busy workers cost one timeout, not N)."""
        pending = []
        for worker in self.workers:
            try:
                pending.append(worker.shutdown.remote())
            except Exception:  # noqa: BLE001 - no shutdown method or a dead actor: the kill below cleans up
                pass
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=timeout)
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
