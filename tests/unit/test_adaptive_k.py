"""Batch-size-aware speculation schedule (nemo_rl_spec/speculative/adaptive_k.py), against hand-worked values
and vLLM's own dense lookup of the same schedule."""

from __future__ import annotations

import json

import pytest

from nemo_rl_spec.speculative.adaptive_k import (
    VLLM_KEY,
    apply_batch_size_schedule,
    derive_schedule,
    engine_schedule,
    expected_tokens_per_step,
    interpolate_cost,
    k_for_batch_size,
    never_drafts,
    predicted_speedups,
    schedule_from_config,
)
from nemo_rl_spec.utils.feature_configs import DynamicSpeculationConfig, validate_schedule

# Hand-worked example. Plain step 1.0 s at batch 1, 2.0 s at batch 9 -> c_AR(b) = 1 + (b-1)/8.
# k=1 step 1.2 / 3.0 s -> c_1(b) = 1.2 + 0.225 (b-1); k=3 step 1.5 / 6.0 s -> c_3(b) = 1.5 + 0.5625 (b-1).
# a = 0.6: E_1 = 1 + 0.6 = 1.6, E_3 = 1 + 0.6 + 0.36 + 0.216 = 2.176.
AR = {1: 1.0, 9: 2.0}
SPEC = {1: {1: 1.2, 9: 3.0}, 3: {1: 1.5, 9: 6.0}}
A = 0.6


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(A, 1) == pytest.approx(1.6)
    assert expected_tokens_per_step(A, 3) == pytest.approx(2.176)
    assert expected_tokens_per_step(0.0, 5) == 1.0
    assert expected_tokens_per_step(1.0, 3) == 4.0
    assert expected_tokens_per_step(A, 0) == 1.0
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.5, 1)


def test_interpolate_cost():
    costs = {1: 0.050, 8: 0.059, 32: 0.128, 64: 0.230}
    assert interpolate_cost(costs, 1) == 0.050
    assert interpolate_cost(costs, 20) == pytest.approx(0.059 + (0.128 - 0.059) * 12 / 24)
    assert interpolate_cost(costs, 96) == pytest.approx(0.230 + (0.230 - 0.128) * 32 / 32)  # extrapolated
    assert interpolate_cost({4: 2.0}, 1) == 2.0
    with pytest.raises(ValueError):
        interpolate_cost({}, 3)


def test_predicted_speedups_by_hand():
    s = predicted_speedups(AR, SPEC, A, 1)
    assert s == pytest.approx({0: 1.0, 1: 1.6 / 1.2, 3: 2.176 / 1.5})
    s = predicted_speedups(AR, SPEC, A, 3)  # c_AR 1.25, c_1 1.65, c_3 2.625
    assert s == pytest.approx({0: 1.0, 1: 1.6 * 1.25 / 1.65, 3: 2.176 * 1.25 / 2.625})
    with_k0 = predicted_speedups(AR, {**SPEC, 0: {1: 1.1, 9: 2.2}}, A, 1)
    assert with_k0[0] == pytest.approx(1.0 / 1.1)


