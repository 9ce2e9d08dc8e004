"""Builds everything a GRPO run needs (placement, worker groups, data, environment, logger, checkpoints) and handles
resume.

Kept out of ``grpo.py`` so the training loop reads in one screen.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

from nemo_rl_spec.algorithms.allocators import build_rollout_allocator
from nemo_rl_spec.algorithms.interfaces import RolloutAllocator
from nemo_rl_spec.algorithms.loss import ClippedPGLossFn
from nemo_rl_spec.algorithms.mtp_warm_start import warm_start_config, warm_start_mtp
from nemo_rl_spec.algorithms.refit import WeightRefitter
from nemo_rl_spec.algorithms.refit_transport import make_refit_transport
from nemo_rl_spec.algorithms.rollout_allocation import difficulty_bucket
from nemo_rl_spec.algorithms.rollouts import RolloutGenerator
from nemo_rl_spec.data import hub_datasets
from nemo_rl_spec.data.datasets import load_gsm8k_original, load_train_problems
from nemo_rl_spec.data.prompts import format_prompt
from nemo_rl_spec.distributed.placement import PlacementPlan, plan_placement
from nemo_rl_spec.distributed.virtual_cluster import RayVirtualCluster
from nemo_rl_spec.environments import build_environment
from nemo_rl_spec.environments.interfaces import EnvironmentInterface
from nemo_rl_spec.models.generation.interfaces import GenerationController
from nemo_rl_spec.models.generation.vllm_generation import VllmGeneration
from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.models.hf_export import write_consolidated_hf
from nemo_rl_spec.models.hf_weight_mapping import check_tp_size, model_spec_from_hf_config
from nemo_rl_spec.models.mtp_export import mtp_drafter_support_error
from nemo_rl_spec.models.policy.interfaces import PolicyController
from nemo_rl_spec.models.policy.lm_policy import Policy, prefetch_worker_class
from nemo_rl_spec.speculative.adaptive_k import engine_schedule, never_drafts
from nemo_rl_spec.speculative.calibration import resolve_step_costs
from nemo_rl_spec.speculative.metrics import SpecDecodeCounters, SpeculationMonitor
from nemo_rl_spec.speculative.online import check_draft_num_layers, draft_trains_at, write_fresh_draft_head
from nemo_rl_spec.utils.checkpoint import CheckpointManager
from nemo_rl_spec.utils.config import ConfigError, to_yaml
from nemo_rl_spec.utils.config_schema import DraftConfig, MasterConfig
from nemo_rl_spec.utils.console import configure_console, ray_logging_level, worker_log_env
from nemo_rl_spec.utils.console_log import active_console_log, log_only
from nemo_rl_spec.utils.logger import Logger
from nemo_rl_spec.utils.precision import precision_line
from nemo_rl_spec.utils.trackers import build_trackers

logger = logging.getLogger(__name__)


@dataclass
class RunState:
    """The mutable state of one GRPO run that outlives a step, in one named place (the run context itself is frozen).

    Attributes:
        start_step: the first step to run (0, or the step of the checkpoint resumed from).
        resumed: what a resumed checkpoint's ``train_state.pt`` held besides the allocator state (async GRPO's
            buffer under ``async_grpo``); empty for a fresh run.
    """

    start_step: int = 0
    resumed: dict = field(default_factory=dict)


@dataclass(frozen=True)
class GRPOSetup:
    """The run context of one GRPO run, built once by :func:`setup` and never re-assigned: the controllers
    ``policy`` (:class:`Policy`, the Megatron worker group) and ``generation`` (:class:`VllmGeneration`, the vLLM
    engines), the ``refitter`` between them, data, environment, allocator, logger and checkpoints; ``spec`` the
    speculative-decoding monitor (None without speculation); ``state`` the mutable :class:`RunState`. The drivers
    call these objects, never Ray handles."""

    cfg: MasterConfig
    policy: PolicyController
    generation: GenerationController
    refitter: WeightRefitter
    tokenizer: Any
    env: EnvironmentInterface
    train_problems: list[dict]
    allocator: RolloutAllocator
    val_problems: list[dict]
    val_prompt_ids: list[list[int]]
    logger: Logger
    checkpoints: CheckpointManager | None
    spec: SpeculationMonitor | None = None
    workers: Workers | None = None
    state: RunState = field(default_factory=RunState)

    @property
    def pad_token_id(self) -> int:
        """Padding id of training batches (the tokenizer's pad token, else EOS, as the generation worker uses)."""
        return pad_token_id(self.tokenizer)

    def trains_draft(self, step: int) -> bool:
        """Whether GRPO step ``step`` (0-based) also trains the online draft: every ``policy.draft.train_period``-th
        step from the first (:func:`~nemo_rl_spec.speculative.online.draft_trains_at`); always with period 1 or
        without an online draft (the flag is then ignored)."""
        return draft_trains_at(step, draft_train_period(self.cfg))

    def prompt_ids(self, problems: list[dict]) -> list[list[int]]:
        """Chat-formatted token ids of ``problems``."""
        return chat_prompt_ids(self.cfg, self.tokenizer, problems)

    def rollout_generator(
        self, version: int | None = None, gate=None, tag_draft_version: bool = False
    ) -> RolloutGenerator:
        """The run's :class:`RolloutGenerator` over the training pool (the one generate path of sync and async
        GRPO; arguments as there)."""
        return RolloutGenerator(
            self.generation,
            self.tokenizer,
            self.env,
            self.train_problems,
            self.prompt_ids,
            self.cfg.grpo.non_finite_reward,
            version=version,
            gate=gate,
            tag_draft_version=tag_draft_version,
        )

    def spec_step_metrics(self, counters: SpecDecodeCounters | None) -> dict[str, float]:
        """``vllm/spec_*`` metrics of one step's generate calls and the alarm's verdict (empty without
        speculation)."""
        if self.spec is None:
            return {}
        return self.spec.step_metrics(self.spec.counts_to_metrics(counters or SpecDecodeCounters()))


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad token id, else its EOS id."""
    pad = tokenizer.pad_token_id
    return int(pad if pad is not None else tokenizer.eos_token_id)


def chat_prompt_ids(cfg: MasterConfig, tokenizer, problems: list[dict]) -> list[list[int]]:
    """Chat-formatted token ids of ``problems`` (``data.system_prompt``, ``policy.tokenizer.chat_template_kwargs``)."""
    kwargs = cfg.policy.tokenizer.chat_template_kwargs
    return [format_prompt(tokenizer, cfg.data.system_prompt, p["question"], **kwargs) for p in problems]


def load_datasets(cfg: MasterConfig) -> tuple[list[dict], list[dict]]:
    """Training and validation problems per ``data.train.source`` / ``data.validation.source``.

    A ``reasoning_gym`` validation set is ``data.validation.max_samples`` draws of its generators at its own seed,
    exactly the generators' distribution (repeats kept), and it is held out by removing its questions from the
    training pool, which therefore holds at most ``data.train.size`` problems. (Removing the training questions
    from the validation draws instead would bias it: small families such as one-digit two-term sums, ~200
    questions, are all in a 2,048-problem pool, so such a validation set keeps only the rarer, harder problems.)"""
    t, v = cfg.data.train, cfg.data.validation
    if t.source == "reasoning_gym":
        train = load_train_problems(t.generators, t.size, t.seed)
    else:
        train = hub_datasets.LOADERS[t.source](t.path, max_samples=t.size)
    if v.source == "gsm8k_original":
        val = load_gsm8k_original(v.max_samples)
    elif v.source == "reasoning_gym":
        val = load_train_problems(v.generators or t.generators, v.max_samples, v.seed)
        held_out = {p["question"] for p in val}
        train = [p for p in train if p["question"] not in held_out]
    else:
        val = hub_datasets.LOADERS[v.source](v.path, max_samples=v.max_samples)
    return train, val[: cfg.grpo.max_val_samples]  # NeMo-RL's cap on the problems validated (None: all)


def init_ray(cfg: MasterConfig) -> None:
    """Start (or join, with ``cluster.ray_address``) Ray with fractional CPUs (docs/guides/install.md: 1-CPU actors starve
    a 2-core machine)."""
    if ray.is_initialized():
        return
    configure_console(cfg.logger.verbose, cpu=cfg.cluster.gpus_per_node == 0)  # before any actor (runtime_env)
    level = ray_logging_level(cfg.logger.verbose)
    console_log = active_console_log()  # the CLI's <log_dir>/console.log: worker output and Ray's notices go there
    if console_log is not None:
        console_log.quiet_ray_records()
    if cfg.cluster.ray_address:
        ray.init(address=cfg.cluster.ray_address, log_to_driver=True, logging_level=level)
    else:
        ray.init(num_cpus=cfg.cluster.num_cpus, include_dashboard=False, log_to_driver=True, logging_level=level)
    if console_log is not None:
        console_log.route_ray_worker_output()


def _policy_env(cfg: MasterConfig) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(cfg.policy.megatron_cfg.num_threads), "HF_HUB_OFFLINE": "1", **worker_log_env()}


def enabled_draft(cfg: MasterConfig) -> DraftConfig | None:
    """``policy.draft`` when present and enabled, else None."""
    draft = cfg.policy.draft
    return draft if draft is not None and draft.enabled else None


def _engine_draft_dir(cfg: MasterConfig, policy, model_path: str) -> str | None:
    """The EAGLE-3 head directory the engine starts with: with online training, the policy worker's head written
    to ``<logger.log_dir>/draft_init`` (so both start equal); else ``policy.draft.model_name``, else
    ``speculative_config.model`` (None returned: kept); a frozen draft that names neither (a fresh head, e.g. one
    :func:`freeze_draft_without_drafting` froze) is written there from the checkpoint at ``model_path``
    (:func:`~nemo_rl_spec.speculative.online.write_fresh_draft_head`)."""
    draft = enabled_draft(cfg)
    if draft is None:
        return None
    out = str((Path(cfg.logger.log_dir) / "draft_init").resolve())
    if draft.online:
        return policy.save_draft(out)
    spec = cfg.policy.generation.speculative_config
    if draft.model_name or spec is None or spec.method != "eagle3" or spec.model:
        return draft.model_name
    return write_fresh_draft_head(draft, model_path, out, cfg.grpo.seed)


def freeze_draft_without_drafting(cfg: MasterConfig) -> str | None:
    """Freeze an online EAGLE-3 draft that the engines would never use: when ``policy.draft.online`` is true but the
    batch-size-aware schedule (:func:`~nemo_rl_spec.speculative.adaptive_k.engine_schedule`) gives k = 0 at every
    running batch size the engines can reach (1..``vllm_kwargs.max_num_seqs``, every batch size when unset;
    :func:`~nemo_rl_spec.speculative.adaptive_k.never_drafts`), sets ``policy.draft.online = false`` in ``cfg``
    and logs one warning naming the schedule. The run is then the frozen-draft run: no draft training step, no
    hidden-state capture or soft targets on the policy worker, no draft refit (the policy refit is unchanged); the
    engines keep their initial draft, whose ``DraftVersionGuard`` pair stays (0, 0) and is not checked, as with any
    frozen draft. Call before any worker starts, after ``step_costs: auto`` is resolved (:func:`preflight` does).

    Returns:
        The warning's text when the draft was frozen, else None (no online draft, no schedule, a schedule that
        cannot be built, which the engines then report as before, or some reachable batch size drafts).
    """
    draft = enabled_draft(cfg)
    gen = cfg.policy.generation
    spec = gen.speculative_config
    if draft is None or not draft.online or spec is None:
        return None
    try:
        schedule = engine_schedule(gen)
    except ValueError:  # e.g. a derivation without acceptance_rate: the engine's start names it, as before
        return None
    max_running = gen.vllm_kwargs.get("max_num_seqs")
    max_running = int(max_running) if max_running is not None else None
    if schedule is None or not never_drafts(schedule, spec.num_speculative_tokens, max_running):
        return None
    source = (
        "policy.generation.dynamic_speculation"
        if gen.dynamic_speculation is not None and gen.dynamic_speculation.enabled
        else "policy.generation.vllm_kwargs.speculative_config.num_speculative_tokens_per_batch_size"
    )
    reach = f"1..{max_running} (max_num_seqs)" if max_running is not None else "every running batch size"
    message = (
        f"policy.draft.online=true, but the speculation schedule {[list(r) for r in schedule]} ({source}) gives "
        f"k = 0 at {reach}: the engines never propose a draft token, so the EAGLE-3 draft is frozen "
        "(run as policy.draft.online=false): no draft training step, hidden-state capture, soft targets or draft "
        f"refit; the engines keep {draft.model_name or spec.model or 'a fresh head'}"
    )
    draft.online = False
    logger.warning(message)
    return message


def serves_policy_mtp(cfg: MasterConfig) -> bool:
    """True when vLLM drafts with the policy's own MTP block (``speculative_config.method: mtp``; the schema requires
    ``policy.megatron_cfg.mtp_num_layers >= 1`` then)."""
    spec = cfg.policy.generation.speculative_config
    return spec is not None and spec.method == "mtp" and cfg.policy.megatron_cfg.mtp_num_layers > 0


def syncs_draft(cfg: MasterConfig) -> bool:
    """True when every refit also pushes the policy workers' drafter into the engines (``WeightRefitter.sync_draft``):
    an online EAGLE-3 draft (``policy.draft.online``, after :func:`freeze_draft_without_drafting`) or the policy's
    own MTP block (:func:`serves_policy_mtp`). A frozen draft is never refit: the engines keep the one they start
    with."""
    draft = enabled_draft(cfg)
    return (draft is not None and draft.online) or serves_policy_mtp(cfg)


def draft_train_period(cfg: MasterConfig) -> int:
    """GRPO steps between the online draft's training steps (:meth:`GRPOSetup.trains_draft`):
    ``policy.draft.train_period`` for an online EAGLE-3 draft; 1 otherwise (the policy's own MTP block trains with
    the policy every step; the schema refuses an online draft beside it)."""
    draft = enabled_draft(cfg)
    return draft.train_period if draft is not None and draft.online else 1


def check_mtp_drafter_model(cfg: MasterConfig, model_path: str) -> None:
    """With ``method: mtp``, the policy must be exportable as a MiMo checkpoint (Llama/Qwen trunk, head_dim ==
    hidden/heads). Raises ConfigError naming the keys otherwise (before any worker starts)."""
    if not serves_policy_mtp(cfg):
        return
    error = mtp_drafter_support_error(json.loads((Path(model_path) / "config.json").read_text()))
    if error is not None:
        raise ConfigError(
            f"policy.generation.vllm_kwargs.speculative_config.method=mtp serves the policy as a MiMo "
            f"checkpoint, which policy.model_name={cfg.policy.model_name!r} cannot be: {error}. Use a "
            "Llama/Qwen model with head_dim == hidden_size / num_attention_heads (e.g. tiny-llama, "
            "smollm2-135m-instruct) or another speculative_config.method"
        )


def check_tensor_parallel_model(cfg: MasterConfig, model_path: str) -> None:
    """Raise ConfigError (before Ray starts) when the policy model cannot be split over
    ``policy.megatron_cfg.tensor_model_parallel_size`` ranks (heads, KV heads, FFN width, vocabulary)."""
    from transformers import AutoConfig  # lazy: transformers is slow to import

    spec = model_spec_from_hf_config(AutoConfig.from_pretrained(model_path, local_files_only=True))
    try:
        check_tp_size(spec, cfg.policy.megatron_cfg.tensor_model_parallel_size)
    except ValueError as exc:
        raise ConfigError(f"{exc}; policy.model_name={cfg.policy.model_name!r}") from None


def check_ray_address(cfg: MasterConfig, timeout_s: float = 5.0) -> None:
    """``cluster.ray_address`` must be null (a local Ray), ``auto`` (the cluster ``RAY_ADDRESS`` or this node's
    ``ray start`` names) or ``[ray://]host:port`` whose port accepts a TCP connection within ``timeout_s`` (ray.init
    would otherwise retry for minutes before failing).

    Raises:
        ConfigError: naming ``cluster.ray_address`` (bad form, or nothing listening there).
    """
    addr = cfg.cluster.ray_address
    if addr is None or addr == "auto":
        return
    host, sep, port = addr.removeprefix("ray://").rpartition(":")
    if not (sep and host and port.isdigit()):
        raise ConfigError(f"cluster.ray_address={addr!r}: expected null, auto, host:port or ray://host:port")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(
            f"cluster.ray_address={addr!r}: nothing answers at {host}:{port} ({exc}); start the "
            "cluster first (slurm/ray.sub, `ray start --head`) or set cluster.ray_address=null"
        ) from None


def check_draft_dir(cfg: MasterConfig) -> None:
    """Raise ConfigError (before any worker starts) when the EAGLE-3 draft directory named by ``policy.draft.model_name``
    or ``speculative_config.model`` has no ``config.json`` (e.g. ``make draft`` was not run), or when
    ``policy.draft.num_layers`` is set and the head the run starts from (``model_name``; else, for a frozen draft,
    ``speculative_config.model``) has another number of decoder layers (its ``num_hidden_layers``)."""
    spec = cfg.policy.generation.speculative_config
    draft = enabled_draft(cfg)
    for key, path in (
        ("policy.draft.model_name", draft.model_name if draft is not None else None),
        (
            "policy.generation.vllm_kwargs.speculative_config.model",
            spec.model if spec is not None and spec.method == "eagle3" else None,
        ),
    ):
        if path and not (Path(path) / "config.json").is_file():
            raise ConfigError(
                f"{key}={path!r}: no draft there (config.json missing); create it with "
                "examples/init_draft.py (make draft) or point the key at an EAGLE-3 head directory"
            )
    if draft is None or draft.num_layers is None:
        return
    start = draft.model_name or (
        spec.model if spec is not None and spec.method == "eagle3" and not draft.online else None
    )
    if start:
        found = json.loads((Path(start) / "config.json").read_text()).get("num_hidden_layers", 1)
        try:
            check_draft_num_layers(draft.num_layers, found, start)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _engine_model_path(cfg: MasterConfig, policy, model_path: str) -> str:
    """The checkpoint the engine starts from: with the MTP drafter, the policy worker's MiMo export (trunk + MTP
    layers + tokenizer) in ``<logger.log_dir>/mimo_policy``; else the HF model directory."""
    if not serves_policy_mtp(cfg):
        return model_path
    return policy.save_mimo_checkpoint(str((Path(cfg.logger.log_dir) / "mimo_policy").resolve()))


@dataclass
class Workers:
    """The run's placement and its controllers: ``policy`` (Megatron worker group), ``generation`` (vLLM engines)."""

    cluster: RayVirtualCluster
    plan: PlacementPlan
    policy: Policy
    generation: VllmGeneration

    def placement_lines(self) -> list[str]:
        """One line per actor: role, rank, the Ray node id it reports (the multi-node check reads these)."""
        lines = [
            f"[placement] policy rank {r} (node {n}) on ray node {i}"
            for r, (n, i) in enumerate(zip(self.plan.policy_nodes, self.policy.node_ids()))
        ]
        lines += [
            f"[placement] generation engine {e} (node {n}) on ray node {i}"
            for e, (n, i) in enumerate(zip(self.plan.engine_nodes, self.generation.node_ids()))
        ]
        return lines

    def shutdown(self) -> None:
        """Stop the engines, then the policy workers, then release the placement group (best effort each)."""
        for part in (self.generation, self.policy, self.cluster):
            try:
                part.shutdown()
            except Exception:  # noqa: BLE001 - teardown must go on; ray.shutdown() is the final guarantee
                pass


