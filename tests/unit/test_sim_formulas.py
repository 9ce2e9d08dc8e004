"""Speculative-decoding and Amdahl formulas against published and hand-computed values."""

import pytest

from nemo_rl_spec.sim.formulas import (
    alpha_for_acceptance_length,
    amdahl_speedup,
    expected_tokens_per_pass,
    phase_amdahl_speedup,
    speculative_speedup,
    tokens_per_pass_per_position,
)


def test_published_case_alpha_08_k3_c005():
    assert expected_tokens_per_pass(0.8, 3) == pytest.approx(2.952, abs=1e-12)  # 1 + .8 + .64 + .512
    assert speculative_speedup(0.8, 3, 0.05) == pytest.approx(2.952 / 1.15, abs=1e-12)
    assert round(speculative_speedup(0.8, 3, 0.05), 3) == 2.567


def test_published_case_alpha_06_k2_c01():
    assert expected_tokens_per_pass(0.6, 2) == pytest.approx(1.96, abs=1e-12)  # 1 + .6 + .36
    assert speculative_speedup(0.6, 2, 0.1) == pytest.approx(1.96 / 1.2, abs=1e-12)
    assert round(speculative_speedup(0.6, 2, 0.1), 4) == 1.6333


@pytest.mark.parametrize("k,c", [(1, 0.05), (3, 0.05), (3, 0.1), (7, 0.2)])
def test_zero_acceptance_is_pure_overhead(k, c):
    assert expected_tokens_per_pass(0.0, k) == 1.0
    assert speculative_speedup(0.0, k, c) == pytest.approx(1.0 / (k * c + 1.0), abs=1e-15)


def test_full_acceptance_emits_k_plus_one():
    assert expected_tokens_per_pass(1.0, 5) == 6.0


def test_per_position_reduces_to_constant_and_hand_case():
    assert tokens_per_pass_per_position([0.8] * 3) == pytest.approx(2.952, abs=1e-12)
    assert tokens_per_pass_per_position([0.9, 0.5, 0.2]) == pytest.approx(1 + 0.9 + 0.45 + 0.09, abs=1e-12)


def test_alpha_inversion():
    assert alpha_for_acceptance_length(2.952, 3) == pytest.approx(0.8, abs=1e-9)
    assert alpha_for_acceptance_length(1.0, 3) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError):
        alpha_for_acceptance_length(4.5, 3)


def test_amdahl_from_phase_fractions():
    # RL-Zero: generation is 100 of 151.2 s; a 1.77x faster generation -> 151.2 / (51.2 + 100 / 1.77).
    assert amdahl_speedup(100 / 151.2, 1.77) == pytest.approx(1.403936, abs=1e-6)
    assert phase_amdahl_speedup({"gen": 100.0, "rest": 51.2}, {"gen": 1.77}) == pytest.approx(
        amdahl_speedup(100 / 151.2, 1.77), abs=1e-12
    )
    assert amdahl_speedup(0.0, 5.0) == 1.0 and amdahl_speedup(1.0, 5.0) == pytest.approx(5.0)


def test_formula_errors():
    with pytest.raises(ValueError):
        expected_tokens_per_pass(1.2, 3)
    with pytest.raises(ValueError):
        speculative_speedup(0.5, 3, -0.1)
    with pytest.raises(KeyError):
        phase_amdahl_speedup({"gen": 1.0}, {"train": 2.0})
