"""Types of the performance simulator: specs (validated pydantic models), results, and the one callable protocol.

Units everywhere: seconds, bytes, FLOPs, FLOP/s, bytes/s, tokens. "Device" means one GPU (or, for the CPU
profile, the whole 2-core machine). A *forward* is one model pass over a batch; a *pass* is one generation
iteration of the continuous-batching engine (one target forward for autoregressive decoding; k draft forwards
plus one (k+1)-token verification forward for speculative decoding).

Worked example of the spec tree (``configs/sim/paper_8b_rl_zero.yaml`` resolves to this)::

    ScenarioSpec(name="rl_zero", model="qwen3-8b", hardware="gb200",
                 layout=LayoutSpec(total_devices=32, gen_devices_per_engine=1, colocated=True),
                 workload=WorkloadSpec(num_prompts=512, generations_per_prompt=16,
                                       response=LengthDistSpec(median_tokens=2000, sigma=0.9, max_tokens=16384)),
                 speculative=SpeculativeSpec(k=3, acceptance_length=2.47, draft="eagle3-qwen3-8b"),
                 baseline=PhaseTimes(generation=100.0, logprob=..., training=..., refit=..., other=...))
"""

from __future__ import annotations

from typing import Literal, Optional, Protocol, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

_STRICT = ConfigDict(extra="forbid", frozen=True)


class HardwareSpec(BaseModel):
    """Peak capabilities of one device (datasheet numbers; efficiencies live in :class:`EfficiencySpec`)."""

    model_config = _STRICT
    name: str
    peak_flops: float = Field(gt=0, description="dense bf16 (CPU: fp32) FLOP/s per device")
    mem_bw: float = Field(gt=0, description="memory bandwidth, bytes/s per device")
    mem_capacity: float = Field(gt=0, description="memory, bytes per device")
    link_bw: float = Field(gt=0, description="scale-up link (NVLink) bytes/s per device per direction")
    net_bw: float = Field(gt=0, description="scale-out network bytes/s per device per direction")
    domain_size: int = Field(ge=1, description="devices per scale-up (NVLink) domain")
    collective_latency_s: float = Field(ge=0, description="fixed latency of one collective in the domain, s")


class EfficiencySpec(BaseModel):
    """Achieved fractions and fixed costs of the software on a device; the calibration command fits these."""

    model_config = _STRICT
    decode_flops_eff: float = Field(gt=0, le=1, description="fraction of peak FLOP/s in decode/verify forwards")
    mem_bw_eff: float = Field(gt=0, le=1, description="fraction of peak bandwidth reached streaming weights/KV")
    overlap: bool = Field(True, description="compute and memory overlap (time = max); False: time = sum (CPU)")
    forward_overhead_s: float = Field(ge=0, description="fixed cost of one target forward (schedule, sample)")
    draft_forward_overhead_s: float = Field(ge=0, description="fixed cost of one draft forward")
    prefill_mfu: float = Field(gt=0, le=1, description="model FLOPs utilisation of prompt prefill")
    logprob_mfu: float = Field(gt=0, le=1, description="model FLOPs utilisation of log-prob forwards")
    train_mfu: float = Field(gt=0, le=1, description="model FLOPs utilisation of training fwd+bwd")
    refit_overhead_s: float = Field(ge=0, description="fixed cost of one weight refit (gather, reload)")
    refit_bw_eff: float = Field(gt=0, le=1, description="fraction of link/network bandwidth reached by refit")


class SystemProfile(BaseModel):
    """A device and the software's efficiencies on it: everything a roofline needs."""

    model_config = _STRICT
    hardware: HardwareSpec
    efficiency: EfficiencySpec


class MoESpec(BaseModel):
    """Mixture-of-experts MLP: ``n_experts`` routed experts, ``top_k`` active per token, uniform routing."""

    model_config = _STRICT
    n_experts: int = Field(ge=1)
    top_k: int = Field(ge=1)
    expert_intermediate: int = Field(ge=1)


class ModelSpec(BaseModel):
    """Decoder-only transformer shape (GQA attention, SwiGLU MLP). Parameter counts are derived, not stored."""

    model_config = _STRICT
    name: str
    n_layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    n_heads: int = Field(ge=1)
    n_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate: int = Field(ge=0, description="dense SwiGLU width (0 if every layer is MoE)")
    vocab: int = Field(ge=1)
    tied_embeddings: bool = False
    moe: Optional[MoESpec] = None
    attn_input_multiple: int = Field(1, ge=1, description="EAGLE-3 layer reads concat(embed, hidden): 2")
    extra_params: int = Field(0, ge=0, description="parameters outside the layers (EAGLE-3 fc 3h->h)")
    bytes_per_param: float = Field(2.0, gt=0)
    kv_bytes_per_elem: float = Field(2.0, gt=0)


