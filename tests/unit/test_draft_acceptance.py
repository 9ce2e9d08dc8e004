"""Offline acceptance estimates (speculative/acceptance.py) and the resumable draft-init stages
(algorithms/draft_init.py), against hand-worked values and independent loops."""

from __future__ import annotations

import json
import math

import pytest
import torch

from nemo_rl_spec.algorithms import draft_init
from nemo_rl_spec.speculative.acceptance import chain_acceptance_length, expected_acceptance, step_acceptance
from nemo_rl_spec.speculative.draft_trainer import DraftTrainer
from nemo_rl_spec.speculative.eagle3 import Eagle3Config, Eagle3DraftHead
from nemo_rl_spec.speculative.offline import PolicyOutputCache


@pytest.mark.numerics
def test_chain_acceptance_length_hand_worked():
    # 1 + a0 + a0 a1 + a0 a1 a2
    assert float(chain_acceptance_length(torch.tensor([0.5, 0.5, 0.5]))) == pytest.approx(1.875)
    assert float(chain_acceptance_length(torch.tensor([1.0, 0.0, 1.0]))) == pytest.approx(2.0)
    assert chain_acceptance_length(torch.zeros(4, 3)).tolist() == [1.0] * 4


@pytest.mark.numerics
def test_step_acceptance_greedy_and_probabilistic_hand_worked():
    p = torch.tensor([0.6, 0.3, 0.1])
    z = torch.log(torch.tensor([0.2, 0.7, 0.1]))  # draft logits at temperature 1
    lp = p.log()
    # greedy: the draft proposes its argmax (token 1), accepted with p(1) = 0.3
    assert float(step_acceptance(z, lp, 1.0, "greedy")) == pytest.approx(0.3)
    # probabilistic: sum_v min(p, q) = 0.2 + 0.3 + 0.1
    assert float(step_acceptance(z, lp, 1.0, "probabilistic")) == pytest.approx(0.6)
    # at T = 0.5 the draft samples from softmax(z / 0.5) ~ q^2 normalised
    q = torch.tensor([0.04, 0.49, 0.01]) / 0.54
    assert float(step_acceptance(z, lp, 0.5, "probabilistic")) == pytest.approx(float(torch.minimum(p, q).sum()))
    with pytest.raises(ValueError, match="draft_sample_method"):
        step_acceptance(z, lp, 1.0, "typical")


def _tiny_head(vocab: int = 11, seed: int = 0) -> Eagle3DraftHead:
    cfg = Eagle3Config(
        hidden_size=8,
        target_hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=4,
        intermediate_size=16,
        vocab_size=vocab,
        draft_vocab_size=vocab,
        aux_layer_ids=(0, 1, 2),
        target_num_hidden_layers=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
    )
    head = Eagle3DraftHead(cfg)
    head.reset_parameters(seed=seed, std=0.5)
    head.set_target_embeddings(torch.randn(vocab, 8, generator=torch.Generator().manual_seed(seed + 1)))
    return head


@pytest.mark.numerics
def test_expected_acceptance_matches_an_independent_loop():
    torch.manual_seed(0)
    head = _tiny_head()
    B, S, V, k, T = 2, 9, 11, 3, 0.7
    aux = torch.randn(B, S, 24)
    ids = torch.randint(0, V, (B, S))
    mask = torch.zeros(B, S, dtype=torch.bool)
    mask[0, 4:] = True
    mask[1, 5:8] = True  # a shorter response, then padding
    lp = torch.log_softmax(torch.randn(B, S, V), -1)
    res = expected_acceptance(head, aux, ids, mask, lp, T, k)
    logits = head.unroll(aux, ids, k)
    for method in ("greedy", "probabilistic"):
        lengths, steps0 = [], []
        for b in range(B):
            for t in range(S):
                if t + 2 >= S or not mask[b, t + 2]:
                    continue
                acc = []
                for j in range(k):
                    pos = t + 2 + j  # the token drafted by step j; its distribution sits at pos - 1
                    if pos >= S or not mask[b, pos]:
                        acc.append(0.0)
                        continue
                    p = lp[b, pos - 1].exp()
                    z = logits[j][b, t]
                    if method == "greedy":
                        acc.append(float(p[z.argmax()]))
                    else:
                        acc.append(float(torch.minimum(p, torch.softmax(z / T, -1)).sum()))
                steps0.append(acc[0])
                lengths.append(1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2])
        # starts t whose first drafted token t + 2 is a response token: t = 2..6 in row 0, 3..5 in row 1
        assert res["chains"] == len(lengths) == 5 + 3
        assert res[f"{method}/acceptance_length"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-5)
        assert res[f"{method}/step0"] == pytest.approx(sum(steps0) / len(steps0), rel=1e-5)
    assert res["oracle_greedy/acceptance_length"] >= res["greedy/acceptance_length"]


