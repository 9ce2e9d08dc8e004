"""Scripted, learnable reward for tests on random models: the fraction of a response's characters in a class.

Reward of a response r (a string of n characters) for the character class C (``env.char_fraction.characters``)::

    reward(r) = |{i : r[i] in C}| / n      if n > 0
    reward(r) = 0.0                        if n == 0

It is deterministic, lies in [0, 1], and is smooth in the policy's token distribution (the expected reward rises
as probability moves to tokens with more characters in C), so a policy can learn it. On a random model the
responses of one prompt differ, so their fractions differ too: every group gets a reward spread and non-zero
advantages, which the math reward (always 0 on a random model) never gives. The ground truth is not used.
Selected by ``env.reward: char_fraction`` (default ``math``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from nemo_rl_spec.environments.interfaces import EnvironmentInterface
from nemo_rl_spec.utils.config_schema import CharFractionEnvConfig

if TYPE_CHECKING:
    import torch


def char_fraction(response: str, characters: frozenset[str]) -> float:
    """Fraction of ``response``'s characters that are in ``characters`` (0.0 for an empty response)."""
    if not response:
        return 0.0
    return sum(c in characters for c in response) / len(response)


class CharFractionEnvironment(EnvironmentInterface):
    """Reward = fraction of response characters in a class (formula in the module docstring).

    Args:
        cfg: the ``env.char_fraction`` config section (:class:`~nemo_rl_spec.utils.config_schema.CharFractionEnvConfig`,
            or a mapping validated into one): ``characters`` (non-empty str; the class C, each character a member).

    Raises:
        ValueError: ``characters`` is empty.
    """

    def __init__(self, cfg: CharFractionEnvConfig | Mapping[str, Any]):
        if not isinstance(cfg, CharFractionEnvConfig):
            if not cfg["characters"]:
                raise ValueError("env.char_fraction.characters must not be empty")
            cfg = CharFractionEnvConfig.model_validate(dict(cfg))
        self.characters = frozenset(cfg.characters)

    def step(self, responses: list[str], metadata: list[dict]) -> torch.Tensor:
        """Rewards in [0, 1]. Shape: N responses (N metadata dicts, unused) -> [N] float32.

        Raises:
            ValueError: len(responses) != len(metadata).
        """
        import torch  # lazy: this module imports without torch

        if len(responses) != len(metadata):
            raise ValueError(f"{len(responses)} responses but {len(metadata)} metadata dicts")
        return torch.tensor([char_fraction(r, self.characters) for r in responses], dtype=torch.float32)
