"""VllmGeneration: the controller the drivers call, over E vLLM engines (data parallel), each its own Ray actor.

Each engine is a :class:`~nemo_rl_spec.models.generation.vllm_worker.VllmGenerationWorker` in a
:class:`~nemo_rl_spec.distributed.worker_group.RayWorkerGroup` (``torch_distributed=False``: engines share no
world), placed into the bundle of its node with its own ``VLLM_PORT`` band and thread settings
(:func:`~nemo_rl_spec.models.generation.runtime_env.vllm_runtime_env`). An engine never starts inside a Megatron
process: it is always its own actor.

Sharding (``generate``): the B prompts are split into E contiguous blocks of whole prompt groups, and engine e gets
``row_offset = first_prompt_e * n`` so row r is sampled with ``derive_row_seeds(seed, B * n)[r]`` exactly as one
engine would sample it (B=5 prompts, n=3, E=2: engine 0 gets rows 0..8, engine 1 rows 9..14 at offset 9). Outputs
are concatenated prompt-major, re-padded to the widest engine's width; all engines run concurrently. Weights:
``update_weights`` puts the weights in the object store once and every engine reads that copy; ``ranks=`` targets
a subset (a refit that skips an engine on purpose is then visible in :meth:`VllmGeneration.get_versions`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch

from nemo_rl_spec.distributed.batch import gather_batch, shard_bounds
from nemo_rl_spec.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl_spec.distributed.worker_group import PendingCalls, RayWorkerGroup, RemoteValue
from nemo_rl_spec.models.generation.engine_recovery import EngineRecovery
from nemo_rl_spec.models.generation.interfaces import GenerationDatumSpec, GenerationOutputSpec
from nemo_rl_spec.models.generation.runtime_env import as_generation_config, vllm_runtime_env
from nemo_rl_spec.models.generation.vllm_worker import VllmGenerationWorker
from nemo_rl_spec.utils.config_schema import GenerationConfig

__all__ = ["VllmGeneration", "EngineVersionMismatchError", "merge_generation_outputs"]


class EngineVersionMismatchError(RuntimeError):
    """Engines that served one generate call hold different policy or draft weight versions."""


def _with_draft_dir(cfg: GenerationConfig, draft_dir: str | None) -> GenerationConfig:
    """``cfg`` with ``vllm_kwargs.speculative_config.model = draft_dir`` (the draft the engines start from).

    Raises:
        ValueError: ``draft_dir`` given but ``policy.generation.vllm_kwargs.speculative_config`` is not set.
    """
    if draft_dir is None:
        return cfg
    spec = cfg.speculative_config
    if spec is None:
        raise ValueError("draft_dir given but policy.generation.vllm_kwargs.speculative_config is not set")
    spec.model = draft_dir
    return cfg.model_copy(update={"vllm_kwargs": {**cfg.vllm_kwargs, "speculative_config": spec.engine_dict()}})


def _common_version(outputs: Sequence[GenerationOutputSpec], key: str, engines: Sequence[int]):
    """The one ``key`` (``policy_version`` / ``draft_version``) all ``outputs`` carry.

    Raises:
        EngineVersionMismatchError: the engines disagree (names each engine and its version).
    """
    versions = [out[key] for out in outputs]
    if len(set(versions)) > 1:
        raise EngineVersionMismatchError(
            f"engines disagree on {key}: "
            + ", ".join(f"engine {e}: {v}" for e, v in zip(engines, versions))
            + " (a refit skipped an engine or failed on it)"
        )
    return versions[0]


def _sum_counters(counters: Sequence[Any]):
    """Sum of SpecDecodeCounters (None entries skipped); None when all are None (no speculation)."""
    present = [c for c in counters if c is not None]
    if not present:
        return None
    total = present[0]
    for c in present[1:]:
        total = total + c
    return total


def merge_generation_outputs(
    outputs: Sequence[GenerationOutputSpec],
    prompt_starts: Sequence[int],
    pad_token_id: int,
    engines: Sequence[int] | None = None,
) -> GenerationOutputSpec:
    """One GenerationOutputSpec from per-engine outputs of consecutive prompt blocks (in block order).

    Args:
        outputs: engine e's output for prompts ``prompt_starts[e]...``; rows prompt-major within each.
        prompt_starts: index of each block's first prompt in the full batch (re-bases ``prompt_index``).
        pad_token_id: pad id of ``output_ids`` (generation log-probs pad with 0).
        engines: engine index of each output (error messages only); default 0..len-1.

    Shape: output_ids / generation_logprobs [N_e, S_e] each -> [sum N_e, max S_e]; input_lengths,
    unpadded_sequence_lengths, prompt_index [N_e] -> [sum N_e].

    Raises:
        EngineVersionMismatchError: outputs carry different ``policy_version`` or ``draft_version``.
        ValueError: no outputs.
    """
    if not outputs:
        raise ValueError("no engine outputs to merge")
    engines = list(range(len(outputs))) if engines is None else list(engines)
    return GenerationOutputSpec(
        output_ids=gather_batch([o["output_ids"] for o in outputs], pad_value=pad_token_id),
        input_lengths=torch.cat([o["input_lengths"] for o in outputs]),
        unpadded_sequence_lengths=torch.cat([o["unpadded_sequence_lengths"] for o in outputs]),
        generation_logprobs=gather_batch([o["generation_logprobs"] for o in outputs], pad_value=0.0),
        prompt_index=torch.cat([o["prompt_index"] + start for o, start in zip(outputs, prompt_starts)]),
        policy_version=_common_version(outputs, "policy_version", engines),
        draft_version=_common_version(outputs, "draft_version", engines),
        spec_counters=_sum_counters([o["spec_counters"] for o in outputs]),
    )


class VllmGeneration:
    """E vLLM engines behind one blocking API (NeMo-RL's ``VllmGeneration``); the drivers never see Ray handles.

    Args:
        cluster: the virtual cluster whose bundles host the engines.
        nodes: node index of each engine (``len(nodes)`` = E engines), e.g. ``[0, 0]`` for two engines on node 0.
        cfg: ``policy.generation`` (typed; a plain mapping is validated).
        model_path: HF checkpoint directory every engine starts from.
        seed: engine seed (``grpo.seed``); sampling seeds come per call.
        num_cpus, num_gpus: Ray resources of each engine actor (fractions of its node's bundle); on GPU an engine
            with ``vllm_cfg.tensor_parallel_size`` = t needs ``num_gpus = t``.
        allow_stale_draft: ``policy.draft.allow_stale_draft``.
        draft_dir: directory of the draft the engines start from (replaces ``speculative_config.model``).
        precision: ``policy.precision``, the engines' dtype.
        name: prefix of the engine actors' names.
        engine_env: per-engine extra environment, ``engine_env(e) -> dict`` (e.g. the GPUs an engine is pinned to,
            :meth:`~nemo_rl_spec.distributed.placement.PlacementPlan.visible_devices_env`).
        max_failures: engine deaths survived over the run (``grpo.async_grpo.max_generation_failures``): a dead
            engine is restarted with the current weights and its call re-issued
            (:class:`~nemo_rl_spec.models.generation.engine_recovery.EngineRecovery`); 0: a dead engine ends the run.

    The constructor returns once every engine is up (an engine's start error is raised here).

    Raises:
        ValueError: empty ``nodes``; ``draft_dir`` without ``speculative_config``; a reserved ``vllm_kwargs`` key.
    """

    def __init__(
        self,
        cluster: RayVirtualCluster,
        nodes: Sequence[int],
        cfg: GenerationConfig,
        model_path: str,
        seed: int,
        num_cpus: float,
        num_gpus: float = 0.0,
        allow_stale_draft: bool = False,
        draft_dir: str | None = None,
        precision: str = "float32",
        name: str = "vllm",
        engine_env: Callable[[int], dict[str, str]] | None = None,
        max_failures: int = 0,
    ):
        self.cfg = _with_draft_dir(as_generation_config(cfg), draft_dir)
        worker_cfg = self.cfg
        self.workers = RayWorkerGroup(
            cluster,
            VllmGenerationWorker,
            nodes,
            init_args=lambda e: (
                (worker_cfg, model_path, seed),
                {"allow_stale_draft": allow_stale_draft, "precision": precision},
            ),
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            env_vars=lambda e: {
                **vllm_runtime_env(worker_cfg.vllm_cfg, engine_index=e)["env_vars"],
                **(engine_env(e) if engine_env else {}),
            },
            torch_distributed=False,
            name=name,
        )
        try:
            self.workers.wait_ready()
            self._info = self.workers.get(self.workers.run_all_workers_single_data("engine_info"))
        except Exception:  # one engine failed to start: stop the others before re-raising
            self.workers.shutdown()
            raise
        self.recovery = EngineRecovery(self.workers, max_failures)

    def _call(self, method: str, calls: Sequence[tuple[tuple, dict]], ranks: Sequence[int]) -> list:
        """``method(*args_i, **kwargs_i)`` on engine ``ranks[i]``, results in that order; an engine that died is
        restarted (:attr:`recovery`, which raises past its budget) and its call re-issued on the new engine."""
        refs = self.workers.run_all_workers_multiple_data(method, calls, ranks=ranks)
        out = []
        for rank, call, ref in zip(ranks, calls, refs):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as exc:
                self.recovery.restart(rank, exc)
                out.append(ray.get(self.workers.run_all_workers_multiple_data(method, [call], ranks=[rank])[0]))
        return out

    def _call_all(self, method: str, *args, ranks: Sequence[int] | None = None) -> list:
        targets = self._ranks(ranks)
        return self._call(method, [(args, {})] * len(targets), targets)

    def recovery_metrics(self) -> dict[str, float]:
        """``generation/engine_restarts`` when engine restarts are enabled (``max_failures > 0``)."""
        return self.recovery.metrics()

    @property
    def num_engines(self) -> int:
        """Number of engines E."""
        return self.workers.world_size

    @property
    def pad_token_id(self) -> int:
        """Pad id of ``output_ids`` (the tokenizer's, engine 0's)."""
        return int(self._info[0]["pad_token_id"])

    def engine_info(self) -> list[dict[str, Any]]:
        """Per engine: ``pad_token_id``, ``dtype``, ``tensor_parallel_size``, ``max_model_len``, ``speculative``."""
        return [dict(i) for i in self._info]

    def _ranks(self, ranks: Sequence[int] | None) -> list[int]:
        targets = list(range(self.num_engines)) if ranks is None else list(ranks)
        bad = [r for r in targets if not 0 <= r < self.num_engines]
        if bad:
            raise IndexError(f"engine ranks {bad} outside 0..{self.num_engines - 1}")
        return targets

    # ---------------------------------------------------------------------------------------------- generation
    def generate(
        self,
        data: GenerationDatumSpec,
        n: int,
        seed: int,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
    ) -> GenerationOutputSpec:
        """Sample ``n`` responses per prompt over all engines; identical to one engine's ``generate`` (same rows,
        same order, same per-row seeds). Blocks until every engine has answered.

        Args / returns: as :meth:`VllmGenerationWorker.generate` (N = B * n rows, prompt-major, right-padded);
        ``spec_counters`` summed over the engines that ran; ``policy_version`` / ``draft_version`` the engines'
        common versions.

        Raises:
            EngineVersionMismatchError: the engines hold different weight versions.
            ValueError: ``n < 1`` (from the engines).
        """
        prompts = list(data["prompt_token_ids"])
        bounds = shard_bounds(len(prompts), self.num_engines)
        used = [e for e, (start, stop) in enumerate(bounds) if stop > start] or [0]
        calls = [
            (
                ({"prompt_token_ids": prompts[bounds[e][0] : bounds[e][1]]}, n, seed, temperature, max_new_tokens),
                {"row_offset": bounds[e][0] * n, "top_p": top_p, "top_k": top_k},
            )
            for e in used
        ]
        outputs = self._call("generate", calls, used)
        return merge_generation_outputs(outputs, [bounds[e][0] for e in used], self.pad_token_id, used)

    def score(
        self, input_ids: torch.Tensor, input_lengths: torch.Tensor, ranks: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """Every engine's (or ``ranks``') log-probs of the same sequences (the refit probe checks each engine).

        Shape: input_ids [B, S], input_lengths [B] -> one [B, S] float32 per engine (rank order); see
        :meth:`VllmGenerationWorker.score`.
        """
        ids_ref, len_ref = ray.put(input_ids), ray.put(input_lengths)
        return self._call_all("score", ids_ref, len_ref, ranks=ranks)

    # ---------------------------------------------------------------------------------------------- weights
    def update_weights(
        self, weights: dict[str, torch.Tensor] | RemoteValue, version: int, ranks: Sequence[int] | None = None
    ) -> None:
        """Load HF-named policy weights into every engine (or only ``ranks``) and record ``version``; one
        object-store copy serves all engines. Blocks until all have loaded.

        Raises:
            ValueError: from an engine (names missing from or unknown to the checkpoint); engines before the failing
                one may have loaded (see :meth:`get_versions`).
        """
        ref = RemoteValue.ref_of(weights)
        self._call_all("update_weights", ref, int(version), ranks=ranks)
        if ranks is None:
            self.recovery.keep_policy(ref, version)

    def update_draft_weights(
        self, draft: dict[str, Any] | RemoteValue, ranks: Sequence[int] | None = None
    ) -> list[dict[str, Any]]:
        """Load an online draft (``{"weights", "draft_version", "policy_version"}``) into every engine's drafter
        (or ``ranks``'); returns each engine's result (rank order), see
        :meth:`VllmGenerationWorker.update_draft_weights`.

        Raises:
            RuntimeError: the engines run without speculation.
            DraftVersionMismatchError: the draft is paired with another policy version than an engine holds.
        """
        ref = RemoteValue.ref_of(draft)
        out = self._call_all("update_draft_weights", ref, ranks=ranks)
        if ranks is None:
            self.recovery.keep_draft(ref)
        return out

    def init_refit_group_async(
        self, host: str, port: int, world_size: int, backend: str, timeout_s: float, algorithm: str
    ) -> PendingCalls:
        """The calls of every engine joining the collective refit group hosted at ``host:port``, engine ``e`` as group
        rank ``e + 1`` (rank 0 is the trainer's; ``world_size`` = 1 + engines)."""
        args = [((host, port, e + 1, world_size, backend, timeout_s, algorithm), {}) for e in range(self.num_engines)]
        return PendingCalls(self.workers.run_all_workers_multiple_data("init_refit_group", args))

    def receive_weights_async(self) -> PendingCalls:
        """The calls of every engine receiving and loading one policy broadcast (rank order)."""
        return PendingCalls(self.workers.run_all_workers_single_data("receive_weights"))

    def receive_draft_weights_async(self) -> PendingCalls:
        """The calls of every engine receiving and loading one drafter broadcast; each holds the engine's load result
        (:meth:`VllmGenerationWorker.update_draft_weights`)."""
        return PendingCalls(self.workers.run_all_workers_single_data("receive_draft_weights"))

    def get_versions(self) -> list[dict[str, int | None]]:
        """Per engine (rank order): ``{"policy_version", "draft_version", "draft_policy_version"}``."""
        return self._call_all("get_versions")

    # ---------------------------------------------------------------------------------------------- metrics, life
    def spec_counters(self):
        """Cumulative speculative-decoding counters summed over the engines (SpecDecodeCounters), or None without
        speculation."""
        return _sum_counters(self.engine_spec_counters())

    def engine_spec_counters(self) -> list[Any]:
        """Each engine's own cumulative counters (rank order; None entries without speculation)."""
        return self.workers.get(self.workers.run_all_workers_single_data("spec_counters"))

    def get_timings(self) -> list[dict[str, float | None]]:
        """Per engine: ``engine_start_s``, ``last_refit_s``, ``last_draft_refit_s`` (seconds)."""
        return self.workers.get(self.workers.run_all_workers_single_data("get_timings"))

    def runtime_info(self) -> list[dict[str, Any]]:
        """Per engine: torch threads, whether Intel OpenMP / tcmalloc are loaded."""
        return self.workers.get(self.workers.run_all_workers_single_data("runtime_info"))

    def run_function(self, fn: Callable[..., Any], *args, ranks: Sequence[int] | None = None) -> list:
        """``fn(engine_worker, *args)`` inside every engine's actor (or ``ranks``), results in engine order; for
        checks that read an engine's internals (e.g. :mod:`nemo_rl_spec.testing.mtp_checks`)."""
        return self.workers.run_function(fn, *args, ranks=ranks)

    def node_ids(self) -> list[str]:
        """The Ray node id each engine runs on (rank order)."""
        return self.workers.node_ids()

    def shutdown(self) -> None:
        """Stop every engine and kill its actor (idempotent)."""
        self.workers.shutdown()
