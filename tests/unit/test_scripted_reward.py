"""The scripted char_fraction reward (environments/char_fraction_env.py) against hand-worked values."""

from pathlib import Path

import pytest
import torch

from nemo_rl_spec.environments import build_environment
from nemo_rl_spec.environments.char_fraction_env import CharFractionEnvironment, char_fraction
from nemo_rl_spec.environments.math_env import MathEnvironment
from nemo_rl_spec.utils.config import load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_tiny.yaml"


def test_hand_worked_fractions():
    env = CharFractionEnvironment({"characters": "abc"})
    # "abcd": a,b,c in class -> 3/4; "xyz": 0/3; "": 0 by definition; "aA a": a,a of 4 chars -> 2/4
    rewards = env.step(["abcd", "xyz", "", "aA a"], [{}] * 4)
    assert rewards.dtype == torch.float32 and rewards.shape == (4,)
    assert rewards.tolist() == [0.75, 0.0, 0.0, 0.5]
    assert char_fraction("ccc", frozenset("c")) == 1.0


def test_deterministic_and_ignores_metadata():
    env = CharFractionEnvironment({"characters": "e"})
    a = env.step(["hello there", "eee!"], [{"answer": "1"}, {}])
    b = env.step(["hello there", "eee!"], [{}, {"answer": "2"}])
    assert a.tolist() == b.tolist() == pytest.approx([3 / 11, 3 / 4])


def test_errors():
    with pytest.raises(ValueError, match="must not be empty"):
        CharFractionEnvironment({"characters": ""})
    with pytest.raises(ValueError, match="2 responses but 1 metadata"):
        CharFractionEnvironment({"characters": "a"}).step(["a", "b"], [{}])


def test_recipe_key_selects_the_reward():
    assert isinstance(build_environment(load_config(TINY, []).env), MathEnvironment)  # default stays math
    cfg = load_config(TINY, ["env.reward=char_fraction", "env.char_fraction.characters=xy"])
    env = build_environment(cfg.env)
    assert isinstance(env, CharFractionEnvironment) and env.characters == frozenset("xy")
    with pytest.raises(Exception, match="reward"):
        load_config(TINY, ["env.reward=parity"])
