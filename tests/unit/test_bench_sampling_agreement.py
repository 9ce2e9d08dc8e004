"""bench/sampling_agreement: the per-run summary (hand-worked values), the option list and the table."""

import pytest

from nemo_rl_spec.bench import sampling_agreement as sa
from nemo_rl_spec.utils.config import load_config


def test_summary_means_over_steps_and_the_goal():
    records = [
        {"step": 0, "validation/accuracy": 0.5},  # no train metrics: not a step
        {"step": 1, "train/token_mult_prob_error": 1.0004, "train/importance_ratio_max_abs_dev": 1e-3},
        {"step": 2, "train/token_mult_prob_error": 1.0020, "train/importance_ratio_max_abs_dev": 3e-3},
    ]
    s = sa.summarize(records)
    assert s["token_mult_prob_error"] == pytest.approx(1.0012, abs=1e-12)
    assert s["importance_ratio_max_abs_dev"] == pytest.approx(2e-3, abs=1e-12)
    assert s["mean_abs_logp_bound"] == pytest.approx(1.2e-3, abs=1e-12)
    assert s["meets_goal"] is False
    assert sa.summarize(records[:1]) == {}


def test_every_option_validates_and_top_k_never_meets_speculation():
    opts = dict(sa.options("/models/draft"))
    assert set(dict(sa.OPTIONS)) < set(opts) and {f"spec_{n}" for n in sa.SPEC_OPTIONS} < set(opts)
    for name, overrides in opts.items():
        spec = any("speculative_config" in o for o in overrides)
        assert name.startswith("spec_") == spec
        assert not (spec and any("top_k" in o for o in overrides)), name  # refused by the schema
        if not spec:  # the spec ones need the draft on disk; their keys are the plain option's plus the config
            load_config("configs/grpo_math_tiny.yaml", sa.run_overrides(1, overrides, []))


def test_table_marks_failed_runs_and_missed_goals():
    rows = {
        "plain": {
            "summary": sa.summarize([{"train/token_mult_prob_error": 1.5, "train/importance_ratio_max_abs_dev": 0.2}])
        },
        "broken": {"summary": {}, "run": {"returncode": 1}},
    }
    text = sa.table(rows)
    assert "failed (returncode 1)" in text and text.splitlines()[2].rstrip().endswith("NO")