def start_workers(cfg: MasterConfig, model_path: str, plan: PlacementPlan) -> Workers:
    """Reserve ``plan``'s bundles, start the Megatron worker group and the vLLM engines on them, wait until all are
    up, and print where each actor runs."""
    cluster = RayVirtualCluster(plan.num_nodes, plan.cpus_per_node, plan.gpus_per_node)
    try:
        return _start_controllers(cfg, model_path, plan, cluster)
    except BaseException:  # a worker failed to start: release what did start (the placement group included)
        cluster.shutdown()
        raise


def _start_controllers(cfg: MasterConfig, model_path: str, plan: PlacementPlan, cluster: RayVirtualCluster) -> Workers:
    policy = Policy(
        cluster,
        plan.policy_nodes,
        cfg.policy,
        ClippedPGLossFn(cfg.loss_fn),
        model_path,
        cfg.grpo.seed,
        num_cpus=plan.policy_num_cpus,
        num_gpus=plan.policy_num_gpus,
        env_vars=_policy_env(cfg),
        rank_env=lambda r: plan.visible_devices_env("policy", r),
        init_reference_model=cfg.loss_fn.reference_policy_kl_penalty > 0,
        block=False,
    )  # the engines start while the policy workers import and build (2 cores: ~10 s)
    draft = enabled_draft(cfg)
    try:
        generation = VllmGeneration(
            cluster,
            plan.engine_nodes,
            cfg.policy.generation,
            _engine_model_path(cfg, policy, model_path),
            cfg.grpo.seed,
            num_cpus=plan.generation_num_cpus,
            num_gpus=plan.generation_num_gpus,
            allow_stale_draft=draft is not None and draft.allow_stale_draft,
            draft_dir=_engine_draft_dir(cfg, policy, model_path),
            precision=cfg.policy.engine_precision,
            engine_env=lambda e: plan.visible_devices_env("generation", e),
            max_failures=cfg.grpo.async_grpo.max_generation_failures if cfg.grpo.async_grpo else 0,
        )
    except BaseException:
        policy.shutdown()
        raise
    try:
        policy.wait_ready()
    except BaseException:
        generation.shutdown()
        raise
    workers = Workers(cluster, plan, policy, generation)
    for line in workers.placement_lines():
        log_only(line)  # quiet: console.log only (the console's budget is the precision and "starting" lines)
    return workers


