"""CPU compatibility patches for megatron-core 0.19.2 (torch CPU wheel, no CUDA, no TE, no Apex).

megatron-core assumes a CUDA device in a handful of places that the dense GPT training path reaches.
:func:`apply_cpu_compat` patches exactly those, in process (idempotent), and is a no-op when CUDA is available.
Call it BEFORE the first ``import megatron.core``; calling it again re-patches megatron modules imported since.

1. triton stub (only if ``import triton`` fails): the MoE code decorates kernels at import time; never launched.
2. ``torch`` proxy in every ``megatron.core.*`` module (:class:`_CpuTorch`): CUDA ``device`` arguments map to
   ``"cpu"``, ``torch.cuda`` streams / events / synchronize are no-ops and its RNG calls act on the CPU generator.
   The global ``torch`` (which vLLM / transformers in the same process use) is left alone.
3. CPU RNG tracker (:class:`CpuRNGStatesTracker`): named CPU generator states in place of CUDA ones.
4. grad clipping: ``clip_grad_by_total_norm_fp32`` asserts CUDA grads; replaced by an equivalent for CPU fp32 grads.
5. distributed optimizer (:func:`cuda_tensor_type_names`, a context, not global): ``DistributedOptimizer.__init__``
   sorts parameters by ``param.type()`` against CUDA type names; inside the context a CPU tensor answers the CUDA
   name of its dtype. The worker wraps only the optimizer's construction in it.
6. tied embeddings under pipeline parallelism: the last stage's copy is all-reduced with the first stage's after a
   ``.cuda()`` (:func:`_patch_tied_embedding_setup`); on CPU it stays on CPU.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types

import torch

_CUDA_DEVICE_FACTORIES = (
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "rand",
    "randn",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "randn_like",
    "rand_like",
    "linspace",
    "eye",
)

# Megatron modules imported (before proxying) so the patches cover the training path.
_MEGATRON_MODULES = (
    "megatron.core.tensor_parallel.random",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.distributed",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.pipeline_parallel.schedules",
)


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means a CUDA device


def _cpu_factory(fn):
    def factory(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    factory.__wrapped__ = fn
    return factory


class _NoOpStream:
    """Stands in for ``torch.cuda.Stream``/``Event``: every method is a no-op, usable as a context."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as seen by megatron modules on a CPU-only torch (see module docstring, patch 2)."""

    def __init__(self):
        super().__init__("torch.cuda")
        self.current_device = lambda: "cpu"
        self.Stream = self.Event = _NoOpStream
        self.current_stream = self.default_stream = lambda *a, **k: _NoOpStream()
        self.stream = lambda *a, **k: contextlib.nullcontext()
        self.synchronize = self.empty_cache = lambda *a, **k: None
        self.get_rng_state = lambda *a, **k: torch.get_rng_state()
        self.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        self.manual_seed = self.manual_seed_all = lambda seed: torch.manual_seed(seed)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by megatron modules on a CPU-only torch (see module docstring, patch 2)."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _CUDA_DEVICE_FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name):
        return getattr(torch, name)


_TORCH_PROXY = _CpuTorch()


def _install_triton_stub() -> None:
    """Patch 1: placeholder ``triton`` / ``triton.language`` when the real package cannot be imported."""
    try:
        import triton  # noqa: F401  # lazy: optional, absent on CPU
        import triton.language  # noqa: F401  # lazy: optional, absent on CPU

        return
    except Exception:  # ImportError, or a broken install that fails at import
        pass

    class _Anything(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return object

    triton_stub = _Anything("triton")
    language_stub = _Anything("triton.language")
    triton_stub.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    triton_stub.autotune = triton_stub.heuristics = lambda *a, **k: lambda f: f
    triton_stub.Config = lambda *a, **k: None
    triton_stub.cdiv = lambda a, b: (a + b - 1) // b
    triton_stub.language = language_stub
    triton_stub.__version__ = "0.0.0+cpu-stub"
    sys.modules["triton"] = triton_stub
    sys.modules["triton.language"] = language_stub


def _patch_megatron_torch_globals() -> None:
    """Patch 2: swap the ``torch`` global of every loaded ``megatron.core`` module for the proxy."""
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = _TORCH_PROXY


def _make_cpu_rng_tracker_class(base):
    class CpuRNGStatesTracker(base):
        """Patch 3: named CPU generator states with ``CudaRNGStatesTracker``'s add/fork semantics."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            outer_state = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer_state)

    return CpuRNGStatesTracker


def _patch_rng_tracker() -> None:
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    if getattr(random.CudaRNGStatesTracker, "_nemo_rl_spec_cpu", False):
        return
    tracker_cls = _make_cpu_rng_tracker_class(random.CudaRNGStatesTracker)
    tracker_cls._nemo_rl_spec_cpu = True
    random.CudaRNGStatesTracker = tracker_cls
    random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    random.initialize_rng_tracker(force_reset=True)


def clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Patch 4: ``megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32`` for CPU fp32 grads.

    Scales every gradient in place by ``min(1, max_norm / (total_norm + 1e-6))``.
    """
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (float(total_norm) + 1.0e-6)
    if clip_coeff < 1.0:
        torch._foreach_mul_(grads, clip_coeff)


def _patch_grad_clip() -> None:
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        module = importlib.import_module(name)
        if hasattr(module, "clip_grad_by_total_norm_fp32"):
            module.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32_cpu


@contextlib.contextmanager
def cuda_tensor_type_names():
    """Patch 5 (module docstring): within the context ``cpu_tensor.type()`` returns ``'torch.cuda.<T>Tensor'``.
    A no-op context on CUDA."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.Tensor.type

    def type_as_cuda(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_as_cuda
    try:
        yield
    finally:
        torch.Tensor.type = original


def _patch_tied_embedding_setup() -> None:
    """Patch 6: ``LanguageModule.setup_embeddings_and_output_layer`` moves the tied embedding copy to ``.cuda()``
    before the first/last-stage all-reduce (pipeline parallelism); on CPU it stays put (``Tensor.cuda`` is the
    identity for the duration of that call only)."""
    module = importlib.import_module("megatron.core.models.common.language_module.language_module")
    setup = module.LanguageModule.setup_embeddings_and_output_layer
    if getattr(setup, "_nemo_rl_spec_cpu", False):
        return

    def setup_on_cpu(self, *args, **kwargs):
        original = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *a, **k: tensor
        try:
            return setup(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = original

    setup_on_cpu._nemo_rl_spec_cpu = True
    module.LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu


def apply_cpu_compat() -> bool:
    """Apply all CPU patches (module docstring). Idempotent; returns False (nothing done) on CUDA."""
    if torch.cuda.is_available():
        return False
    _install_triton_stub()
    for name in _MEGATRON_MODULES:
        importlib.import_module(name)
    _patch_rng_tracker()
    _patch_grad_clip()
    _patch_tied_embedding_setup()
    _patch_megatron_torch_globals()
    return True
