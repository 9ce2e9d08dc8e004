"""EAGLE-3 heads of more than one decoder layer (``policy.draft.num_layers``): the torch head against an independent
float64 re-implementation of vLLM's eagle3 drafter written from its layer equations (per token, one KV list per
layer, vLLM's (hidden, residual) pairs with the fused add-and-norm), the training-time-test unroll against a plain
causal forward, windowed chains, export names and a bit-exact save / load round trip, the unchanged one-layer layout,
the refit names, and the layer-count checks of the config and the loaders. Tolerances:
docs/design/numerical_tolerances.md."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fixtures_models

from nemo_rl_spec.speculative.draft_refit import eagle3_vllm_names
from nemo_rl_spec.speculative.eagle3 import Eagle3Config, Eagle3DraftHead
from nemo_rl_spec.speculative.online import build_draft_head
from nemo_rl_spec.utils.config_schema import DraftConfig

torch.set_num_threads(1)
V, H, NH, KVH, HD, FF = 96, 32, 4, 2, 8, 64
S, K = 10, 3


def make_head(num_layers: int, seed: int = 0, draft_vocab_size: int | None = None) -> Eagle3DraftHead:
    """A random head with visible weights (std 0.3, norm gains 1 +- 0.3) and a random embedding."""
    cfg = Eagle3Config(
        vocab_size=V,
        hidden_size=H,
        num_attention_heads=NH,
        num_key_value_heads=KVH,
        head_dim=HD,
        intermediate_size=FF,
        aux_layer_ids=(0, 1, 2),
        target_num_hidden_layers=2,
        draft_vocab_size=draft_vocab_size,
        num_layers=num_layers,
    )
    return fixtures_models.randomize_eagle3_head(Eagle3DraftHead(cfg), seed).eval()


def make_batch(seed: int = 0, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """aux hidden [B, S, 3H], input_ids [B, S]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, S, 3 * H, generator=gen), torch.randint(0, V, (batch, S), generator=gen)