def starting_line(plan: PlacementPlan) -> str:
    """The console line printed before the workers start, e.g. ``starting 2 Ray workers on 1 node (1 Megatron
    policy rank, 1 vLLM engine); full console in logs/x/console.log`` (the file part only with a console log)."""
    ranks, engines = len(plan.policy_nodes), len(plan.engine_nodes)
    nodes = f"{plan.num_nodes} node{'s' if plan.num_nodes > 1 else ''}"
    line = (
        f"starting {ranks + engines} Ray workers on {nodes} ({ranks} Megatron policy "
        f"rank{'s' if ranks > 1 else ''}, {engines} vLLM engine{'s' if engines > 1 else ''})"
    )
    console_log = active_console_log()
    return line if console_log is None else f"{line}; full console in {console_log.path}"


def build_allocator(cfg: MasterConfig, pool_size: int, problems: list[dict] | None = None) -> RolloutAllocator:
    """Uniform GRPO, DAPO dynamic sampling or Pilot-Commit over prompt ids ``0..pool_size-1``, per config.

    ``problems`` (the training pool, indexed by prompt id) gives the allocator each prompt's
    :func:`~nemo_rl_spec.algorithms.rollout_allocation.difficulty_bucket`, logged per step as
    ``rollout_alloc/trained_bucket/*``; without it only the bucket metrics are missing."""
    g = cfg.grpo
    alloc = build_rollout_allocator(
        range(pool_size),
        num_prompts_per_step=g.num_prompts_per_step,
        num_generations_per_prompt=g.num_generations_per_prompt,
        seed=g.seed,
        pilot_commit=g.pilot_commit,
        dynamic_sampling=g.dynamic_sampling,
    )
    if problems is not None and hasattr(alloc, "set_prompt_buckets"):
        alloc.set_prompt_buckets([difficulty_bucket(p) for p in problems[:pool_size]])
    return alloc


