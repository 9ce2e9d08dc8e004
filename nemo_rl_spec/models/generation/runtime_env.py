"""Process environment of a vLLM generation actor (no vLLM import: the driver calls this).

vLLM's in-process CPU engine reads most of its settings from environment variables, and the OpenMP
runtime must be chosen before the process starts (``LD_PRELOAD``), so a Ray actor gets them through its
``runtime_env`` and :class:`~nemo_rl_spec.models.generation.vllm_worker.VllmGenerationWorker` applies
the in-process ones again (:func:`apply_engine_env`) for callers that construct it without Ray.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nemo_rl_spec.utils.config_schema import GenerationConfig, VllmConfig
from nemo_rl_spec.utils.console import quiet_harmless_warnings, worker_log_env

GiB = 1 << 30
VLLM_PORT_BASE, VLLM_PORT_BAND = 7000, 100  # engine e scans for its ports from 7000 + 100 * e


def iomp_library() -> str | None:
    """Intel OpenMP runtime shipped in the venv (``<prefix>/lib/libiomp5.so``), or None."""
    path = Path(sys.prefix) / "lib" / "libiomp5.so"
    return str(path) if path.is_file() else None


def tcmalloc_library() -> str | None:
    """tcmalloc bundled with the vLLM CPU wheel (``vllm/libs/libtcmalloc*.so*``), or None."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    libs = Path(list(spec.submodule_search_locations)[0]) / "libs"
    for pattern in ("libtcmalloc_minimal*.so*", "libtcmalloc.so*"):
        found = sorted(glob.glob(str(libs / pattern)))
        if found:
            return found[0]
    return None


def _ld_preload(existing: str, libs: list[str]) -> str:
    """Append ``libs`` to an ``LD_PRELOAD`` value, skipping ones already there. When Intel OpenMP is
    added, GNU/LLVM OpenMP entries are dropped (vLLM itself writes torch's libgomp into
    ``os.environ["LD_PRELOAD"]`` of any process that imported it; two OpenMP runtimes must not mix)."""
    entries = [e for e in existing.split(":") if e]
    if any(Path(lib).name.startswith("libiomp") for lib in libs):
        entries = [e for e in entries if not Path(e).name.startswith(("libgomp", "libomp"))]
    for lib in libs:
        stem = Path(lib).name.split(".")[0]  # libiomp5 / libtcmalloc_minimal
        if not any(Path(e).name.startswith(stem) for e in entries):
            entries.append(lib)
    return ":".join(entries)


def kv_cache_bytes(vllm_cfg: VllmConfig) -> int:
    """KV-cache size of the engine in bytes, from ``policy.generation.vllm_cfg.kv_cache_space_gb`` (GiB)."""
    return int(float(vllm_cfg.kv_cache_space_gb) * GiB)


def engine_port_base(engine_index: int) -> int:
    """First port of engine ``engine_index``'s ``VLLM_PORT`` band (NeMo-RL's ``7000 + 100 * index``): several engines
    on one machine otherwise race for the same free port (vllm#39015); vLLM scans upward from it.

    Raises:
        ValueError: a negative index, or one whose band would pass port 65535.
    """
    port = VLLM_PORT_BASE + VLLM_PORT_BAND * int(engine_index)
    if engine_index < 0 or port + VLLM_PORT_BAND > 65535:
        raise ValueError(f"engine index {engine_index} has no VLLM_PORT band below 65536")
    return port