def test_measured_vocab_sizes_by_coverage():
    # responses: token 5 x6, token 7 x3, token 9 x1 (prompt tokens 1, 2 ignored); EOS 0 always included
    seqs = [[1, 2, 5, 5, 5, 7], [1, 5, 5, 5, 7, 7, 9]]
    plens = [2, 1]
    vocab, info = draft_init.measured_vocab(seqs, plens, 12, [0], coverage=0.85, size=None)
    assert vocab.tolist() == [0, 5, 7] and info["coverage"] == pytest.approx(0.9)  # 9 of 10 response tokens
    vocab, info = draft_init.measured_vocab(seqs, plens, 12, [0], coverage=1.0, size=None)
    assert vocab.tolist() == [0, 5, 7, 9] and info["coverage"] == pytest.approx(1.0)
    vocab, _ = draft_init.measured_vocab(seqs, plens, 12, [0], coverage=0.5, size=2)
    assert vocab.tolist() == [0, 5]
    assert info["distinct_response_tokens"] == 3


def test_batch_rows_are_epochs_without_replacement_and_reproducible():
    rows = list(range(100, 110))
    seen = [r for step in range(5) for r in draft_init.batch_rows(rows, 2, 3, step)]
    assert sorted(seen) == rows  # one epoch covers every row once
    assert draft_init.batch_rows(rows, 2, 3, 7) == draft_init.batch_rows(rows, 2, 3, 7)  # resume draws the same


def test_samples_file_roundtrip_and_state_resume(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text(
        json.dumps({"call": 1, "rows": [[2, [1, 2, 9], 2]]})
        + "\n"
        + json.dumps({"call": 0, "rows": [[0, [1, 3], 1], [1, [1, 4, 4], 1]]})
        + "\n"
    )
    s = draft_init.read_samples(path)
    assert s.prompt_index == [0, 1, 2] and s.sequences[2] == [1, 2, 9] and s.prompt_lengths == [1, 1, 2]

    class Interrupted(Exception):
        pass

    def run(steps, state_path, interrupt_at=None):
        torch.manual_seed(0)
        head = _tiny_head()
        trainer = DraftTrainer(head, lr=1e-2, ttt_steps=2)
        seqs = [
            [int(x) for x in torch.randint(0, 11, (8,), generator=torch.Generator().manual_seed(i))] for i in range(6)
        ]
        samples = draft_init.Samples(list(range(6)), seqs, [3] * 6)
        aux = [torch.randn(8, 24, generator=torch.Generator().manual_seed(10 + i)) for i in range(6)]
        lps = [
            torch.log_softmax(torch.randn(8, 11, generator=torch.Generator().manual_seed(20 + i)), -1) for i in range(6)
        ]
        cache = PolicyOutputCache(aux, lps, [torch.zeros(8) for _ in range(6)], 1.0)
        state = draft_init.load_state(state_path, trainer)

        def save(st):
            draft_init.save_state(state_path, trainer, st)
            if st["step"] == interrupt_at:
                raise Interrupted  # killed right after the checkpoint of step 3

        state = draft_init.train(trainer, cache, samples, [0, 1, 2, 3], [4, 5], steps, 2, 0, 2, state, save, 1)
        return trainer.head.state_dict(), state

    full, st_full = run(5, tmp_path / "a.pt")
    with pytest.raises(Interrupted):
        run(5, tmp_path / "b.pt", interrupt_at=3)
    resumed, st_res = run(5, tmp_path / "b.pt")  # the same command again finishes the run
    assert st_res["step"] == 5 and len(st_res["history"]) == 5
    assert [p["step"] for p in st_res["curve"]] == [2, 4, 5]
    for name, t in full.items():
        assert torch.equal(t, resumed[name]), name
    assert math.isclose(
        st_full["curve"][-1]["greedy/acceptance_length"], st_res["curve"][-1]["greedy/acceptance_length"]
    )


def test_plot_curves_writes_a_png(tmp_path):
    point = {
        "greedy/acceptance_length": 1.5,
        "probabilistic/acceptance_length": 1.7,
        "oracle_greedy/acceptance_length": 2.4,
    }
    summary = {
        "ttt_steps": 3,
        "model": "m",
        "temperature": 0.7,
        "acceptance_vs_steps": [{"step": 50, **point}, {"step": 100, **point}],
        "acceptance_vs_data": [{"train_sequences": 10, **point}, {"train_sequences": 40, **point}],
    }
    draft_init.plot_curves(summary, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
