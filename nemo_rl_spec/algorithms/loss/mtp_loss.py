"""MTP-head log-probs, masks, losses and acceptance: re-exported from :mod:`nemo_rl_spec.models.policy.mtp_loss`
(the Megatron worker computes them, and models must not import algorithms)."""

from nemo_rl_spec.models.policy.mtp_loss import (
    mtp_acceptance_counts,
    mtp_ce_loss,
    mtp_offset,
    mtp_token_logprobs,
    mtp_valid_mask,
)

__all__ = ["mtp_acceptance_counts", "mtp_ce_loss", "mtp_offset", "mtp_token_logprobs", "mtp_valid_mask"]
