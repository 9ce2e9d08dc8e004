"""Pilot-Commit diagnostics: which prompts were trained on (``rollout_alloc/trained_*`` metrics, difficulty buckets) and
the constant loss normaliser (Dr. GRPO) of ClippedPGLossFn, against hand computations."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from nemo_rl_spec.algorithms.interfaces import Stage, TrainGroup
from nemo_rl_spec.algorithms.loss import ClippedPGLossFn
from nemo_rl_spec.algorithms.pilot_commit import PilotCommitAllocator
from nemo_rl_spec.algorithms.rollout_allocation import UniformAllocator, difficulty_bucket
from nemo_rl_spec.bench import pc_ablation_table
from nemo_rl_spec.bench import pilot_commit as bench_pilot_commit
from nemo_rl_spec.utils.config_schema import LossConfig
from nemo_rl_spec.utils.feature_configs import PilotCommitConfig

LOSS_CFG = dict(
    ratio_clip_min=0.2,
    ratio_clip_max=0.2,
    token_level_loss=True,
    reference_policy_kl_penalty=0.0,
    reference_policy_kl_type="k3",
    use_importance_sampling_correction=False,
    truncated_importance_sampling_ratio=None,
)


def _generate(p_of, version=0):
    """Rewards [1, 0, 1, 0, ...] for p 0.5, all 1 for 1.0, all 0 for 0.0."""

    def gen(requests):
        out = []
        for r in requests:
            p = p_of[r.prompt_id]
            rewards = [float(i % 2 == 0) for i in range(r.n)] if p == 0.5 else [p] * r.n
            out.append(r.result(rewards, version))
        return out

    return gen


# ----------------------------------------------------------------------------------------- trained prompts
def test_difficulty_bucket_rules():
    q = "State the final answer to the following arithmetic problem: 0 - 4 - 8 ="
    assert difficulty_bucket({"question": q, "source": "chain_sum:min_terms=2,max_terms=4"}) == "terms_3"
    assert difficulty_bucket({"question": "problem: 12 + 3 =", "source": "chain_sum"}) == "terms_2"
    assert difficulty_bucket({"question": "x", "source": "basic_arithmetic:min_terms=2"}) == "basic_arithmetic"
    assert difficulty_bucket({"question": "x", "source": "chain_sum", "difficulty": 3}) == "3"
    assert difficulty_bucket({"question": "x"}) == "unknown"


def test_uniform_trained_prompt_metrics_by_hand():
    # pool of 3, 2 prompts a step, id order: steps train [0,1], [2], [0,1], [2]
    alloc = UniformAllocator(range(3), num_prompts_per_step=2, num_generations_per_prompt=2, shuffle=False)
    alloc.set_prompt_buckets(["terms_2", "terms_3", "terms_2"])
    gen = _generate({0: 0.5, 1: 1.0, 2: 0.0})
    m = [alloc.step(gen).metrics for _ in range(4)]
    pre = "rollout_alloc/"
    assert [x[pre + "trained_prompts"] for x in m] == [2, 1, 2, 1]
    assert [x[pre + "trained_times_seen_mean"] for x in m] == [1, 1, 2, 2]
    assert [x[pre + "trained_times_seen_max"] for x in m] == [1, 1, 2, 2]
    # distinct prompts ever trained / train groups so far: 2/2, 3/3, 3/5, 3/6
    assert [x[pre + "trained_unique_frac"] for x in m] == pytest.approx([1, 1, 3 / 5, 3 / 6])
    # rewards: prompt 0 [1, 0], prompt 1 [1, 1] -> 3/4; prompt 2 [0, 0] -> 0
    assert [x[pre + "trained_group_reward_mean"] for x in m] == pytest.approx([0.75, 0.0, 0.75, 0.0])
    # every bucket of the pool reported each step, 0 included
    assert [(x[pre + "trained_bucket/terms_2"], x[pre + "trained_bucket/terms_3"]) for x in m] == [
        (1, 1),
        (1, 0),
        (1, 1),
        (1, 0),
    ]


def test_trained_prompt_counts_survive_resume_and_cover_pilot_commit():
    cfg = PilotCommitConfig(
        n_pilot=2,
        n_commit=2,
        pilot_batch_size=4,
        rollout_budget_per_step=12,
        p_lower=0.1,
        p_upper=0.9,
        bind_pilot_to_commit=False,
    )
    p_of = {i: 0.5 for i in range(4)}  # every prompt selected; 2 commit slots: (12 - 8) // 2
    a = PilotCommitAllocator(range(4), cfg, shuffle=False)
    a.set_prompt_buckets({0: "a", 1: "a", 2: "b", 3: "b"})
    s0 = a.step(_generate(p_of))
    assert [g.prompt_id for g in s0.groups] == [0, 1]
    assert s0.metrics["rollout_alloc/trained_bucket/a"] == 2 and s0.metrics["rollout_alloc/trained_bucket/b"] == 0
    state = a.state_dict()
    b = PilotCommitAllocator(range(4), cfg, shuffle=False)
    b.load_state_dict(state)
    b.set_prompt_buckets({0: "a", 1: "a", 2: "b", 3: "b"})
    s1a, s1b = a.step(_generate(p_of)), b.step(_generate(p_of))
    assert s1a.metrics == s1b.metrics
    # step 1 trains [0, 1] (fresh pilot of the next epoch) or buffered 2, 3: either way the counts continue
    assert s1a.metrics["rollout_alloc/trained_unique_frac"] == pytest.approx(
        len({g.prompt_id for g in s0.groups + s1a.groups}) / 4
    )
    del state["times_trained"], state["train_groups_total"]  # a checkpoint written before these metrics loads
    PilotCommitAllocator(range(4), cfg, shuffle=False).load_state_dict(state)


def test_empty_step_reports_zeros():
    a = UniformAllocator(range(2), 2, 2, shuffle=False)
    m = a._trained_prompt_metrics([])
    assert m["rollout_alloc/trained_prompts"] == 0 and m["rollout_alloc/trained_times_seen_mean"] == 0.0
    assert m["rollout_alloc/trained_group_reward_mean"] == 0.0
    g = TrainGroup(1, _generate({1: 0.5})([a._request(1, 2, Stage.GROUP, 0)]))
    assert a._trained_prompt_metrics([g])["rollout_alloc/trained_unique_frac"] == 1.0


# ----------------------------------------------------------------------------------------- loss normaliser
def _batch():
    """2 rows, on-policy (ratio 1, no clipping): per-token pg = -A. Row 0: A=+1, 3 valid tokens; row 1: A=-2, 1
    valid token. Sum over valid tokens of pg = -3 + 2 = -1; d sum / d curr = -A on valid tokens."""
    prev = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, 0.0, 0.0, 0.0]])
    curr = prev.clone().requires_grad_(True)
    data = dict(
        prev_logprobs=prev,
        token_mask=torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]]),
        sample_mask=torch.ones(2),
        advantages=torch.tensor([1.0, -2.0]),
    )
    return curr, data


@pytest.mark.numerics
def test_constant_normaliser_divides_by_the_constant_not_the_batch_tokens():
    curr, data = _batch()
    batch_loss, _ = ClippedPGLossFn(LOSS_CFG)(curr, data, torch.tensor(4.0), torch.tensor(2.0))
    assert float(batch_loss.detach()) == pytest.approx(-1 / 4)  # today's batch mean: sum / 4 valid tokens
    const = ClippedPGLossFn({**LOSS_CFG, "loss_normalizer": "constant", "loss_normalizer_constant": 64.0})
    loss, metrics = const(curr, data, torch.tensor(4.0), torch.tensor(2.0))
    assert float(loss) == pytest.approx(-1 / 64)  # sum / C, whatever the batch's token count
    loss.backward()
    expected = torch.tensor([[-1.0, -1.0, -1.0, 0.0], [2.0, 0.0, 0.0, 0.0]]) / 64
    torch.testing.assert_close(curr.grad, expected, rtol=0, atol=1e-7)
    assert metrics["probs_ratio"] == pytest.approx(1.0)  # metrics keep the batch normalisation


@pytest.mark.numerics
def test_constant_normaliser_gradient_scales_with_batch_size_batch_mean_does_not():
    """What the constant normaliser is for: twice the informative rows -> twice the gradient on a shared parameter
    with the constant normaliser; the batch mean gives the half batch the same gradient as the full one (so a step
    with one or two groups moves the policy as far as a full batch). Fails on the old, batch-only behaviour."""

    def shared_grad(cfg, copies):
        curr, data = _batch()
        data = {k: torch.cat([v] * copies) for k, v in data.items()}
        theta = torch.zeros((), requires_grad=True)  # a parameter every token's log-prob depends on
        curr = data["prev_logprobs"] + theta
        loss, _ = ClippedPGLossFn(cfg)(curr, data, data["token_mask"].sum(), torch.tensor(2.0 * copies))
        loss.backward()
        return float(theta.grad)

    def tol(copies):
        """The 4 * copies terms +-A / 40 are inexact in binary and cancel: each rounds once, the sum adds 4 copies - 1
        roundings, all <= eps * sum|terms| = eps * 5 copies / 40 (docs/design/numerical_tolerances.md)."""
        return 4 * copies * torch.finfo(torch.float32).eps * 5 * copies / 40

    const = {**LOSS_CFG, "loss_normalizer": "constant", "loss_normalizer_constant": 40.0}
    # d loss / d theta = sum over valid tokens of -A / normaliser: (-3 + 2) * copies / C, or (-1 * copies) / (4 copies)
    # (the batch mean's terms +-1/4 are dyadic: exact)
    assert shared_grad(const, 1) == pytest.approx(-1 / 40, abs=tol(1))
    assert shared_grad(const, 2) == pytest.approx(-2 / 40, abs=tol(2))
    assert shared_grad(LOSS_CFG, 1) == pytest.approx(-1 / 4) and shared_grad(LOSS_CFG, 2) == pytest.approx(-1 / 4)


@pytest.mark.numerics
def test_constant_normaliser_sequence_level():
    curr, data = _batch()
    cfg = {**LOSS_CFG, "token_level_loss": False, "loss_normalizer": "constant", "loss_normalizer_constant": 8.0}
    loss, _ = ClippedPGLossFn(cfg)(curr, data, torch.tensor(4.0), torch.tensor(2.0))
    assert float(loss) == pytest.approx((-1.0 + 2.0) / 8)  # per-row token means -1 and +2, summed, / 8 rows


def test_loss_normaliser_config_errors():
    with pytest.raises(ValueError, match="loss_normalizer_constant"):
        ClippedPGLossFn({**LOSS_CFG, "loss_normalizer": "constant"})
    with pytest.raises(ValueError, match="loss_normalizer must be one of"):
        ClippedPGLossFn({**LOSS_CFG, "loss_normalizer": "mean"})
    with pytest.raises(ValidationError, match="loss_normalizer_constant"):
        LossConfig(**LOSS_CFG, loss_normalizer="constant")
    assert LossConfig(**LOSS_CFG).loss_normalizer == "batch"
    assert (
        LossConfig(**LOSS_CFG, loss_normalizer="constant", loss_normalizer_constant=3072).loss_normalizer_constant
        == 3072
    )


# ----------------------------------------------------------------------------------------- ablation table
def test_bench_training_diagnostics_and_ablation_table(tmp_path):
    bench, table = bench_pilot_commit, pc_ablation_table
    steps = [
        {
            "step": 1,
            "rollout_alloc/train_rollouts": 40.0,
            "train/grad_norm": 2.0,
            "rollout_alloc/trained_times_seen_mean": 1.0,
            "rollout_alloc/trained_unique_frac": 1.0,
            "rollout_alloc/trained_bucket/terms_2": 3.0,
            "rollout_alloc/trained_bucket/terms_3": 1.0,
            "rollout_alloc/trained_group_reward_mean": 0.5,
        },
        {
            "step": 2,
            "rollout_alloc/train_rollouts": 8.0,
            "train/grad_norm": 6.0,
            "rollout_alloc/trained_times_seen_mean": 2.0,
            "rollout_alloc/trained_unique_frac": 0.8,
            "rollout_alloc/trained_bucket/terms_2": 0.0,
            "rollout_alloc/trained_bucket/terms_3": 1.0,
            "rollout_alloc/trained_group_reward_mean": 0.25,
        },
    ]
    d = bench.training_diagnostics(steps)
    assert d["mean_train_rows"] == 24 and d["mean_grad_norm"] == 4 and d["max_grad_norm"] == 6
    assert d["mean_trained_times_seen"] == 1.5 and d["final_trained_unique_frac"] == 0.8
    assert d["trained_bucket_share"] == {"terms_2": 0.6, "terms_3": 0.4} and d["mean_train_group_reward"] == 0.375
    assert bench.training_diagnostics([{"step": 1}])["mean_grad_norm"] is None
    # accuracy 0.3 (step 0), 0.7 (2), 0.8 (4), 0.6 (6): peak 0.8 at step 4, final 0.6, drop 0.2
    run = {
        "curve": [[0, 0, 0.3], [2, 100, 0.7], [4, 200, 0.8], [6, 300, 0.6]],
        "cumulative_rollouts": [[6, 300.0]],
        **d,
    }
    row = table.run_row(run)
    assert row["final"] == 0.6 and row["peak"] == 0.8 and row["peak_step"] == 4
    assert row["drop"] == pytest.approx(0.2) and row["rollouts"] == 300 and row["rows_per_step"] == 24
    assert row["dip_last10"] == pytest.approx(0.2) and row["max_drawdown"] == pytest.approx(0.2)
    # a dip that recovers: peak 0.8 (step 4), 0.6 (step 16), 0.8 (step 30); last 10 steps = 20..30
    rec = table.run_row({"curve": [[0, 0, 0.3], [4, 1, 0.8], [16, 2, 0.6], [22, 3, 0.75], [30, 4, 0.8]]})
    assert rec["drop"] == 0 and rec["max_drawdown"] == pytest.approx(0.2) and rec["dip_last10"] == pytest.approx(0.05)
    f = tmp_path / "abl.json"
    f.write_text(
        __import__("json").dumps(
            {
                "runs": {"pilot_commit": {"0": run, "1": {**run, "curve": run["curve"][:3]}}},
                "meta": {"overrides": ["x=1"]},
            }
        )
    )
    s = table.summarize_file(f)["abl"]
    assert s["seeds"]["1"]["drop"] == 0 and s["mean"]["final"]["mean"] == pytest.approx(0.7)
    assert s["mean"]["drop"]["mean"] == pytest.approx(0.1) and s["overrides"] == ["x=1"]
    md = table.markdown({"abl": s})
    assert "| abl | 0.600 0.800 | 0.700" in md and "4.00 (6.0)" in md
    # mean curve: steps 0, 2, 4 from both seeds, step 6 from seed 0 only
    assert table.mean_curve({"0": run, "1": {"curve": run["curve"][:3]}}) == [(0, 0.3), (2, 0.7), (4, 0.8), (6, 0.6)]
    table.plot([f], tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 0


def test_reference_ratios_hand_values():
    """Targets from the reference's uniform runs (start 0.3, finals 0.7 and 0.5: mean 0.6, gain 0.3): f = 0.5 ->
    0.45, f = 1 -> 0.6; ratios reference / row per seed, a seed where the row never gets there censored."""
    ref = {
        "runs": {
            "uniform": {
                "0": {"curve": [[0, 0, 0.3], [2, 128, 0.5], [4, 256, 0.7]]},
                "1": {"curve": [[0, 0, 0.3], [2, 128, 0.4], [4, 256, 0.5]]},
            }
        }
    }
    row = {"0": {"curve": [[0, 0, 0.3], [2, 32, 0.46], [4, 64, 0.6]]}, "1": {"curve": [[0, 0, 0.3], [2, 64, 0.45]]}}
    out = pc_ablation_table.reference_ratios(ref, row)
    assert out["0.5"]["accuracy"] == pytest.approx(0.45) and out["1"]["accuracy"] == pytest.approx(0.6)
    half = out["0.5"]
    assert half["rollouts_to_target"] == {"uniform": {"0": 128, "1": 256}, "pilot_commit": {"0": 32, "1": 64}}
    assert half["ratios"]["uniform_over_pilot_commit"]["per_seed"] == {"0": 4.0, "1": 4.0}
    full = out["1"]["ratios"]["uniform_over_pilot_commit"]
    assert full["per_seed"] == {"0": 4.0} and full["censored"] == {"1": "both missed"}
    table = pc_ablation_table.reference_markdown({"row": out})
    assert "128/32 256/64, 4.00" in table and "(cens 1)" in table
