"""Refit: push the trainer's HF-named weights into every generation engine, check each engine's versions, then probe
each engine for log-prob mismatch.

After every refit, a fixed probe batch of token sequences is scored by every vLLM engine (prompt log-probs) and once by
the trainer; ``refit/logprob_mismatch`` is the largest, over engines, of the mean |logp_vllm - logp_trainer| over all
scored tokens (nats); with several engines ``refit/logprob_mismatch_engine_<e>`` gives each. A stale or wrongly mapped
weight shows up here immediately (docs/guides/install.md: an untied ``lm_head`` left vLLM stale with a 0.19 difference). Before the
probe, every engine must report the policy version just pushed (and, with draft sync, the draft pushed last: paired with
it, or with an earlier version between the steps that train the draft): an engine that a refit skipped is named by
:class:`EngineVersionMismatchError`.
"""

from __future__ import annotations

import torch

from nemo_rl_spec.algorithms.refit_transport import ObjectStoreTransport, RefitTransport
from nemo_rl_spec.algorithms.rollouts import masked_mean_abs_diff, response_mask
from nemo_rl_spec.models.generation.vllm_generation import EngineVersionMismatchError

__all__ = ["WeightRefitter", "RefitMismatchError", "EngineVersionMismatchError"]


class RefitMismatchError(RuntimeError):
    """``refit/logprob_mismatch`` exceeded ``policy.refit.logprob_mismatch_threshold``."""


