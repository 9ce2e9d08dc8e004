"""Acceptance metrics from vLLM counters, the low-acceptance alarm, draft version rules, greedy-round simulation
and the chi-square helpers (no engine)."""

from __future__ import annotations

import math
from types import SimpleNamespace as NS

import pytest
import torch

from nemo_rl_spec.speculative.draft_refit import (
    DraftVersionGuard,
    DraftVersionMismatchError,
)
from nemo_rl_spec.speculative.metrics import LowAcceptanceAlarm, SpecDecodeCounters
from nemo_rl_spec.testing.lossless import (
    chi2_sf,
    chi_square_goodness_of_fit,
    chi_square_homogeneity,
    first_mismatch,
    require_acceptance,
    simulate_greedy_rounds,
    total_variation,
)


def fake_metrics(drafts, draft_tokens, accepted, per_pos, engines=1):
    out = [NS(name="vllm:num_requests_running", value=3)]
    for _ in range(engines):
        out += [
            NS(name="vllm:spec_decode_num_drafts", value=drafts),
            NS(name="vllm:spec_decode_num_draft_tokens", value=draft_tokens),
            NS(name="vllm:spec_decode_num_accepted_tokens", value=accepted),
            NS(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=list(per_pos)),
        ]
    return out


def test_counters_and_metrics_by_hand():
    before = SpecDecodeCounters.from_vllm_metrics(fake_metrics(10, 30, 12, [6, 4, 2]))
    after = SpecDecodeCounters.from_vllm_metrics(fake_metrics(50, 150, 72, [36, 24, 12]))
    delta = after - before
    assert delta == SpecDecodeCounters(40, 120, 60, (30, 20, 10))
    m = delta.as_metrics()
    assert m["vllm/spec_acceptance_length"] == pytest.approx(1 + 60 / 40)
    assert m["vllm/spec_acceptance_rate"] == pytest.approx(60 / 120)
    assert [m[f"vllm/spec_acceptance_rate_pos{i}"] for i in range(3)] == pytest.approx([0.75, 0.5, 0.25])
    two = SpecDecodeCounters.from_vllm_metrics(fake_metrics(1, 3, 2, [1, 1, 0], engines=2))
    assert two == SpecDecodeCounters(2, 6, 4, (2, 2, 0))
    empty = SpecDecodeCounters.from_vllm_metrics([])
    assert math.isnan(empty.acceptance_length) and math.isnan(empty.acceptance_rate)
    # two calls of one batch add up; per-position lists of different lengths are zero-padded
    assert delta + two == SpecDecodeCounters(42, 126, 64, (32, 22, 10))
    assert SpecDecodeCounters(1, 2, 1, (1,)) + SpecDecodeCounters(1, 3, 2, (1, 1, 0)) == SpecDecodeCounters(
        2, 5, 3, (2, 1, 0)
    )
    assert empty + delta == delta and (delta + two) - two == delta


def test_alarm_fires_only_after_refit_and_under_floor():
    alarm = LowAcceptanceAlarm(floor=1.2, min_drafts=4)
    low = SpecDecodeCounters(100, 300, 5, (5, 0, 0)).as_metrics()  # length 1.05
    high = SpecDecodeCounters(100, 300, 150, (80, 50, 20)).as_metrics()
    assert alarm.check(low)[LowAcceptanceAlarm.METRIC] == 0.0  # no refit pending: not judged
    alarm.notify_refit()
    with pytest.warns(RuntimeWarning, match="acceptance length 1.050"):
        assert alarm.check(low)[LowAcceptanceAlarm.METRIC] == 1.0
    alarm.notify_refit()
    assert alarm.check(high)[LowAcceptanceAlarm.METRIC] == 0.0
    alarm.notify_refit()
    tiny = SpecDecodeCounters(2, 6, 0, (0, 0, 0)).as_metrics()  # too few drafts to judge
    assert alarm.check(tiny)[LowAcceptanceAlarm.METRIC] == 0.0
    always = LowAcceptanceAlarm(floor=1.2, only_after_refit=False, min_drafts=1)
    with pytest.warns(RuntimeWarning):
        assert always.check(low)[LowAcceptanceAlarm.METRIC] == 1.0
    assert alarm.num_fired == 1