def test_derive_schedule_by_hand():
    # b = 1: k=3 (1.451 > 1.333). b >= 2: k=1 beats k=3 (b=2: 1.263 vs 1.187). k=1 stays >= 1.05 while
    # 1.6 (1 + x/8) >= 1.05 (1.2 + 0.225 x), x = b - 1, i.e. x <= 0.34 / 0.03625 = 9.38 -> b <= 10.
    assert derive_schedule(AR, SPEC, A, max_batch_size=32, min_speedup=1.05) == [(1, 1, 3), (2, 10, 1), (11, 32, 0)]
    # without k = 3 measured (or capped by max_k = 2) only k = 1 remains at b = 1
    assert derive_schedule(AR, SPEC, A, 32, 1.05, max_k=2) == [(1, 10, 1), (11, 32, 0)]
    # per-k acceptance: k=3 with a = 0 never pays, k=1 keeps a = 0.6 -> k=1 from b = 1
    assert derive_schedule(AR, SPEC, {1: A, 3: 0.0}, 32, 1.05) == [(1, 10, 1), (11, 32, 0)]
    with pytest.raises(ValueError, match="k=3"):
        derive_schedule(AR, SPEC, {1: A}, 32)
    # acceptance 0: nothing ever pays
    assert derive_schedule(AR, SPEC, 0.0, 16) == [(1, 16, 0)]
    # a measured k=0 step (drafter prefill only) 10% above plain decoding: k=0's speedup is 1/1.1, so k=1 pays
    # while 1.6 (1 + x/8) >= (1.05/1.1)(1.2 + 0.225 x), i.e. x <= 0.4545 / 0.01477 = 30.8 -> b <= 31
    k0 = {**SPEC, 0: {1: 1.1, 9: 2.2}}
    assert derive_schedule(AR, k0, A, 40, 1.05) == [(1, 1, 3), (2, 31, 1), (32, 40, 0)]


def test_schedule_lookup_matches_vllm():
    vllm_utils = pytest.importorskip("vllm.v1.spec_decode.dynamic.utils")
    schedules = [[(1, 1, 3), (2, 10, 1), (11, 32, 0)], [(1, 4, 5), (9, 16, 2)], [(1, 1, 7)]]
    for sched in schedules:
        dense = vllm_utils.build_dynamic_sd_schedule_lookup([list(r) for r in sched], 64, 5)
        assert [k_for_batch_size(sched, b, max_k=5) for b in range(1, 65)] == dense[1:]
    # hand-worked: gap 5..8 keeps k=5 (capped by 5), tail keeps 2
    assert [k_for_batch_size(schedules[1], b) for b in (1, 4, 5, 8, 9, 16, 17, 200)] == [5, 5, 5, 5, 2, 2, 2, 2]


@pytest.mark.parametrize("bad", [[], [(2, 4, 1)], [(1, 4, 1), (3, 8, 0)], [(1, 4, -1)], [(1, 0, 1)], [(1, 2)]])
def test_validate_schedule_rejects(bad):
    with pytest.raises(ValueError):
        validate_schedule(bad)


