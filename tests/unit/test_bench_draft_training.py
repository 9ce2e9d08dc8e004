"""examples/bench_draft_training.py on tiny shapes: the recipe-shaped batch, the micro-batch plan, the fp32 variants'
first steps agreeing (same loss, same gradient norm from identical heads) and the bf16 variant's close to them."""

from __future__ import annotations

import json

import pytest

from nemo_rl_spec.bench.draft_training import (
    RecipeShapes,
    _head_summary,
    loop_policy_seconds,
    micro_batches,
    recipe_batch,
    run,
)

TINY = RecipeShapes(
    vocab_size=96,
    hidden_size=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=32,
    num_hidden_layers=6,
    prompts=3,
    rollouts_per_prompt=2,
    prompt_tokens=(5, 7),
    response_tokens=(2, 6),
    max_new_tokens=9,
    rows_at_cap=1,
    train_mb_tokens=40,
    policy_dtype="float32",
)


def test_recipe_batch_masks_exactly_the_responses():
    batch = recipe_batch(TINY)
    mask, lengths = batch["loss_mask"], batch["input_lengths"]
    responses = mask.sum(1)
    assert mask.shape == (6, int(lengths.max())) and int((responses == TINY.max_new_tokens).sum()) >= 1
    assert bool(((responses >= 2) & (responses <= TINY.max_new_tokens)).all())
    prompt = lengths - responses
    assert bool(((prompt >= 5) & (prompt <= 7)).all()) and bool(
        (prompt.view(3, 2)[:, 0] == prompt.view(3, 2)[:, 1]).all()
    )
    mbs = micro_batches(TINY, batch)
    assert sum(mb["loss_mask"].sum() for mb in mbs) == mask.sum()
    assert all(mb["input_ids"].numel() <= TINY.train_mb_tokens for mb in mbs) and len(mbs) > 1


def test_run_gives_the_same_first_step_in_the_fp32_variants_and_a_close_one_in_bf16(tmp_path):
    result = run(TINY, {"reduced": 24, "full": None}, repeats=2, threads=1, root=tmp_path)
    assert result["settings"]["scored_tokens"] == int(recipe_batch(TINY)["loss_mask"][:, 2:].sum())
    for head in ("reduced", "full"):
        s = result["heads"][head]
        assert len(s["seconds"]["before"]) == len(s["seconds"]["after"]) == len(s["seconds"]["bf16"]) == 2
        loss, norm = s["first_step_draft_loss"], s["first_step_grad_norm"]
        assert loss["after"] == pytest.approx(loss["before"], rel=1e-6) and loss["before"] > 0
        assert norm["after"] == pytest.approx(norm["before"], rel=1e-5)
        # bf16 autocast really ran (the loss differs) and stays within bf16's rounding of the fp32 loss
        assert loss["bf16"] != loss["after"] and loss["bf16"] == pytest.approx(loss["after"], rel=1e-3)
        end = s["loss_at_last_step"]
        assert end["step"] == 3 and end["bf16"] == pytest.approx(end["after"], rel=1e-3)
        assert s["loop"] == {}
    json.dumps(result)


def test_loop_policy_seconds_reads_the_logged_phases(tmp_path):
    modes = {
        "sync/autoregressive": {"training_s": 10.0, "step_time_s": 20.0},
        "sync/speculative@ms13": {"draft_train_s": 2.0, "step_time_s": 24.0},
    }
    path = tmp_path / "docs/results/spec_loop_default/real_draft_5steps.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"modes": modes}))
    got = loop_policy_seconds(tmp_path, "vocab1160")
    assert (got["ar_policy_training_s"], got["spec_draft_train_s"], got["spec_step_s"], got["ar_step_s"]) == (
        10.0,
        2.0,
        24.0,
        20.0,
    )
    assert loop_policy_seconds(tmp_path, "full") == {}
    assert got["draft_variant"] == "after"


@pytest.mark.parametrize(("variant", "saved"), [("after", 2.0 * (1 - 1 / 2)), ("before", 2.0 * (1 - 1 / 4))])
def test_projection_scales_the_loop_draft_seconds_from_the_variant_it_ran(variant, saved):
    """Medians 4 / 2 / 1 s (before / after / bf16); the loop's draft took 2 s of a 24 s step (AR 20 s): bf16 saves
    2 x (1 - bf16 / <variant the loop ran>) seconds of it, worked out by hand here."""
    times = {"before": [4.0], "after": [2.0], "bf16": [1.0]}
    warm = {v: (0.0, {"draft_loss": 1.0, "draft_grad_norm": 1.0}) for v in times}
    loop = {"spec_draft_train_s": 2.0, "spec_step_s": 24.0, "ar_step_s": 20.0, "draft_variant": variant}
    summary = _head_summary(24, TINY, times, warm, loop)
    assert summary["bf16_over_after"] == 0.5 and summary["loop_step_over_ar"] == 1.2
    assert summary["projected_step_over_ar"] == pytest.approx((24.0 - saved) / 20.0, rel=1e-12)