def test_version_guard():
    guard = DraftVersionGuard(policy_version=3)
    guard.check(3)
    with pytest.raises(DraftVersionMismatchError, match="policy version 2"):
        guard.check(2)
    guard.record(draft_version=7, draft_policy_version=3)
    assert guard.as_dict() == {"policy_version": 3, "draft_version": 7, "draft_policy_version": 3}
    guard.policy_version = 4  # policy refit happened, draft not yet
    assert guard.is_stale
    stale_ok = DraftVersionGuard(policy_version=4, allow_stale_draft=True)
    stale_ok.check(3)


def test_simulate_greedy_rounds_by_hand():
    # prompt [10, 11], generated [20, 21, 22, 23, 24, 25]; k = 2
    seq = [10, 11, 20, 21, 22, 23, 24, 25]
    props = torch.full((8, 2), -1, dtype=torch.long)
    props[1] = torch.tensor([21, 22])  # chain 1 (token 20) guesses 21, 22: both right -> next chain 4
    props[4] = torch.tensor([24, 99])  # chain 4 (token 23): 24 right, 99 wrong -> next chain 6
    props[6] = torch.tensor([0, 0])  # chain 6 (token 25) is the last token: no round
    rounds = simulate_greedy_rounds(props, seq, prompt_len=2)
    assert [(r.chain_index, r.accepted) for r in rounds] == [(1, 2), (4, 1)]