class LengthDistSpec(BaseModel):
    """Response lengths: log-normal with ``median_tokens`` and shape ``sigma``, clipped to [min, max] (truncation
    at max_new_tokens puts an atom at the maximum, as real RL runs show)."""

    model_config = _STRICT
    median_tokens: float = Field(gt=0)
    sigma: float = Field(ge=0)
    max_tokens: int = Field(ge=1)
    min_tokens: int = Field(1, ge=1)


class PilotCommitSpec(BaseModel):
    """Rollout counts of Pilot-Commit: ``n_pilot`` rollouts for every prompt of the sampling batch, then
    ``n_commit`` more for the ``selected_fraction`` that pass the filter; pilot and commit share one call."""

    model_config = _STRICT
    sampling_prompts: int = Field(ge=1)
    n_pilot: int = Field(ge=1)
    n_commit: int = Field(ge=0)
    selected_fraction: float = Field(ge=0, le=1)


class WorkloadSpec(BaseModel):
    """What one RL step generates and trains on."""

    model_config = _STRICT
    num_prompts: int = Field(ge=1)
    generations_per_prompt: int = Field(ge=1)
    prompt_tokens: int = Field(ge=1)
    response: LengthDistSpec
    pilot_commit: Optional[PilotCommitSpec] = None
    reference_logprobs: bool = Field(False, description="also run the reference model (KL penalty on)")
    seed: int = 0


class SpeculativeSpec(BaseModel):
    """Draft length ``k`` and the per-position acceptance: exactly one of ``alpha`` (constant per-position
    acceptance), ``per_position`` (conditional acceptance of positions 1..k) or ``acceptance_length`` (mean
    tokens per target pass at this k; converted to a constant alpha)."""

    model_config = _STRICT
    k: int = Field(ge=1)
    alpha: Optional[float] = Field(None, ge=0, le=1)
    per_position: Optional[list[float]] = None
    acceptance_length: Optional[float] = Field(None, ge=1)
    draft: Union[str, ModelSpec] = "eagle3"
    online_draft_training: bool = False
    ttt_steps: Optional[int] = Field(
        None,
        ge=1,
        description="training-time-test unroll of online draft training "
        "(draft forwards per trained token); None: k, as policy.draft.ttt_steps",
    )
    draft_train_period: int = Field(
        1,
        ge=1,
        description="online draft trained and refit every n-th step (policy.draft.train_period); the step's draft "
        "training and draft refit are their per-step means, 1/n of a training step's",
    )

    @model_validator(mode="after")
    def _one_acceptance(self) -> "SpeculativeSpec":
        given = [x is not None for x in (self.alpha, self.per_position, self.acceptance_length)]
        if sum(given) != 1:
            raise ValueError("give exactly one of alpha, per_position, acceptance_length")
        if self.per_position is not None and len(self.per_position) < self.k:
            raise ValueError(f"per_position needs k={self.k} entries, got {len(self.per_position)}")
        if self.acceptance_length is not None and self.acceptance_length > self.k + 1:
            raise ValueError(f"acceptance_length {self.acceptance_length} exceeds k+1={self.k + 1}")
        return self


class LayoutSpec(BaseModel):
    """Where phases run. Generation engines of ``gen_devices_per_engine`` = tp x pp devices (EP shares the TP
    devices), data-parallel over the generation devices. Colocated: generation and training share all devices in
    turn; otherwise ``gen_devices`` generate and the rest train. Training layouts (TP/PP/CP/EP of Megatron)
    enter through ``train_mfu``."""

    model_config = _STRICT
    total_devices: int = Field(ge=1)
    gen_devices_per_engine: int = Field(1, ge=1, description="tp * pp devices of one engine (EP inside TP)")
    gen_pipeline_parallel: int = Field(1, ge=1, description="pipeline stages of an engine (divides the above)")
    colocated: bool = True
    gen_devices: Optional[int] = Field(None, ge=1, description="non-colocated only; None: search the split")
    max_num_seqs: int = Field(256, ge=1, description="engine's concurrency cap (vLLM max_num_seqs)")
    kv_cache_fraction: float = Field(0.9, gt=0, le=1, description="vLLM gpu_memory_utilization")
    refit_over_network: bool = Field(False, description="refit crosses the scale-out network")
    prefix_caching: bool = Field(True, description="a prompt's group shares one prefill (vLLM prefix caching)")

    @model_validator(mode="after")
    def _pipeline_divides(self) -> "LayoutSpec":
        if self.gen_devices_per_engine % self.gen_pipeline_parallel:
            raise ValueError(
                f"gen_pipeline_parallel {self.gen_pipeline_parallel} does not divide "
                f"gen_devices_per_engine {self.gen_devices_per_engine}"
            )
        return self


MiB = 2**20


