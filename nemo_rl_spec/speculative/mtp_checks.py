"""Checks of the native MTP drafter on the running GRPO workers (``speculative_config.method: mtp``).

The first three functions run *inside* the Ray actors through the controllers' ``run_function(fn, *args)`` (Ray's
``__ray_call__``: ``fn(actor_instance, *args)`` on every worker), so no test-only method is needed on the workers::

    init = policy.run_function(mtp_params)[0]
    outputs, proposals = generation.run_function(spec_greedy_with_proposals, prompts, 32)[0]
    preds = policy.run_function(megatron_mtp_argmax, [p + o for p, o in zip(prompts, outputs)])[0]
    agree, total = replay_agreement(prompts, outputs, proposals, preds)   # agree == total: the drafter is current

They live in the package (not in a test module) because Ray pickles functions of importable modules by reference.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def mtp_params(worker) -> dict[str, torch.Tensor]:
    """Copies of the policy worker's megatron MTP parameters (``mtp.layers.*``), e.g. to compare later."""
    from nemo_rl_spec.models.policy import megatron_model as mm

    return {k: v.detach().clone() for k, v in mm.megatron_param_state(worker.module).items()
            if k.startswith(mm.MTP_PREFIX)}


def megatron_mtp_argmax(worker, sequences: Sequence[Sequence[int]],
                        params: dict[str, torch.Tensor] | None = None) -> list[list[int]]:
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
    from nemo_rl_spec.models.policy import megatron_model as mm

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


def spec_greedy_with_proposals(worker, prompts: Sequence[Sequence[int]], max_tokens: int):
    """Greedy decode (``ignore_eos``, ``max_tokens`` each) one prompt at a time on the generation worker's engine,
    recording the drafter's proposals. Returns ``(outputs, proposals)``: per prompt, the generated ids and one
    ``[1, k]`` list per engine step. Resets the prefix cache afterwards."""
    from vllm import SamplingParams

    from nemo_rl_spec.speculative.checks import _generate
    from nemo_rl_spec.speculative.lossless import (
        install_proposal_recorder,
        recorded_proposals,
    )

    install_proposal_recorder(worker.llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs, proposals = [], []
    for p in prompts:
        recorded_proposals(worker.llm)  # clear
        outputs += _generate(worker.llm, [p], params)
        proposals.append([r.tolist() for r in recorded_proposals(worker.llm)])
    worker.llm.reset_prefix_cache()
    return outputs, proposals


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
