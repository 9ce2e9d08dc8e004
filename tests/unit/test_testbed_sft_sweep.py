"""examples/testbed_sft_sweep.py: override parsing and the per-mode scores, by hand."""

from __future__ import annotations

import pytest

from nemo_rl_spec.bench import testbed_sft_sweep

sweep = testbed_sft_sweep


def test_overrides_parse_json_values_and_model_keys():
    from nemo_rl_spec.models.testbed import TESTBED

    got = sweep.parse_overrides(
        ["lr=2e-3", "sft_steps=300", "generator=chain_sum:min_terms=2", "model.hidden_size=128"]
    )
    assert got["lr"] == 2e-3 and got["sft_steps"] == 300 and got["generator"] == "chain_sum:min_terms=2"
    assert got["model"] == {**TESTBED.model, "hidden_size": 128}


@pytest.mark.parametrize("bad", ["lr", "nope=1", "lr.x=1", "__doc__=1"])
def test_bad_overrides_exit_naming_the_field(bad):
    with pytest.raises(SystemExit, match="expected field=value" if "=" not in bad else "no field"):
        sweep.parse_overrides([bad])


def test_scores_by_hand():
    # 2 problems x 2 answers: problem 0 (answer 3): a right chain and a wrong direct answer;
    # problem 1 (answer -4): a right direct answer and a right chain
    texts = ["1 + 2 = 3\n\\boxed{3}", "\\boxed{5}", "\\boxed{-4}", "4 - 8 = -4\n\\boxed{-4}"]
    got = sweep.score(texts, ["3", "-4"], 2)
    assert got == {"accuracy": 0.75, "p_direct": 0.5, "chain_accuracy": 1.0, "direct_accuracy": 0.5, "share_mixed": 0.5}


def test_eval_steps_cover_both_stages_and_refuse_the_rest():
    from nemo_rl_spec.models.testbed import TESTBED

    last = TESTBED.sft_steps + TESTBED.direct_steps
    assert sweep.eval_steps(f"1,200,{last}", TESTBED) == {1, 200, last}
    with pytest.raises(SystemExit, match=rf"\[{last + 1}\] outside the recipe's SFT steps 1..{last}"):
        sweep.eval_steps(f"200,{last + 1}", TESTBED)
    with pytest.raises(SystemExit, match="comma-separated"):
        sweep.eval_steps("200 350", TESTBED)
