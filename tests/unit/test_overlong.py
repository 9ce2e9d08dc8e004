"""grpo.overlong_filtering: exactly the rows cut off by a length limit leave the loss (hand-built batch)."""

from __future__ import annotations

import torch

from nemo_rl_spec.algorithms.overlong import apply_overlong_filtering, truncated_rows

EOS = 2


def _batch():
    """Prompt of 2 tokens, max_new_tokens 4, max_model_len 7. Rows: 0 hits max_new_tokens without EOS (cut);
    1 ends with EOS exactly at the limit (complete); 2 ends early with EOS; 3 stops early without EOS (a stop
    string, complete); 4 has a 3-token prompt and reaches max_model_len 7 with 4 response tokens, no EOS (cut);
    5 has a 4-token prompt and reaches max_model_len with 3 response tokens (cut)."""
    rows = [
        ([5, 6], [7, 8, 9, 10]),
        ([5, 6], [7, 8, 9, EOS]),
        ([5, 6], [7, EOS]),
        ([5, 6], [7, 8]),
        ([5, 6, 4], [7, 8, 9, 10]),
        ([5, 6, 4, 3], [7, 8, 9]),
    ]
    ids, tmask = torch.zeros(6, 8, dtype=torch.long), torch.zeros(6, 8)
    for b, (p, r) in enumerate(rows):
        ids[b, : len(p) + len(r)] = torch.tensor(p + r)
        tmask[b, len(p) : len(p) + len(r)] = 1.0
    lengths = torch.tensor([len(p) + len(r) for p, r in rows])
    return {"input_ids": ids, "input_lengths": lengths, "token_mask": tmask, "sample_mask": torch.ones(6)}


def test_truncated_rows_and_mask():
    data = _batch()
    truncated = truncated_rows(data, max_new_tokens=4, max_model_len=7, eos_token_id=EOS)
    assert truncated.tolist() == [True, False, False, False, True, True]
    data["sample_mask"][3] = 0.0  # an already-masked row stays masked
    metrics = apply_overlong_filtering(data, truncated)
    assert data["sample_mask"].tolist() == [0.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert metrics == {"train/overlong_filtered": 3.0, "train/overlong_fraction": 0.5}


def test_stop_tokens_and_stop_strings_end_a_response_normally():
    """policy.generation.stop_token_ids / stop_strings: row 0 ends with stop token 10 at the limit (complete); row 4
    (cut at max_model_len) decodes to "7 8 9 10", which contains the stop string "8 9" (complete); row 5 decodes to
    "7 8 9": no stop string "9 10" in it, still cut."""
    data = _batch()
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    ends = [EOS, 10]
    assert truncated_rows(data, 4, 7, ends).tolist() == [False, False, False, False, False, True]
    assert truncated_rows(data, 4, 7, EOS, ["8 9"], decode).tolist() == [False, False, False, False, False, False]
    assert truncated_rows(data, 4, 7, EOS, ["9 10"], decode).tolist() == [False, False, False, False, False, True]
