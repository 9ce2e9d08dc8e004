"""Math environment: answer extraction and math-verify rewards on real strings, off-main-thread use, workers."""

import signal
import threading

import pytest
import torch

from nemo_rl_spec.environments.interfaces import EnvironmentInterface
from nemo_rl_spec.environments.math_env import MathEnvironment, extract_final_answer

CASES = [
    # (response, ground truth, reward)
    ("Half of it: \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("So the probability is \\boxed{0.5}.", "\\frac{1}{2}", 1.0),
    ("In total \\boxed{1,000} apples.", "1000", 1.0),
    ("They sold 1,000 apples.", "1000", 1.0),  # no box: last number, thousands separator
    ("The answer is \\boxed{\\$18}", "18", 1.0),
    ("\\boxed{12}. Check: 12 - 2 = 10", "12", 1.0),  # a box wins over a later number
    ("First \\boxed{3}, no wait: \\boxed{4}", "4", 1.0),  # the last box wins
    ("First \\boxed{3}, no wait: \\boxed{4}", "3", 0.0),
    ("Calculate: -1515 / 5 = \\boxed{-303}", "-303", 1.0),
    ("\\boxed{303}", "-303", 0.0),
    ("The answer is \\boxed{7}", "8", 0.0),
    ("The answer is \\boxed{3.01}", "3", 0.0),
    ("I am not sure how to solve this.", "42", 0.0),
    ("", "42", 0.0),
]


@pytest.fixture(scope="module")
def env():
    with MathEnvironment({"num_workers": 1}) as e:
        yield e


def test_is_an_environment(env):
    assert isinstance(env, EnvironmentInterface)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
        ("\\boxed{3} then \\boxed{ 1,000 }", "1,000"),
        ("\\boxed{7.}", "7"),
        ("\\boxed{5} and then the output was cut: \\boxed{3", "5"),
        ("it's 5-3 = 2", "2"),
        ("x = -12.5 done", "-12.5"),
        ("cost 1,234,567.89 in total", "1,234,567.89"),
        ("no answer here", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_rewards_on_real_strings(env):
    responses = [c[0] for c in CASES]
    rewards = env.step(responses, [{"answer": c[1]} for c in CASES])
    assert rewards.dtype == torch.float32 and rewards.shape == (len(CASES),)
    assert rewards.tolist() == [c[2] for c in CASES]


def test_numeric_ground_truth_and_extra_metadata_keys(env):
    rewards = env.step(["\\boxed{28080}", "\\boxed{28081}"], [{"answer": 28080, "question": "q"}, {"answer": 28080}])
    assert rewards.tolist() == [1.0, 0.0]


def test_off_main_thread_does_not_crash_and_still_verifies(env):
    # math-verify's signal.alarm timeout raises off the main thread; a silent failure would give all zeros.
    result = {}

    def worker():
        result["rewards"] = env.step([c[0] for c in CASES], [{"answer": c[1]} for c in CASES])

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert result["rewards"].tolist() == [c[2] for c in CASES]


def test_callers_alarm_timer_survives_scoring(env):
    # math-verify's signal.alarm(0) would silently cancel a timer armed by the caller (e.g. pytest-timeout)
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        signal.setitimer(signal.ITIMER_REAL, 300.0)
        env.step(["\\boxed{1}"], [{"answer": "1"}])
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 200.0 < remaining <= 300.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_worker_processes_match_inline():
    with MathEnvironment({"num_workers": 2}) as pooled:
        rewards = pooled.step([c[0] for c in CASES], [{"answer": c[1]} for c in CASES])
    assert rewards.tolist() == [c[2] for c in CASES]


def test_errors(env):
    with pytest.raises(ValueError, match="metadata"):
        env.step(["a", "b"], [{"answer": "1"}])
    with pytest.raises(KeyError, match="answer"):
        env.step(["\\boxed{1}"], [{"ground_truth": "1"}])
    with pytest.raises(ValueError, match="num_workers"):
        MathEnvironment({"num_workers": 0})
