"""The policy controller the drivers call (NeMo-RL's ``Policy``): a group of Megatron workers laid out DP x TP x PP.

``Policy`` starts one :class:`~nemo_rl_spec.models.policy.megatron_worker.MegatronPolicyWorker` per rank in a
:class:`~nemo_rl_spec.distributed.worker_group.RayWorkerGroup` (one ``torch.distributed`` world), rank ``r`` on node
``nodes[r]``, in megatron's default order (TP fastest): rank = pp * (DP * TP) + dp * TP + tp, DP = N / (TP * PP).
Every method blocks until the workers are done and returns plain values (or object refs for the big weight dicts).
Batches are sharded by DP rank into contiguous row blocks (:func:`~nemo_rl_spec.distributed.batch.shard_batch`;
shards may be empty); TP peers of a DP rank get the same shard; per-row outputs come back from the TP-rank-0 worker
of each DP rank, concatenated in DP order.

Training follows NeMo-RL's ``policy.train_global_batch_size`` (GBS): :meth:`Policy.train` splits the rows of a GRPO
step into consecutive mini-batches of GBS rows and makes one optimizer step per mini-batch. ``prev_logprobs`` come
with the batch, computed before the first mini-batch, so from the second mini-batch on the PPO ratio
pi_theta / pi_old differs from 1 and clipping acts (:func:`train_minibatches`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch

from nemo_rl_spec.distributed.batch import gather_batch
from nemo_rl_spec.distributed.interfaces import TrainDatumSpec
from nemo_rl_spec.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl_spec.distributed.worker_group import PendingCalls, RayWorkerGroup, RemoteValue
from nemo_rl_spec.utils.config_schema import PolicyConfig

# per-mini-batch metrics that add up over mini-batches; ``*_max`` keys take the max, ``lr`` the last step's value,
# ``update_successful`` the min (every step succeeded), every other key the mean over mini-batches
_SUMMED_METRICS = ("num_valid_tokens", "num_valid_seqs", "num_micro_batches")


def minibatch_bounds(rows: int, global_batch_size: int) -> list[tuple[int, int]]:
    """Row ranges ``[start, stop)`` of the consecutive mini-batches of ``global_batch_size`` rows (the last one holds
    the remainder), e.g. 20 rows with GBS 8 -> (0, 8), (8, 16), (16, 20); no rows -> [].

    Raises:
        ValueError: ``global_batch_size < 1`` or ``rows < 0``.
    """
    if global_batch_size < 1 or rows < 0:
        raise ValueError(f"policy.train_global_batch_size={global_batch_size} must be >= 1 (rows={rows} >= 0)")
    return [(start, min(start + global_batch_size, rows)) for start in range(0, rows, global_batch_size)]


PER_MINIBATCH_METRICS = ("mtp/lambda", "mtp/c_ref", "mtp/v2_ref", "mtp/lambda_ref")
"""Metrics also reported per optimizer step of a ``train`` call (OCC's lambda against its full-gradient reference)."""


def combine_minibatch_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """One metric dict for the optimizer steps of a ``train`` call: counts (``num_valid_tokens``, ``num_valid_seqs``,
    ``num_micro_batches``) summed, ``*_max`` by max, ``lr`` the last step's, ``update_successful`` the min, every
    other key (loss, probs_ratio, grad_norm, ...: already normalised per mini-batch) the mean over mini-batches;
    adds ``num_optimizer_steps`` and, with several parts, ``<key>/mb<i>`` of step i for every key of
    :data:`PER_MINIBATCH_METRICS`. One part comes back unchanged (plus that count).

    Raises:
        ValueError: no parts.
    """
    if not parts:
        raise ValueError("no mini-batch metrics to combine (the batch has no rows)")
    keys = list(dict.fromkeys(k for part in parts for k in part))
    out = {}
    for key in keys:
        values = [p[key] for p in parts if key in p]
        if key in _SUMMED_METRICS:
            out[key] = float(sum(values))
        elif key.endswith("_max"):
            out[key] = float(max(values))
        elif key == "lr":
            out[key] = float(values[-1])
        elif key == "update_successful":
            out[key] = float(min(values))
        else:
            out[key] = float(sum(values) / len(values))
    if len(parts) > 1:  # OCC's coefficient and its reference per optimizer step (lambda is 0 on the first)
        for key in PER_MINIBATCH_METRICS:
            out.update({f"{key}/mb{i}": float(p[key]) for i, p in enumerate(parts) if key in p})
    return {**out, "num_optimizer_steps": float(len(parts))}


def train_minibatches(
    step_fn: Callable[[TrainDatumSpec], dict[str, float]], data: TrainDatumSpec, global_batch_size: int
) -> list[dict[str, float]]:
    """``step_fn`` (one optimizer step) on each mini-batch of :func:`minibatch_bounds`, in row order; returns each
    step's metrics. ``data["prev_logprobs"]`` is the same slice of the log-probs taken before the first step, so the
    second step's ratio is pi_after_step_1 / pi_old (NeMo-RL's mini-batch PPO).

    Shape: every tensor of ``data`` [B, ...]; step ``i`` gets rows ``bounds[i]``.
    """
    metrics = []
    for start, stop in minibatch_bounds(int(data["input_ids"].shape[0]), global_batch_size):
        rows = {k: (v[start:stop] if isinstance(v, torch.Tensor) and v.dim() > 0 else v) for k, v in data.items()}
        metrics.append(step_fn(rows))
    return metrics


def _worker_class():
    from nemo_rl_spec.models.policy.megatron_worker import MegatronPolicyWorker  # imports megatron (seconds)

    return MegatronPolicyWorker


def prefetch_worker_class() -> threading.Thread:
    """Start importing the Megatron worker module (megatron-core and its torch extensions: about 3 s of a 2-core
    machine) in a daemon thread, so the import overlaps work that mostly waits, such as ``ray.init``. ``join()`` the
    thread before building a :class:`Policy`; an import error there is raised again by the :class:`Policy` constructor
    (a failed import leaves nothing in ``sys.modules``)."""

    def _import() -> None:
        try:
            _worker_class()
        except Exception:  # noqa: BLE001 - re-raised by the Policy constructor's own import, in the caller's thread
            pass

    thread = threading.Thread(target=_import, name="prefetch-megatron-worker", daemon=True)
    thread.start()
    return thread


class Policy:
    """Controller over the Megatron policy workers.

    Args:
        cluster: the virtual cluster hosting the workers.
        nodes: node index of each rank (``len(nodes)`` = N workers = DP * TP * PP).
        cfg: the ``policy`` section.
        loss_fn: the micro-batch loss (pickled to every worker).
        model_path: local HF checkpoint directory (readable on every node).
        seed: initialisation seed (the same on every rank).
        num_cpus, num_gpus: Ray resources per worker.
        env_vars: extra environment of every worker (e.g. ``OMP_NUM_THREADS``).
        init_reference_model: every worker keeps the initial weights as the frozen reference policy (KL penalty).
        rank_env: per-rank extra environment, ``rank_env(rank) -> dict`` (e.g. the GPU a rank is pinned to,
            :meth:`~nemo_rl_spec.distributed.placement.PlacementPlan.visible_devices_env`).
        block: wait here until every worker is up (default). False: return once the actors are launched, so the
            caller can start the vLLM engines meanwhile (their imports and warm-up overlap the workers'); call
            :meth:`wait_ready` before using the policy.

    Raises:
        ValueError: N is not a multiple of TP * PP (names the config keys); errors of a worker's constructor
            (unsupported PP, a TP size the model cannot be split by, ...) are re-raised here (with ``block=False``:
            by :meth:`wait_ready`).
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        nodes: Sequence[int],
        cfg: PolicyConfig,
        loss_fn,
        model_path: str,
        seed: int,
        num_cpus: float,
        num_gpus: float = 0.0,
        env_vars: dict[str, str] | None = None,
        rank_env: Callable[[int], dict[str, str]] | None = None,
        init_reference_model: bool = False,
        block: bool = True,
    ):
        mcfg = cfg.megatron_cfg
        self.tp_size, self.pp_size = mcfg.tensor_model_parallel_size, mcfg.pipeline_model_parallel_size
        if not nodes or len(nodes) % (self.tp_size * self.pp_size):
            raise ValueError(
                f"{len(nodes)} policy workers is not a multiple of policy.megatron_cfg."
                f"tensor_model_parallel_size={self.tp_size} x pipeline_model_parallel_size={self.pp_size}"
            )
        self.dp_size = len(nodes) // (self.tp_size * self.pp_size)
        self.train_global_batch_size = cfg.train_global_batch_size
        env = dict(env_vars or {})
        self.group = RayWorkerGroup(
            cluster,
            _worker_class(),
            nodes,
            init_args=lambda rank: ((cfg, loss_fn, model_path, seed), {"init_reference_model": init_reference_model}),
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            env_vars=lambda rank: {**env, **(rank_env(rank) if rank_env else {})},
            name="policy",
        )
        self._layout_refs = self.group.run_all_workers_single_data("parallel_layout")  # queued behind __init__
        self.layouts: list[dict] = []
        if block:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until every worker's constructor has finished and read its Megatron layout (a no-op once done).

        Raises:
            Exception: a worker constructor's error (the worker group is shut down first).
        """
        if self.layouts:
            return
        try:
            self.layouts = self.group.get(self._layout_refs)
        except Exception:
            self.group.shutdown()
            raise
        self.dp_rank_of = [layout["dp_rank"] for layout in self.layouts]
        # per-row results: the first (TP rank 0, PP rank 0) worker of each DP rank, in DP order
        self._row_owners = [
            next(
                r
                for r, lay in enumerate(self.layouts)
                if lay["dp_rank"] == d and lay["tp_rank"] == 0 and lay["pp_rank"] == 0
            )
            for d in range(self.dp_size)
        ]

    @property
    def world_size(self) -> int:
        """Number of policy workers (DP * TP * PP)."""
        return self.group.world_size

    def _sharded(self, method: str, data: TrainDatumSpec, *args) -> list:
        return self.group.get(
            self.group.run_all_workers_sharded_data(method, data, self.dp_rank_of, self.dp_size, *args)
        )

    def _all(self, method: str, *args, **kwargs) -> list:
        return self.group.get(self.group.run_all_workers_single_data(method, *args, **kwargs))

    def get_logprobs(self, data: TrainDatumSpec, temperature: float = 1.0, filtered: bool = True) -> torch.Tensor:
        """Per-token log-probs of ``data["input_ids"]`` (logits / ``temperature``; ``filtered``: under the engine's
        top-k / top-p, :meth:`PolicyInterface.get_logprobs`), computed DP-sharded.

        Shape: input_ids [B, S] -> [B, S] float32 (0 at position 0 and on padding)."""
        outputs = self._sharded("get_logprobs", data, temperature, filtered)
        return gather_batch([outputs[r] for r in self._row_owners])

    def get_reference_policy_logprobs(self, data: TrainDatumSpec, temperature: float = 1.0) -> torch.Tensor:
        """Per-token log-probs under the frozen reference policy (the initial weights), DP-sharded like
        :meth:`get_logprobs`. Needs ``init_reference_model=True``.

        Shape: input_ids [B, S] -> [B, S] float32."""
        outputs = self._sharded("get_reference_policy_logprobs", data, temperature)
        return gather_batch([outputs[r] for r in self._row_owners])

    def train_steps(self, data: TrainDatumSpec, train_draft: bool = True) -> list[dict[str, float]]:
        """One optimizer step per mini-batch of ``policy.train_global_batch_size`` rows of ``data``
        (:func:`train_minibatches`), each sharded over DP; the metrics of every step (rank 0's; every rank returns
        the same, see :meth:`MegatronPolicyWorker.train`). ``train_draft``: the online draft trains in every one of
        them, or in none."""
        return train_minibatches(
            lambda rows: self._sharded("train", rows, train_draft)[0], data, self.train_global_batch_size
        )

    def train(self, data: TrainDatumSpec, train_draft: bool = True) -> dict[str, float]:
        """:meth:`train_steps` with the steps' metrics combined (:func:`combine_minibatch_metrics`)."""
        return combine_minibatch_metrics(self.train_steps(data, train_draft))

    def mtp_warm_start(
        self, train_data: TrainDatumSpec, eval_data: TrainDatumSpec, steps: int, batch_size: int, lr: float, seed: int
    ) -> dict[str, float]:
        """CE warm start of the MTP layers on every rank, each with the whole (replicated) batches
        (:meth:`MegatronPolicyWorker.mtp_warm_start`); rank 0's ``mtp_warm_start/*`` metrics.

        Shape: input_ids / token_mask [B, S], input_lengths / sample_mask [B] (each set).
        Raises:
            RuntimeError: the policy has no MTP layers (from the workers).
        """
        train_ref, eval_ref = ray.put(train_data), ray.put(eval_data)  # one copy in the object store for all ranks
        return self._all("mtp_warm_start", train_ref, eval_ref, steps, batch_size, lr, seed)[0]

    def mtp_states(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's MTP parameters (:meth:`MegatronPolicyWorker.mtp_state`: CPU, its TP slices), rank order."""
        return self._all("mtp_state")

    def load_mtp_states(self, states: Sequence[dict[str, torch.Tensor]]) -> None:
        """Rank r loads ``states[r]`` (:meth:`MegatronPolicyWorker.load_mtp_state`; fresh MTP optimizer).

        Raises:
            ValueError: ``len(states)`` is not the number of ranks, or a state does not fit its rank (from the worker).
        """
        if len(states) != self.world_size:
            raise ValueError(f"load_mtp_states: {len(states)} states for {self.world_size} policy ranks")
        self.group.get(self.group.run_all_workers_multiple_data("load_mtp_state", [((st,), {}) for st in states]))

    def draft_version(self) -> int | None:
        """Rank 0's drafter version (:meth:`MegatronPolicyWorker.draft_version`): a cheap call, no weights move."""
        return self._all("draft_version")[0]

    def _rank_zero(self, method: str, *args) -> RemoteValue:
        """Run ``method`` on every rank (a collective), wait for all, return rank 0's result, left in the object
        store (the other ranks return empty dicts; their errors are raised here)."""
        refs = self.group.run_all_workers_single_data(method, *args)
        self.group.get(refs[1:])
        ray.wait(refs[:1])
        return RemoteValue(refs[0])

    def export_hf_weights(self, version: int | None = None, dtype: str | None = None) -> RemoteValue:
        """The full HF-named weights (``dict[str, Tensor]``, TP slices gathered, CPU, in ``dtype``: ``float32`` |
        ``bfloat16``, None: the policy's) as a :class:`RemoteValue` (``.get()`` fetches them; the generation
        controller loads them into its engines without a copy through the driver); every rank takes part and
        records ``version``."""
        return self._rank_zero("export_hf_weights", version, dtype)

    def export_draft_weights(self, dtype: str | None = None) -> RemoteValue:
        """The drafter export ``{"weights", "draft_version", "policy_version"}``, weights in ``dtype`` (None:
        fp32), as a :class:`RemoteValue`."""
        return self._rank_zero("export_draft_weights", dtype)

    # ------------------------------------------------------------------ collective refit (refit_transport: nccl)
    def refit_group_address(self) -> tuple[str, int]:
        """(rank 0's node IP, a free port there): where the collective refit group's store is hosted."""
        return self.group.get(self.group.run_all_workers_single_data("refit_group_address", ranks=[0]))[0]

    def init_refit_group_async(
        self, host: str, port: int, world_size: int, backend: str, timeout_s: float, algorithm: str
    ) -> PendingCalls:
        """The calls of every rank joining the refit group (rank 0 as the sender; the others return at once)."""
        return PendingCalls(
            self.group.run_all_workers_single_data(
                "init_refit_group", host, port, world_size, backend, timeout_s, algorithm
            )
        )

    def broadcast_hf_weights_async(
        self, version: int, dtype: str | None, bucket_bytes: int, keep: bool = False
    ) -> PendingCalls:
        """The calls of the policy broadcast (every rank gathers; rank 0 sends; its future holds the send stats
        ``{"bytes", "buckets"}``, rank 0's future first)."""
        return PendingCalls(
            self.group.run_all_workers_single_data("broadcast_hf_weights", version, dtype, bucket_bytes, keep)
        )

    def broadcast_draft_weights_async(self, dtype: str | None, bucket_bytes: int, keep: bool = False) -> PendingCalls:
        """The calls of the drafter broadcast, like :meth:`broadcast_hf_weights_async`."""
        return PendingCalls(
            self.group.run_all_workers_single_data("broadcast_draft_weights", dtype, bucket_bytes, keep)
        )

    def sent_refit_weights(self, kind: str) -> RemoteValue:
        """Rank 0's last collective broadcast kept with ``keep`` (``kind``: ``policy`` | ``draft``), in the object
        store: what a restarted engine is given (:meth:`VllmGenerationWorker.update_weights` /
        ``update_draft_weights`` take it as it is)."""
        return RemoteValue(self.group.run_all_workers_single_data("sent_refit_weights", kind, ranks=[0])[0])

    def export_megatron_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter under its Megatron name, full size (MTP block included); for checks."""
        return self._rank_zero("export_megatron_weights").get()

    def save_checkpoint(self, path: str, save_optimizer: bool = True) -> None:
        """Write the model, optimizer (unless ``save_optimizer`` is False: ``checkpointing.save_optimizer``) and
        draft state into the existing directory ``path`` (per TP rank)."""
        self._all("save_checkpoint", path, save_optimizer)

    def load_checkpoint(self, path: str) -> None:
        """Restore :meth:`save_checkpoint` output (written with any DP size, the same TP size)."""
        self._all("load_checkpoint", path)

    def save_draft(self, path: str) -> str:
        """Write the online draft head in vLLM's eagle3 format to ``path``; returns it."""
        return self._all("save_draft", path)[0]

    def save_mimo_checkpoint(self, path: str) -> str:
        """Write the policy with its MTP layers as a MiMo checkpoint to ``path``; returns it."""
        return self._all("save_mimo_checkpoint", path)[0]

    def get_model_config(self) -> dict:
        """Architecture facts of the policy model (vocab_size, num_layers, ...)."""
        return self.group.get(self.group.run_all_workers_single_data("get_model_config", ranks=[0]))[0]

    def node_ids(self) -> list[str]:
        """The Ray node id each rank runs on (rank order)."""
        return self.group.node_ids()

    def run_function(self, fn: Callable[..., Any], *args, ranks: Sequence[int] | None = None) -> list:
        """``fn(worker, *args)`` inside every worker (or ``ranks``), results in rank order; for checks that read a
        worker's internals (e.g. :mod:`nemo_rl_spec.testing.mtp_checks`). ``fn`` must be importable (pickled by
        reference)."""
        return self.group.run_function(fn, *args, ranks=ranks)

    def shutdown(self) -> None:
        """Kill the workers (idempotent)."""
        self.group.shutdown()
