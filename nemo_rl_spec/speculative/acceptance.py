"""Offline estimates of speculative-decoding acceptance from teacher-forced draft unrolls.

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023) accepts draft token ``x`` drawn from ``q`` with
probability ``min(1, p(x) / q(x))``, where ``p`` is the target's next-token distribution at the sampling
temperature ``T``. The probability that draft step ``j`` is accepted, given the context, is then

- greedy drafting (``draft_sample_method: greedy``, vLLM's default; ``q`` one-hot at the draft's argmax):
  ``a_j = p_T(argmax q)``;
- probabilistic drafting (the draft samples from ``q_T = softmax(z / T)``): ``a_j = sum_v min(p_T(v), q_T(v)) =
  1 - TV(p_T, q_T)``.

A chain of ``k`` draft steps starting at position ``t`` yields ``1 + sum_{i=1..k} prod_{j<i} a_j(t)`` tokens per
verification step in expectation. Here the ``a_j`` come from a teacher-forced unroll (:meth:`Eagle3DraftHead.unroll`)
on sequences the policy sampled, so step ``j`` conditions on the sampled tokens rather than on its own accepted
proposals: an estimate, which the rollout benchmark checks against vLLM's counters.
"""

from __future__ import annotations

import torch

from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


def chain_acceptance_length(step_accept: torch.Tensor) -> torch.Tensor:
    """Expected tokens per verification step of a k-step chain.

    Shape: step_accept [..., k] (acceptance probability of each draft step given the previous were accepted, in
    [0, 1]) -> [...]: ``1 + sum_{i=1..k} prod_{j<i} step_accept[..., j]``.
    """
    return 1.0 + torch.cumprod(step_accept, dim=-1).sum(-1)


def step_acceptance(
    draft_logits: torch.Tensor, target_logprobs: torch.Tensor, temperature: float, method: str
) -> torch.Tensor:
    """Per-position acceptance probability of one draft step.

    Args:
        draft_logits: [..., Vd] the draft's logits over its vocabulary.
        target_logprobs: [..., Vd] the target's log-probabilities at temperature ``temperature`` (normalised over
            the full vocabulary, then restricted to the draft vocabulary's ids).
        temperature: sampling temperature (> 0; at 0 both methods reduce to ``argmax q == argmax p``).
        method: ``greedy`` or ``probabilistic`` (module docstring).

    Returns:
        [...] acceptance probabilities in [0, 1].

    Raises:
        ValueError: unknown ``method``.
    """
    if method not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"draft_sample_method={method!r}: expected one of {DRAFT_SAMPLE_METHODS}")
    p = target_logprobs.float().exp()
    if temperature <= 0:
        return (draft_logits.argmax(-1) == target_logprobs.argmax(-1)).float()
    if method == "greedy":
        return p.gather(-1, draft_logits.argmax(-1, keepdim=True)).squeeze(-1)
    q = torch.softmax(draft_logits.float() / temperature, dim=-1)
    return torch.minimum(p, q).sum(-1)


@torch.no_grad()
def expected_acceptance(
    head: Eagle3DraftHead,
    aux_hidden: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    target_logprobs: torch.Tensor,
    temperature: float,
    num_steps: int,
    methods: tuple[str, ...] = DRAFT_SAMPLE_METHODS,
) -> dict[str, float]:
    """Estimated acceptance of ``head`` at ``num_steps`` draft steps on sampled sequences (module docstring).

    Chains start at every position ``t`` whose first drafted token ``input_ids[t+2]`` is a response token
    (``loss_mask``) and are cut where the sequence ends: a step past the last response token counts as rejected.

    Args:
        aux_hidden: [B, S, n_aux * H] the policy's aux hidden states.
        input_ids: [B, S] prompt + sampled response.
        loss_mask: [B, S] response tokens (bool / 0-1).
        target_logprobs: [B, S, Vd] the policy's next-token log-probs at ``temperature``, restricted to the draft
            vocabulary (``target_logprobs[:, i]`` is the distribution of ``input_ids[:, i+1]``).

    Returns:
        ``{method}/acceptance_length`` (mean over chains) and ``{method}/step{j}`` (mean acceptance of step j over
        chains that reach it) per method, ``oracle_greedy/acceptance_length`` (a draft that always proposes the
        target's mode: the ceiling of greedy drafting), and ``chains`` (how many).
    """
    S = input_ids.shape[1]
    logits = head.unroll(aux_hidden.float(), input_ids, num_steps)
    mask = loss_mask.bool()
    starts = torch.zeros_like(mask)
    starts[:, : S - 2] = mask[:, 2:]
    n = int(starts.sum())
    out: dict[str, float] = {"chains": float(n)}
    if n == 0:
        return out
    results = {m: [] for m in methods}
    oracle = []
    for j, lg in enumerate(logits):
        shift = 1 + j  # target_logprobs[:, t + 1 + j] is the distribution drafted by step j of chain t
        lp = torch.full_like(target_logprobs, float("-inf"))
        lp[:, : S - shift] = target_logprobs[:, shift:]
        valid = torch.zeros_like(mask)
        valid[:, : S - shift - 1] = mask[:, shift + 1 :]
        lp_safe = torch.where(valid.unsqueeze(-1), lp, torch.zeros_like(lp))
        for m in methods:
            results[m].append(step_acceptance(lg, lp_safe, temperature, m) * valid)
        oracle.append(lp_safe.exp().max(-1).values * valid if temperature > 0 else valid.float())
    for m in methods:
        acc = torch.stack(results[m], dim=-1)[starts]  # [n, k]
        out[f"{m}/acceptance_length"] = float(chain_acceptance_length(acc).mean())
        for j in range(num_steps):
            out[f"{m}/step{j}"] = float(acc[:, j].mean())
    out["oracle_greedy/acceptance_length"] = float(chain_acceptance_length(torch.stack(oracle, -1)[starts]).mean())
    return out
