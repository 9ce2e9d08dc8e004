"""Placement plan: which Megatron rank and which vLLM engine runs on which node, with which CPU / GPU share.

:func:`plan_placement` is pure (no Ray): it reads the recipe, checks that it fits its cluster and returns a
:class:`PlacementPlan`, which the setup code turns into one :class:`~nemo_rl_spec.distributed.virtual_cluster.
RayVirtualCluster` (one bundle per node) and two worker groups. ``examples/run_grpo.py --dry-run`` prints it.

A node has ``S`` worker slots (GPUs, or CPU slots on CPU). Colocated (sync GRPO): every slot holds one Megatron rank
and a share of one engine, and an engine never spans nodes. Split (async GRPO): generation takes the last slots
(one node) or the last nodes whole (several nodes), the policy the rest. Megatron ranks follow megatron-core's
order (TP fastest). On GPU the setup pins every worker to its slots' GPUs (:meth:`PlacementPlan.visible_devices_env`):
Ray's fractional-GPU requests alone would put two ranks on one GPU. The rules: :func:`plan_placement`; the Ray
requests: :func:`_requests`.
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_rl_spec.utils.config import ConfigError
from nemo_rl_spec.utils.config_schema import MasterConfig

COLOCATED_GPU_SHARE = 0.5  # GPU fraction of each of the two colocated actors on one GPU


@dataclass(frozen=True)
class PlacementPlan:
    """Where every worker of a run goes (:func:`plan_placement` gives the layout rules).

    Attributes:
        num_nodes: Ray nodes (= placement-group bundles), ``cluster.num_nodes``.
        slots_per_node: worker slots per node (GPUs on GPU, ``cluster.workers_per_node`` on CPU).
        use_gpus: ``cluster.gpus_per_node > 0``.
        colocated: ``policy.generation.colocated.enabled``.
        cpus_per_node, gpus_per_node: one bundle's CPUs (fractional) and GPUs.
        tp_size, pp_size, dp_size: Megatron tensor / pipeline / data parallel sizes (``tp * pp * dp`` = ranks).
        vllm_tp: tensor-parallel size of every engine.
        policy_nodes: node of each Megatron rank, ``len`` = policy world size.
        policy_slots: local slot (= local GPU on GPU) of each Megatron rank.
        engine_nodes: node of each vLLM engine, ``len`` = number of engines.
        engine_slots: local slots (= local GPUs on GPU) of each engine, ``vllm_tp`` each.
        policy_num_cpus, policy_num_gpus: Ray request of one Megatron rank.
        generation_num_cpus, generation_num_gpus: Ray request of one engine actor.
        dp_rank_of, tp_rank_of, pp_rank_of: Megatron coordinates of each rank.
    """

    num_nodes: int
    slots_per_node: int
    use_gpus: bool
    colocated: bool
    cpus_per_node: float
    gpus_per_node: int
    tp_size: int
    pp_size: int
    dp_size: int
    vllm_tp: int
    policy_nodes: list[int]
    policy_slots: list[int]
    engine_nodes: list[int]
    engine_slots: list[list[int]]
    policy_num_cpus: float
    policy_num_gpus: float
    generation_num_cpus: float
    generation_num_gpus: float
    dp_rank_of: list[int]
    tp_rank_of: list[int]
    pp_rank_of: list[int]

    @property
    def policy_world_size(self) -> int:
        """Number of Megatron ranks."""
        return len(self.policy_nodes)

    @property
    def num_engines(self) -> int:
        """Number of vLLM engines."""
        return len(self.engine_nodes)

    def groups(self, axis: str) -> list[list[int]]:
        """Megatron process groups along ``axis`` ("tp", "dp" or "pp") from the per-rank coordinates: the ranks that
        share the other two coordinates, ascending, groups ordered by first rank (as megatron-core's
        ``RankGenerator.get_ranks`` lists them). Shape: ``world / size`` groups of ``size`` ranks (``size`` = that
        axis' parallel size).

        Raises:
            ValueError: unknown ``axis``.
        """
        coords = {"tp": self.tp_rank_of, "dp": self.dp_rank_of, "pp": self.pp_rank_of}
        if axis not in coords:
            raise ValueError(f"axis must be 'tp', 'dp' or 'pp', got {axis!r}")
        a, b = (v for k, v in coords.items() if k != axis)
        by_key: dict[tuple[int, int], list[int]] = {}
        for r in range(self.policy_world_size):
            by_key.setdefault((a[r], b[r]), []).append(r)
        return sorted(by_key.values())

    def table(self) -> str:
        """A readable plan: the bundles, the Megatron parallel layout (:meth:`_layout_lines`), then one line per node
        listing its workers with their shares."""
        unit = "GPU" if self.use_gpus else "CPU slot"
        head = [
            f"placement: {'colocated' if self.colocated else 'split'}, {self.num_nodes} node(s) x "
            f"{self.slots_per_node} {unit}(s); bundle per node: {self.cpus_per_node:g} CPU, {self.gpus_per_node} GPU",
            f"policy: {self.policy_world_size} Megatron rank(s), DP={self.dp_size} TP={self.tp_size} "
            f"PP={self.pp_size}; each {self.policy_num_cpus:g} CPU, {self.policy_num_gpus:g} GPU",
            f"generation: {self.num_engines} vLLM engine(s), TP={self.vllm_tp}; each {self.generation_num_cpus:g} CPU, "
            f"{self.generation_num_gpus:g} GPU",
            *self._layout_lines(),
        ]
        label = "gpu" if self.use_gpus else "slot"
        for node in range(self.num_nodes):
            head.append(f"  node {node}:")
            for slot in range(self.slots_per_node):
                head.append(f"    {label} {slot}: " + " | ".join(self._slot_workers(node, slot) or ["idle"]))
        return "\n".join(head)

    def visible_devices_env(self, role: str, index: int) -> dict[str, str]:
        """Environment that pins worker ``index`` of ``role`` ("policy" or "generation") to the GPUs of its slots:
        ``CUDA_VISIBLE_DEVICES`` = its local GPU indices and ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`` (Ray's
        fractional packing would put two ranks on one GPU; Ray still accounts the shares). Ray's fractional-GPU
        allocator fills a partly used GPU first: with logical GPUs (ray 2.60, ``ray.init(num_gpus=4)``), in one
        bundle of 4 GPUs, four 0.5-GPU actors got GPUs [0, 0, 1, 1]; with one 1-GPU bundle per slot, the two actors
        in bundle ``s`` both got GPU ``s``. So on GPU either the reservation has one bundle per GPU (NeMo-RL's
        layout) or the setup pins every worker to its slots' GPUs; fractional requests alone do not.
        Empty on CPU. Not run on a GPU here.

        Raises:
            ValueError: unknown ``role``.
        """
        if role not in ("policy", "generation"):
            raise ValueError(f"role must be 'policy' or 'generation', got {role!r}")
        if not self.use_gpus:
            return {}
        slots = [self.policy_slots[index]] if role == "policy" else self.engine_slots[index]
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots)), "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}

    def _layout_lines(self) -> list[str]:
        """One line per pipeline stage (its ranks and nodes) when PP > 1, then the rank groups of each Megatron axis
        of size > 1 (:meth:`groups`); none for DP = TP = PP = 1."""
        out = []
        for stage in range(self.pp_size if self.pp_size > 1 else 0):
            ranks = [r for r, p in enumerate(self.pp_rank_of) if p == stage]
            nodes = sorted({self.policy_nodes[r] for r in ranks})
            out.append(f"  pp stage {stage}: policy ranks {_span(ranks)} on node(s) {_span(nodes)}")
        for axis, size in (("tp", self.tp_size), ("dp", self.dp_size), ("pp", self.pp_size)):
            if size > 1:
                out.append(f"  {axis} groups: " + " ".join(f"[{_span(g)}]" for g in self.groups(axis)))
        return out

    def _slot_workers(self, node: int, slot: int) -> list[str]:
        """Descriptions of the Megatron rank and the engine that hold ``slot`` of ``node``."""
        out = [
            f"policy rank {r} (dp {self.dp_rank_of[r]}, tp {self.tp_rank_of[r]}, pp {self.pp_rank_of[r]})"
            for r, (n, s) in enumerate(zip(self.policy_nodes, self.policy_slots))
            if (n, s) == (node, slot)
        ]
        for e, (n, slots) in enumerate(zip(self.engine_nodes, self.engine_slots)):
            if n == node and slot in slots:
                part = f", tp rank {slots.index(slot)} of {self.vllm_tp}" if self.vllm_tp > 1 else ""
                out.append(f"engine {e}{part}")
        return out


def _span(values: list[int]) -> str:
    """Ascending integers, compactly: ``"4"``, ``"0-3"`` (consecutive), ``"0,8,..,56"`` (more than four, evenly
    spaced), else ``"0,4,9"``."""
    steps = {b - a for a, b in zip(values, values[1:])}
    if len(values) > 1 and steps == {1}:
        return f"{values[0]}-{values[-1]}"
    if len(values) > 4 and len(steps) == 1:
        return f"{values[0]},{values[1]},..,{values[-1]}"
    return ",".join(map(str, values))


def megatron_coordinates(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp_rank, dp_rank, pp_rank) of global rank ``rank`` in megatron-core's default order (TP fastest).

    Example: TP=2, DP=2, PP=2: rank 5 -> (1, 0, 1).
    """
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def slots_per_node(cfg: MasterConfig) -> int:
    """Worker slots per node: ``cluster.gpus_per_node`` on GPU, ``cluster.workers_per_node`` on CPU."""
    c = cfg.cluster
    return c.gpus_per_node if c.gpus_per_node > 0 else c.workers_per_node


def _split_layout(cfg: MasterConfig, slots: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(node, local slot) of every policy slot and every generation slot with split placement.

    Raises:
        ConfigError: ``colocated.resources`` missing, or not leaving both roles at least one slot / node.
    """
    res, nodes = cfg.policy.generation.colocated.resources, cfg.cluster.num_nodes
    key = "policy.generation.colocated.resources"
    if nodes == 1:
        if res.num_nodes not in (None, 1):
            raise ConfigError(
                f"{key}.num_nodes={res.num_nodes} with cluster.num_nodes=1: on one node generation "
                f"gets {key}.gpus_per_node slots of it; set {key}.num_nodes to null or 1"
            )
        gen = res.gpus_per_node
        if gen is None or gen >= slots:
            raise ConfigError(
                f"{key}.gpus_per_node={gen}: split placement on one node needs the slots given to "
                f"generation, 1 .. {slots - 1} of the node's {slots} ({_slot_key(cfg)}={slots}), so "
                "that the policy keeps at least one"
            )
        return [(0, s) for s in range(slots - gen)], [(0, s) for s in range(slots - gen, slots)]
    gen_nodes = res.num_nodes
    if gen_nodes is None or gen_nodes >= nodes:
        raise ConfigError(
            f"{key}.num_nodes={gen_nodes}: split placement on {nodes} nodes gives generation the last "
            f"{key}.num_nodes nodes whole; set it to 1 .. {nodes - 1} (cluster.num_nodes={nodes})"
        )
    if res.gpus_per_node not in (None, slots):
        raise ConfigError(
            f"{key}.gpus_per_node={res.gpus_per_node}: with several nodes generation takes whole "
            f"nodes ({slots} slots each, {_slot_key(cfg)}); set it to {slots} or null"
        )
    policy = [(n, s) for n in range(nodes - gen_nodes) for s in range(slots)]
    return policy, [(n, s) for n in range(nodes - gen_nodes, nodes) for s in range(slots)]


def _slot_key(cfg: MasterConfig) -> str:
    return "cluster.gpus_per_node" if cfg.cluster.gpus_per_node > 0 else "cluster.workers_per_node"


def _engines(gen_slots: list[tuple[int, int]], vllm_tp: int, slots: int) -> tuple[list[int], list[list[int]]]:
    """Group generation slots into engines of ``vllm_tp`` consecutive slots on one node.

    Raises:
        ConfigError: ``vllm_tp`` does not divide the generation slots, or an engine would span two nodes.
    """
    key = "policy.generation.vllm_cfg.tensor_parallel_size"
    if len(gen_slots) % vllm_tp:
        raise ConfigError(f"{key}={vllm_tp} does not divide the {len(gen_slots)} generation slot(s)")
    groups = [gen_slots[i : i + vllm_tp] for i in range(0, len(gen_slots), vllm_tp)]
    if any(len({n for n, _ in g}) > 1 for g in groups):
        raise ConfigError(
            f"{key}={vllm_tp} does not divide the {slots} slots per node: an engine would span two "
            "nodes (vLLM tensor parallelism stays inside a node here)"
        )
    return [g[0][0] for g in groups], [[s for _, s in g] for g in groups]


def _parallel_sizes(cfg: MasterConfig, world: int) -> tuple[int, int, int]:
    """(TP, PP, DP) for a policy world of ``world`` ranks.

    Raises:
        ConfigError: TP * PP does not divide the world.
    """
    mc = cfg.policy.megatron_cfg
    tp, pp = mc.tensor_model_parallel_size, mc.pipeline_model_parallel_size
    if world % (tp * pp):
        raise ConfigError(
            f"policy.megatron_cfg.tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} "
            f"= {tp * pp} does not divide the {world} policy rank(s) of this placement "
            f"({_slot_key(cfg)}, cluster.num_nodes, policy.generation.colocated)"
        )
    return tp, pp, world // (tp * pp)


def _requests(cfg: MasterConfig, vllm_tp: int) -> tuple[float, float, float, float]:
    """(policy CPUs, policy GPUs, engine CPUs, engine GPUs) asked from Ray per worker.

    - CPU: a policy rank asks ``cluster.policy_num_cpus``, an engine ``T * cluster.generation_num_cpus`` (one share
      per slot it holds); no GPUs.
    - GPU colocated: a policy rank asks 0.5 GPU; an engine with ``T = 1`` 0.5 GPU. An engine with ``T > 1`` asks 0
      GPUs from Ray and runs on the GPUs of its slots (``engine_slots[e]``, set as its visible devices by the
      setup): Ray cannot hand one actor half of each of ``T`` GPUs (a request above 1 GPU is a count of whole GPUs),
      and vLLM's TP workers need one device each.
    - GPU split: a policy rank asks 1 GPU; an engine ``T`` whole GPUs (Ray makes those ``T`` visible to it).
    """
    c, colocated = cfg.cluster, cfg.policy.generation.colocated.enabled
    if c.gpus_per_node == 0:
        return c.policy_num_cpus, 0.0, vllm_tp * c.generation_num_cpus, 0.0
    if colocated:
        engine_gpus = COLOCATED_GPU_SHARE if vllm_tp == 1 else 0.0
        return c.policy_num_cpus, COLOCATED_GPU_SHARE, vllm_tp * c.generation_num_cpus, engine_gpus
    return c.policy_num_cpus, 1.0, vllm_tp * c.generation_num_cpus, float(vllm_tp)


def _bundle_cpus(cfg: MasterConfig, policy: list[tuple[int, int]], gen: list[tuple[int, int]]) -> float:
    """CPUs of one bundle: the largest per-node sum of the shares its slots hold."""
    c = cfg.cluster
    per_node = [0.0] * c.num_nodes
    for n, _ in policy:
        per_node[n] += c.policy_num_cpus
    for n, _ in gen:
        per_node[n] += c.generation_num_cpus
    return max(per_node)


def _check_local_fit(cfg: MasterConfig, cpus_per_node: float) -> None:
    """A local Ray start (no ``cluster.ray_address``) has one node with ``cluster.num_cpus`` CPUs.

    Raises:
        ConfigError: several nodes, or the bundle needs more CPUs than ``cluster.num_cpus``.
    """
    c = cfg.cluster
    if c.ray_address:
        return
    if c.num_nodes > 1:
        raise ConfigError(
            f"cluster.num_nodes={c.num_nodes} with cluster.ray_address=null: a local Ray start has one "
            "node; join a multi-node Ray cluster (cluster.ray_address=auto under slurm/ray.sub)"
        )
    if cpus_per_node > c.num_cpus + 1e-9:
        raise ConfigError(
            f"the placement needs {cpus_per_node:g} CPUs on the node (cluster.policy_num_cpus="
            f"{c.policy_num_cpus:g} and cluster.generation_num_cpus={c.generation_num_cpus:g} per slot, "
            f"{_slot_key(cfg)}={slots_per_node(cfg)}) but cluster.num_cpus={c.num_cpus:g}"
        )


def plan_placement(cfg: MasterConfig) -> PlacementPlan:
    """Lay out the Megatron ranks and vLLM engines of ``cfg`` on its cluster.

    Slots. A node has ``S`` worker slots: ``cluster.gpus_per_node`` GPUs on GPU, ``cluster.workers_per_node`` CPU
    slots on CPU (``cluster.gpus_per_node: 0``). Slot ``s`` of a node is local GPU ``s`` on GPU.

    Colocated (``policy.generation.colocated.enabled: true``, sync GRPO): every slot holds one Megatron rank *and* a
    share of one engine. Policy world ``W = num_nodes * S``; rank ``r`` sits on node ``r // S``, slot ``r % S``.
    Engines ``E = W / T`` for vLLM TP ``T``; engine ``e`` holds slots ``e*T .. e*T+T-1`` (global slot numbering), so
    it sits on the node of slot ``e*T`` and never spans nodes (``T`` must divide ``S``). A node's bundle has
    ``S * (policy_num_cpus + generation_num_cpus)`` CPUs and ``S`` GPUs.

    Split (``enabled: false``, async GRPO): on one node, generation takes the last ``G =
    colocated.resources.gpus_per_node`` slots (on CPU: CPU slots) and the policy the first ``S - G``; on several
    nodes, generation takes the last ``N_g = colocated.resources.num_nodes`` nodes whole and the policy the first
    ``num_nodes - N_g``. Every bundle has the same shape (the virtual cluster reserves one shape per node): the
    larger of the two roles' per-node demand.

    Megatron rank order (TP fastest, then DP, then PP; megatron-core's default order "tp-cp-ep-dp-pp" with CP = EP =
    1): ``tp_rank = r % TP``, ``dp_rank = (r // TP) % DP``, ``pp_rank = r // (TP * DP)``, ``DP = W / (TP * PP)``.
    Ray requests per worker: :func:`_requests`.

    Raises:
        ConfigError: naming the key when the recipe does not fit: TP x PP not dividing the policy ranks, vLLM TP not
            dividing the generation slots or spanning nodes, split resources missing or not leaving both roles room,
            several nodes or too many CPUs for a local Ray start.
    """
    slots, nodes = slots_per_node(cfg), cfg.cluster.num_nodes
    if cfg.policy.generation.colocated.enabled:
        policy = gen = [(n, s) for n in range(nodes) for s in range(slots)]
    else:
        policy, gen = _split_layout(cfg, slots)
    tp, pp, dp = _parallel_sizes(cfg, len(policy))
    vllm_tp = cfg.policy.generation.vllm_cfg.tensor_parallel_size
    engine_nodes, engine_slots = _engines(gen, vllm_tp, slots)
    cpus = _bundle_cpus(cfg, policy, gen)
    _check_local_fit(cfg, cpus)
    p_cpu, p_gpu, g_cpu, g_gpu = _requests(cfg, vllm_tp)
    coords = [megatron_coordinates(r, tp, dp) for r in range(len(policy))]
    return PlacementPlan(
        num_nodes=nodes,
        slots_per_node=slots,
        use_gpus=cfg.cluster.gpus_per_node > 0,
        colocated=cfg.policy.generation.colocated.enabled,
        cpus_per_node=cpus,
        gpus_per_node=cfg.cluster.gpus_per_node,
        tp_size=tp,
        pp_size=pp,
        dp_size=dp,
        vllm_tp=vllm_tp,
        policy_nodes=[n for n, _ in policy],
        policy_slots=[s for _, s in policy],
        engine_nodes=engine_nodes,
        engine_slots=engine_slots,
        policy_num_cpus=p_cpu,
        policy_num_gpus=p_gpu,
        generation_num_cpus=g_cpu,
        generation_num_gpus=g_gpu,
        tp_rank_of=[c[0] for c in coords],
        dp_rank_of=[c[1] for c in coords],
        pp_rank_of=[c[2] for c in coords],
    )
