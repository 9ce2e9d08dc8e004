"""The precision benchmark's arithmetic (examples/bench_precision.py), without a model: run order, per-run
overrides, per-run phase means with the warm-up step dropped, the bf16 / fp32 ratios against the benchmark's goals with
failed runs left out, the /proc/cpuinfo parse, the table and the plot."""

import pytest

from nemo_rl_spec.bench import precision as bench_precision

bench = bench_precision

STEP = "timing/train/total_step_time"


def records(times: list[float], scale: float = 1.0, mult_err: float = 1.0, mismatch: float = 1e-5) -> list[dict]:
    """metrics.jsonl records of a run whose step k takes times[k-1] * scale s, split 1:2:3:1 over generation,
    log-probs, training, refit (total = 7 parts), plus a validation-only record at step 0."""
    out = [{"step": 0, "validation/accuracy": 0.5}]
    for k, t in enumerate(times, start=1):
        part = t * scale / 7
        out.append(
            {
                "step": k,
                "timing/train/generation": part,
                "timing/train/policy_and_reference_logprobs": 2 * part,
                "timing/train/policy_training": 3 * part,
                "timing/train/weight_sync": part,
                STEP: 7 * part,
                "train/token_mult_prob_error": mult_err + k / 100,
                "refit/logprob_mismatch": mismatch,
            }
        )
    return out[::-1]  # out of order on purpose: step_records sorts


def run(precision: str, summary: dict, rc=0) -> dict:
    return {"precision": precision, "returncode": rc, **summary}


def test_schedule_interleaves_and_overrides_put_precision_last():
    assert bench.schedule(["float32", "bfloat16"], 2) == [
        (0, "float32"),
        (0, "bfloat16"),
        (1, "float32"),
        (1, "bfloat16"),
    ]
    with pytest.raises(ValueError, match="repeats"):
        bench.schedule(["float32"], 0)
    o = bench.run_overrides("bfloat16", 3, ["policy.generation.vllm_cfg.precision=float32"], engine_key=True)
    assert o[:4] == [
        "grpo.max_num_steps=3",
        "grpo.val_at_start=false",
        "grpo.val_period=0",
        "checkpointing.enabled=false",
    ]
    # the extra override comes after the benchmark's engine dtype (so it wins), policy.precision is last
    assert o[4:] == [
        "policy.generation.vllm_cfg.precision=bfloat16",
        "policy.generation.vllm_cfg.precision=float32",
        "policy.precision=bfloat16",
    ]
    assert not any("vllm_cfg" in x for x in bench.run_overrides("float32", 1, [], engine_key=False))


def test_parse_args_refuses_a_precision_override():
    args, extra = bench.parse_args(["--steps", "2", "grpo.seed=1"])
    assert (args.steps, args.repeats, args.precisions, extra) == (2, 3, ["float32", "bfloat16"], ["grpo.seed=1"])
    for bad in (["policy.precision=auto"], ["--repeats", "0"], ["--precisions", "float32", "float32"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_run_summary_drops_the_first_step_from_the_times_only():
    s = bench.run_summary(records([70.0, 7.0, 14.0]))
    assert [p["step"] for p in s["per_step"]] == [1, 2, 3]
    assert s["warmup_dropped"] == 1
    assert s["phases"]["total_step"] == pytest.approx(10.5)  # (7 + 14) / 2; step 1's 70 s is warm-up
    assert s["phases"]["training"] == pytest.approx(4.5)  # 3/7 of it
    assert s["numerics"]["token_mult_prob_error"] == pytest.approx(1.02)  # mean of 1.01, 1.02, 1.03: every step
    one = bench.run_summary(records([7.0]))
    assert one["warmup_dropped"] == 0 and one["phases"]["total_step"] == pytest.approx(7.0)
    empty = bench.run_summary([{"step": 0, "validation/accuracy": 0.1}])
    assert empty["per_step"] == [] and empty["phases"]["generation"] is None


def test_summarize_ratios_goals_and_failed_runs():
    fp = [bench.run_summary(records([99.0, t])) for t in (10.0, 12.0)]
    bf = [bench.run_summary(records([99.0, t], mult_err=1.1, mismatch=0.04)) for t in (5.0, 6.6)]
    crashed = bench.run_summary(records([99.0, 1.0]))  # a failed run's partial numbers must not count
    runs = [
        run("float32", fp[0]),
        run("bfloat16", bf[0]),
        run("float32", fp[1]),
        run("bfloat16", bf[1]),
        run("bfloat16", crashed, rc="timeout"),
    ]
    s = bench.summarize(runs, ["float32", "bfloat16"])
    assert s["runs_ok"] == {"float32": 2, "bfloat16": 2}
    total = s["phases"]["total_step"]
    assert total["float32"]["values"] == pytest.approx([10.0, 12.0])
    bf_total = total["bfloat16"]
    assert (bf_total["mean"], bf_total["min"], bf_total["max"]) == pytest.approx((5.8, 5.0, 6.6))
    assert total["ratio"] == pytest.approx(5.8 / 11.0)
    assert (total["goal"], total["meets_goal"], total["moonshot"]) == (0.6, True, 0.5)
    assert s["phases"]["generation"]["goal"] == 0.55 and s["phases"]["generation"]["meets_goal"] is True
    assert s["phases"]["logprobs"]["goal"] is None and s["phases"]["logprobs"]["meets_goal"] is None
    assert s["numerics"]["logprob_mismatch"]["bfloat16"]["mean"] == pytest.approx(0.04)
    slow = bench.summarize(
        [run("float32", fp[0]), run("bfloat16", bench.run_summary(records([1.0, 8.0])))], ["float32", "bfloat16"]
    )
    assert slow["phases"]["training"]["meets_goal"] is False  # 0.8x > 0.6
    assert "NOT met" in bench.goal_text(slow["phases"]["training"])
    only_fp = bench.summarize([run("float32", fp[0])], ["float32"])
    assert only_fp["phases"]["total_step"]["ratio"] is None


def test_parse_cpuinfo():
    text = (
        "processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx512f avx512_bf16 amx_tile amx_bf16\n\n"
        "processor\t: 1\nmodel name\t: Some Xeon\nflags\t\t: fpu\n"
    )
    info = bench.parse_cpuinfo(text)
    assert info == {
        "cpu_model": "Some Xeon",
        "bf16_flags": ["amx_bf16", "amx_tile", "avx512_bf16"],
        "native_bf16": True,
        "logical_cpus_listed": 2,
    }
    assert bench.parse_cpuinfo("flags : fpu avx2\n")["native_bf16"] is False
    assert bench.parse_cpuinfo("")["cpu_model"] is None
    m = bench.machine_info()
    assert m["nproc"] >= 1 and len(m["loadavg"]) == 3


def test_table_and_plot(tmp_path):
    fp, bf = bench.run_summary(records([9.0, 10.0])), bench.run_summary(records([9.0, 5.0]))
    s = bench.summarize([run("float32", fp), run("bfloat16", bf)], ["float32", "bfloat16"])
    text = bench.table(s, ["float32", "bfloat16"], warmup=True)
    assert "total_step" in text and "0.500" in text and "<= 0.6 met (moonshot <= 0.5)" in text
    assert "warm-up" in text and "token_mult_prob_error" in text
    bench.plot(s, ["float32", "bfloat16"], tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 10_000