def preflight(cfg: MasterConfig) -> tuple[str, Any, list[dict], list[dict], PlacementPlan]:
    """Every check :func:`setup` makes before Ray starts: draft directory, model, data, MTP drafter, TP split, the
    step costs of the batch-size-aware schedule (``step_costs: auto`` resolved for this machine), whether an online
    draft is ever used (:func:`freeze_draft_without_drafting` sets ``policy.draft.online = false`` when the schedule
    never drafts), the placement plan and the Ray address. Returns ``(model_path, tokenizer, train problems,
    validation problems, plan)``.

    Raises:
        ConfigError: naming the key whose file, model or layout does not work.
    """
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_draft_dir(cfg)
    model_path = resolve_model(cfg.policy.model_name)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train, val = load_datasets(cfg)
    check_mtp_drafter_model(cfg, model_path)
    check_tensor_parallel_model(cfg, model_path)
    step_costs = resolve_step_costs(cfg, model_path)  # `step_costs: auto` -> this machine's table entry
    if step_costs is not None:
        log_only(f"dynamic speculation: step costs from {step_costs}")
    freeze_draft_without_drafting(cfg)  # an online draft the schedule never uses is not trained (one warning)
    plan = plan_placement(cfg)  # ConfigError when the recipe does not fit its cluster, before Ray starts
    check_ray_address(cfg)
    return model_path, tokenizer, train, val, plan


