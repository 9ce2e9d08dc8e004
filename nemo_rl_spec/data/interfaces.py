"""Data specs: one math problem. (Prompt order and resume state live in the rollout allocator's PromptStream.)"""

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