class WeightRefitter:
    """Versioned policy -> generation weight sync with a per-engine version check and log-prob probe.

    Args:
        policy: the :class:`~nemo_rl_spec.models.policy.lm_policy.Policy` controller (Megatron worker group).
        generation: the :class:`~nemo_rl_spec.models.generation.vllm_generation.VllmGeneration` controller.
        probe_sequences: token ids of the fixed probe sequences (e.g. chat-formatted validation prompts).
        threshold: raise :class:`RefitMismatchError` above this mismatch (None: only log).
        pad_token_id: padding id of the probe batch.
        sync_draft: also refit the drafter (online EAGLE-3 head or MTP layers) right after the policy, as the same pair.
        engine_dtype: the engines' dtype (``float32`` | ``bfloat16``; ``policy.engine_precision``): the trainer casts
            the weights to it once before sending (bf16 engines get half the bytes).
        transport: how the weights travel (:mod:`~nemo_rl_spec.algorithms.refit_transport`); None: Ray's object
            store in ``engine_dtype``.
    """

    def __init__(
        self,
        policy,
        generation,
        probe_sequences: list[list[int]],
        threshold: float | None,
        pad_token_id: int,
        sync_draft: bool = False,
        engine_dtype: str = "float32",
        transport: RefitTransport | None = None,
    ) -> None:
        self.policy, self.generation, self.threshold = policy, generation, threshold
        self.transport = transport or ObjectStoreTransport(policy, generation, engine_dtype)
        self.sync_draft = sync_draft
        # the last draft pushed: its draft_version and the policy version it was paired with (None before a push)
        self.draft_version: int | None = None
        self.draft_policy_version: int | None = None
        self.probe_lengths = torch.tensor([len(q) for q in probe_sequences])
        self.probe_ids = torch.full((len(probe_sequences), int(self.probe_lengths.max())), pad_token_id)
        for b, seq in enumerate(probe_sequences):
            self.probe_ids[b, : len(seq)] = torch.tensor(seq)

    def refit(self, version: int) -> dict[str, float]:
        """Export the policy weights once (TP shards gathered into full HF tensors), load them into every engine as
        ``version``, the drafter too with ``sync_draft`` when it changed (:meth:`pushes_draft`), check every engine's
        versions, run the probe.

        Returns metrics ``refit/logprob_mismatch`` (nats, worst engine), ``refit/weight_version``, with
        ``sync_draft`` ``refit/draft_policy_lag`` (policy versions since the engines' draft was pushed; 0 after a
        push) and, when the draft was pushed, ``refit/draft_version``; with several engines
        ``refit/logprob_mismatch_engine_<e>``; with ``refit_transport: nccl`` ``refit/broadcast_bytes`` and
        ``refit/broadcast_buckets``; with engine restarts enabled ``generation/engine_restarts`` (so far this run).
        Raises:
            EngineVersionMismatchError: an engine does not hold ``version`` afterwards (a skipped engine).
            RefitMismatchError: mismatch above the threshold.
            DraftVersionMismatchError: the draft offered is not paired with ``version`` (from the generation worker).
        """
        self.transport.push_policy(version)
        draft = self.refit_draft(version) if self.pushes_draft() else {}
        self.check_versions(version)
        if self.sync_draft:
            draft["refit/draft_policy_lag"] = float(version - self.draft_policy_version)
        per_engine = self.probe()
        mismatch = max(per_engine)
        if self.threshold is not None and not mismatch <= self.threshold:  # NaN fails too
            raise RefitMismatchError(
                f"refit/logprob_mismatch={mismatch:.3g} exceeds policy.refit.logprob_mismatch_threshold="
                f"{self.threshold:g} at weight version {version} (per engine: "
                f"{', '.join(f'{m:.3g}' for m in per_engine)})"
            )
        out = {"refit/logprob_mismatch": mismatch, "refit/weight_version": float(version), **draft}
        out.update(self.transport.metrics())
        out.update(getattr(self.generation, "recovery_metrics", dict)())  # generation/engine_restarts, when enabled
        if len(per_engine) > 1:
            out.update({f"refit/logprob_mismatch_engine_{e}": m for e, m in enumerate(per_engine)})
        return out

    def pushes_draft(self) -> bool:
        """Whether this refit pushes the drafter: with ``sync_draft``, at the first refit (the engines may hold the
        initial draft, or a resumed run's draft differs from it) and whenever the trainer's drafter has trained since
        the last push (its ``draft_version`` moved: a cheap call, no weights). A step that did not train it
        (``policy.draft.train_period``, or a step with nothing to train on) leaves the engines' draft as it is."""
        if not self.sync_draft:
            return False
        return self.draft_version is None or self.policy.draft_version() != self.draft_version

    def refit_draft(self, version: int) -> dict[str, float]:
        """Push the policy workers' drafter, paired with policy ``version``, into every engine's drafter (after the
        policy refit to ``version``)."""
        outs = self.transport.push_draft()
        self.draft_version = min(int(o["draft_version"]) for o in outs)
        self.draft_policy_version = int(version)
        return {"refit/draft_version": float(self.draft_version)}

    def check_versions(self, version: int) -> None:
        """Every engine must hold policy ``version`` and, with draft sync, the draft pushed last (paired with
        ``version`` when this refit pushed it, with the earlier version it was pushed at otherwise).

        Raises:
            EngineVersionMismatchError: naming each engine that differs and what it holds.
        """
        stale = []
        for e, v in enumerate(self.generation.get_versions()):
            if v["policy_version"] != version or (
                self.sync_draft and v.get("draft_policy_version") != self.draft_policy_version
            ):
                stale.append(f"engine {e}: {v}")
        if stale:
            raise EngineVersionMismatchError(
                f"after the refit to version {version}, engines do not hold it: " + "; ".join(stale)
            )

    def probe(self) -> list[float]:
        """Mean |vLLM log-prob - trainer log-prob| over every scored token of the probe sequences (nats), one value
        per engine, both at temperature 1 (the probe checks weights; sampling plays no part, so it also holds under
        speculation)."""
        data = {"input_ids": self.probe_ids, "input_lengths": self.probe_lengths}
        trainer_lp = self.policy.get_logprobs(data, 1.0, filtered=False).float()  # the engine scores raw logits
        mask = response_mask(torch.ones_like(self.probe_lengths), self.probe_lengths, self.probe_ids.shape[1])
        return [
            masked_mean_abs_diff(lp.float(), trainer_lp, mask)
            for lp in self.generation.score(self.probe_ids, self.probe_lengths)
        ]
