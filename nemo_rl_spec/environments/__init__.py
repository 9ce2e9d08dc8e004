"""Reward environments: math-verify correctness (math_env) and the scripted char_fraction reward (char_fraction_env)."""

from __future__ import annotations

from nemo_rl_spec.environments.char_fraction_env import CharFractionEnvironment
from nemo_rl_spec.environments.interfaces import EnvironmentInterface
from nemo_rl_spec.environments.math_env import MathEnvironment


def build_environment(env_cfg) -> EnvironmentInterface:
    """The reward environment the recipe's ``env`` section selects (``env.reward``: ``math`` | ``char_fraction``).

    Args:
        env_cfg: the validated ``env`` section (config_schema.EnvConfig).
    """
    if env_cfg.reward == "char_fraction":
        return CharFractionEnvironment(env_cfg.char_fraction)
    return MathEnvironment(env_cfg.math)
