"""Continuous batching in pass space, checked against hand-built schedules."""

import numpy as np

from nemo_rl_spec.sim.batching import active_batch_and_context, admission_passes, passes_needed


def test_passes_needed():
    np.testing.assert_array_equal(passes_needed(np.array([5, 1, 7, 10]), 2.5), [2, 1, 3, 4])
    np.testing.assert_array_equal(passes_needed(np.array([3]), 1.0), [3])


def test_fcfs_admission_with_two_slots():
    # ends 3 and 1; the third starts at 1 (ends 3); the fourth at 3 (ends 7)
    np.testing.assert_array_equal(admission_passes(np.array([3, 1, 2, 4]), 2), [0, 0, 1, 3])
    np.testing.assert_array_equal(admission_passes(np.array([3, 1, 2]), 8), [0, 0, 0])


def test_active_batch_and_context_by_hand():
    passes, starts, prompts = np.array([3, 1, 2, 4]), np.array([0, 0, 1, 3]), np.array([10, 20, 30, 40])
    b, c = active_batch_and_context(passes, starts, prompts, 1.0)
    np.testing.assert_array_equal(b, [2, 2, 2, 1, 1, 1, 1])
    # pass 0: 10 + 20; pass 1: 11 + 30; pass 2: 12 + 31; passes 3-6: 40..43
    np.testing.assert_allclose(c, [30, 41, 43, 40, 41, 42, 43])
    _, c2 = active_batch_and_context(passes, starts, prompts, 2.0)
    np.testing.assert_allclose(c2, [30, 42, 46, 40, 42, 44, 46])
