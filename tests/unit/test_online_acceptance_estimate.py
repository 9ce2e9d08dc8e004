"""``policy.draft.estimate_acceptance`` (nemo_rl_spec/speculative/online.py, AcceptanceEstimate): the online head's
estimated acceptance before each update and the frozen starting head's, on the step's rollouts, against
``expected_acceptance`` of the whole batch computed here (itself checked against an independent loop in
tests/unit/test_draft_acceptance.py), on tiny random heads."""

from __future__ import annotations

import copy

import pytest
import torch

from nemo_rl_spec.speculative.acceptance import expected_acceptance
from nemo_rl_spec.speculative.online import OnlineDraft
from nemo_rl_spec.utils.config_schema import DraftConfig
from tests.unit.test_ttt_scored import MASK, K, T, V, make_batch, make_head, reorder_tol

pytestmark = pytest.mark.numerics  # docs/design/numerical_tolerances.md

METHODS = ("greedy", "probabilistic")


class _Captured:
    def __init__(self, aux: torch.Tensor) -> None:
        self._aux = aux

    def aux_hidden(self) -> torch.Tensor:
        return self._aux


def whole_batch(head, aux, ids, logits) -> dict[str, float]:
    """expected_acceptance over the whole batch at T, the policy's log-probs restricted to the draft vocabulary."""
    lp = torch.log_softmax(logits / T, -1).index_select(-1, head.draft_ids)
    return expected_acceptance(head, aux, ids, MASK, lp, T, K)


def train_step(draft: OnlineDraft, embedding: torch.Tensor, batch) -> dict[str, float]:
    """One online step over two micro-batches (rows 0-1 and 2-4)."""
    aux, ids, logits = batch
    draft.begin(embedding, MASK)
    for sl in (slice(0, 2), slice(2, 5)):
        draft.accumulate(_Captured(aux[sl]), ids[sl], MASK[sl], logits[sl])
    return draft.finish()


# The estimates are means over the chains of per-chain acceptance lengths (> 0), summed per micro-batch or per rank and
# merged, against one whole-batch sum: two summation orders of the chains' terms, each computed by the same per-row
# ops (a GEMM over fewer rows may block differently): relative bound reorder_tol(chains) = 2 (chains + 64) eps
# (tests/unit/test_ttt_scored.py; docs/design/numerical_tolerances.md). One chain more or less moves the mean
# by ~1 / chains (1/37), far above it.
REL = reorder_tol(int(MASK[:, 2:].sum()))


def test_estimates_are_the_chain_weighted_whole_batch_values_before_the_update_and_of_the_frozen_start():
    head = make_head(24)
    start = copy.deepcopy(head)
    draft = OnlineDraft(
        head, DraftConfig(online=True, estimate_acceptance=True, optimizer={"lr": 0.05}), ttt_steps=K, temperature=T
    )
    emb = head.embed_tokens.weight.detach().clone()
    batches = [make_batch(10), make_batch(11)]
    for step, batch in enumerate(batches):
        before = copy.deepcopy(draft.head)
        metrics = train_step(draft, emb, batch)
        mine, ref = whole_batch(before, *batch), whole_batch(start, *batch)
        assert metrics["draft_est_chains"] == mine["chains"] == int(MASK[:, 2:].sum())
        for m in METHODS:
            assert metrics[f"draft_est_acceptance_{m}"] == pytest.approx(mine[f"{m}/acceptance_length"], rel=REL)
            assert metrics[f"draft_ref_est_acceptance_{m}"] == pytest.approx(ref[f"{m}/acceptance_length"], rel=REL)
            if step == 0:  # nothing trained yet: the same head
                assert metrics[f"draft_est_acceptance_{m}"] == pytest.approx(metrics[f"draft_ref_est_acceptance_{m}"])
        assert metrics["draft_est_seconds"] > 0
    # after one update (lr 0.05) the online head's estimate has moved away from the frozen start's
    assert abs(metrics["draft_est_acceptance_probabilistic"] - metrics["draft_ref_est_acceptance_probabilistic"]) > 1e-4
    assert all(torch.equal(a, b) for a, b in zip(draft.estimate.reference.parameters(), start.parameters()))


def test_reference_reads_the_policys_current_embedding_and_the_key_defaults_off():
    head = make_head(None)
    draft = OnlineDraft(head, DraftConfig(online=True, estimate_acceptance=True), ttt_steps=K, temperature=T)
    new_emb = torch.randn(V, head.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    draft.begin(new_emb, MASK)
    assert torch.equal(draft.estimate.reference.embed_tokens.weight, new_emb)
    assert not any(p.requires_grad for p in draft.estimate.reference.parameters())
    plain = OnlineDraft(make_head(None), DraftConfig(online=True), ttt_steps=K, temperature=T)
    assert plain.estimate is None
    metrics = train_step(plain, new_emb, make_batch(1))
    assert not any(k.startswith(("draft_est", "draft_ref_est")) for k in metrics)


class _OtherRank:
    """A data-parallel sync whose only other rank contributed ``sums``."""

    def __init__(self, sums: dict[str, float]) -> None:
        self.sums = sums

    def sum_metrics(self, values: dict[str, float]) -> dict[str, float]:
        return {k: v + self.sums.get(k, 0.0) for k, v in values.items()}


def test_data_parallel_ranks_give_the_chain_weighted_whole_batch_value():
    """Two ranks holding rows 0-1 and 2-4 agree with one worker holding all rows."""
    aux, ids, logits = make_batch(7)
    head = make_head(24)
    ranks = []
    for sl in (slice(0, 2), slice(2, 5)):
        draft = OnlineDraft(head, DraftConfig(online=True, estimate_acceptance=True), ttt_steps=K, temperature=T)
        draft.estimate.add(head, aux[sl], ids[sl], MASK[sl], logits[sl])
        ranks.append(draft.estimate)
    other = dict(ranks[1]._sums)
    merged = ranks[0].metrics(_OtherRank(other))
    whole = whole_batch(head, aux, ids, logits)
    assert merged["draft_est_chains"] == whole["chains"]
    for m in METHODS:
        assert merged[f"draft_est_acceptance_{m}"] == pytest.approx(whole[f"{m}/acceptance_length"], rel=REL)
    assert ranks[0].metrics()["draft_est_chains"] == 0  # the step's sums were cleared
