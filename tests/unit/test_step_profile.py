"""The per-component step profile's arithmetic and tables (nemo_rl_spec.bench.step_profile), no engine: residuals,
the step filter, median-then-quietest reduction, the extra-time split and the printed rows."""

from __future__ import annotations

import json

import pytest

from nemo_rl_spec.bench import step_profile as sp


def _measured(**over):
    base = dict.fromkeys(sp.MAIN, 0.0)
    base.update(over)
    return base


def test_step_parts_residuals_add_up():
    m = _measured(
        target_forward=0.020,
        target_logits=0.004,
        sampling=0.015,
        drafter=0.010,
        rs_forward=0.013,
        rs_bonus=0.002,
        rs_constraints=0.001,
        rs_accept=0.005,
        rs_logprobs=0.001,
        drafter_kv_pass=0.004,
        drafter_forward=0.002,
        drafter_sample=0.003,
    )
    p = sp.step_parts(0.055, m)
    assert p["step"] == 0.055
    assert p["bookkeeping"] == pytest.approx(0.055 - 0.020 - 0.004 - 0.015 - 0.010)
    assert p["logits_copies"] == pytest.approx(0.013 - 0.002 - 0.001 - 0.005 - 0.001)  # no processors: 0
    assert p["sampling_other"] == pytest.approx(0.002)
    assert p["drafter_other"] == pytest.approx(0.001)
    main = sum(p[k] for k in sp.SPEC_COMPONENTS)
    assert main == pytest.approx(p["step"])
    rs = sum(p[k] for k in ("rs_bonus", "logits_copies", "rs_constraints", "rs_accept", "rs_logprobs", "rs_processors"))
    assert rs + p["sampling_other"] == pytest.approx(p["sampling"])


def test_step_parts_ar_engine_has_no_detail_keys():
    p = sp.step_parts(0.030, _measured(target_forward=0.024, target_logits=0.002, sampling=0.002))
    assert set(p) == {*sp.MAIN, "step", "bookkeeping"}
    assert p["bookkeeping"] == pytest.approx(0.002)
    with pytest.raises(KeyError):
        sp.step_parts(0.03, {"target_forward": 0.01})


def test_keep_step_only_full_batch_with_k_drafts_each():
    assert sp.keep_step(8, 32, 8, 3)  # 8 requests x (1 + 3)
    assert not sp.keep_step(8, 8, 8, 3)  # a step without drafts
    assert not sp.keep_step(7, 28, 8, 3)  # batch not full
    assert not sp.keep_step(8, 200, 8, 3)  # prefill
    assert sp.keep_step(1, 1, 1, 0)


def test_run_summary_median_and_quietest_minimum_per_key():
    steps = [{"step": s, "a": a} for s, a in ((0.10, 0.01), (0.30, 0.05), (0.20, 0.02))]
    r = sp.run_summary(steps)
    assert r == {"step": 0.20, "a": 0.02, "n_steps": 3}
    q = sp.quietest([r, {"step": 0.25, "a": 0.015, "n_steps": 2}])
    assert q == {"step": 0.20, "a": 0.015}  # each key its own minimum; n_steps dropped
    with pytest.raises(ValueError):
        sp.run_summary([])
    with pytest.raises(ValueError):
        sp.quietest([])
    red = sp.reduce_runs({"ar": {1: [r]}, "k1": {1: [r, {"step": 0.1, "a": 0.3, "n_steps": 1}]}})
    assert red["k1"][1] == {"step": 0.1, "a": 0.02}


def test_interleaved_order_reverses_on_odd_repeats():
    assert sp.interleaved_order(["ar", "k1", "k3"], 0) == ["ar", "k1", "k3"]
    assert sp.interleaved_order(["ar", "k1", "k3"], 1) == ["k3", "k1", "ar"]


def _table():
    ar = sp.step_parts(0.040, _measured(target_forward=0.030, target_logits=0.004, sampling=0.004))
    k3 = sp.step_parts(
        0.100,
        _measured(
            target_forward=0.045,
            target_logits=0.010,
            sampling=0.025,
            drafter=0.012,
            rs_forward=0.024,
            rs_bonus=0.004,
            rs_accept=0.012,
            drafter_kv_pass=0.005,
        ),
    )
    return {"ar": {8: ar}, "k3": {8: k3}}


def test_verification_summary_splits_the_extra_time():
    v = sp.verification_summary(_table())
    assert set(v) == {"k3"}
    e = v["k3"][8]
    assert e["extra_ms"] == pytest.approx(60.0)
    assert e["target_ms"] == pytest.approx(21.0)
    assert e["drafter_ms"] == pytest.approx(12.0)
    assert e["sampling_ms"] == pytest.approx(21.0)
    assert e["bookkeeping_ms"] == pytest.approx(6.0)
    assert e["target_ms"] + e["drafter_ms"] + e["sampling_ms"] + e["bookkeeping_ms"] == pytest.approx(e["extra_ms"])


def test_format_component_table_rows_shares_and_dashes():
    text = sp.format_component_table(_table(), sp.SPEC_COMPONENTS, shares=True)
    lines = text.splitlines()
    assert lines[0].startswith("| engine | batch | step ms | target forward | target logits | drafter | sampling")
    assert lines[1].count("---") == len(sp.SPEC_COMPONENTS) + 4
    ar_row = lines[2].split(" | ")
    assert ar_row[0] == "| ar" and ar_row[1] == "8" and ar_row[2] == "40.0"
    assert ar_row[3] == "30.0 (75%)" and ar_row[5] == "-"  # AR has no drafter
    assert lines[2].endswith("| 1.000 |")
    k3_row = lines[3]
    assert "| 45.0 (45%) |" in k3_row and "| 12.0 (12%) |" in k3_row and k3_row.endswith("| 2.500 |")
    detail = sp.format_component_table(_table(), sp.SPEC_DETAIL_COLUMNS).splitlines()
    assert detail[2].count("| - ") == len(sp.SPEC_DETAIL_COLUMNS)  # AR: no detail keys at all
    # logits copies = rs_forward - bonus - accept = 24 - 4 - 12 ms
    assert f"| {8.0:.1f} |" in detail[3]
    with pytest.raises(KeyError):
        sp.format_component_table({"k3": _table()["k3"]}, sp.COMPONENTS)


def test_table_survives_json_round_trip_of_the_result():
    res = {"components_s": _table(), "verification": sp.verification_summary(_table())}
    back = json.loads(json.dumps(res))
    assert back["components_s"]["k3"]["8"]["logits_copies"] == pytest.approx(0.008)
    assert back["verification"]["k3"]["8"]["extra_ms"] == pytest.approx(60.0)
