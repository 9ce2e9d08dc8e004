"""Wall-clock timers for step phases, reported as NeMo-RL's ``timing/train/<phase>`` metrics (seconds)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


class Timer:
    """Accumulates wall-clock seconds per named phase within one step.

    Example::

        timer = Timer()
        with timer.time("generation"):
            ...
        timer.metrics("timing/train/")  # {"timing/train/generation": 1.23}
    """

    def __init__(self) -> None:
        self._elapsed: dict[str, float] = {}

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        """Add the seconds spent inside the ``with`` block to phase ``name``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._elapsed[name] = self._elapsed.get(name, 0.0) + time.perf_counter() - start

    def metrics(self, prefix: str) -> dict[str, float]:
        """Phase durations in seconds, keys prefixed by ``prefix``."""
        return {f"{prefix}{k}": v for k, v in self._elapsed.items()}

    def reset(self) -> None:
        """Forget all phases (start of a new step)."""
        self._elapsed.clear()
