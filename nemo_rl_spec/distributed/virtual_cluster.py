"""A virtual cluster of Ray placement-group bundles, one bundle per node (NeMo-RL's RayVirtualCluster, our own code).

One placement group holds ``num_nodes`` bundles; bundle ``n`` is node ``n``'s whole share (``gpus_per_node`` GPUs and
``cpus_per_node`` CPUs). With more than one node the group uses ``STRICT_SPREAD``, so every bundle lands on its own Ray
node; with one node ``PACK``. Workers are scheduled *into* a bundle with their own fractional ``num_cpus`` /
``num_gpus`` (several actors share a bundle: that is how colocated training and generation share a node's GPUs or
cores), so the bundle index of a worker is its node index.

On CPU (``gpus_per_node == 0``) a node's share is CPUs only; the Megatron workers and vLLM engines on it ask for
fractions of them (``cluster.policy_num_cpus``, ``cluster.generation_num_cpus``).
"""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from nemo_rl_spec.distributed.weight_broadcast import node_address_and_free_port


class ClusterResourcesError(RuntimeError):
    """The Ray cluster cannot host the requested bundles (too few nodes, CPUs or GPUs)."""


class RayVirtualCluster:
    """``num_nodes`` bundles of ``{"CPU": cpus_per_node, "GPU": gpus_per_node}``, one per Ray node.

    Args:
        num_nodes: nodes to reserve (``cluster.num_nodes``).
        cpus_per_node: CPUs reserved on each node (fractional allowed), > 0.
        gpus_per_node: GPUs reserved on each node (0 on CPU).
        name: placement-group name (shows in ``ray status``).
        timeout_s: seconds to wait for the reservation.

    Raises:
        ValueError: non-positive sizes.
        ClusterResourcesError: the reservation is not granted within ``timeout_s`` (the message lists the Ray nodes
            and their CPUs / GPUs).
    """

    def __init__(
        self,
        num_nodes: int,
        cpus_per_node: float,
        gpus_per_node: int = 0,
        name: str = "nemo_rl_spec",
        timeout_s: float = 120.0,
    ):
        if num_nodes < 1 or cpus_per_node <= 0 or gpus_per_node < 0:
            raise ValueError(
                f"num_nodes={num_nodes} must be >= 1, cpus_per_node={cpus_per_node} > 0, "
                f"gpus_per_node={gpus_per_node} >= 0"
            )
        self.num_nodes, self.cpus_per_node, self.gpus_per_node = num_nodes, float(cpus_per_node), int(gpus_per_node)
        bundle = {"CPU": self.cpus_per_node, **({"GPU": self.gpus_per_node} if self.gpus_per_node else {})}
        strategy = "STRICT_SPREAD" if num_nodes > 1 else "PACK"
        self.placement_group = placement_group([dict(bundle) for _ in range(num_nodes)], strategy=strategy, name=name)
        if not self._wait(timeout_s):
            nodes = [
                (n["NodeManagerAddress"], n["Resources"].get("CPU", 0), n["Resources"].get("GPU", 0))
                for n in ray.nodes()
                if n["Alive"]
            ]
            remove_placement_group(self.placement_group)
            raise ClusterResourcesError(
                f"cannot reserve {num_nodes} node(s) x {bundle} ({strategy}) within {timeout_s:.0f} s; Ray nodes "
                f"(address, CPUs, GPUs): {nodes}. Check cluster.num_nodes, cluster.gpus_per_node and the per-worker "
                "CPU shares"
            )

    def _wait(self, timeout_s: float) -> bool:
        ready, _ = ray.wait([self.placement_group.ready()], timeout=timeout_s)
        return bool(ready)

    def scheduling(self, node: int) -> PlacementGroupSchedulingStrategy:
        """The scheduling strategy that puts an actor into node ``node``'s bundle.

        Raises:
            IndexError: ``node`` outside ``0..num_nodes-1``.
        """
        if not 0 <= node < self.num_nodes:
            raise IndexError(f"node {node} outside 0..{self.num_nodes - 1}")
        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group,
            placement_group_bundle_index=node,
            placement_group_capture_child_tasks=False,
        )

    def node_address(self, node: int) -> tuple[str, int]:
        """(IP address, a free TCP port) on node ``node``, probed by a tiny task scheduled into its bundle (the
        rendezvous address of a worker group whose rank 0 lives there)."""
        return ray.get(_address_and_free_port.options(num_cpus=0, scheduling_strategy=self.scheduling(node)).remote())

    def shutdown(self) -> None:
        """Release the reservation (idempotent)."""
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None


_address_and_free_port = ray.remote(num_cpus=0)(node_address_and_free_port)
