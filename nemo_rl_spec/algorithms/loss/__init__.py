"""Training losses: the GRPO clipped policy-gradient loss and the micro-batch loss contract."""

from nemo_rl_spec.algorithms.loss.clipped_pg import ClippedPGLossFn
from nemo_rl_spec.algorithms.loss.interfaces import LossFunction, aggregate_microbatch_metrics

__all__ = ["ClippedPGLossFn", "LossFunction", "aggregate_microbatch_metrics"]
