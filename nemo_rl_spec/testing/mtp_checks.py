"""Checks of the native MTP drafter on the running GRPO workers (``speculative_config.method: mtp``).

The first four functions run *inside* the Ray actors through the controllers' ``run_function(fn, *args)`` (Ray's
``__ray_call__``: ``fn(actor_instance, *args)`` on every worker), so no test-only method is needed on the workers::

    init = policy.run_function(mtp_params)[0]
    fit = policy.run_function(train_mtp_on_own_greedy, prompts, 32)[0]  # a drafter that accepts, before a refit
    outputs, proposals, counters = generation.run_function(spec_greedy_with_proposals, prompts, 32)[0]
    preds = policy.run_function(megatron_mtp_argmax, [p + o for p, o in zip(prompts, outputs)])[0]
    agree, total = replay_agreement(prompts, outputs, proposals, preds)   # agree == total: the drafter is current

They live in the package (not in a test module) because Ray pickles functions of importable modules by reference.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from nemo_rl_spec.models.hf_weight_mapping import megatron_to_hf
from nemo_rl_spec.models.mtp_export import megatron_mtp_to_mimo, write_mimo_checkpoint
from nemo_rl_spec.models.policy import megatron_model as mm
from nemo_rl_spec.models.policy.megatron_model import MTP_PREFIX, build_from_hf, megatron_param_state
from nemo_rl_spec.speculative.metrics import read_spec_decode_counters
from nemo_rl_spec.testing.checks import generate_tokens
from nemo_rl_spec.testing.lossless import (
    install_proposal_recorder,
    recorded_proposals,
)


def mtp_params(worker) -> dict[str, torch.Tensor]:
    """Copies of the policy worker's megatron MTP parameters (``mtp.layers.*``), e.g. to compare later."""
    return {
        k: v.detach().clone() for k, v in mm.megatron_param_state(worker.module).items() if k.startswith(mm.MTP_PREFIX)
    }


def megatron_mtp_argmax(
    worker, sequences: Sequence[Sequence[int]], params: dict[str, torch.Tensor] | None = None
) -> list[list[int]]:
    """Megatron MTP (layer 0) greedy prediction at every index t of each sequence (it predicts token t + 2), with the
    token embedding zeroed at position 0 as vLLM's MiMo layer does (megatron does not zero it; see mtp_export.py).

    Args:
        worker: the :class:`MegatronPolicyWorker` (inside its actor).
        sequences: token ids, one list per sequence (run one at a time, no padding).
        params: optional MTP parameters (:func:`mtp_params` names) to predict with instead of the current ones; the
            current ones are restored afterwards.
    Returns:
        one list of len(sequence) token ids per sequence.
    """
    mod = worker.module
    named = dict(mod.named_parameters())
    saved = {k: named[k].detach().clone() for k in (params or {})}
    was_training = mod.training

    def zero_first_position(**kwargs):
        emb = mod.embedding(**kwargs).clone()  # [S, B, H]
        emb[0] = 0
        return emb

    out = []
    with torch.no_grad():
        try:
            for k, v in (params or {}).items():
                named[k].copy_(v)
            mod.eval()
            for seq in sequences:
                ids = torch.tensor([list(seq)])
                trunk = mm.gpt_trunk_forward(mod, ids)
                hidden = mm.mtp_hidden_states(mod, ids, trunk, trunk.hidden, zero_first_position)[0]
                out.append(mm.output_logits(mod, hidden)[0].argmax(-1).tolist())
        finally:
            for k, v in saved.items():
                named[k].copy_(v)
            mod.train(was_training)
    return out