def setup(cfg: MasterConfig) -> GRPOSetup:
    """Resolve the model, load data, start Ray and the workers, and resume from the latest checkpoint if any; a run
    that starts at step 0 then warm-starts the MTP layers when ``policy.megatron_cfg.mtp_warm_start`` is enabled
    (:func:`~nemo_rl_spec.algorithms.mtp_warm_start.warm_start_mtp`)."""
    model_path, tokenizer, train, val, plan = preflight(cfg)
    print(precision_line(cfg.policy), flush=True)
    print(starting_line(plan), flush=True)
    prefetch = prefetch_worker_class()  # megatron-core's import overlaps Ray's start-up (about 3 s of a CLI run)
    init_ray(cfg)
    prefetch.join()
    workers = start_workers(cfg, model_path, plan)
    try:
        return _finish_setup(cfg, workers, tokenizer, train, val)
    except BaseException:  # e.g. a failing resume: no actor or placement group may outlive setup
        workers.shutdown()
        raise


def _finish_setup(cfg: MasterConfig, workers: Workers, tokenizer, train: list[dict], val: list[dict]) -> GRPOSetup:
    policy, generation = workers.policy, workers.generation
    val_prompt_ids = chat_prompt_ids(cfg, tokenizer, val)
    refitter = WeightRefitter(
        policy,
        generation,
        val_prompt_ids[: cfg.policy.refit.probe_batch_size],
        cfg.policy.refit_threshold,
        pad_token_id(tokenizer),
        engine_dtype=cfg.policy.engine_precision,
        sync_draft=syncs_draft(cfg),
        transport=make_refit_transport(
            cfg.policy.generation.refit_transport,
            policy,
            generation,
            cfg.policy.engine_precision,
            uses_gpus=workers.plan.policy_num_gpus > 0,
            bucket_mb=cfg.policy.refit.bucket_size_mb,
        ),
    )
    spec = None
    if cfg.policy.generation.speculative_config is not None:
        spec = SpeculationMonitor((cfg.policy.draft or DraftConfig()).acceptance_alarm_floor)
    logger = Logger(
        cfg.logger.log_dir,
        cfg.logger.tensorboard_enabled,
        console=True,
        trackers=build_trackers(cfg.logger, cfg.model_dump(mode="json")),
    )  # W&B / MLflow start here
    s = GRPOSetup(
        cfg=cfg,
        policy=policy,
        generation=generation,
        refitter=refitter,
        tokenizer=tokenizer,
        workers=workers,
        env=build_environment(cfg.env),
        train_problems=train,
        allocator=build_allocator(cfg, len(train), train),
        val_problems=val,
        val_prompt_ids=val_prompt_ids,
        logger=logger,
        checkpoints=CheckpointManager(
            cfg.checkpointing.checkpoint_dir,
            cfg.checkpointing.keep_top_k,
            cfg.checkpointing.metric_name,
            cfg.checkpointing.higher_is_better,
        )
        if cfg.checkpointing.enabled
        else None,
        spec=spec,
    )
    if cfg.checkpointing.enabled and cfg.checkpointing.resume:
        resume(s)
    if s.state.start_step == 0 and warm_start_config(cfg) is not None:
        warm_start_mtp(s)  # CE warm start of the MTP layers before RL (cached; a resumed run keeps its own)
    return s


