"""Quiet console (issue 16, item 5): vLLM's log level and the rotary refit warning, in a real vLLM process."""
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from nemo_rl_spec.models.generation.runtime_env import engine_env_vars
from nemo_rl_spec.utils.config_schema import VllmConfig
from nemo_rl_spec.utils.console import REFIT_LOGGER, configure_console, step_line

# What an engine actor does (its runtime_env, apply_engine_env, vLLM's own logging setup at engine start), then the
# messages vLLM's layerwise reload logs at a refit (same logger, same format) and lines through vLLM's loggers.
_PROBE = textwrap.dedent("""
    import os
    from nemo_rl_spec.models.generation.runtime_env import apply_engine_env, engine_env_vars
    from nemo_rl_spec.utils.config_schema import VllmConfig
    from nemo_rl_spec.utils.console import configure_console
    vcfg = VllmConfig(tensor_parallel_size=1, gpu_memory_utilization=0.5, max_model_len=64, kv_cache_space_gb=1,
                      num_threads=1, enforce_eager=True)
    configure_console(False)            # the driver
    runtime_env = engine_env_vars(vcfg, 0)
    os.environ.clear()
    os.environ.update({**ACTOR_BASE, **runtime_env})  # the actor: a fresh process with its runtime_env
    apply_engine_env(vcfg)
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging, init_logger
    from vllm.model_executor.model_loader.reload import layerwise
    configure_logging(LoggingConfig())
    layerwise.logger.warning("%s: Failed to load weights", "RotaryEmbedding")
    layerwise.logger.warning("%s: Failed to load weights", "Llama3RotaryEmbedding")
    layerwise.logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    init_logger("vllm.probe").info("an info line")
    init_logger("vllm.probe").warning("a warning line")
""")


@pytest.fixture(scope="module")
def quiet_engine_output():
    """Output of an engine process set up as a default (quiet) run sets it up."""
    clean = {k: v for k, v in os.environ.items() if k not in ("NEMO_RL_SPEC_VERBOSE", "VLLM_LOGGING_LEVEL")}
    code = f"ACTOR_BASE = {clean!r}\n" + _PROBE
    proc = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def test_quiet_engine_drops_rotary_warning_and_info_but_keeps_other_warnings(quiet_engine_output):
    out = quiet_engine_output
    assert "RotaryEmbedding: Failed to load weights" not in out
    assert "QKVParallelLinear: Failed to load weights" in out and "a warning line" in out
    assert "an info line" not in out


def test_verbose_removes_the_filter(monkeypatch):
    target = logging.getLogger(REFIT_LOGGER)
    record = logging.LogRecord(REFIT_LOGGER, logging.WARNING, __file__, 1, "%s: Failed to load weights",
                               ("RotaryEmbedding",), None)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    configure_console(False)
    assert not target.filter(record)
    configure_console(True)
    assert target.filter(record)
    configure_console(False)
    assert not target.filter(record) and len(target.filters) == 1


def test_driver_settings_reach_the_engine_runtime_env(monkeypatch):
    vcfg = VllmConfig(tensor_parallel_size=1, gpu_memory_utilization=0.5, max_model_len=64, kv_cache_space_gb=1,
                      num_threads=1, enforce_eager=True)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    configure_console(False)
    env = engine_env_vars(vcfg, engine_index=0)
    assert env["NEMO_RL_SPEC_VERBOSE"] == "0" and env["VLLM_LOGGING_LEVEL"] == "WARNING"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    configure_console(True)
    env = engine_env_vars(vcfg, engine_index=0)
    assert env["NEMO_RL_SPEC_VERBOSE"] == "1" and env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    monkeypatch.setenv("NEMO_RL_SPEC_VERBOSE", "0")
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")


def test_step_line():
    m = {"train/reward": 0.375, "validation/accuracy": 0.5, "timing/train/total_step_time": 14.24, "train/loss": 1.0}
    assert step_line(m, 2) == "step 2: reward 0.375 | val accuracy 0.500 | 14.2 s"
    assert step_line({"validation/accuracy": 0.25}, 0) == "step 0: val accuracy 0.250"
    assert step_line({"train/reward": float("nan"), "timing/train/total_step_time": 3.0}, 1) == "step 1: 3.0 s"
