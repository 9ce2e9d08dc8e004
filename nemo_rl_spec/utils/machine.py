"""The machine a benchmark ran on, recorded in every benchmark JSON under a top-level ``"machine"`` key.

Machines of the same kind come with either an AMD EPYC (AVX512-BF16, no AMX) or an Intel Xeon (AMX) CPU, and the
same benchmark takes a different kernel path on each (oneDNN runs bf16 matmuls on AMX tiles where it has them), so a
number is only comparable with numbers from the same CPU. :func:`machine_info` says which one; :func:`write_bench_json`
is the one writer of the benchmarks' result JSONs (``nemo_rl_spec/bench``, ``examples/bench_*.py``) and adds it;
:func:`sources_machine` is the ``"machine"`` of a JSON derived from other benchmark JSONs (tables over seeds,
merges), which ran where their sources ran.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nemo_rl_spec.utils.precision import CPUINFO, cpuinfo_value, read_cpuinfo

#: The CPU flags (``/proc/cpuinfo`` names) that pick the CPU kernels: AMX tiles and their bf16 ops (Intel Xeon
#: Sapphire Rapids and later), AVX512-BF16 (e.g. AMD EPYC Zen 4), AVX-512 and AVX2.
ISA_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2")
#: Environment variables that cap the kernels below what the CPU has: ATen's dispatch level and oneDNN's ISA
#: (``DNNL_MAX_CPU_ISA`` is oneDNN's older name for the same setting).
CPU_ENV_OVERRIDES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
#: Keys of :func:`machine_info` that describe the moment rather than the machine (left out when comparing).
VOLATILE_KEYS = ("loadavg",)


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name: the first ``model name`` line of ``/proc/cpuinfo`` (e.g. ``"AMD EPYC 9R14 96-Core
    Processor"``); without one (not Linux, or an Arm CPU that lists none) ``platform.processor()``, else
    ``platform.machine()``, else ``"unknown"``."""
    name = cpuinfo_value(read_cpuinfo(cpuinfo) or "", "model name")
    return name or platform.processor() or platform.machine() or "unknown"


def isa_flags(cpuinfo: Path = CPUINFO) -> list[str] | None:
    """The :data:`ISA_FLAGS` the first processor of ``/proc/cpuinfo`` lists, in that order; None when the file has
    no ``flags`` line (not Linux, not x86): unknown rather than absent."""
    flags = cpuinfo_value(read_cpuinfo(cpuinfo) or "", "flags")
    if flags is None:
        return None
    present = set(flags.split())
    return [f for f in ISA_FLAGS if f in present]