def test_config_needs_exactly_one_source(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        DynamicSpeculationConfig()
    costs = tmp_path / "x.json"
    costs.write_text("{}")
    with pytest.raises(ValueError, match="exactly one"):
        DynamicSpeculationConfig(num_speculative_tokens_per_batch_size=[(1, 4, 1)], step_costs=str(costs))
    assert DynamicSpeculationConfig(enabled=False).enabled is False


def test_schedule_from_step_cost_file(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(
        json.dumps(
            {
                "step_costs": {
                    "ar_step_s": {str(b): c for b, c in AR.items()},
                    "spec_step_s": {str(k): {str(b): c for b, c in v.items()} for k, v in SPEC.items()},
                    "acceptance_rate": A,
                }
            }
        )
    )
    cfg = {"step_costs": str(path), "min_speedup": 1.05, "max_batch_size": 32}
    assert schedule_from_config(cfg) == [(1, 1, 3), (2, 10, 1), (11, 32, 0)]
    assert schedule_from_config({**cfg, "acceptance_rate": 0.0}) == [(1, 32, 0)]
    with pytest.raises(ValueError, match="step_costs: no file .*missing.json"):  # refused when the config is read
        schedule_from_config({"step_costs": str(tmp_path / "missing.json")})


def test_apply_batch_size_schedule():
    engine = {"model": "m", "speculative_config": {"method": "eagle3", "model": "d", "num_speculative_tokens": 3}}
    gen = {"dynamic_speculation": {"num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 256, 0]]}}
    out = apply_batch_size_schedule(engine, gen)
    assert out["speculative_config"][VLLM_KEY] == [[1, 4, 3], [5, 256, 0]]
    assert VLLM_KEY not in engine["speculative_config"]  # input untouched
    assert apply_batch_size_schedule(engine, {"dynamic_speculation": None}) is engine
    assert apply_batch_size_schedule(engine, {"dynamic_speculation": {"enabled": False}}) is engine
    with pytest.raises(ValueError, match="speculative_config"):
        apply_batch_size_schedule({"model": "m"}, gen)
    with pytest.raises(ValueError, match="set one"):
        apply_batch_size_schedule({"speculative_config": {**engine["speculative_config"], VLLM_KEY: [[1, 2, 1]]}}, gen)


# ----------------------------------------------------------------------------- the plain k = 0 path (fake engine)
class _FakeLLM:
    """``collective_rpc(fn)`` calls ``fn`` on one in-process worker, as vLLM's uniprocess executor does."""

    def __init__(self, worker):
        self.worker = worker

    def collective_rpc(self, fn, args=()):
        return [fn(self.worker, *args)]


class _Meta:
    def __init__(self, num_draft_tokens):
        self.max_spec_len = max(num_draft_tokens)


def _fake_worker(aux: bool = True):
    from types import SimpleNamespace

    inner = SimpleNamespace(aux_hidden_state_layers=(2, 15, 27))
    calls = []
    runner = SimpleNamespace(
        use_aux_hidden_state_outputs=aux, drafter=SimpleNamespace(), model=SimpleNamespace(model=inner)
    )
    runner.get_model = lambda: runner.model
    runner._prepare_inputs = lambda out, n: ("idx", out["meta"], 1)
    runner.execute_model = lambda out: calls.append(
        (runner.use_aux_hidden_state_outputs, inner.aux_hidden_state_layers)
    )
    runner.drafter.propose = lambda k, **kw: calls.append(("propose", k))
    return SimpleNamespace(model_runner=runner), calls


def test_plain_step_drops_metadata_only_without_drafts():
    from nemo_rl_spec.speculative.adaptive_k import install_plain_step_without_drafts

    worker, _ = _fake_worker()
    llm = _FakeLLM(worker)
    install_plain_step_without_drafts(llm)
    install_plain_step_without_drafts(llm)  # idempotent
    runner = worker.model_runner
    assert runner._prepare_inputs({"meta": _Meta([0, 0, 0])}, None) == ("idx", None, 1)
    with_drafts = _Meta([0, 3, 1])
    assert runner._prepare_inputs({"meta": with_drafts}, None)[1] is with_drafts
    assert runner._prepare_inputs({"meta": None}, None)[1] is None


def test_drafter_skip_turns_aux_capture_off_on_k0_steps_only():
    from types import SimpleNamespace

    import torch

    from nemo_rl_spec.speculative.adaptive_k import install_drafter_skip_at_k0

    worker, calls = _fake_worker()
    install_drafter_skip_at_k0(_FakeLLM(worker))
    runner = worker.model_runner
    runner.execute_model(SimpleNamespace(num_spec_tokens_to_schedule=0))
    runner.execute_model(SimpleNamespace(num_spec_tokens_to_schedule=3))
    runner.execute_model(SimpleNamespace(num_spec_tokens_to_schedule=0))
    assert calls == [(False, ()), (True, (2, 15, 27)), (False, ())]
    cad = SimpleNamespace(batch_size=lambda: 4)
    out = runner.drafter.propose(0, common_attn_metadata=cad, target_positions=torch.zeros(4))
    assert out.shape == (4, 0) and calls[-1] == (False, ())  # k = 0: the drafter is not called
    runner.drafter.propose(2, common_attn_metadata=cad, target_positions=torch.zeros(4))
    assert calls[-1] == ("propose", 2)


def test_drafter_pass_kept_up_to_a_running_batch():
    """drafter_pass_max_batch = 6: k = 0 steps keep the drafter's pass (and the aux capture) at <= 6 running
    requests, skip both above; drafting steps always run it."""
    from types import SimpleNamespace

    import torch

    from nemo_rl_spec.speculative.adaptive_k import install_drafter_skip_at_k0

    worker, calls = _fake_worker()
    install_drafter_skip_at_k0(_FakeLLM(worker), 6)
    runner = worker.model_runner

    def step(k, batch):
        runner.execute_model(
            SimpleNamespace(num_spec_tokens_to_schedule=k, num_scheduled_tokens=dict.fromkeys(range(batch), 1))
        )
        cad = SimpleNamespace(batch_size=lambda: batch)
        return runner.drafter.propose(k, common_attn_metadata=cad, target_positions=torch.zeros(batch))

    assert step(0, 8).shape == (8, 0)  # above the limit: no capture, no pass
    step(0, 6)  # at the limit: capture and pass
    step(3, 2)
    assert calls == [(False, ()), (True, (2, 15, 27)), ("propose", 0), (True, (2, 15, 27)), ("propose", 3)]


def test_drafter_pass_max_batch_needs_the_pass():
    from nemo_rl_spec.utils.feature_configs import DynamicSpeculationConfig

    with pytest.raises(ValueError, match="drafter_pass_max_batch=8 needs drafter_pass_at_k0: true"):
        DynamicSpeculationConfig(
            num_speculative_tokens_per_batch_size=[[1, 4, 3], [5, 32, 0]],
            drafter_pass_at_k0=False,
            drafter_pass_max_batch=8,
        )


@pytest.mark.parametrize(
    "schedule,extra,plain,skip",
    [
        ([[1, 1024, 0]], {}, True, True),  # never drafts: both
        ([[1, 4, 3], [5, 32, 0]], {}, True, False),  # can draft: keep the drafter's KV pass
        ([[1, 4, 3], [5, 32, 0]], {"drafter_pass_at_k0": False}, True, True),
        ([[1, 4, 3], [5, 32, 0]], {"drafter_pass_max_batch": 8}, True, True),  # skipped above 8 only
        ([[1, 1024, 0]], {"plain_step_at_k0": False}, False, False),  # vLLM's own speculative path at k = 0
        ([[1, 4, 3], [5, 32, 0]], {"drafter_pass_at_k0": False, "drafter_catch_up": True}, True, "catch_up"),
        ([[1, 1024, 0]], {"drafter_pass_at_k0": False, "drafter_catch_up": True}, True, True),  # never: no store
    ],
)
def test_install_k0_paths_follows_the_config(schedule, extra, plain, skip):
    from nemo_rl_spec.speculative.adaptive_k import install_k0_paths

    worker, _ = _fake_worker()
    spec = {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3, VLLM_KEY: schedule}
    install_k0_paths(_FakeLLM(worker), spec, {"num_speculative_tokens_per_batch_size": schedule, **extra})
    runner = worker.model_runner
    assert getattr(runner, "_nemo_rl_spec_plain_k0", False) == plain
    assert getattr(runner.drafter, "_nemo_rl_spec_skip_k0", False) == bool(skip)
    assert (getattr(runner.drafter, "_nemo_rl_spec_catch_up", None) is not None) == (skip == "catch_up")


def test_catch_up_records_decode_steps_replays_them_and_keeps_aux_on():
    """drafter_catch_up: k = 0 decode steps above the limit are recorded (no pass), prefill steps and steps at or
    below the limit run the pass, and a request's recorded positions are replayed (vLLM's propose, k = 0) right
    before its next pass; aux capture is never switched off; finished requests are forgotten."""
    from types import SimpleNamespace

    import torch

    from nemo_rl_spec.speculative.adaptive_k import install_drafter_skip_at_k0

    worker, calls = _fake_worker()
    runner = worker.model_runner
    runner.requests = {"a": 0, "b": 1, "c": 2}
    runner.drafter.max_num_tokens = 64
    backend = pytest.importorskip("vllm.v1.attention.backend")
    runner.drafter.propose = lambda num_speculative_tokens, **kw: calls.append(
        ("propose", num_speculative_tokens, kw["target_positions"].tolist())
    )
    install_drafter_skip_at_k0(_FakeLLM(worker), 2, True)
    store = runner.drafter._nemo_rl_spec_catch_up

    def step(k, req_ids, positions, query_len=1):
        runner.input_batch = SimpleNamespace(req_ids=list(req_ids))
        b = len(req_ids)
        qsl = torch.arange(0, b * query_len + 1, query_len, dtype=torch.int32)
        cad = backend.CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl,
            seq_lens=torch.tensor([p + query_len for p in positions], dtype=torch.int32),
            num_reqs=b,
            num_actual_tokens=b * query_len,
            max_query_len=query_len,
            max_seq_len=max(positions) + query_len,
            block_table_tensor=torch.arange(b * 2).view(b, 2),
            slot_mapping=torch.arange(b * query_len),
        )
        pos = torch.tensor([p + i for p in positions for i in range(query_len)])
        return runner.drafter.propose(
            k,
            common_attn_metadata=cad,
            target_positions=pos,
            target_token_ids=pos * 10,
            target_hidden_states=pos[:, None].float(),
            next_token_ids=torch.zeros(b, dtype=torch.int32),
            sampling_metadata=None,
        )

    runner.execute_model(SimpleNamespace(num_spec_tokens_to_schedule=0))
    assert calls == [(True, (2, 15, 27))]  # aux capture untouched
    step(0, "abc", [0, 0, 0], query_len=4)  # prefill: the pass runs
    assert calls[-1] == ("propose", 0, list(range(4)) * 3)
    assert step(0, "abc", [4, 4, 4]).shape == (3, 0)  # recorded, no pass
    assert step(0, "abc", [5, 5, 5]).shape == (3, 0)
    assert len(calls) == 2 and store.pending == {"a", "b", "c"}
    del runner.requests["c"]  # c finished
    step(0, "ab", [6, 6])  # at the limit: replay a and b (positions 4-5), then the step's own pass
    assert calls[-2:] == [("propose", 0, [4, 5, 4, 5]), ("propose", 0, [6, 6])] and store.replayed_tokens == 4
    assert store.pending == set() and store.steps == []


def test_catch_up_needs_a_skipped_pass_and_a_hidden_state_drafter():
    from nemo_rl_spec.speculative.adaptive_k import install_k0_paths
    from nemo_rl_spec.utils.feature_configs import DynamicSpeculationConfig

    schedule = [[1, 4, 3], [5, 32, 0]]
    with pytest.raises(ValueError, match="drafter_catch_up=true needs a skipped drafter pass"):
        DynamicSpeculationConfig(num_speculative_tokens_per_batch_size=schedule, drafter_catch_up=True)
    DynamicSpeculationConfig(
        num_speculative_tokens_per_batch_size=schedule, drafter_catch_up=True, drafter_pass_max_batch=8
    )
    worker, _ = _fake_worker()
    spec = {"method": "draft_model", "model": "/d", "num_speculative_tokens": 3, VLLM_KEY: schedule}
    dynamic = {"num_speculative_tokens_per_batch_size": schedule, "drafter_pass_at_k0": False, "drafter_catch_up": True}
    with pytest.raises(ValueError, match="drafter_catch_up needs a drafter fed the target's hidden states"):
        install_k0_paths(_FakeLLM(worker), spec, dynamic)


def test_install_k0_paths_without_a_schedule_only_takes_the_plain_sampler():
    from nemo_rl_spec.speculative.adaptive_k import install_k0_paths

    worker, _ = _fake_worker()
    install_k0_paths(_FakeLLM(worker), {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}, None)
    assert worker.model_runner._nemo_rl_spec_plain_k0
    assert not getattr(worker.model_runner.drafter, "_nemo_rl_spec_skip_k0", False)


@pytest.mark.parametrize(
    "schedule,max_k,max_running,expected",
    [
        ([[1, 32, 0]], None, None, True),  # k = 0 everywhere (the tail keeps k = 0)
        ([[1, 1024, 0]], 3, None, True),  # bench_sync_vs_async's speculative@k0 variant
        ([[1, 4, 3], [5, 32, 0]], 3, None, False),  # drafts in the tail (the default spec recipe's shape)
        ([[1, 4, 0], [5, 32, 0]], None, None, True),
        ([[1, 8, 0], [9, 16, 2]], None, None, False),  # drafts from b = 9 ...
        ([[1, 8, 0], [9, 16, 2]], None, 8, True),  # ... which an engine of max_num_seqs 8 never reaches
        ([[1, 8, 0], [9, 16, 2]], None, 9, False),
        ([[1, 8, 0], [12, 16, 2]], None, 11, True),  # b = 9..11 fall in the gap: the previous range's k = 0
        ([[1, 2, 0], [3, 4, 1], [5, 8, 0]], None, None, False),  # one drafting range in the middle
        ([[1, 4, 3]], 0, None, True),  # capped at num_speculative_tokens = 0
    ],
)
def test_never_drafts_by_hand(schedule, max_k, max_running, expected):
    assert never_drafts(schedule, max_k, max_running) is expected
    # the same as asking k_for_batch_size at every batch size the engine can reach
    reach = range(1, (max_running or 64) + 1)
    assert expected == all(k_for_batch_size(schedule, b, max_k) == 0 for b in reach)


def test_never_drafts_rejects_an_invalid_schedule():
    with pytest.raises(ValueError, match="first range must start at batch size 1"):
        never_drafts([[2, 4, 0]])


def test_engine_schedule_sources(tmp_path):
    from nemo_rl_spec.utils.feature_configs import SpeculativeConfig

    class Gen:  # the two attributes engine_schedule reads from a GenerationConfig
        def __init__(self, spec, dynamic):
            self.speculative_config = None if spec is None else SpeculativeConfig.model_validate(spec)
            self.dynamic_speculation = None if dynamic is None else DynamicSpeculationConfig(**dynamic)

    spec = {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    assert engine_schedule(Gen(None, None)) is None  # no speculation
    assert engine_schedule(Gen(spec, None)) is None  # fixed k = 3 at every batch size
    assert engine_schedule(Gen({**spec, VLLM_KEY: [[1, 32, 0]]}, None)) == [(1, 32, 0)]  # set by hand
    dyn = {"num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 32, 0]]}
    assert engine_schedule(Gen(spec, dyn)) == [(1, 4, 3), (5, 32, 0)]
    assert engine_schedule(Gen(spec, {**dyn, "enabled": False})) is None
    # derived from the hand-worked costs above (test_derive_schedule_by_hand)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"step_costs": {"ar_step_s": AR, "spec_step_s": SPEC}}))
    derived = {"step_costs": str(path), "acceptance_rate": A, "max_batch_size": 32, "min_speedup": 1.05}
    assert engine_schedule(Gen(spec, derived)) == [(1, 1, 3), (2, 10, 1), (11, 32, 0)]
    assert not never_drafts(engine_schedule(Gen(spec, derived)), 3)
    nothing_pays = {**derived, "acceptance_rate": 0.0, "max_batch_size": 16}
    assert engine_schedule(Gen(spec, nothing_pays)) == [(1, 16, 0)]
    assert never_drafts(engine_schedule(Gen(spec, nothing_pays)), 3)


def test_install_k0_paths_skips_the_drafter_when_drafting_is_out_of_reach():
    """A schedule that drafts only above the engine's max_num_seqs never drafts there: no drafter pass."""
    from nemo_rl_spec.speculative.adaptive_k import install_k0_paths

    schedule = [[1, 8, 0], [9, 16, 2]]
    spec = {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3, VLLM_KEY: schedule}
    for max_running, skip in ((8, True), (16, False), (None, False)):
        worker, _ = _fake_worker()
        install_k0_paths(_FakeLLM(worker), spec, {"num_speculative_tokens_per_batch_size": schedule}, max_running)
        assert getattr(worker.model_runner.drafter, "_nemo_rl_spec_skip_k0", False) == skip, max_running