def train_mtp_on_own_greedy(
    worker, prompts: Sequence[Sequence[int]], max_tokens: int, steps: int = 150
) -> dict[str, object]:
    """Train the policy worker's MTP layer 0 (trunk frozen: the policy's outputs do not change) on the policy's own
    greedy continuations of ``prompts``, so the engine's MTP drafter accepts after the next refit: what a lossless
    check needs (with nothing accepted, equality proves nothing about verification).

    Each prompt is continued greedily by megatron's main head (``max_tokens + 1`` tokens, full forward per token,
    no KV cache), then :func:`train_mtp_on_sequences` (``steps`` full-batch Adam steps) fits the MTP layer to
    draft token t + 2 at every response position. The worker's own MTP AdamW state and CPU RNG state are left
    untouched.

    Raises:
        ValueError: tensor parallelism > 1 (the training reads the full [V, H] output weight on one rank).
    Returns:
        :func:`train_mtp_on_sequences`'s result plus ``"sequences"`` (prompt + greedy continuation, token ids).
    """
    if worker.layout.tp_size != 1:
        raise ValueError(f"train_mtp_on_own_greedy needs tensor_model_parallel_size 1, got {worker.layout.tp_size}")
    mod = worker.module
    was_training = mod.training
    mod.eval()
    sequences = []
    with torch.no_grad():
        for p in prompts:
            seq = list(p)
            for _ in range(max_tokens + 1):
                seq.append(int(mm.gpt_logits(mod, torch.tensor([seq]))[0, -1].argmax()))
            sequences.append(seq)
    with torch.random.fork_rng(devices=[]):  # its manual_seed must not move the worker's own RNG stream
        result = train_mtp_on_sequences(mod, sequences, [len(p) for p in prompts], steps)
    mod.train(was_training)
    return {**result, "sequences": sequences}


