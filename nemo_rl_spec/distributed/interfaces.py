"""Batch specs shared by the policy and generation workers.

All batches crossing a Ray actor boundary are plain ``dict[str, torch.Tensor]`` (CPU tensors), right-padded.

Worked example (B=2 sequences, pad id 0, prompt lengths 3 and 2, response lengths 2 and 3)::

    input_ids     = [[11, 12, 13, 21, 22,  0],      # prompt 11 12 13, response 21 22
                     [14, 15, 23, 24, 25,  0]]      # prompt 14 15,    response 23 24 25
    input_lengths = [5, 5]                           # prompt + response tokens, no padding
    token_mask    = [[0, 0, 0, 1, 1, 0],             # 1 on response tokens that the loss sees
                     [0, 0, 1, 1, 1, 0]]
    generation_logprobs[b, s] = log pi_gen(input_ids[b, s] | input_ids[b, :s]) on response tokens, 0 elsewhere

Log-prob tensors are aligned with ``input_ids`` (position s holds the log-prob *of* token s), so position 0 is
always 0.
"""

from __future__ import annotations

from typing import TypedDict

import torch


class TrainDatumSpec(TypedDict, total=False):
    """One training batch. Shapes: B sequences, S padded length.

    input_ids: [B, S] int64.   input_lengths: [B] int64.   token_mask: [B, S] float32 (1 = response token).
    sample_mask: [B] float32 (0 drops a whole sequence).
    advantages: [B] float32, or [B, S] per token (``loss_fn.use_kl_in_reward``: the KL penalty in the reward).
    generation_logprobs: [B, S] float32, log-probs under the policy that sampled (behaviour policy).
    prev_logprobs: [B, S] float32, log-probs under the trainer's weights before the update (pi_old).
    reference_policy_logprobs: [B, S] float32, log-probs under the frozen reference (only if KL is on).
    rewards: [B] float32, the environment's reward per sequence (``loss_fn.positive_example_nll_weight``).
    """

    input_ids: torch.Tensor
    input_lengths: torch.Tensor
    token_mask: torch.Tensor
    sample_mask: torch.Tensor
    advantages: torch.Tensor
    generation_logprobs: torch.Tensor
    prev_logprobs: torch.Tensor
    reference_policy_logprobs: torch.Tensor
    rewards: torch.Tensor
