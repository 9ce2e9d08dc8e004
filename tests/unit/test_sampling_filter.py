"""The trainer's top-k / top-p filter (models/policy/sampling_filter.py) against vLLM's own sampler code, and the
filtered log-probs against ``log_softmax`` of vLLM's filtered logits."""

import pytest
import torch

from nemo_rl_spec.models.policy.sampling_filter import SamplingFilter
from nemo_rl_spec.models.policy.vocab_parallel import target_logprobs, token_logprobs
from nemo_rl_spec.utils.config import load_config

pytestmark = pytest.mark.numerics  # fp32 comparisons with bounds derived in logsumexp_bound

CASES = [(None, 0.8), (5, 1.0), (5, 0.8), (1, 1.0), (None, 0.05), (40, 0.95)]


def vllm_filtered(scaled: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """vLLM's filter (the engine's, ``allow_cpu_sync=False``: the sort path) on [N, V] scaled logits."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch  # heavy: not in the spawned ranks

    n = scaled.shape[0]
    k = None if top_k is None else torch.full((n,), top_k, dtype=torch.long)
    p = None if top_p >= 1.0 else torch.full((n,), top_p, dtype=torch.float32)
    return apply_top_k_top_p_pytorch(scaled.clone(), k, p)


def logsumexp_bound(scaled: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """|d lp| between two fp32 orders of ``lp = z_t - m - log sum_v exp(z_v - m)`` (docs/design/numerical_tolerances.md):
    eps (2V + 4 + 2 max|z| + 2|lp|) per row, V the entries summed. Shapes: scaled [..., V], lp [...]."""
    eps, vocab = torch.finfo(torch.float32).eps, scaled.shape[-1]
    zmax = scaled.masked_fill(~torch.isfinite(scaled), 0.0).abs().amax(-1)
    return eps * (2 * vocab + 4 + 2 * zmax + 2 * lp.abs())


def logits_with_ties(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(64, 97, generator=gen)
    logits[0, :8] = logits[0].max() + 1.0  # 8-way tie at the top: top-k keeps all tied entries, as vLLM
    logits[1] = torch.round(logits[1])  # many ties everywhere
    return logits


@pytest.mark.parametrize("top_k,top_p", CASES)
def test_keep_mask_equals_vllms_sampler(top_k, top_p):
    scaled = logits_with_ties() / 0.7
    expected = torch.isfinite(vllm_filtered(scaled, top_k, top_p))
    got = SamplingFilter(top_k, top_p).keep_mask(scaled)
    assert torch.equal(got, expected)
    assert got.any(-1).all()  # never an empty row


@pytest.mark.parametrize("top_k,top_p", CASES)
def test_filtered_logprobs_and_grad_equal_log_softmax_of_vllms_filtered_logits(top_k, top_p):
    logits = logits_with_ties(1)[:, None, :].repeat(1, 2, 1).requires_grad_(True)  # [64, 2, 97]
    scaled = logits.detach()[:, 0] / 0.7
    kept = torch.isfinite(vllm_filtered(scaled, top_k, top_p))
    targets = torch.multinomial(kept.float(), 2, replacement=True, generator=torch.Generator().manual_seed(2))
    lp = target_logprobs(logits, targets, 0.7, None, SamplingFilter(top_k, top_p))
    expected = torch.log_softmax(vllm_filtered(scaled, top_k, top_p), -1).gather(-1, targets)
    # the same fp32 ops on the same kept set (log_softmax over -inf entries), in rows of another batch shape
    assert ((lp - expected).abs() <= logsumexp_bound(scaled.unsqueeze(1), expected)).all()
    lp.sum().backward()
    assert (logits.grad[~kept.unsqueeze(1).expand_as(logits)] == 0).all()  # a dropped logit gets no gradient
    several = kept.sum(-1) > 1  # a row keeping one entry has log p = 0 and no gradient at all
    assert (logits.grad[several].abs().sum(-1) > 0).all()


def test_a_dropped_target_stays_finite_and_no_filter_is_the_full_softmax():
    logits = torch.tensor([[[4.0, 3.0, 0.0, -2.0]]])
    dropped = torch.tensor([[3]])  # outside top_k = 2
    lp = target_logprobs(logits, dropped, 1.0, None, SamplingFilter(top_k=2))
    # kept set {0, 1} plus the target itself: log(e^-2 / (e^4 + e^3 + e^-2))
    assert float(lp) == pytest.approx(-2.0 - torch.tensor([4.0, 3.0, -2.0]).logsumexp(0).item(), abs=1e-6)
    full = target_logprobs(logits, dropped, 1.0, None, None)
    assert torch.equal(full, target_logprobs(logits, dropped, 1.0, None, SamplingFilter()))
    assert float(full) == pytest.approx(torch.log_softmax(logits, -1)[0, 0, 3].item(), abs=1e-6)


def test_token_logprobs_passes_the_filter_on():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 11, generator=gen)
    ids = torch.randint(0, 11, (2, 6), generator=gen)
    lengths = torch.tensor([6, 4])
    filt = SamplingFilter(top_p=0.5)
    got = token_logprobs(logits, ids, lengths, 0.9, None, filt)
    expected = target_logprobs(logits[:, :-1], ids[:, 1:], 0.9, None, filt)
    assert torch.equal(got[0, 1:], expected[0]) and torch.equal(got[1, 1:4], expected[1, :3])
    assert (got[:, 0] == 0).all() and (got[1, 4:] == 0).all()


def test_from_generation_follows_the_engine():
    def gen(*overrides):
        return load_config("configs/grpo_math_tiny.yaml", list(overrides)).policy.generation

    assert SamplingFilter.from_generation(gen()) is None  # top_p 1.0, no top_k: the full softmax
    assert SamplingFilter.from_generation(gen("policy.generation.top_p=0.8")) == SamplingFilter(None, 0.8)
    assert SamplingFilter.from_generation(gen("policy.generation.top_k=7")) == SamplingFilter(7, 1.0)
    greedy = gen("policy.generation.top_p=0.8", "policy.generation.temperature=0.0")
    assert SamplingFilter.from_generation(greedy) is None  # the worker drops top-p / top-k when greedy
    with pytest.raises(ValueError, match="top_p"):
        SamplingFilter(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingFilter(top_k=0)


def _filtered_rank(rank: int, port: int, logits: torch.Tensor, targets: torch.Tensor, out: dict) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        half = logits.shape[-1] // 2
        shard = logits[..., rank * half : (rank + 1) * half].clone().requires_grad_(True)
        lp = target_logprobs(shard, targets, 0.7, dist.group.WORLD, SamplingFilter(top_k=9, top_p=0.8))
        lp.sum().backward()
        out[rank] = {"logprobs": lp.detach(), "grad": shard.grad}
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_filtered_logprobs_equal_the_single_device_path():
    """TP = 2 over gloo: the filter is taken on the gathered vocabulary and each shard keeps its slice."""
    import torch.multiprocessing as mp
    from test_megatron_parallel_units import _free_port

    logits = 3.0 * torch.randn(3, 4, 30, generator=torch.Generator().manual_seed(4))
    targets = torch.randint(0, 30, (3, 4), generator=torch.Generator().manual_seed(5))
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_filtered_rank, args=(_free_port(), logits, targets, out), nprocs=2)
        out = dict(out)
    full = logits.clone().requires_grad_(True)
    expected = target_logprobs(full, targets, 0.7, None, SamplingFilter(top_k=9, top_p=0.8))
    expected.sum().backward()
    # two shards' exp sums all-reduced vs one row: logsumexp_bound; the gradient (onehot - p) / T inherits it
    # through p = exp(lp), p |lp| <= 1/e (upstream 1): eps / T (2V + 5 + 2 max|z|)
    scaled = logits / 0.7
    lp_tol = logsumexp_bound(scaled, expected.detach())
    eps, vocab = torch.finfo(torch.float32).eps, logits.shape[-1]
    grad_tol = (eps / 0.7 * (2 * vocab + 5 + 2 * scaled.abs().amax(-1))).unsqueeze(-1)
    for rank in range(2):
        assert ((out[rank]["logprobs"] - expected.detach()).abs() <= lp_tol).all()
        assert ((out[rank]["grad"] - full.grad[..., rank * 15 : (rank + 1) * 15]).abs() <= grad_tol).all()
