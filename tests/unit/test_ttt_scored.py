"""The online draft's TTT loss at the scored tokens only (nemo_rl_spec/speculative/ttt_scored.py) against the
full-position formula it replaces, written out here: the same loss, gradients and metrics to fp32 rounding, on tiny
random heads (reduced and full vocabulary), a mask with holes, rows without scored tokens, soft and hard targets."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fixtures_models

from nemo_rl_spec.speculative.draft_trainer import DraftTrainer
from nemo_rl_spec.speculative.eagle3 import Eagle3Config, Eagle3DraftHead
from nemo_rl_spec.speculative.online import OnlineDraft
from nemo_rl_spec.speculative.ttt_scored import chain_window, scored_index, scored_soft_targets, scored_ttt_loss
from nemo_rl_spec.utils.config_schema import DraftConfig

pytestmark = pytest.mark.numerics  # docs/design/numerical_tolerances.md

torch.set_num_threads(1)
V, H, S, K, T = 64, 16, 14, 3, 0.7
# Prompts of 3-5 tokens, responses with holes (masked-out tokens inside a response), right padding, one row with
# nothing to score, one scored token at the first scorable index (2) and one at the last (S - 1).
MASK = torch.tensor(
    [
        [0, 0, 0, 1, 1, 0, 1, 1, 1, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1, 0, 1, 1],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0],
    ],
    dtype=torch.bool,
)


def make_head(draft_vocab_size: int | None, seed: int = 0, num_layers: int = 1) -> Eagle3DraftHead:
    """A random head with visible weights (std 0.3, norms off 1) and a random embedding."""
    cfg = Eagle3Config(
        vocab_size=V,
        hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=32,
        aux_layer_ids=(0, 1, 2),
        target_num_hidden_layers=2,
        draft_vocab_size=draft_vocab_size,
        num_layers=num_layers,
    )
    return fixtures_models.randomize_eagle3_head(Eagle3DraftHead(cfg), seed)


def make_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """aux hidden [B, S, 3H], input_ids [B, S], policy logits [B, S, V] (scale 3: peaked and flat rows)."""
    gen = torch.Generator().manual_seed(seed)
    B = MASK.shape[0]
    return (
        torch.randn(B, S, 3 * H, generator=gen),
        torch.randint(0, V, (B, S), generator=gen),
        3.0 * torch.randn(B, S, V, generator=gen),
    )


def reference_loss(head, aux, ids, mask, logits, weights, soft=True, temperature=T):
    """The pre-restriction formula, at every position: soft targets log_softmax(logits / temperature) [B, S, V], the
    draft's logits at every chain of every step, each term weighted by the mask, mean per step, weighted mean of
    steps."""
    target = torch.log_softmax(logits.float() / temperature, dim=-1).index_select(-1, head.draft_ids)
    per_step, metrics = [], {}
    for j, step_logits in enumerate(head.unroll(aux, ids, K)):
        shift = 2 + j
        logq = torch.log_softmax(step_logits[:, : S - shift], dim=-1)
        tokens, valid = ids[:, shift:], mask[:, shift:].clone()
        if soft:
            per_tok = -(target[:, shift - 1 : S - 1].exp() * logq).sum(-1)
        else:
            draft_tok = head.target_to_draft[tokens]
            valid &= draft_tok >= 0
            per_tok = -logq.gather(-1, draft_tok.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        n = valid.sum().clamp_min(1)
        per_step.append((per_tok * valid).sum() / n)
        pred = head.draft_ids[step_logits[:, : S - shift].argmax(-1)]
        metrics[f"draft_acc_step{j}"] = float(((pred == tokens) & valid).sum() / n)
        metrics[f"draft_loss_step{j}"] = float(per_step[-1].detach())
    return sum(w * s for w, s in zip(weights, per_step, strict=True)) / sum(weights), metrics


def control_positions(head, ids) -> list[tuple[int, int]]:
    """The last scored token and the last hole inside a response whose tokens the draft vocabulary holds (a hard
    target outside it scores nothing either way)."""
    in_vocab = head.target_to_draft[ids] >= 0
    scored = [(r, q) for r, q in zip(*scored_index(MASK & in_vocab), strict=True)]
    holes = [(r, q) for r, q in zip(*scored_index(~MASK & in_vocab), strict=True) if MASK[r, :q].any()]
    return [tuple(map(int, scored[-1])), tuple(map(int, holes[-1]))]


def grads_of(head, loss) -> dict[str, torch.Tensor]:
    head.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in head.named_parameters() if p.requires_grad}


# The bound of the scored-vs-full comparisons (docs/design/numerical_tolerances.md). Both paths add up the same
# N nonnegative-weighted terms, one per scored (chain, step) pair, in different orders and groupings (the full path
# also adds exact zeros); each order is within gamma_{N-1} ~ (N - 1) eps of the exact sum of the absolute values
# (Higham, recursive summation), so two orders differ by <= 2 N eps sum_k |term_k| elementwise. A term's own
# arithmetic is the same per-row ops on both paths, but a GEMM may block differently for a different row count:
# R = 64 (the longest inner dimension here: the vocabulary) more reorderings of it. The loss terms are >= 0, so for
# the loss sum_k |term_k| is the loss itself; for a gradient element it is sum_k |d term_k / d theta|, computed
# below by one backward per term. A dropped or extra scored position changes the loss and gradients by about
# 1 / N of their size, some 100x above this bound (the controls below check that).
EPS32 = torch.finfo(torch.float32).eps
R_INNER = 64


def reorder_tol(num_terms: int) -> float:
    """Relative bound on two summation orders of ``num_terms`` nonnegative terms (block comment above)."""
    return 2 * (num_terms + R_INNER) * EPS32


def term_abs_grads(head, aux, ids, mask, logits, weights, soft=True, temperature=T, scale=1.0):
    """(sum over the loss's terms of |d term / d param| per parameter element, number of terms) of
    ``scale * reference_loss(...)``: a term is one scored token at one step j, weight w_j / (n_j sum_j w_j)."""
    per_step_n = []
    for j in range(K):
        valid = mask[:, 2 + j :].clone()
        if not soft:
            valid &= head.target_to_draft[ids[:, 2 + j :]] >= 0
        per_step_n.append(int(valid.sum()))
    total = {n: torch.zeros_like(p) for n, p in head.named_parameters() if p.requires_grad}
    terms = 0
    for r, q in zip(*scored_index(mask), strict=True):
        for j in range(min(K, int(q) - 1)):
            if not soft and int(head.target_to_draft[ids[r, q]]) < 0:
                continue
            one = torch.zeros_like(mask)
            one[r, q] = True
            onehot = [1.0 if i == j else 0.0 for i in range(K)]
            term, _ = reference_loss(head, aux, ids, one, logits, onehot, soft, temperature)
            term = term * (scale * weights[j] / (per_step_n[j] * sum(weights)))
            for name, g in grads_of(head, term).items():
                total[name] += g.abs()
            terms += 1
    return total, terms


def assert_same(new: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], abs_grads, num_terms: int) -> None:
    """Elementwise |new - ref| <= reorder_tol(num_terms) * sum_k |d term_k / d param| (+ the float32 underflow)."""
    assert new.keys() == ref.keys() == abs_grads.keys()
    for name in ref:
        bound = reorder_tol(num_terms) * abs_grads[name] + torch.finfo(torch.float32).tiny
        excess = ((new[name] - ref[name]).abs() - bound).max()
        assert excess <= 0, (name, float(excess))


@pytest.mark.parametrize("draft_vocab_size", [24, None], ids=["reduced_vocab", "full_vocab"])
@pytest.mark.parametrize("soft", [True, False], ids=["soft", "hard"])
def test_scored_loss_and_gradients_equal_the_full_position_formula(draft_vocab_size, soft):
    check_scored_equals_full(make_head(draft_vocab_size), soft)


def test_two_layer_head_scored_loss_and_gradients_equal_the_full_position_formula():
    """``policy.draft.num_layers`` = 2 (each layer with its own TTT cache; the window's chains need layer 0 at every
    index below the window's end): the same comparison and bound."""
    check_scored_equals_full(make_head(24, num_layers=2), soft=True)


def check_scored_equals_full(head: Eagle3DraftHead, soft: bool) -> None:
    aux, ids, logits = make_batch()
    weights = [1.0, 0.7, 0.3]
    ref, ref_metrics = reference_loss(head, aux, ids, MASK, logits, weights, soft)
    ref_grads = grads_of(head, ref)
    targets = scored_soft_targets(logits, MASK, T, head.draft_ids) if soft else None
    new, metrics = scored_ttt_loss(head, aux, ids, MASK, K, targets, weights)
    abs_grads, num_terms = term_abs_grads(head, aux, ids, MASK, logits, weights, soft)
    loss_tol = reorder_tol(num_terms)  # relative: the terms are >= 0
    torch.testing.assert_close(new, ref, rtol=loss_tol, atol=0.0)
    assert_same(grads_of(head, new), ref_grads, abs_grads, num_terms)
    assert metrics.keys() == ref_metrics.keys()
    for key, value in ref_metrics.items():  # per-step means of <= num_terms terms >= 0; accuracies are counts / n
        assert metrics[key] == pytest.approx(value, rel=loss_tol, abs=0.0), key
    # control: one scored position dropped, or a hole filled, moves the loss by over 10x the tolerance
    for r, q in control_positions(head, ids):
        changed = MASK.clone()
        changed[r, q] = not changed[r, q]
        other, _ = reference_loss(head, aux, ids, changed, logits, weights, soft)
        assert abs(float(other.detach()) - float(new.detach())) > 10 * loss_tol * abs(float(new.detach()))


def test_scored_soft_targets_are_the_full_log_softmax_rows():
    head = make_head(24)
    _, _, logits = make_batch(1)
    rows, cols = scored_index(MASK)
    assert len(rows) == DraftTrainer.scored_tokens(MASK) == int(MASK[:, 2:].sum())
    assert bool(MASK[rows, cols].all()) and int(cols.min()) == 2 and int(cols.max()) == S - 1
    full = torch.log_softmax(logits.bfloat16().float() / T, dim=-1)
    got = scored_soft_targets(logits.bfloat16(), MASK, T, head.draft_ids)
    # log_softmax of the same rows (a row subset vs the whole tensor): |d lp| <= eps (2V + 4 + 2 max|z| + 2|lp|), z =
    # logits / T (the sum of V exps in two orders, ~1 ulp per exp and log, the subtractions at |z| and |lp|)
    expected = full[rows, cols - 1][:, head.draft_ids]
    zmax = (logits.bfloat16().float() / T)[rows, cols - 1].abs().amax(-1, keepdim=True)
    bound = EPS32 * (2 * V + 4 + 2 * zmax + 2 * expected.abs())
    assert ((got - expected).abs() <= bound).all()


def test_chain_window_covers_exactly_the_chains_that_score():
    rows, cols = scored_index(MASK)
    start, end = chain_window(cols, K, S)
    chains = {int(q) - 2 - j for q in cols for j in range(K) if int(q) - 2 - j >= 0}
    assert (start, end) == (min(chains), max(chains) + 1) == (0, S - 2)
    lone = torch.zeros(2, 20, dtype=torch.bool)
    lone[1, 12] = lone[0, 15] = True
    assert chain_window(scored_index(lone)[1], 3, 20) == (12 - 2 - 2, 15 - 2 + 1)
    assert chain_window(scored_index(torch.zeros(2, 20, dtype=torch.bool))[1], 3, 20) == (0, 20)


def test_online_draft_step_equals_the_full_position_formula():
    """OnlineDraft.begin / accumulate (two micro-batches) / gradients, against the reference weighted by each
    micro-batch's share of the scored tokens, as the trainer did before. The soft targets are at temperature 1 though
    the rollouts' temperature is T = 0.7: vLLM draws draft tokens from softmax(z / T) of the draft's logits z, so z
    must fit log p_1 (online.py's module docstring)."""
    head = make_head(24)
    ref_head = make_head(24)
    aux, ids, logits = make_batch(2)
    draft = OnlineDraft(head, DraftConfig(online=True), ttt_steps=K, temperature=T)
    draft.begin(head.embed_tokens.weight.detach().clone(), MASK)
    parts = (slice(0, 2), slice(2, 5))
    for sl in parts:
        draft.accumulate(_Captured(aux[sl]), ids[sl], MASK[sl], logits[sl])
    total = DraftTrainer.scored_tokens(MASK)
    weights = [0.8**j for j in range(K)]
    ref = sum(
        reference_loss(ref_head, aux[sl], ids[sl], MASK[sl], logits[sl], weights, temperature=1.0)[0]
        * (DraftTrainer.scored_tokens(MASK[sl]) / total)
        for sl in parts
    )
    ref_grads = grads_of(ref_head, ref)
    abs_grads, num_terms = {n: torch.zeros_like(g) for n, g in ref_grads.items()}, 0
    for sl in parts:
        share = DraftTrainer.scored_tokens(MASK[sl]) / total
        part, n = term_abs_grads(ref_head, aux[sl], ids[sl], MASK[sl], logits[sl], weights, True, 1.0, share)
        abs_grads = {name: abs_grads[name] + part[name] for name in abs_grads}
        num_terms += n
    assert_same({n: p.grad for n, p in head.named_parameters() if p.requires_grad}, ref_grads, abs_grads, num_terms)
    metrics = draft.finish()
    assert metrics["draft_loss"] == pytest.approx(float(ref), rel=reorder_tol(num_terms), abs=0.0)


class _Captured:
    """Stands in for a HiddenStateCapture: the aux hidden states of one micro-batch."""

    def __init__(self, aux: torch.Tensor) -> None:
        self._aux = aux

    def aux_hidden(self) -> torch.Tensor:
        return self._aux


def test_bf16_autocast_step_keeps_fp32_state_and_tracks_the_fp32_step():
    """``policy.draft.precision: bfloat16``: the trainer's loss is the scored loss under ``torch.autocast`` (recomputed
    here), it differs from the fp32 loss (autocast ran) by bf16 rounding only, the gradients point the same way, the
    weights and AdamW moments stay fp32, and a dtype other than bf16 is refused."""
    aux, ids, logits = make_batch(3)
    targets = scored_soft_targets(logits, MASK, 1.0, None)  # the online draft's soft targets are at temperature 1
    runs = {}
    for precision in ("float32", "bfloat16"):
        head = make_head(None)
        draft = OnlineDraft(head, DraftConfig(online=True, precision=precision), ttt_steps=K, temperature=T)
        assert draft.trainer.autocast_dtype == (torch.bfloat16 if precision == "bfloat16" else None)
        draft.begin(head.embed_tokens.weight.detach().clone(), MASK)
        draft.accumulate(_Captured(aux), ids, MASK, logits)
        grads = torch.cat([p.grad.flatten() for p in draft.trainer.params])
        runs[precision] = (draft.finish(), grads, draft.trainer)
    fp32, bf16 = runs["float32"][0]["draft_loss"], runs["bfloat16"][0]["draft_loss"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        by_hand, _ = scored_ttt_loss(make_head(None), aux, ids, MASK, K, targets)
    # the trainer's loss is this very call on the same inputs (one micro-batch): equal up to the slack 1e-6 (8 eps)
    assert bf16 == pytest.approx(float(by_hand), rel=1e-6)
    # bf16 vs fp32: a statistical tolerance, not a worst-case bound (that is ~2^-8 per bf16 rounding times the depth,
    # over 1e-2). Each of the N = 74 per-token terms moves by <= 2 max|d z| (the CE's slope in the logits z), with
    # independent bf16 roundings (2^-9 relative) that average down like 1 / sqrt(N); seen: 1.8e-4 (AVX-512/AMX and
    # AVX2 alike). The gradients: 1 - cos <= (|d g| / |g|)^2 / 2, so cos > 0.999 holds up to |d g| / |g| = 0.045 = 11
    # bf16 ulps (2^-8).
    assert bf16 != fp32 and bf16 == pytest.approx(fp32, rel=1e-3)
    g32, g16 = runs["float32"][1], runs["bfloat16"][1]
    assert float(torch.nn.functional.cosine_similarity(g32, g16, dim=0)) > 0.999
    trainer = runs["bfloat16"][2]
    assert all(p.dtype == torch.float32 for p in trainer.params)
    moments = [t for s in trainer.optimizer.state.values() for t in s.values() if t.dim()]
    assert len(moments) == 2 * len(trainer.params) and all(t.dtype == torch.float32 for t in moments)
    with pytest.raises(ValueError, match="autocast_dtype"):
        DraftTrainer(make_head(None), autocast_dtype=torch.float16)


def test_draft_precision_key_names_itself_when_invalid():
    with pytest.raises(ValueError, match="precision"):
        DraftConfig(online=True, precision="float16")
