"""Environment interface: score a batch of responses (NeMo-RL's EnvironmentInterface, single-turn)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is not imported at run time, so math-verify worker processes start fast
    import torch


class EnvironmentInterface(ABC):
    """A reward function over decoded responses. Stateless between calls except for worker resources."""

    @abstractmethod
    def step(self, responses: list[str], metadata: list[dict]) -> torch.Tensor:
        """Score each response.

        Shape: N responses, N metadata dicts (aligned) -> rewards [N] float32.

        Args:
            responses: decoded response texts (the prompt excluded).
            metadata: per-response dicts; what keys are required is defined by the environment.

        Raises:
            ValueError: the two lists have different lengths.
        """

    def close(self) -> None:  # noqa: B027 (an optional hook: a no-op unless overridden)
        """Release worker processes or other resources (no-op by default). Safe to call twice."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
