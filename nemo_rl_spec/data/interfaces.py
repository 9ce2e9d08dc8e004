"""Data specs: one math problem, and the resumable state of the prompt dataloader."""
from __future__ import annotations

from typing import TypedDict


class MathProblem(TypedDict):
    """One problem. The math environment reads ``answer`` as the ground truth.

    Example::

        {"question": "Calculate 5 - 3 - 6.", "answer": "-4", "source": "basic_arithmetic"}

    question: the problem text shown to the model (without system prompt or chat template).
    answer: the ground-truth final answer as a string (a number for every built-in source).
    source: where it came from: a reasoning-gym generator name, or ``gsm8k_original``.
    """

    question: str
    answer: str
    source: str


class DataloaderState(TypedDict):
    """:meth:`PromptDataloader.state_dict` output (plain ints, safe for ``torch.save``/JSON).

    seed, num_problems, batch_size: identity checks on load.   epoch: current epoch (0-based).
    batch_in_epoch: index of the next batch to yield within that epoch's permutation.
    """

    seed: int
    num_problems: int
    batch_size: int
    epoch: int
    batch_in_epoch: int