class RefitSpec(BaseModel):
    """How a refit moves the weights to the generation engines (NeMo-RL ``policy.generation.refit_transport``) and
    the hardware numbers of that path; formulas in :mod:`nemo_rl_spec.sim.refit`. Defaults are assumptions (the
    description of each says on what they rest); set them from a measurement when one exists."""

    model_config = _STRICT
    transport: Literal["ray", "nccl", "cuda_ipc"] = Field(
        description="ray: Ray object store; nccl: bucketed broadcast trainer -> engines; cuda_ipc: colocated handles"
    )
    bucket_bytes: float = Field(256 * MiB, gt=0, description="bytes per broadcast / IPC bucket (assumed 256 MiB)")
    fixed_s: Optional[float] = Field(
        None, ge=0, description="fixed seconds per refit on top of the transport (RPCs); None: efficiency's overhead"
    )
    host_device_bw: float = Field(
        25e9, gt=0, description="ray: device<->host copy bytes/s (PCIe Gen5 x16 is 64e9 peak; pageable copies less)"
    )
    serialize_bw: float = Field(10e9, gt=0, description="ray: bytes/s of putting the tensors into the object store")
    store_bw: float = Field(10e9, gt=0, description="ray: bytes/s the object store sends from one node (TCP path)")
    ray_fetch: Literal["sender", "tree"] = Field(
        "sender", description="sender: every engine pulls from the sender's node; tree: copies serve further pulls"
    )
    nccl_bw: Optional[float] = Field(
        None, gt=0, description="nccl: broadcast bus bytes/s; None: 0.8 x net_bw (refit_over_network) or link_bw"
    )
    nccl_latency_s: float = Field(50e-6, ge=0, description="nccl: seconds per bucket per tree level (assumed)")
    ipc_copy_bw: Optional[float] = Field(None, gt=0, description="cuda_ipc: device copy bytes/s; None: mem_bw / 2")
    ipc_bucket_s: float = Field(1e-3, ge=0, description="cuda_ipc: handle export/open/sync seconds per bucket")


class PhaseTimes(BaseModel):
    """Seconds per phase of one RL step (NeMo-RL ``timing/train/*``: generation, policy_and_reference_logprobs,
    policy_training, weight_sync; ``other`` = the rest of ``total_step_time``)."""

    model_config = _STRICT
    generation: float = Field(ge=0)
    logprob: float = Field(ge=0)
    training: float = Field(ge=0)
    refit: float = Field(ge=0)
    other: float = Field(0.0, ge=0)

    @property
    def total(self) -> float:
        """Synchronous step time: the phases run one after another, seconds."""
        return self.generation + self.logprob + self.training + self.refit + self.other


class ScenarioSpec(BaseModel):
    """One simulated RL setup. ``model``/``hardware``/``draft`` are preset names or inline specs.

    ``baseline``: measured autoregressive phase times. When given, the response-length scale is fitted so the
    simulated autoregressive generation time equals ``baseline.generation`` and the non-generation phases are
    taken from it (the simulator then predicts only what speculation changes)."""

    model_config = _STRICT
    name: str
    description: str = ""
    model: Union[str, ModelSpec]
    hardware: Union[str, HardwareSpec]
    efficiency: Optional[dict[str, Union[float, bool]]] = Field(None, description="overrides of the defaults")
    layout: LayoutSpec
    workload: WorkloadSpec
    speculative: SpeculativeSpec
    mode: Literal["sync", "async"] = "sync"
    max_policy_lag: int = Field(1, ge=0, description="async: max trajectory age in steps")
    baseline: Optional[PhaseTimes] = None
    paper: Optional[dict[str, Optional[float]]] = Field(None, description="published values (null: not given)")
    refit: Optional[RefitSpec] = Field(
        None, description="weight transport of a refit; None: the lumped model (efficiency.refit_overhead_s/_bw_eff)"
    )

    @model_validator(mode="after")
    def _ipc_needs_colocation(self) -> "ScenarioSpec":
        if self.refit is not None and self.refit.transport == "cuda_ipc" and not self.layout.colocated:
            raise ValueError("refit.transport cuda_ipc needs layout.colocated: true (use nccl or ray for split pools)")
        return self


class GenerationResult(BaseModel):
    """Outcome of simulating one generation phase."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)
    seconds: float = Field(description="makespan over all engines, s")
    passes: int = Field(description="engine passes of the slowest engine")
    tokens: int = Field(description="response tokens generated")
    batch_trace: np.ndarray = Field(description="active sequences per pass, slowest engine. Shape: [passes]")
    time_trace: np.ndarray = Field(description="seconds per pass, slowest engine. Shape: [passes]")


class StepResult(BaseModel):
    """Autoregressive vs speculative phase times of one scenario and the speedups (AR time / spec time)."""

    model_config = _STRICT
    name: str
    ar: PhaseTimes
    spec: PhaseTimes
    ar_step_s: float
    spec_step_s: float
    generation_speedup: float
    e2e_speedup: float
    details: dict[str, float] = Field(default_factory=dict)


class PassCostFn(Protocol):
    """Seconds of one engine pass for each entry of vectors of batch sizes and summed context lengths.

    Args:
        batch: active sequences per pass. Shape: [P].
        context_tokens: tokens of KV cache the batch attends to, summed over sequences. Shape: [P].
    Returns:
        seconds per pass. Shape: [P].
    """

    def __call__(self, batch: np.ndarray, context_tokens: np.ndarray) -> np.ndarray: ...