def engine_env_vars(vllm_cfg: VllmConfig, engine_index: int | None = None) -> dict[str, str]:
    """Variables the engine reads in-process (safe to set after the process started).

    Args:
        vllm_cfg: ``policy.generation.vllm_cfg`` (reads ``num_threads``: threads per TP rank, ``kv_cache_space_gb``,
            ``tensor_parallel_size``).
        engine_index: the engine's index in its :class:`~nemo_rl_spec.models.generation.vllm_generation.
            VllmGeneration`; sets its own ``VLLM_PORT`` band (:func:`engine_port_base`). None: no ``VLLM_PORT``.

    With ``tensor_parallel_size > 1`` the engine spawns one process per TP rank (vLLM's ``mp`` executor): they run
    unbound (``VLLM_CPU_OMP_THREADS_BIND=nobind``; vLLM's ``auto`` binding needs one NUMA node per rank) with
    ``num_threads`` OpenMP threads each, and ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` lets the drafter refit send its
    callable to them.
    """
    threads = str(int(vllm_cfg.num_threads))
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine: refit reaches the model directly
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # Intel OpenMP spins 200 ms after each parallel region by default, burning cores that other
        # actors on this machine need; vLLM's own multi-process CPU workers use 5 ms as well.
        "KMP_BLOCKTIME": "5",
    }
    gb = float(vllm_cfg.kv_cache_space_gb)
    if gb == int(gb) and gb > 0:  # vLLM's variable takes whole GiB; fractions go through kwargs only
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(gb))
    if engine_index is not None:
        env["VLLM_PORT"] = str(engine_port_base(engine_index))
    if vllm_cfg.tensor_parallel_size > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    env.update(worker_log_env())  # logger.verbose and VLLM_LOGGING_LEVEL reach the actor (utils/console.py)
    return env


def vllm_runtime_env(
    vllm_cfg: VllmConfig, engine_index: int | None = None, preload_tcmalloc: bool = False
) -> dict[str, Any]:
    """Ray ``runtime_env`` for a generation actor.

    Args:
        vllm_cfg: ``policy.generation.vllm_cfg`` (see :func:`engine_env_vars`).
        engine_index: the engine's index (its ``VLLM_PORT`` band); None: no ``VLLM_PORT``.
        preload_tcmalloc: also preload vLLM's bundled tcmalloc (off by default; not measured here).

    Returns:
        ``{"env_vars": {...}}`` with ``LD_PRELOAD`` of the venv's ``libiomp5.so`` when present (it must
        be loaded at process start; measured on 2 busy cores, SmolLM2 batch 8, 2 threads: 32-59 tok/s
        with it, 5-7 tok/s with torch's libgomp; equal at 1 thread), thread counts,
        ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_PORT`` and ``HF_HUB_OFFLINE=1``.
    """
    env = engine_env_vars(vllm_cfg, engine_index)
    libs = [lib for lib in (iomp_library(), tcmalloc_library() if preload_tcmalloc else None) if lib]
    preload = _ld_preload(os.environ.get("LD_PRELOAD", ""), libs)
    if preload:
        env["LD_PRELOAD"] = preload
    return {"env_vars": env}


def apply_engine_env(vllm_cfg: VllmConfig) -> None:
    """Set the in-process engine variables in ``os.environ`` (before the engine is created).

    ``VLLM_ENABLE_V1_MULTIPROCESSING`` is forced to 0; the others keep a value the caller already set (a Ray
    actor's ``runtime_env``: its ``VLLM_PORT`` band), except ``VLLM_CPU_KVCACHE_SPACE``, which must agree with the
    config (vLLM lets it override kwargs). Also installs the quiet-console log filter of this process
    (:func:`~nemo_rl_spec.utils.console.quiet_harmless_warnings`).
    """
    env = engine_env_vars(vllm_cfg)
    for key, value in env.items():
        if key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE"):
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)
    if "VLLM_CPU_KVCACHE_SPACE" not in env:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    quiet_harmless_warnings()


def as_generation_config(generation_cfg: GenerationConfig | Mapping[str, Any]) -> GenerationConfig:
    """The typed ``policy.generation`` section; a plain mapping (scripts that load YAML themselves) is validated
    into one, so its defaults come from the schema only.

    Raises:
        pydantic.ValidationError: the mapping is not a valid ``policy.generation`` section (names the key).
    """
    if isinstance(generation_cfg, GenerationConfig):
        return generation_cfg
    return GenerationConfig.model_validate(dict(generation_cfg))


def loaded_libraries() -> set[str]:
    """File names of the shared libraries mapped into this process (Linux), e.g. ``libiomp5.so``."""
    try:
        with open("/proc/self/maps") as maps:
            return {Path(line.split()[-1]).name for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return set()
