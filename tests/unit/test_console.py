"""Quiet console: vLLM's log level and the rotary refit warning, in a real vLLM process."""

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from nemo_rl_spec.models.generation.runtime_env import engine_env_vars
from nemo_rl_spec.utils.config_schema import VllmConfig
from nemo_rl_spec.utils.console import REFIT_LOGGER, configure_console, step_line

VCFG = VllmConfig(
    tensor_parallel_size=1,
    gpu_memory_utilization=0.5,
    max_model_len=64,
    kv_cache_space_gb=1,
    num_threads=1,
    enforce_eager=True,
)

# What an engine actor does once started with its runtime_env: apply_engine_env, vLLM's own logging setup at engine
# start, then messages vLLM logs at engine start and at a refit (same loggers, same formats), lines through vLLM's
# loggers and one of megatron-core's import-time warnings.
_PROBE = textwrap.dedent("""
    import warnings
    from nemo_rl_spec.models.generation.runtime_env import apply_engine_env
    from nemo_rl_spec.utils.config_schema import VllmConfig
    apply_engine_env(VllmConfig(tensor_parallel_size=1, gpu_memory_utilization=0.5, max_model_len=64,
                                kv_cache_space_gb=1, num_threads=1, enforce_eager=True))
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging, init_logger
    from vllm.model_executor.model_loader.reload import layerwise
    configure_logging(LoggingConfig())
    layerwise.logger.warning("%s: Failed to load weights", "RotaryEmbedding")
    layerwise.logger.warning("%s: Failed to load weights", "Llama3RotaryEmbedding")
    layerwise.logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    init_logger("vllm.engine.arg_utils").warning("The global random seed is set to %d. Since ...", 42)
    worker = init_logger("vllm.v1.worker.cpu_worker")
    worker.warning("%s is not found in LD_PRELOAD. For best performance ...", "libtcmalloc")
    worker.warning("%s is not found in LD_PRELOAD. For best performance ...", "libiomp")
    init_logger("vllm.probe").info("an info line")
    init_logger("vllm.probe").warning("a warning line")
    warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning)
    warnings.warn("Transformer Engine is slow here", UserWarning)
""")


@pytest.fixture(scope="module")
def quiet_engine_output():
    """Output of an engine process started with the runtime_env a default (quiet) CPU run gives it."""
    keys = ("NEMO_RL_SPEC_VERBOSE", "VLLM_LOGGING_LEVEL", "PYTHONWARNINGS", "NEMO_RL_SPEC_IGNORED_WARNINGS")
    saved = {k: os.environ.pop(k) for k in keys if k in os.environ}
    try:
        configure_console(False, cpu=True)  # the driver
        runtime_env = engine_env_vars(VCFG, engine_index=0)
    finally:
        for k in keys:
            os.environ.pop(k, None)
        os.environ.update(saved)
    clean = {k: v for k, v in os.environ.items() if k not in keys}
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], env={**clean, **runtime_env}, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_quiet_engine_drops_harmless_warnings_and_info_but_keeps_other_warnings(quiet_engine_output):
    out = quiet_engine_output
    assert "RotaryEmbedding: Failed to load weights" not in out
    assert "QKVParallelLinear: Failed to load weights" in out and "a warning line" in out
    assert "global random seed" not in out and "libtcmalloc is not found" not in out
    assert "libiomp is not found" in out
    assert "Apex are not installed" not in out and "Transformer Engine is slow here" in out
    assert "an info line" not in out


def test_verbose_removes_the_filter(monkeypatch):
    target = logging.getLogger(REFIT_LOGGER)
    record = logging.LogRecord(
        REFIT_LOGGER, logging.WARNING, __file__, 1, "%s: Failed to load weights", ("RotaryEmbedding",), None
    )
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    configure_console(False)
    assert not target.filter(record)
    configure_console(True)
    assert target.filter(record)
    configure_console(False)
    assert not target.filter(record) and len(target.filters) == 1


def test_driver_settings_reach_the_engine_runtime_env(monkeypatch):
    vcfg = VCFG
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    configure_console(False)
    env = engine_env_vars(vcfg, engine_index=0)
    assert env["NEMO_RL_SPEC_VERBOSE"] == "0" and env["VLLM_LOGGING_LEVEL"] == "WARNING"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    configure_console(True)
    env = engine_env_vars(vcfg, engine_index=0)
    assert env["NEMO_RL_SPEC_VERBOSE"] == "1" and env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert "PYTHONWARNINGS" not in env
    monkeypatch.setenv("NEMO_RL_SPEC_VERBOSE", "0")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    monkeypatch.setenv("PYTHONWARNINGS", "default")
    configure_console(False, cpu=True)
    assert engine_env_vars(vcfg)["PYTHONWARNINGS"].startswith("default,ignore:Transformer Engine and Apex")
    monkeypatch.delenv("NEMO_RL_SPEC_IGNORED_WARNINGS")


def test_step_line():
    m = {"train/reward": 0.375, "validation/accuracy": 0.5, "timing/train/total_step_time": 14.24, "train/loss": 1.0}
    assert step_line(m, 2) == "step 2: reward 0.375 | val accuracy 0.500 | 14.2 s"
    assert step_line({"validation/accuracy": 0.25}, 0) == "step 0: val accuracy 0.250"
    assert step_line({"mtp_warm_start/ce_after": 2.5, "mtp_warm_start/ce_before": 7.0}, 0) == (
        "step 0: MTP warm-start CE 2.500"
    )
    assert step_line({"train/reward": float("nan"), "timing/train/total_step_time": 3.0}, 1) == "step 1: 3.0 s"