# ------------------------------------------------------------ vLLM's eagle3 drafter, written from its equations
class VllmEagle3Reference:
    """vLLM's ``LlamaModel`` of ``llama_eagle3.py`` re-derived in float64 on the *checkpoint* tensors (``midlayer.*``
    is ``layers.0``, ``layers.<i>.*`` for i >= 1), one token at a time with one KV list per decoder layer:

    - layer 0: ``x = [rms(embed; input_layernorm), rms(hidden; hidden_norm)]`` (2H), ``residual = hidden``;
    - layer i >= 1: ``residual = hidden + residual; x = rms(residual; input_layernorm)`` (vLLM's fused add-and-norm);
    - every layer: ``hidden = attn(x)``; ``residual = hidden + residual; x = rms(residual; post_attention_layernorm)``;
      ``hidden = mlp(x)``; the layer returns (hidden, residual);
    - end: ``prenorm = hidden + residual``, ``logits = lm_head(rms(prenorm; norm))``; ``prenorm`` feeds the next
      draft step (``aux_output = hidden_prenorm``, norm_output off).
    """

    def __init__(self, state: dict[str, torch.Tensor], cfg: Eagle3Config) -> None:
        self.w = {k: v.double() for k, v in state.items() if v.is_floating_point()}
        self.cfg = cfg
        self.draft_ids = torch.arange(cfg.draft_vocab_size) + (state["d2t"] if "d2t" in state else 0)
        self.prefixes = ["midlayer."] + [f"layers.{i}." for i in range(1, cfg.num_layers)]

    def rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean() + self.cfg.rms_norm_eps) * self.w[name]

    def rope(self, x: torch.Tensor, pos: int) -> torch.Tensor:
        """x [heads, hd] at position pos; neox layout (first half with second half)."""
        half = self.cfg.head_dim // 2
        inv = self.cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / self.cfg.head_dim)
        c, s = torch.cos(pos * inv), torch.sin(pos * inv)
        a, b = x[:, :half], x[:, half:]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    def attention(self, p: str, x: torch.Tensor, pos: int, cache: tuple[list, list]) -> torch.Tensor:
        c = self.cfg
        q = self.rope((self.w[p + "self_attn.q_proj.weight"] @ x).view(c.num_attention_heads, c.head_dim), pos)
        k = self.rope((self.w[p + "self_attn.k_proj.weight"] @ x).view(c.num_key_value_heads, c.head_dim), pos)
        v = (self.w[p + "self_attn.v_proj.weight"] @ x).view(c.num_key_value_heads, c.head_dim)
        cache[0].append(k)
        cache[1].append(v)
        keys, values = torch.stack(cache[0]), torch.stack(cache[1])  # [n, kvh, hd]
        group = c.num_attention_heads // c.num_key_value_heads
        ctx = []
        for h in range(c.num_attention_heads):
            probs = torch.softmax(keys[:, h // group] @ q[h] / math.sqrt(c.head_dim), dim=0)
            ctx.append(probs @ values[:, h // group])
        return self.w[p + "self_attn.o_proj.weight"] @ torch.cat(ctx)

    def mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        gate = self.w[p + "mlp.gate_proj.weight"] @ x
        return self.w[p + "mlp.down_proj.weight"] @ (
            torch.nn.functional.silu(gate) * (self.w[p + "mlp.up_proj.weight"] @ x)
        )

    def token(self, token: int, hidden: torch.Tensor, pos: int, caches: list) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward of one token: (logits [draft_vocab], prenorm [H]); appends to every layer's cache."""
        residual = None
        for i, p in enumerate(self.prefixes):
            if i == 0:
                embed = self.rms(self.w["embed_tokens.weight"][token], p + "input_layernorm.weight")
                residual = hidden
                x = torch.cat([embed, self.rms(hidden, p + "hidden_norm.weight")])
            else:
                residual = hidden + residual
                x = self.rms(residual, p + "input_layernorm.weight")
            hidden = self.attention(p, x, pos, caches[i])
            residual = hidden + residual
            hidden = self.mlp(p, self.rms(residual, p + "post_attention_layernorm.weight"))
        prenorm = hidden + residual
        return self.w["lm_head.weight"] @ self.rms(prenorm, "norm.weight"), prenorm

    @torch.no_grad()
    def chains(self, aux: torch.Tensor, ids: torch.Tensor, num_steps: int, free_running: bool) -> dict:
        """{t: [logits of steps 0..num_steps-1]} of every chain start t, for one row (aux [S, 3H], ids [S]).
        Step 0 is the drafter's prefill over indices 0..t (the target's hidden states); step j >= 1 of chain t
        reads the token ``ids[t+1+j]`` (or the draft's own greedy token) and the previous step's prenorm at
        position t + j, attending to the prefill's keys of indices <= t and the chain's own earlier steps."""
        n_layers = self.cfg.num_layers
        prefill = [([], []) for _ in range(n_layers)]
        step0 = []
        fc = self.w["fc.weight"]
        for s in range(S - 1):  # index s reads token s + 1
            step0.append(self.token(int(ids[s + 1]), fc @ aux[s].double(), s, prefill))
        out = {}
        for t in range(S - 1):
            caches = [(list(k[: t + 1]), list(v[: t + 1])) for k, v in prefill]
            logits, prenorm = step0[t]
            steps = [logits]
            for j in range(1, num_steps):
                if free_running:
                    token = int(self.draft_ids[logits.argmax()])
                elif t + 1 + j < S:
                    token = int(ids[t + 1 + j])
                else:
                    break
                logits, prenorm = self.token(token, prenorm, t + j, caches)
                steps.append(logits)
            out[t] = steps
        return out


def plain_forward(state: dict[str, torch.Tensor], cfg: Eagle3Config, aux: torch.Tensor, ids: torch.Tensor):
    """The drafter's prefill as one causal forward over the whole sequence (float64, batched over positions; the
    same equations as :class:`VllmEagle3Reference`, written as matrix products with a causal mask): the logits
    [S - 1, draft_vocab] at indices 0..S-2 of one row (aux [S, 3H], ids [S])."""
    w = {k: v.double() for k, v in state.items() if v.is_floating_point()}
    eps, n = cfg.rms_norm_eps, S - 1

    def rms(x, name):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w[name]

    half = cfg.head_dim // 2
    inv = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / cfg.head_dim)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv  # [n, half]
    cos, sin = torch.cos(ang)[:, None], torch.sin(ang)[:, None]

    def rope(x):  # [n, heads, hd]
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    mask = torch.ones(n, n, dtype=torch.bool).tril()
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    hidden = aux[:n].double() @ w["fc.weight"].T
    residual = None
    for i in range(cfg.num_layers):
        p = "midlayer." if i == 0 else f"layers.{i}."
        if i == 0:
            residual = hidden
            embed = rms(w["embed_tokens.weight"][ids[1 : n + 1]], p + "input_layernorm.weight")
            x = torch.cat([embed, rms(hidden, p + "hidden_norm.weight")], dim=-1)
        else:
            residual = hidden + residual
            x = rms(residual, p + "input_layernorm.weight")
        q = rope((x @ w[p + "self_attn.q_proj.weight"].T).view(n, cfg.num_attention_heads, cfg.head_dim))
        k = rope((x @ w[p + "self_attn.k_proj.weight"].T).view(n, cfg.num_key_value_heads, cfg.head_dim))
        v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, cfg.num_key_value_heads, cfg.head_dim)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(cfg.head_dim)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        hidden = torch.einsum("hqk,khd->qhd", probs, v).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        residual = hidden + residual
        x = rms(residual, p + "post_attention_layernorm.weight")
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        hidden = (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(hidden + residual, "norm.weight") @ w["lm_head.weight"].T


def full_state(head: Eagle3DraftHead) -> dict[str, torch.Tensor]:
    """The checkpoint tensors vLLM loads plus the (target's) embedding it shares."""
    return head.export_state_dict(include_embeddings=True)


# The fp32 head against the float64 references: the head's own fp32 rounding only (the references are float64). Not a
# worst-case bound (a GEMM's is 2 n eps sum|w x|, ~1e-4 here for n = 64) but the one-layer test's tolerance
# (tests/unit/test_eagle3.py: measured 7.7e-6 there): the largest difference measured here was 8.4e-6 (chains of 2 and 3
# layers, K = 3, |logits| <= 7.5, seeds 0-3, default and AVX2 kernel paths), plain forward 4.1e-6, windowed chains
# 2.0e-6. A broken layer semantics (a residual add dropped, one KV cache shared by the layers, the post-norm output
# fed to the next step) moves the logits by more than 0.1.
ATOL, RTOL = 2e-5, 1e-5


@pytest.mark.numerics
@pytest.mark.parametrize("free_running", [False, True], ids=["teacher", "free_running"])
@pytest.mark.parametrize("num_layers", [2, 3])
def test_multi_layer_unroll_equals_vllm_drafter_reference(num_layers, free_running):
    head = make_head(num_layers, draft_vocab_size=40)
    aux, ids = make_batch()
    with torch.no_grad():
        fast = head.unroll(aux, ids, K, free_running=free_running)
    ref = VllmEagle3Reference(full_state(head), head.cfg)
    compared = 0
    for b in range(aux.shape[0]):
        for t, steps in ref.chains(aux[b], ids[b], K, free_running).items():
            for j, logits in enumerate(steps):
                torch.testing.assert_close(fast[j][b, t].double(), logits, atol=ATOL, rtol=RTOL)
                compared += 1
    assert compared == aux.shape[0] * ((S - 1) * K if free_running else sum(min(K, S - 1 - t) for t in range(S - 1)))
    if free_running:  # the greedy proposals are the argmax chain (vLLM at temperature 0)
        props = head.propose_greedy(aux, ids, K)
        for t, steps in ref.chains(aux[0], ids[0], K, True).items():
            assert props[0, t].tolist() == [int(ref.draft_ids[lg.argmax()]) for lg in steps]


@pytest.mark.numerics
def test_ttt_step0_equals_a_plain_causal_forward():
    head = make_head(2)
    aux, ids = make_batch(1)
    with torch.no_grad():
        step0 = head.unroll(aux, ids, K)[0]
    for b in range(aux.shape[0]):
        plain = plain_forward(full_state(head), head.cfg, aux[b], ids[b])
        torch.testing.assert_close(step0[b, : S - 1].double(), plain, atol=ATOL, rtol=RTOL)


@pytest.mark.numerics
def test_windowed_chains_equal_the_full_unroll():
    """unroll_hidden on a window (start > 0, end < S): layers below the last run step 0 at every index < end, so the
    window's chains equal the full unroll's. The window's GEMMs have fewer rows than the full ones, which may block
    differently: same bound as above."""
    head = make_head(2)
    aux, ids = make_batch(2)
    with torch.no_grad():
        full = head.unroll(aux, ids, K)
        part = head.unroll_hidden(aux, ids, K, window=(3, 7))
    for j in range(K):
        logits = head.lm_head(head.norm(part[j])).float()
        torch.testing.assert_close(logits, full[j][:, 3:7], atol=ATOL, rtol=RTOL)


def test_every_layer_gets_gradient_from_the_ttt_loss():
    head = make_head(2).train()
    aux, ids = make_batch(3)
    loss, _ = head.ttt_loss(aux, ids, torch.ones_like(ids), num_steps=K)
    loss.backward()
    for name, p in head.named_parameters():
        if p.requires_grad and name.startswith(("midlayer.", "layers.1.")):
            assert p.grad is not None and float(p.grad.abs().sum()) > 0, name


ONE_LAYER_KEYS = [  # Eagle3DraftHead.state_dict() of a one-layer head before num_layers existed
    "d2t",
    "t2d",
    "embed_tokens.weight",
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
]
LAYER_I = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
]


def test_one_layer_state_dict_keys_are_unchanged():
    assert list(make_head(1).state_dict()) == ONE_LAYER_KEYS


def test_two_layer_export_names_shapes_and_bit_exact_round_trip(tmp_path):
    head = make_head(2, draft_vocab_size=40)
    path = head.save_pretrained(tmp_path / "draft2")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["nemo_rl_spec_eagle3"]["num_layers"] == 2
    from safetensors.torch import load_file

    saved = load_file(str(path / "model.safetensors"))
    layer1 = {f"layers.1.{n}" for n in LAYER_I}
    assert set(saved) == (set(ONE_LAYER_KEYS) - {"embed_tokens.weight"}) | layer1
    assert saved["layers.1.self_attn.q_proj.weight"].shape == (NH * HD, H)  # layer 1 reads H, not 2H
    assert saved["layers.1.self_attn.k_proj.weight"].shape == (KVH * HD, H)
    assert saved["midlayer.self_attn.q_proj.weight"].shape == (NH * HD, 2 * H)
    loaded = Eagle3DraftHead.from_pretrained(path, target_embeddings=head.embed_tokens.weight)
    assert loaded.cfg == head.cfg
    want, got = head.state_dict(), loaded.state_dict()
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    aux, ids = make_batch(4)
    with torch.no_grad():
        for a, b in zip(head.unroll(aux, ids, K), loaded.unroll(aux, ids, K), strict=True):
            assert torch.equal(a, b)
    vnames = eagle3_vllm_names(head.export_state_dict())
    assert vnames["model.layers.1.self_attn.qkv_proj.weight"].shape == ((NH + 2 * KVH) * HD, H)
    assert vnames["model.layers.1.mlp.gate_up_proj.weight"].shape == (2 * FF, H)
    assert torch.equal(vnames["model.layers.1.input_layernorm.weight"], saved["layers.1.input_layernorm.weight"])
    assert not any(k.startswith(("midlayer", "layers")) for k in vnames)


def test_one_layer_file_is_written_as_before_and_loads_as_one_layer(tmp_path):
    """A one-layer head's config.json has no num_layers in its trainer block (the file written before the key
    existed, which older code loads), and such a file loads with one layer."""
    head = make_head(1)
    path = head.save_pretrained(tmp_path / "old")
    cfg = json.loads((path / "config.json").read_text())
    assert "num_layers" not in cfg["nemo_rl_spec_eagle3"] and cfg["num_hidden_layers"] == 1
    loaded = Eagle3DraftHead.from_pretrained(path, target_embeddings=head.embed_tokens.weight)
    assert loaded.cfg.num_layers == 1 and len(loaded.layers) == 0


def test_layer_count_checks_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="num_layers must be an integer >= 1, got 0"):
        make_head(0)
    head = make_head(2)
    path = head.save_pretrained(tmp_path / "draft2")
    emb = head.embed_tokens.weight
    with pytest.raises(ValueError, match=r"policy\.draft\.num_layers=1 but the EAGLE-3 head .* has 2 decoder layer"):
        build_draft_head(DraftConfig(model_name=str(path), num_layers=1), None, emb, None)
    for count in (None, 2):  # null: the checkpoint's count
        assert (
            build_draft_head(DraftConfig(model_name=str(path), num_layers=count), None, emb, None).cfg.num_layers == 2
        )
    fresh = build_draft_head(DraftConfig(num_layers=3), _TargetConfig(), emb, torch.randn(V, H))
    assert fresh.cfg.num_layers == 3 and sorted(fresh.layers) == ["1", "2"]


def test_check_draft_dir_refuses_a_head_of_another_depth(tmp_path):
    from nemo_rl_spec.algorithms.grpo_setup import check_draft_dir
    from nemo_rl_spec.utils.config import ConfigError, load_config

    path = make_head(2).save_pretrained(tmp_path / "draft2")
    recipe = Path(__file__).resolve().parents[2] / "configs" / "grpo_math_tiny.yaml"
    check_draft_dir(load_config(recipe, [f"+policy.draft.model_name={path}", "+policy.draft.num_layers=2"]))
    cfg = load_config(recipe, [f"+policy.draft.model_name={path}", "+policy.draft.num_layers=3"])
    with pytest.raises(ConfigError, match=r"policy\.draft\.num_layers=3 but the EAGLE-3 head .* has 2 decoder layer"):
        check_draft_dir(cfg)


class _TargetConfig:
    """The HF config fields Eagle3Config.from_target reads."""

    hidden_size, num_attention_heads, num_key_value_heads, head_dim = H, NH, KVH, HD
    intermediate_size, num_hidden_layers, vocab_size, rms_norm_eps = FF, 2, V, 1e-6
    rope_theta, max_position_embeddings, bos_token_id, eos_token_id = 10000.0, 64, 0, 1