def test_first_mismatch():
    assert first_mismatch([[1, 2], [3]], [[1, 2], [3]]) is None
    assert first_mismatch([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == (1, 1)
    assert first_mismatch([[1, 2]], [[1]]) == (0, 1)


def test_chi2_sf_reference_values():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-9)  # scipy.stats.chi2.ppf(0.95, 1)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(0.0, 4) == 1.0


def test_chi_square_tests_accept_same_and_reject_different():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    a = torch.bincount(torch.multinomial(probs, 20000, True, generator=gen), minlength=4)
    b = torch.bincount(torch.multinomial(probs, 20000, True, generator=gen), minlength=4)
    c = torch.bincount(
        torch.multinomial(torch.tensor([0.45, 0.35, 0.15, 0.05]), 20000, True, generator=gen), minlength=4
    )
    assert chi_square_homogeneity(a, b)[2] > 0.01
    assert chi_square_homogeneity(a, c)[2] < 1e-6
    assert chi_square_goodness_of_fit(a, probs)[2] > 0.01
    assert chi_square_goodness_of_fit(c, probs)[2] < 1e-6
    assert chi_square_goodness_of_fit(torch.tensor([5, 5, 1]), torch.tensor([0.5, 0.5, 0.0]))[2] == 0.0
    assert total_variation(torch.tensor([1, 1]), torch.tensor([1, 0])) == pytest.approx(0.5)


def test_megatron_mtp_to_mimo_mapping_by_hand():
    """eh_proj's [embedding ; hidden] columns become MiMo's [hidden ; embedding]; the MTP transformer layer maps
    like decoder layer 0 (q/k/v split from megatron's grouped linear_qkv, gate/up from linear_fc1)."""
    from nemo_rl_spec.models.hf_weight_mapping import ModelSpec, fuse_qkv
    from nemo_rl_spec.models.mtp_export import (
        megatron_mtp_to_mimo,
        with_zero_qkv_bias,
    )

    spec = ModelSpec(
        "LlamaForCausalLM",
        num_layers=2,
        hidden_size=4,
        ffn_hidden_size=6,
        num_attention_heads=2,
        num_query_groups=1,
        head_dim=2,
        vocab_size=10,
        max_position_embeddings=16,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        qk_layernorm=False,
        tie_word_embeddings=True,
    )
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen)
    q, k, v = r(4, 4), r(2, 4), r(2, 4)
    gate, up = r(6, 4), r(6, 4)
    eh = r(4, 8)
    pre, lay = "mtp.layers.0.", "mtp.layers.0.mtp_model_layer."
    state = {
        "embedding.word_embeddings.weight": r(10, 4),
        "decoder.final_layernorm.weight": r(4),
        "decoder.layers.0.input_layernorm.weight": r(4),  # trunk layers are ignored
        pre + "enorm.weight": r(4),
        pre + "hnorm.weight": r(4),
        pre + "eh_proj.weight": eh,
        pre + "final_layernorm.weight": r(4),
        lay + "input_layernorm.weight": r(4),
        lay + "self_attention.linear_qkv.weight": fuse_qkv(q, k, v, spec),
        lay + "self_attention.linear_proj.weight": r(4, 4),
        lay + "pre_mlp_layernorm.weight": r(4),
        lay + "mlp.linear_fc1.weight": torch.cat([gate, up]),
        lay + "mlp.linear_fc2.weight": r(4, 6),
    }
    out = megatron_mtp_to_mimo(state, spec)
    m = "model.mtp_layers.0."
    assert torch.equal(out[m + "input_proj.weight"], torch.cat([eh[:, 4:], eh[:, :4]], dim=1))
    assert torch.equal(out[m + "token_layernorm.weight"], state[pre + "enorm.weight"])
    assert torch.equal(out[m + "hidden_layernorm.weight"], state[pre + "hnorm.weight"])
    assert torch.equal(out[m + "final_layernorm.weight"], state[pre + "final_layernorm.weight"])
    assert torch.equal(out[m + "self_attn.q_proj.weight"], q) and torch.equal(out[m + "self_attn.v_proj.weight"], v)
    assert torch.equal(out[m + "mlp.gate_proj.weight"], gate) and torch.equal(out[m + "mlp.up_proj.weight"], up)
    assert torch.equal(out[m + "post_attention_layernorm.weight"], state[lay + "pre_mlp_layernorm.weight"])
    assert all(n.startswith(m) for n in out)
    biased = with_zero_qkv_bias(out)
    assert biased[m + "self_attn.k_proj.bias"].shape == (2,) and not biased[m + "self_attn.k_proj.bias"].any()


def test_expand_kernel_fix_by_hand():
    from nemo_rl_spec.models.generation.vllm_patches import expand_kernel_impl

    temps = torch.tensor([0.7, -1.0, 1.3])  # -1 = vLLM's GREEDY_TEMPERATURE
    out = torch.full((6,), float("nan"))
    expand_kernel_impl(out, temps, torch.tensor([2, 2, 6]), -1, 1)  # request 1 has no draft tokens
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.3, 1.3, 1.3, 1.3])
    ks = torch.tensor([5, 0], dtype=torch.int32)
    out_k = torch.zeros(3, dtype=torch.int32)
    expand_kernel_impl(out_k, ks, torch.tensor([1, 3]), 0, 0)
    assert out_k.tolist() == [5, 0, 0]


def test_require_acceptance_fails_near_one():
    """The guard every lossless test runs before equality: 1 + accepted / drafts >= 1.5, else an error naming it."""
    require_acceptance(SpecDecodeCounters(10, 30, 5), "half")  # 1 + 5/10 = 1.5 exactly: passes
    for counters, shown in (
        (SpecDecodeCounters(10, 30, 4), "1.400"),
        (SpecDecodeCounters(100, 300, 0), "1.000"),
        (SpecDecodeCounters(), "nan"),
    ):
        with pytest.raises(AssertionError, match=rf"mtp: acceptance length {shown} < 1.5"):
            require_acceptance(counters, "mtp")
