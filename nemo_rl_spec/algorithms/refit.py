"""Refit: push the trainer's HF-named weights into the generation workers, then probe for log-prob mismatch.

After every refit, a fixed probe batch is sampled by vLLM with the new weights and scored by the trainer at the
same temperature; ``refit/logprob_mismatch`` is the mean |logp_vllm - logp_trainer| over the probe's response
tokens (nats). A stale or wrongly mapped weight shows up here immediately (DESIGN.md: an untied ``lm_head`` left
vLLM stale with a 0.19 difference).
"""
from __future__ import annotations

import ray

from nemo_rl_spec.algorithms.rollouts import masked_mean_abs_diff, response_mask


class RefitMismatchError(RuntimeError):
    """``refit/logprob_mismatch`` exceeded ``policy.refit.logprob_mismatch_threshold``."""


class WeightRefitter:
    """Versioned policy -> generation weight sync with a log-prob probe.

    Args:
        policy, generation: Ray actor handles (PolicyInterface, GenerationInterface).
        probe_prompt_ids: token ids of the fixed probe prompts.
        temperature: generation temperature (the probe samples and scores at it).
        threshold: raise :class:`RefitMismatchError` above this mismatch (None: only log).
        probe_max_new_tokens: response length of the probe (tokens).
    """

    def __init__(self, policy, generation, probe_prompt_ids: list[list[int]], temperature: float,
                 threshold: float | None, probe_max_new_tokens: int = 16, seed: int = 1234) -> None:
        self.policy, self.generation = policy, generation
        self.probe_prompt_ids = probe_prompt_ids
        self.temperature, self.threshold = temperature, threshold
        self.probe_max_new_tokens, self.seed = probe_max_new_tokens, seed

    def refit(self, version: int) -> dict[str, float]:
        """Export policy weights, load them into vLLM as ``version``, run the probe.

        Returns metrics ``refit/logprob_mismatch`` (nats), ``refit/weight_version``.
        Raises:
            RefitMismatchError: mismatch above the threshold.
        """
        weights = self.policy.export_hf_weights.remote()
        ray.get(self.generation.update_weights.remote(weights, version))
        mismatch = self.probe()
        if self.threshold is not None and not mismatch <= self.threshold:  # NaN fails too
            raise RefitMismatchError(
                f"refit/logprob_mismatch={mismatch:.3g} exceeds policy.refit.logprob_mismatch_threshold="
                f"{self.threshold:g} at weight version {version}"
            )
        return {"refit/logprob_mismatch": mismatch, "refit/weight_version": float(version)}

    def probe(self) -> float:
        """Mean |generation log-prob - trainer log-prob| over the probe's response tokens (nats)."""
        gen = ray.get(self.generation.generate.remote(
            {"prompt_token_ids": self.probe_prompt_ids}, 1, self.seed,
            temperature=self.temperature, max_new_tokens=self.probe_max_new_tokens))
        data = {"input_ids": gen["output_ids"], "input_lengths": gen["unpadded_sequence_lengths"]}
        trainer_lp = ray.get(self.policy.get_logprobs.remote(data, self.temperature))
        mask = response_mask(gen["input_lengths"], gen["unpadded_sequence_lengths"], gen["output_ids"].shape[1])
        return masked_mean_abs_diff(gen["generation_logprobs"].float(), trainer_lp.float(), mask)
