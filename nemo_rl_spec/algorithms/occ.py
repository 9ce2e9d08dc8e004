"""OCC, the per-step coefficient of the MTP heads' policy loss (docs/design/methods.md section 3, docs/guides/occ.md).

The math lives in :mod:`nemo_rl_spec.models.policy.occ` (the Megatron worker applies it in its loss, and models must
not import algorithms); this module re-exports it under its algorithmic name.
"""

from nemo_rl_spec.models.policy.occ import MODES, PROXIES, MTPCoefficient, logprob_delta_lambda, occ_lambda

__all__ = ["MODES", "PROXIES", "MTPCoefficient", "logprob_delta_lambda", "occ_lambda"]