def spec_greedy_with_proposals(worker, prompts: Sequence[Sequence[int]], max_tokens: int):
    """Greedy decode (``ignore_eos``, ``max_tokens`` each) one prompt at a time on the generation worker's engine,
    recording the drafter's proposals. Returns ``(outputs, proposals, counters)``: per prompt, the generated ids
    and one ``[1, k]`` list per engine step; the engine's spec-decode counts over the whole decode
    (:class:`~nemo_rl_spec.speculative.metrics.SpecDecodeCounters`, e.g. for
    :func:`~nemo_rl_spec.testing.lossless.require_acceptance`). Resets the prefix cache afterwards."""
    from vllm import SamplingParams  # lazy: vllm is slow to import

    install_proposal_recorder(worker.llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs, proposals = [], []
    before = read_spec_decode_counters(worker.llm)
    for p in prompts:
        recorded_proposals(worker.llm)  # clear
        outputs += generate_tokens(worker.llm, [p], params)
        proposals.append([r.tolist() for r in recorded_proposals(worker.llm)])
    counters = read_spec_decode_counters(worker.llm) - before
    worker.llm.reset_prefix_cache()
    return outputs, proposals, counters


def replay_agreement(prompts, outputs, proposals, predictions) -> tuple[int, int]:
    """(agreeing, total) drafting rounds of a k = 1 greedy decode: a round drafts at chain index t (the last
    verified token's index; t = len(prompt) - 1 after prefill) and its proposal should equal ``predictions[i][t]``;
    an accepted proposal (equal to the output token at t + 2) advances t by 2, a rejected one by 1. Rounds whose
    t + 2 lies past the decoded sequence are not counted."""
    agree = total = 0
    for p, out, props, pred in zip(prompts, outputs, proposals, predictions):
        seq, t = list(p) + list(out), len(p) - 1
        for prop in props:
            if t + 2 >= len(seq):
                break
            guess = int(prop[0][0])
            agree += guess == pred[t]
            total += 1
            t += 2 if guess == seq[t + 2] else 1
    return agree, total


def train_mtp_on_sequences(
    model,
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    steps: int = 150,
    lr: float = 1e-2,
    seed: int = 0,
    top_k: int = 64,
    mse_weight: float = 0.1,
) -> dict[str, object]:
    """Train only the MTP layer 0 of a megatron GPTModel (trunk, embedding and output layer frozen, so the target's
    outputs do not change) to draft the target's next token on ``sequences``: a drafter that accepts, for lossless
    checks (a random MTP layer accepts nothing, so equality would prove nothing).

    At every response position t the MTP layer's output hidden state h (after its final norm) is trained towards
    the trunk's final-normed hidden state g at t + 1, whose logits W g give the target's token t + 2 (its greedy
    choice on these sequences). No vocabulary-sized tensor is formed: the loss is the cross-entropy of h's logits
    over the ``top_k`` tokens of W g (the target's token first, its closest rivals after it) for class 0, plus
    ``mse_weight * ||h - g||^2``. Full-batch Adam, the token embedding zeroed at position 0 as vLLM's MiMo layer
    does (see :func:`megatron_mtp_argmax`). Deterministic. Measured on the tiny Llama (16 prompts x 64 tokens):
    100 steps, ~15 s on one busy core, full-vocabulary argmax accuracy 0.99.

    Shape: sequences: B lists of token ids (prompt + the target's greedy response; right-padded here); prompt_lens: B
    prompt lengths.

    Returns:
        {"losses": the loss at every step, "accuracy": fraction of the trained positions whose MTP argmax over the
        full vocabulary equals the sequence's token t + 2 after training (what a k = 1 draft needs)}.
    """
    torch.manual_seed(seed)
    width = max(len(s) for s in sequences)
    ids = torch.tensor([list(s) + [0] * (width - len(s)) for s in sequences])
    mask = torch.zeros(ids.shape, dtype=torch.bool)  # [B, S]: positions t with a token t + 2 in the response
    for b, (s, p) in enumerate(zip(sequences, prompt_lens)):
        mask[b, max(p - 2, 0) : len(s) - 2] = True
    named = dict(model.named_parameters())
    mtp = {n: p for n, p in named.items() if n.startswith(mm.MTP_PREFIX)}
    frozen = {n: p.requires_grad for n, p in named.items() if n not in mtp}
    for n in frozen:
        named[n].requires_grad_(False)

    def zero_first_position(**kwargs):
        emb = model.embedding(**kwargs).clone()  # [S, B, H]
        emb[0] = 0
        return emb

    opt = torch.optim.Adam(list(mtp.values()), lr=lr)
    losses = []
    try:
        model.train()
        with torch.no_grad():
            trunk = mm.gpt_trunk_forward(model, ids)
            # [N, H]: the trunk's hidden at t + 1 of each trained position t (the last two positions are masked out)
            goal = torch.roll(trunk.hidden.transpose(0, 1), shifts=-1, dims=1)[mask]
            weight = mm.output_weight(model).detach()  # [V, H]
            top = (goal @ weight.T).topk(top_k, dim=-1).indices  # [N, top_k]: the target's token first, then rivals
            rivals = weight[top]  # [N, top_k, H]
        for _ in range(steps):
            hidden = mm.mtp_hidden_states(model, ids, trunk, trunk.hidden, zero_first_position)[0]
            h = hidden.transpose(0, 1)[mask]  # [N, H]
            sub_logits = torch.einsum("nh,nkh->nk", h, rivals)
            ce = torch.nn.functional.cross_entropy(sub_logits, torch.zeros(len(h), dtype=torch.long))
            loss = ce + mse_weight * (h - goal).pow(2).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        model.eval()
        with torch.no_grad():
            hidden = mm.mtp_hidden_states(model, ids, trunk, trunk.hidden, zero_first_position)[0]
            guess = mm.output_logits(model, hidden).argmax(-1)  # [B, S]
            want = torch.roll(ids, shifts=-2, dims=1)
            accuracy = float((guess[mask] == want[mask]).float().mean())
    finally:
        for n, flag in frozen.items():
            named[n].requires_grad_(flag)
        model.eval()
    return {"losses": losses, "accuracy": accuracy}


def export_trained_mimo(
    llama_dir: str,
    out_dir: str,
    sequences: Sequence[Sequence[int]],
    prompt_lens: Sequence[int],
    steps: int = 150,
    lr: float = 1e-2,
) -> dict[str, object]:
    """Megatron policy for the HF Llama ``llama_dir`` with one MTP layer trained on ``sequences``
    (:func:`train_mtp_on_sequences`), written to ``out_dir`` as the MiMo checkpoint vLLM serves with ``method: mtp``
    (trunk unchanged). Needs its own process (it initialises torch.distributed): run it through
    ``checks.run_isolated``. Returns :func:`train_mtp_on_sequences`'s result."""
    model, spec = build_from_hf(llama_dir, mtp_num_layers=1)
    result = train_mtp_on_sequences(model, sequences, prompt_lens, steps, lr)
    state = megatron_param_state(model)
    trunk = megatron_to_hf({n: t for n, t in state.items() if not n.startswith(MTP_PREFIX)}, spec)
    cfg = json.loads((Path(llama_dir) / "config.json").read_text())
    write_mimo_checkpoint(trunk, cfg, megatron_mtp_to_mimo(state, spec), out_dir, tokenizer_dir=llama_dir)
    return result
