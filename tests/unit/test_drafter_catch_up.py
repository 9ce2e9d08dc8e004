"""DrafterCatchUp against hand-worked batches: what a skipped decode step records, which positions a request
replays (contiguous, ending right before its current query), the chunking of long replays and the attention
metadata of a replay pass (vLLM's own CommonAttentionMetadata). The real-engine check (same drafts as the full
pass, a negative control) is tests/functional/test_drafter_catch_up_engine.py (slow tier)."""

from __future__ import annotations

import pytest
import torch

from nemo_rl_spec.speculative.drafter_catch_up import CatchUpRun, DrafterCatchUp, pack_chunks

D = 4  # hidden width of the fake target states


def _cad(query_lens, seq_lens, block_table=None, slots=None):
    backend = pytest.importorskip("vllm.v1.attention.backend")
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    n = int(qsl[-1])
    return backend.CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(query_lens),
        num_actual_tokens=n,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table if block_table is not None else torch.arange(len(query_lens) * 4).view(-1, 4),
        slot_mapping=slots if slots is not None else torch.arange(100, 100 + n, dtype=torch.int64),
    )


def _decode_step(positions, tokens, slots):
    """propose() kwargs of a decode step: one token per request at ``positions``; hidden row = position + 0.5."""
    b = len(positions)
    return {
        "target_token_ids": torch.tensor(tokens),
        "target_positions": torch.tensor(positions),
        "target_hidden_states": (torch.tensor(positions, dtype=torch.float32) + 0.5)[:, None].repeat(1, D),
        "next_token_ids": torch.zeros(b, dtype=torch.int32),
        "common_attn_metadata": _cad([1] * b, [p + 1 for p in positions], slots=torch.tensor(slots)),
        "sampling_metadata": "sm",
    }


def test_replays_the_contiguous_skipped_positions_of_each_request():
    store = DrafterCatchUp(max_tokens_per_pass=64)
    # requests a, b, c decode positions 10-12 (a), 20-22 (b), 30 only (c: then finished)
    store.record(["a", "b", "c"], _decode_step([10, 20, 30], [1, 2, 3], [510, 520, 530]))
    store.record(["a", "b"], _decode_step([11, 21], [4, 5], [511, 521]))
    store.record(["b", "a"], _decode_step([22, 12], [6, 7], [522, 512]))  # rows reordered (vLLM condenses)
    store.forget_all_but({"a", "b"})  # c left the engine
    assert store.pending == {"a", "b"} and len(store.steps) == 3

    now = _decode_step([13, 23], [8, 9], [0, 0])  # the step whose drafter pass runs: a at row 0, b at row 1
    runs = store.runs_for(["a", "b"], now)
    a, b = runs
    assert (a.batch_row, b.batch_row) == (0, 1)
    assert a.positions.tolist() == [10, 11, 12] and a.token_ids.tolist() == [1, 4, 7] and a.next_token_id == 8
    assert b.positions.tolist() == [20, 21, 22] and b.token_ids.tolist() == [2, 5, 6] and b.next_token_id == 9
    assert a.slots.tolist() == [510, 511, 512] and b.slots.tolist() == [520, 521, 522]
    assert torch.equal(a.hidden_states[:, 0], torch.tensor([10.5, 11.5, 12.5]))
    # both requests are now caught up: nothing is kept
    assert store.pending == set() and store.steps == []


def test_a_gap_ends_the_run_and_other_requests_keep_theirs():
    store = DrafterCatchUp(max_tokens_per_pass=64)
    store.record(["a", "b"], _decode_step([5, 40], [1, 2], [5, 40]))
    store.record(["a", "b"], _decode_step([6, 41], [3, 4], [6, 41]))
    # a's pass ran at position 7 (not recorded); then a skipped 8 and 9
    store.record(["a", "b"], _decode_step([8, 42], [5, 6], [8, 42]))
    store.record(["a", "b"], _decode_step([9, 43], [7, 8], [9, 43]))
    (run,) = store.runs_for(["a"], _decode_step([10], [9], [10]))
    assert run.positions.tolist() == [8, 9] and run.token_ids.tolist() == [5, 7] and run.next_token_id == 9
    # b was not in that step: still pending with all four positions
    assert store.pending == {"b"} and len(store.steps) == 4
    (run_b,) = store.runs_for(["x", "b"], _decode_step([0, 44], [0, 10], [0, 44]))
    assert run_b.batch_row == 1 and run_b.positions.tolist() == [40, 41, 42, 43]