def save_checkpoint(s: GRPOSetup, step: int, metrics: dict[str, float], extra_state: dict | None = None) -> Path | None:
    """Write ``step_<step>`` atomically: policy (model + optimizer, the optimizer unless ``checkpointing.save_optimizer``
    is false; with ``checkpointing.save_consolidated`` also ``policy/consolidated``, an HF checkpoint),
    rollout-allocator state (prompt stream, Pilot-Commit pool and replay buffer), info (``optimizer_saved`` too).
    ``extra_state``: more entries of ``train_state.pt`` (async GRPO's buffer; its ``allocator`` entry, when given,
    replaces the allocator's current state)."""
    if s.checkpoints is None:
        return None
    tmp = s.checkpoints.begin(step)
    (tmp / "policy").mkdir()
    save_optimizer = s.cfg.checkpointing.save_optimizer
    s.policy.save_checkpoint(str(tmp / "policy"), save_optimizer)
    if s.cfg.checkpointing.save_consolidated:  # NeMo-RL: also an HF checkpoint (transformers / vLLM / model_name)
        write_consolidated_hf(
            s.policy.export_hf_weights(None, s.cfg.checkpointing.consolidated_dtype).get(),
            resolve_model(s.cfg.policy.model_name),
            tmp / "policy" / "consolidated",
        )
    state = dict(extra_state or {})
    if "allocator" not in state:  # async GRPO passes the allocator state of its last buffered batch instead
        state["allocator"] = s.allocator.state_dict()
    torch.save(state, tmp / "train_state.pt")
    info = {
        k: v
        for k, v in metrics.items()
        if k.startswith(("train/reward", "validation/")) or k == s.cfg.checkpointing.metric_name
    }
    return s.checkpoints.finalize(tmp, step, {**info, "optimizer_saved": save_optimizer}, to_yaml(s.cfg))


