"""Pure pieces of the Megatron scale-out: TP slicing of HF-layout tensors, rank coordinates, metric combination, and
the vocab-parallel log-prob / argmax in a real 2-process gloo world (no megatron import).

The vocab-parallel checks compare against the unsharded computation (``log_softmax`` + ``gather``, its autograd
gradient, ``argmax``) on the same logits, each rank holding half of the vocabulary.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from nemo_rl_spec.models.hf_weight_mapping import (
    ModelSpec,
    check_tp_size,
    fuse_qkv,
    tp_partition,
    tp_shard,
    tp_unshard,
)
from nemo_rl_spec.models.policy.parallel import ParallelLayout, combine_metrics

SPEC = ModelSpec(
    architecture="Qwen3ForCausalLM",
    num_layers=1,
    hidden_size=8,
    ffn_hidden_size=6,
    num_attention_heads=4,
    num_query_groups=2,
    head_dim=2,
    vocab_size=10,
    max_position_embeddings=16,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    qk_layernorm=True,
    tie_word_embeddings=True,
)


def test_partition_rules_by_megatron_name():
    rules = {
        "decoder.layers.0.self_attention.linear_qkv.weight": "rows",
        "mtp.layers.0.eh_proj.weight": "rows",
        "embedding.word_embeddings.weight": "rows",
        "output_layer.weight": "rows",
        "decoder.layers.0.mlp.linear_fc1.weight": "glu",
        "mtp.layers.0.mtp_model_layer.mlp.linear_fc1.weight": "glu",
        "decoder.layers.0.self_attention.linear_proj.weight": "cols",
        "decoder.layers.0.mlp.linear_fc2.weight": "cols",
        "decoder.layers.0.input_layernorm.weight": None,
        "decoder.layers.0.self_attention.q_layernorm.weight": None,
        "decoder.final_layernorm.weight": None,
    }
    assert {name: tp_partition(name) for name in rules} == rules


def test_glu_shard_is_gate_and_up_of_the_rank():
    gate, up = torch.arange(12.0).reshape(6, 2), 100 + torch.arange(12.0).reshape(6, 2)
    fc1 = torch.cat([gate, up])
    shards = [tp_shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, r, 2) for r in range(2)]
    assert torch.equal(shards[1], torch.cat([gate[3:], up[3:]]))  # megatron: silu on the local first half
    assert torch.equal(tp_unshard("decoder.layers.0.mlp.linear_fc1.weight", shards), fc1)


def test_qkv_shard_holds_whole_query_groups():
    q, k, v = (torch.randn(n * SPEC.head_dim, 8) for n in (4, 2, 2))
    fused = fuse_qkv(q, k, v, SPEC)
    rank1 = tp_shard("decoder.layers.0.self_attention.linear_qkv.weight", fused, 1, 2)
    # group 1 = query heads 2, 3, then key head 1, value head 1
    assert torch.equal(rank1, torch.cat([q[4:8], k[2:4], v[2:4]]))


@pytest.mark.parametrize(
    "name, shape",
    [
        ("decoder.layers.0.self_attention.linear_proj.weight", (8, 8)),
        ("embedding.word_embeddings.weight", (10, 8)),
        ("decoder.layers.0.input_layernorm.weight", (8,)),
    ],
)
def test_shard_unshard_round_trip(name, shape):
    full = torch.randn(shape)
    shards = [tp_shard(name, full, r, 2) for r in range(2)]
    assert torch.equal(tp_unshard(name, shards), full)
    if tp_partition(name) == "cols":
        assert shards[0].shape == (8, 4)


def test_check_tp_size_names_the_key():
    check_tp_size(SPEC, 2)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=4 does not divide .*num_key_value_heads"):
        check_tp_size(SPEC, 4)


def test_megatron_rank_order_tp_fastest():
    coords = [ParallelLayout.of_rank(r, tp_size=2, pp_size=1, world_size=4) for r in range(4)]
    assert [(c["dp_rank"], c["tp_rank"]) for c in coords] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_combine_metrics_sums_maxes_and_skips_missing():
    parts = [{"loss": 1.0, "lp_max": 2.0, "n": 3.0}, {}, {"loss": 0.5, "lp_max": 5.0, "n": 1.0}]
    assert combine_metrics(parts) == {"loss": 1.5, "lp_max": 5.0, "n": 4.0}
    with pytest.raises(ValueError, match="no rows"):
        combine_metrics([{}, {}])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _vocab_parallel_rank(rank: int, port: int, logits: torch.Tensor, targets: torch.Tensor, out: dict) -> None:
    import torch.distributed as dist

    from nemo_rl_spec.models.policy.vocab_parallel import gather_vocab, target_logprobs, vocab_argmax

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        half = logits.shape[-1] // 2
        shard = logits[..., rank * half : (rank + 1) * half].clone().requires_grad_(True)
        lp = target_logprobs(shard, targets, temperature=0.7, group=dist.group.WORLD)
        (lp * torch.arange(1.0, 1.0 + lp.numel()).view_as(lp)).sum().backward()  # a non-uniform upstream gradient
        out[rank] = {
            "logprobs": lp.detach(),
            "grad": shard.grad,
            "argmax": vocab_argmax(shard, dist.group.WORLD),
            "gathered": gather_vocab(shard.detach(), dist.group.WORLD),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.numerics
def test_vocab_parallel_logprobs_grad_and_argmax_equal_unsharded():
    gen = torch.Generator().manual_seed(0)
    logits = 4.0 * torch.randn(2, 5, 12, generator=gen)
    logits[0, 0, 2] = logits[0, 0, 9] = logits[0, 0].max() + 1.0  # tie across shards: the lower id wins
    targets = torch.randint(0, 12, (2, 5), generator=gen)
    targets[0, :2] = torch.tensor([3, 8])  # one target on each shard
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_vocab_parallel_rank, args=(_free_port(), logits, targets, out), nprocs=2)
        out = dict(out)
    full = logits.clone().requires_grad_(True)
    expected = torch.log_softmax(full / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    upstream = torch.arange(1.0, 1.0 + expected.numel()).view_as(expected)
    (expected * upstream).sum().backward()
    # Bound (fp32, eps = 2^-23; docs/design/numerical_tolerances.md). Both sides compute lp = z_t - m - log sum_v
    # exp(z_v - m), z = logits / T, V = 12 (here max|z| ~ 19.5, |lp| up to ~24, where one ulp is 1.9e-6): the sum of V
    # positive exps in two orders (two shards vs one vectorised row) differs by <= 2(V-1) eps relative, each exp and
    # the log by ~1 ulp, and the subtractions round at |z| and |lp|:
    #   |d lp| <= eps (2V + 4 + 2 max|z| + 2|lp|)                                    per row
    # The gradient is u (onehot - p) / T (u: upstream 1..10); p = exp(lp_v) inherits d lp_v, |d p| <= p |d lp_v|,
    # and p |lp_v| <= 1/e:
    #   |d grad| <= eps |u| / T (2V + 5 + 2 max|z|)                                     per row
    # A wrong normaliser (a shard's own max or sum) moves lp by O(1), far above both (~1e-5 and ~1e-4 here).
    eps, vocab, temp = torch.finfo(torch.float32).eps, logits.shape[-1], 0.7
    zmax = (logits / temp).abs().amax(-1)
    lp_tol = eps * (2 * vocab + 4 + 2 * zmax + 2 * expected.detach().abs())
    grad_tol = (eps * upstream / temp * (2 * vocab + 5 + 2 * zmax)).unsqueeze(-1)
    for rank in range(2):
        assert ((out[rank]["logprobs"] - expected.detach()).abs() <= lp_tol).all()
        expected_grad = full.grad[..., rank * 6 : (rank + 1) * 6]
        assert ((out[rank]["grad"] - expected_grad).abs() <= grad_tol).all()
        assert torch.equal(out[rank]["argmax"], logits.argmax(-1)) and out[rank]["argmax"][0, 0] == 2
        assert torch.equal(out[rank]["gathered"], logits)