def test_a_request_whose_query_does_not_follow_its_records_replays_nothing():
    store = DrafterCatchUp(max_tokens_per_pass=64)
    store.record(["a"], _decode_step([5], [1], [5]))
    assert store.runs_for(["a"], _decode_step([7], [2], [7])) == []  # position 6 was never recorded
    assert store.pending == set() and store.steps == []


def _run(row, first, m, next_token):
    pos = torch.arange(first, first + m)
    return CatchUpRun(row, pos * 10, pos, pos + 1000, pos[:, None].float().repeat(1, D), next_token)


def test_long_replays_are_chunked_in_position_order():
    a, b = _run(0, 0, 5, 99), _run(1, 50, 3, 77)
    passes = pack_chunks([a, b], max_tokens=4)
    assert [[(c.batch_row, c.positions.tolist(), c.next_token_id) for c in p] for p in passes] == [
        [(0, [0, 1, 2, 3], 40)],  # next token: a's token at position 4
        [(0, [4], 99), (1, [50, 51, 52], 77)],
    ]
    assert len(pack_chunks([a, b], max_tokens=8)) == 1
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        pack_chunks([a], 0)


def test_replay_feeds_vllms_propose_a_prefill_of_the_skipped_positions():
    block_table = torch.tensor([[7, 8, 9, 0], [3, 4, 0, 0], [5, 6, 0, 0]])
    store = DrafterCatchUp(max_tokens_per_pass=4)
    current = _decode_step([60, 5, 52], [1, 2, 3], [0, 0, 0])
    current["common_attn_metadata"] = current["common_attn_metadata"].replace(block_table_tensor=block_table)
    calls = []
    total = store.replay(
        [_run(0, 55, 5, 11), _run(2, 50, 2, 22)], lambda **kw: calls.append(kw) or torch.empty(0), current
    )
    assert total == 7 and store.replayed_tokens == 7 and len(calls) == 2
    first, second = calls
    assert first["num_speculative_tokens"] == 0 and first["token_indices_to_sample"] is None
    assert first["target_positions"].tolist() == [55, 56, 57, 58]
    assert first["target_token_ids"].tolist() == [550, 560, 570, 580] and first["next_token_ids"].tolist() == [590]
    cad = first["common_attn_metadata"]
    assert cad.query_start_loc.tolist() == [0, 4] and cad.seq_lens.tolist() == [59]
    assert cad.block_table_tensor.tolist() == [[7, 8, 9, 0]] and cad.slot_mapping.tolist() == [1055, 1056, 1057, 1058]
    assert (cad.num_reqs, cad.num_actual_tokens, cad.max_query_len, cad.max_seq_len) == (1, 4, 4, 59)
    assert second["target_positions"].tolist() == [59, 50, 51] and second["next_token_ids"].tolist() == [11, 22]
    cad = second["common_attn_metadata"]
    assert cad.query_start_loc.tolist() == [0, 1, 3] and cad.seq_lens.tolist() == [60, 52]
    assert cad.block_table_tensor.tolist() == [[7, 8, 9, 0], [5, 6, 0, 0]]
    assert cad.slot_mapping.tolist() == [1059, 1050, 1051] and cad.max_seq_len == 60
    assert second["target_hidden_states"].shape == (3, D) and second["sampling_metadata"] == "sm"


def test_bad_buffer_size_is_refused():
    with pytest.raises(ValueError, match="max_tokens_per_pass must be >= 1"):
        DrafterCatchUp(0)