def resume(s: GRPOSetup) -> None:
    """Load the newest complete checkpoint (if any), sync its weights into vLLM, and set ``s.state``."""
    latest = s.checkpoints.latest()
    if latest is None:
        return
    s.policy.load_checkpoint(str(latest / "policy"))
    state = torch.load(latest / "train_state.pt", weights_only=False)
    s.allocator.load_state_dict(state.pop("allocator"))
    s.state.resumed = state
    info = CheckpointManager.read_info(latest)
    s.state.start_step = info["step"]
    s.logger.truncate_after(s.state.start_step)
    s.refitter.refit(version=s.state.start_step)
    print(resume_line(latest, info), flush=True)


def resume_line(latest: Path, info: dict) -> str:
    """The console line of a resume; it says when the checkpoint has no optimizer state (written with
    ``checkpointing.save_optimizer=false``), so the optimizer restarted and the run is not an exact continuation."""
    line = f"resumed from {latest} (step {info['step']})"
    if info.get("optimizer_saved", True):
        return line
    return (
        f"{line}; it holds no optimizer state (written with checkpointing.save_optimizer=false): the optimizer "
        "restarts (Adam moments at zero, fp32 masters from the saved weights), so this is not an exact resume"
    )


def teardown(s: GRPOSetup | None) -> None:
    """Stop the workers and Ray (also on errors and Ctrl-C), so no actor or vLLM engine is left behind."""
    if s is not None:
        if s.workers is not None:
            s.workers.shutdown()
        s.logger.close()
    if ray.is_initialized():
        ray.shutdown()