@functools.cache
def _nvidia_smi_gpu_name() -> str | None:
    """Name of the first GPU this process sees, from ``nvidia-smi`` (the first ``CUDA_VISIBLE_DEVICES`` entry when
    set); None without ``nvidia-smi`` or when it fails. Asks the driver without creating a CUDA context here."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    cmd = [exe, "--query-gpu=name", "--format=csv,noheader", *(["-i", visible] if visible else [])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in out.splitlines() if line.strip()]
    return names[0] if names else None


def _torch_info() -> dict[str, Any]:
    """The torch half of :func:`machine_info` (None / False throughout when torch is not installed)."""
    try:
        import torch  # lazy: utils stays importable without torch, and bench parents only pay for it when writing
    except ImportError:
        return {
            "torch_version": None,
            "torch_cpu_capability": None,
            "cuda_available": False,
            "cuda_initialized": False,
            "cuda_device": None,
        }
    if torch.cuda.is_initialized():  # this process has used CUDA: asking torch costs nothing more
        available, device = True, torch.cuda.get_device_name(torch.cuda.current_device())
    else:
        # torch.cuda.is_available() through NVML (as with PYTORCH_NVML_BASED_CUDA_CHECK=1): the default check calls
        # cuInit, after which a forked worker cannot use CUDA, and get_device_name would create a CUDA context
        available = torch.cuda.device_count() > 0
        device = _nvidia_smi_gpu_name() if available else None
    return {
        "torch_version": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda_available": available,
        "cuda_initialized": torch.cuda.is_initialized(),
        "cuda_device": device,
    }


def machine_info() -> dict[str, Any]:
    """This machine, as a JSON-ready dict (what benchmark JSONs record under ``"machine"``).

    Keys:
        cpu_model: :func:`cpu_model`, the ``model name`` of ``/proc/cpuinfo`` (str).
        isa_flags: :func:`isa_flags`, which of :data:`ISA_FLAGS` the CPU has (``amx_bf16``/``amx_tile``: Intel AMX,
            ``avx512_bf16``, ``avx512f``, ``avx2``; list of str, None when ``/proc/cpuinfo`` lists no flags).
        logical_cpus: logical CPUs of the machine, ``os.cpu_count()`` (int, None if unknown).
        nproc: logical CPUs this process may run on (its affinity mask, what ``nproc`` prints; int).
        loadavg: the 1, 5 and 15 minute load averages when the JSON was written (list of 3 floats; a shared machine
            under load gives slower times).
        torch_version: ``torch.__version__`` (str; None without torch).
        torch_cpu_capability: ``torch.backends.cpu.get_cpu_capability()``, the CPU kernel set ATen dispatches to
            (``"AVX512"``, ``"AVX2"``, ``"DEFAULT"``, ...; AMX is used through oneDNN, not named here; None without
            torch).
        cuda_available: a CUDA GPU is visible to torch (bool; counted through NVML, see below).
        cuda_initialized: this process has used CUDA (``torch.cuda.is_initialized()``; a benchmark whose runs are
            subprocesses has False here even when they ran on the GPU; bool).
        cuda_device: the visible GPU's name (e.g. ``"NVIDIA H100 80GB HBM3"``): from torch when this process has
            used CUDA, else from ``nvidia-smi``; None without a GPU (str).
        cpu_env: the :data:`CPU_ENV_OVERRIDES` that are set (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
            ``DNNL_MAX_CPU_ISA``) with their values; empty when none is (dict of str).

    Never initialises CUDA in the calling process: a benchmark parent that forks workers afterwards, or leaves the
    GPU to its subprocesses, stays as it was.
    """
    return {
        "cpu_model": cpu_model(),
        "isa_flags": isa_flags(),
        "logical_cpus": os.cpu_count(),
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        **_torch_info(),
        "cpu_env": {name: os.environ[name] for name in CPU_ENV_OVERRIDES if name in os.environ},
    }


def same_machine(a: dict | None, b: dict | None) -> bool:
    """Whether two recorded machines are the same (every key but :data:`VOLATILE_KEYS`); False when either is
    None (not recorded)."""
    if a is None or b is None:
        return False
    strip = lambda m: {k: v for k, v in m.items() if k not in VOLATILE_KEYS}  # noqa: E731
    return strip(a) == strip(b)


def sources_machine(docs: Iterable[dict]) -> dict[str, Any]:
    """The ``"machine"`` of a JSON derived from the benchmark JSONs ``docs``: their common machine when every one
    records the same (:func:`same_machine`), else ``{"sources": [each doc's "machine", None where it records
    none]}`` (older files, or runs on different machines)."""
    machines = [d.get("machine") for d in docs]
    if machines and all(same_machine(machines[0], m) for m in machines[1:]) and machines[0] is not None:
        return machines[0]
    return {"sources": machines}


def with_machine(result: dict, machine: dict | None = None) -> dict:
    """A copy of ``result`` with ``"machine"``: ``machine`` when given, else :func:`machine_info` (this machine).
    An existing ``"machine"`` is replaced (in its place); ``result`` itself is not changed."""
    return {**result, "machine": machine_info() if machine is None else machine}


def write_bench_json(
    path: str | Path, result: dict, *, machine: dict | None = None, indent: int = 1, default: Any = None
) -> Path:
    """Write a benchmark's ``result`` to ``path`` as JSON (``json.dumps(..., indent, default)`` and a newline) with
    ``"machine"`` at the top level (:func:`with_machine`); returns the path. The parent directory must exist.

    ``"machine"`` is the machine that wrote the file; runs a benchmark reads back from an earlier invocation
    (``--reuse``, ``--analyse-only``) ran where that one ran."""
    path = Path(path)
    path.write_text(json.dumps(with_machine(result, machine), indent=indent, default=default) + "\n")
    return path
