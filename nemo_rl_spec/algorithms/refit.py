"""Refit: push the trainer's HF-named weights into the generation workers, then probe for log-prob mismatch.

After every refit, a fixed probe batch of token sequences is scored by vLLM (prompt log-probs) and by the trainer;
``refit/logprob_mismatch`` is the mean |logp_vllm - logp_trainer| over all scored tokens (nats). A stale or wrongly mapped weight shows up here immediately (DESIGN.md: an untied ``lm_head`` left
vLLM stale with a 0.19 difference).
"""
from __future__ import annotations

import ray
import torch

from nemo_rl_spec.algorithms.rollouts import masked_mean_abs_diff, response_mask


class RefitMismatchError(RuntimeError):
    """``refit/logprob_mismatch`` exceeded ``policy.refit.logprob_mismatch_threshold``."""


class WeightRefitter:
    """Versioned policy -> generation weight sync with a log-prob probe.

    Args:
        policy, generation: Ray actor handles (PolicyInterface, GenerationInterface).
        probe_sequences: token ids of the fixed probe sequences (e.g. chat-formatted validation prompts).
        threshold: raise :class:`RefitMismatchError` above this mismatch (None: only log).
        pad_token_id: padding id of the probe batch.
        sync_draft: also refit the online draft (``policy.draft.online``) right after the policy, as the same pair.
    """

    def __init__(self, policy, generation, probe_sequences: list[list[int]], threshold: float | None,
                 pad_token_id: int, sync_draft: bool = False) -> None:
        self.policy, self.generation, self.threshold = policy, generation, threshold
        self.sync_draft = sync_draft
        self.probe_lengths = torch.tensor([len(q) for q in probe_sequences])
        self.probe_ids = torch.full((len(probe_sequences), int(self.probe_lengths.max())), pad_token_id)
        for b, seq in enumerate(probe_sequences):
            self.probe_ids[b, : len(seq)] = torch.tensor(seq)

    def refit(self, version: int) -> dict[str, float]:
        """Export policy weights, load them into vLLM as ``version``, run the probe.

        Returns metrics ``refit/logprob_mismatch`` (nats), ``refit/weight_version`` and, with ``sync_draft``,
        ``refit/draft_version``.
        Raises:
            RefitMismatchError: mismatch above the threshold.
            DraftVersionMismatchError: the draft offered is not paired with ``version`` (from the generation worker).
        """
        weights = self.policy.export_hf_weights.remote(version)
        ray.get(self.generation.update_weights.remote(weights, version))
        draft = self.refit_draft() if self.sync_draft else {}
        mismatch = self.probe()
        if self.threshold is not None and not mismatch <= self.threshold:  # NaN fails too
            raise RefitMismatchError(
                f"refit/logprob_mismatch={mismatch:.3g} exceeds policy.refit.logprob_mismatch_threshold="
                f"{self.threshold:g} at weight version {version}"
            )
        return {"refit/logprob_mismatch": mismatch, "refit/weight_version": float(version), **draft}

    def refit_draft(self) -> dict[str, float]:
        """Push the policy worker's online draft into the engine's drafter (after the policy refit)."""
        out = ray.get(self.generation.update_draft_weights.remote(self.policy.export_draft_weights.remote()))
        return {"refit/draft_version": float(out["draft_version"])}

    def probe(self) -> float:
        """Mean |vLLM log-prob - trainer log-prob| over every scored token of the probe sequences (nats), both at
        temperature 1 (the probe checks weights; sampling plays no part, so it also holds under speculation)."""
        data = {"input_ids": self.probe_ids, "input_lengths": self.probe_lengths}
        vllm_lp = ray.get(self.generation.score.remote(self.probe_ids, self.probe_lengths))
        trainer_lp = ray.get(self.policy.get_logprobs.remote(data, 1.0))
        mask = response_mask(torch.ones_like(self.probe_lengths), self.probe_lengths, self.probe_ids.shape[1])
        return masked_mean_abs_diff(vllm_lp.float(), trainer_lp.float(), mask)
