"""EAGLE-3 draft head in plain torch, with vLLM-loadable export and a training-time-test (TTT) loss.

The head mirrors vLLM's ``Eagle3LlamaForCausalLM`` (``vllm/model_executor/models/llama_eagle3.py``) exactly, so
a head trained here and exported with :meth:`Eagle3DraftHead.save_pretrained` proposes in vLLM (method ``eagle3``)
the tokens it proposes here (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test"). Aux layer ids: :class:`Eagle3Config`; a chain's positions and attention:
:meth:`Eagle3DraftHead.unroll`. One draft step at sequence index t, position ``pos``::

    h0        = fc(cat(aux_hidden[k] for k in aux_layer_ids))     # step 0 only; [.., n_aux * H_t] -> [.., H]
    residual  = h                                                  # (norm_before_residual: hidden_norm(h))
    x         = cat(input_layernorm(embed(token)), hidden_norm(h)) # [.., 2H]
    residual  = self_attn(x, pos) + residual                       # q/k/v project from 2H
    prenorm   = mlp(post_attention_layernorm(residual)) + residual
    logits    = lm_head(norm(prenorm))                             # [.., draft_vocab]
    h_next    = prenorm                                            # fed to the next draft step

With ``num_layers`` = N > 1 (vLLM's ``num_hidden_layers``) the line computing ``prenorm`` is layer 0 (checkpoint
prefix ``midlayer.``) and layers i = 1..N-1 (prefix ``layers.<i>.``) follow, each a plain Llama decoder layer on the
hidden state alone (vLLM's fused ``input_layernorm(hidden, residual)`` adds the previous layer's MLP output to its
residual, which is the previous layer's ``prenorm``)::

    x         = input_layernorm(prenorm)                           # [.., H]; q/k/v project from H
    residual  = self_attn(x, pos) + prenorm                        # each layer attends to its own keys/values
    prenorm   = mlp(post_attention_layernorm(residual)) + residual

and ``logits`` / ``h_next`` are taken from the last layer's ``prenorm``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TRAINER_META_KEY = "nemo_rl_spec_eagle3"


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """Aux layer ids (vLLM convention) for a target with ``num_target_layers`` decoder layers.

    vLLM's default is ``(2, L // 2, L - 3)`` (``SupportsEagle3.get_eagle3_default_aux_hidden_state_layers``); it is
    used when it names three distinct, increasing ids in ``[0, L]`` (L >= 6). Shallower targets get
    ``round(linspace(0, L, 3))`` deduplicated (L = 2 -> (0, 1, 2)), and the ids are always written into the
    draft config so vLLM never falls back to its own default.
    """
    L = int(num_target_layers)
    if L < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {L}")
    vllm_default = (2, L // 2, L - 3)
    if L >= 6 and 0 <= vllm_default[0] < vllm_default[1] < vllm_default[2] <= L:
        return vllm_default
    return tuple(sorted({round(x) for x in torch.linspace(0, L, 3).tolist()}))


@dataclass
class Eagle3Config:
    """Shape and semantics of an EAGLE-3 head. ``hidden_size`` must equal the target's (vLLM feeds the
    target's token embedding into the draft layer).

    aux_layer_ids: sorted target layer ids in vLLM's convention: id k is the residual stream after k decoder layers,
        i.e. HF ``output_hidden_states[k]`` for k < L (id 0 = embedding output) and the *un-normed* last-layer output
        for k = L (HF's ``hidden_states[L]`` is after the final norm; a forward hook on decoder layer k-1 gives id k).
    draft_vocab_size: rows of lm_head; < vocab_size uses the d2t/t2d reduced vocabulary.
    num_layers: decoder layers of the draft (vLLM's ``num_hidden_layers``; ``policy.draft.num_layers``): layer 0
        reads ``[embed ; hidden]``, layers 1.. are plain Llama layers on the hidden state.
    norm_before_residual: vLLM/speculators option (hidden_norm applied before the residual branch).
    """

    vocab_size: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    aux_layer_ids: tuple[int, ...]
    target_num_hidden_layers: int
    draft_vocab_size: int | None = None
    num_layers: int = 1
    target_hidden_size: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    norm_before_residual: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.aux_layer_ids = tuple(sorted({int(i) for i in self.aux_layer_ids}))
        if self.draft_vocab_size is None:
            self.draft_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        bad = [i for i in self.aux_layer_ids if not 0 <= i <= self.target_num_hidden_layers]
        if bad:
            raise ValueError(f"aux_layer_ids {bad} outside [0, {self.target_num_hidden_layers}]")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError("draft_vocab_size must be <= vocab_size")
        if isinstance(self.num_layers, bool) or int(self.num_layers) != self.num_layers or self.num_layers < 1:
            raise ValueError(f"num_layers must be an integer >= 1, got {self.num_layers!r}")
        self.num_layers = int(self.num_layers)

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @classmethod
    def from_target(
        cls,
        target_config,
        aux_layer_ids: Sequence[int] | None = None,
        draft_vocab_size: int | None = None,
        intermediate_size: int | None = None,
        **overrides,
    ) -> Eagle3Config:
        """Derive a head config from the target's HF config (object or dict): same hidden size, heads, head_dim,
        rope theta and eps; aux ids default to :func:`default_aux_layer_ids`."""
        get = (
            (lambda k, d=None: target_config.get(k, d))
            if isinstance(target_config, dict)
            else (lambda k, d=None: getattr(target_config, k, d))
        )
        hidden = get("hidden_size")
        heads = get("num_attention_heads")
        rope = get("rope_parameters") or get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in ("default", None):
            raise NotImplementedError(f"EAGLE-3 head supports default RoPE only, target has {rope_type!r}")
        theta = (rope.get("rope_theta") if isinstance(rope, dict) else None) or get("rope_theta", 10000.0)
        n_layers = get("num_hidden_layers")
        eos = get("eos_token_id")
        kwargs = dict(
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads") or heads,
            head_dim=get("head_dim") or hidden // heads,
            intermediate_size=intermediate_size or get("intermediate_size"),
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(n_layers),
            target_num_hidden_layers=n_layers,
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=get("max_position_embeddings", 4096),
            bos_token_id=get("bos_token_id"),
            eos_token_id=eos if not isinstance(eos, list) else eos[0],
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict:
        """The ``config.json`` vLLM's ``eagle3`` method reads (Llama-type draft, architecture
        ``LlamaForCausalLMEagle3``), with the aux layer ids written explicitly."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_layers,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "num_aux_hidden_states": self.num_aux,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
            "norm_before_residual": self.norm_before_residual,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
            TRAINER_META_KEY: self._trainer_meta(),
        }

    def _trainer_meta(self) -> dict:
        """This config as ``config.json``'s trainer block. ``num_layers`` is written only when > 1, so a one-layer
        head's file is the one written before the key existed (older readers load it; a missing key reads as 1)."""
        meta = {**asdict(self), "aux_layer_ids": list(self.aux_layer_ids)}
        if self.num_layers == 1:
            del meta["num_layers"]
        return meta

    @classmethod
    def from_hf_dict(cls, d: dict) -> Eagle3Config:
        if TRAINER_META_KEY in d:
            return cls(**d[TRAINER_META_KEY])
        raise ValueError(
            f"config.json was not written by Eagle3DraftHead.save_pretrained (no {TRAINER_META_KEY!r} block)"
        )


class RMSNorm(nn.Module):
    """Llama RMSNorm: ``x * rsqrt(mean(x^2) + eps) * weight``, computed in fp32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE tables. Shape: positions [B, S] -> cos, sin [B, 1, S, head_dim] (fp32)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read ``in_size`` features: the 2H concatenation [embed ; hidden] in layer 0 (the
    default), the H-wide hidden state in layers 1.."""

    def __init__(self, cfg: Eagle3Config, in_size: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        in_size = 2 * cfg.hidden_size if in_size is None else in_size
        self.q_proj = nn.Linear(in_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(in_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(in_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Shape: x [B, S, in_size] -> q [B, nh, S, hd], k, v [B, nh, S, hd] (kv heads repeated to nh)."""
        B, S, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, S, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, S, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, S, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = c.num_attention_heads // c.num_key_value_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return q, k, v

    def out(self, ctx: torch.Tensor) -> torch.Tensor:
        """Shape: ctx [B, nh, S, hd] -> [B, S, H]."""
        B, nh, S, hd = ctx.shape
        return self.o_proj(ctx.transpose(1, 2).reshape(B, S, nh * hd))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Eagle3Layer(nn.Module):
    """What every draft decoder layer shares: attention output + residual, then the MLP with its residual."""

    post_attention_layernorm: RMSNorm
    mlp: Eagle3MLP

    def post_attention(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Shape: attn_out, residual [B, S, H] -> the layer's pre-norm output [B, S, H] (the next layer's input;
        the last layer's is the hidden state carried to the next draft step)."""
        residual = attn_out + residual
        return self.mlp(self.post_attention_layernorm(residual)) + residual


class Eagle3MidLayer(_Eagle3Layer):
    """Decoder layer 0 (checkpoint prefix ``midlayer.``, vLLM's ``layers.0``): attention reads [embed ; hidden]."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)
        self.norm_before_residual = cfg.norm_before_residual

    def pre_attention(self, embeds: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Shape: embeds, hidden [B, S, H] -> (attention input [B, S, 2H], residual [B, S, H])."""
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = self.hidden_norm(hidden)
        return torch.cat([self.input_layernorm(embeds), hidden], dim=-1), residual


class Eagle3DecoderLayer(_Eagle3Layer):
    """Decoder layer i >= 1 (checkpoint prefix ``layers.<i>.``): a plain Llama layer on the hidden state, as vLLM's
    eagle3 drafter runs it (no embedding input, no ``hidden_norm``; q/k/v read H features). vLLM carries the pair
    (MLP output, residual) between layers and adds them in the next ``input_layernorm``; their sum is the previous
    layer's pre-norm output, which is what this layer takes. vLLM builds a ``hidden_norm`` in these layers too but never
    reads it; it is not exported (vLLM's in-place drafter refit then logs "RMSNorm: Failed to load weights" once)."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, in_size=cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def pre_attention_hidden(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Shape: hidden [B, S, H] (the previous layer's pre-norm output) -> (attention input [B, S, H], residual
        [B, S, H])."""
        return self.input_layernorm(hidden), hidden


@dataclass
class _DraftKeyValues:
    """What one unroll's queries attend to: step 0's keys/values at every index < end (causally), plus each chain's
    own keys/values of steps 1..j (the drafter KV cache vLLM holds). ``causal`` [W, end]: row i is chain start + i."""

    causal: torch.Tensor
    scale: float
    keys0: torch.Tensor | None = None
    values0: torch.Tensor | None = None
    diag_k: list[torch.Tensor] = field(default_factory=list)
    diag_v: list[torch.Tensor] = field(default_factory=list)

    def attend(self, q: torch.Tensor, causal: torch.Tensor | None = None) -> torch.Tensor:
        """Softmax attention in fp32; ``causal`` [W', end] replaces the chains' mask (step 0 of a layer below the
        last, whose queries are every index < end). Shape: q [B, nh, W, hd] -> ctx [B, nh, W, hd] (float32)."""
        scores = torch.matmul(q.float(), self.keys0.float().transpose(-1, -2)) * self.scale  # [B, nh, W, end]
        scores = scores.masked_fill(~(self.causal if causal is None else causal), float("-inf"))
        diag = [(q.float() * dk.float()).sum(-1, keepdim=True) * self.scale for dk in self.diag_k]  # [B, nh, W, 1]
        probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
        n_keys = scores.shape[-1]
        ctx = torch.matmul(probs[..., :n_keys], self.values0.float())
        for i, dv in enumerate(self.diag_v):
            ctx = ctx + probs[..., n_keys + i : n_keys + i + 1] * dv.float()
        return ctx


class Eagle3DraftHead(nn.Module):
    """EAGLE-3 draft head. Parameter names match the speculators/vLLM checkpoint layout:
    ``fc``, ``midlayer.*`` (decoder layer 0), ``layers.<i>.*`` (decoder layers i = 1..num_layers-1, none for one
    layer), ``norm``, ``lm_head`` (+ buffers ``d2t``, ``t2d`` for a reduced vocabulary).

    ``embed_tokens`` is a frozen copy of the target's input embedding (vLLM shares the target's embedding with
    the draft when the checkpoint omits it, which :meth:`save_pretrained` does by default); keep it in sync
    with the policy through :meth:`set_target_embeddings`.
    """

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3MidLayer(cfg)
        # keys "1".."N-1": checkpoint names layers.<i>.* as vLLM's loader expects (layer 0 is midlayer)
        self.layers = nn.ModuleDict({str(i): Eagle3DecoderLayer(cfg) for i in range(1, cfg.num_layers)})
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("target_to_draft", torch.arange(cfg.vocab_size), persistent=False)
        self.reset_parameters(seed=0)

    # ------------------------------------------------------------------ construction
    def reset_parameters(self, seed: int = 0, std: float = 0.02) -> None:
        """Deterministic init from a private generator (no global RNG): normal(0, std) linears, unit norms."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if name == "embed_tokens.weight":
                    continue
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    @classmethod
    def from_target(
        cls,
        target_model: nn.Module | None = None,
        target_config=None,
        *,
        aux_layer_ids: Sequence[int] | None = None,
        draft_vocab: torch.Tensor | None = None,
        init_lm_head_from_target: bool = True,
        seed: int = 0,
        **cfg_overrides,
    ) -> Eagle3DraftHead:
        """Build a head for an HF target (``target_model`` or just its config).

        Args:
            draft_vocab: optional sorted int64 target token ids of a reduced draft vocabulary (see
                :func:`draft_vocab_from_counts`); full vocabulary when None.
            init_lm_head_from_target: copy the target's output rows (restricted to the draft vocabulary) into
                lm_head, a much better start than random.
        """
        config = target_config if target_config is not None else target_model.config
        dvs = None if draft_vocab is None else int(draft_vocab.numel())
        head = cls(Eagle3Config.from_target(config, aux_layer_ids, draft_vocab_size=dvs, **cfg_overrides))
        head.reset_parameters(seed=seed)
        if draft_vocab is not None:
            head.set_draft_vocab(draft_vocab)
        if target_model is not None:
            head.set_target_embeddings(target_model.get_input_embeddings().weight)
            if init_lm_head_from_target:
                out = target_model.get_output_embeddings().weight.detach()
                ids = draft_vocab if draft_vocab is not None else torch.arange(out.shape[0])
                with torch.no_grad():
                    head.lm_head.weight.copy_(out[ids])
        return head

    def set_target_embeddings(self, weight: torch.Tensor) -> None:
        """Copy the policy's current input embedding (detached) into the frozen ``embed_tokens``."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight.detach().to(self.embed_tokens.weight))

    def set_draft_vocab(self, draft_vocab: torch.Tensor) -> None:
        """Install a reduced vocabulary: ``draft_vocab`` = sorted unique target ids, one per lm_head row.
        Sets ``d2t[i] = draft_vocab[i] - i`` (vLLM adds the row index back) and the bool mask ``t2d``."""
        ids = torch.as_tensor(draft_vocab, dtype=torch.long)
        if ids.numel() != self.cfg.draft_vocab_size or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft_vocab must hold draft_vocab_size sorted unique target ids")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True
        t2d_index = torch.full((self.cfg.vocab_size,), -1, dtype=torch.long)
        t2d_index[ids] = torch.arange(ids.numel())
        self.target_to_draft = t2d_index

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft row. Shape: [draft_vocab_size]."""
        return self.d2t + torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device)

    @property
    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers in order: ``midlayer`` (layer 0), then ``layers["1"]`` .. ``layers[str(N-1)]``."""
        return [self.midlayer, *(self.layers[str(i)] for i in range(1, self.cfg.num_layers))]

    # ------------------------------------------------------------------ forward
    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Shape: [B, S, n_aux * H_t] -> [B, S, H]."""
        return self.fc(aux_hidden)

    def unroll(
        self,
        aux_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        num_steps: int,
        position_ids: torch.Tensor | None = None,
        free_running: bool = False,
    ) -> list[torch.Tensor]:
        """Training-time test: run ``num_steps`` draft steps for every chain start t in parallel.

        Step j of chain t reads token ``input_ids[t+1+j]`` (teacher forcing; index past the end reads token 0 and
        must be masked by the caller) and the previous step's pre-norm output (step 0: ``fc(aux[t])``), sits at
        position ``position_ids[t] + j`` and attends to step-0 keys of indices <= t plus its own steps 1..j (each
        decoder layer to its own keys/values: one TTT cache per layer, as vLLM keeps one KV cache per draft layer).
        With ``free_running`` steps j >= 1 read the draft's own greedy token of step j-1 instead (what vLLM
        does at temperature 0), so ``argmax`` of the returned logits are vLLM's proposals for every chain start.

        Shape: aux_hidden [B, S, n_aux * H_t], input_ids [B, S] -> list of num_steps logits [B, S, draft_vocab]
        (float32); ``logits[j][:, t]`` predicts ``input_ids[t+2+j]``.
        """
        logits_per_step: list[torch.Tensor] = []

        def tokens_of_step(j: int, teacher: torch.Tensor) -> torch.Tensor:
            return self.draft_ids[logits_per_step[-1].argmax(-1)] if free_running and j > 0 else teacher

        S = aux_hidden.shape[1]
        for hidden in self._draft_steps(aux_hidden, input_ids, num_steps, position_ids, (0, S), tokens_of_step):
            logits_per_step.append(self.lm_head(self.norm(hidden)).float())
        return logits_per_step

    def unroll_hidden(
        self,
        aux_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        num_steps: int,
        window: tuple[int, int],
        position_ids: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """Teacher-forced :meth:`unroll` for the chain starts t in ``window = (start, end)`` only, before the output
        layer: the pre-norm output of every draft step (``unroll``'s logits are ``lm_head(norm(.))`` of it). Step 0's
        keys/values are computed at every index < end (the chains attend to them; with several decoder layers, every
        layer below the last runs step 0 at every index < end, since the next layer's keys read its output); the rest
        runs on the window only. A loss that scores only some positions needs only the chains that reach them
        (:func:`~nemo_rl_spec.speculative.ttt_scored.chain_window`).

        Shape: aux_hidden [B, S, n_aux * H_t], input_ids [B, S] -> num_steps tensors [B, end - start, H];
        ``out[j][:, i]`` is chain t = start + i, whose output predicts ``input_ids[t+2+j]``.
        """
        return list(self._draft_steps(aux_hidden, input_ids, num_steps, position_ids, window, None))

    def _draft_steps(self, aux_hidden, input_ids, num_steps, position_ids, window, tokens_of_step):
        """Yield the pre-norm output [B, end - start, H] of draft steps 0..num_steps-1 for chains [start, end).
        ``tokens_of_step(j, teacher)`` may replace the teacher tokens [B, S] of step j (free running, window (0, S))."""
        start, end = window
        B, S, _ = aux_hidden.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S)
        full_causal = torch.ones(end, end, dtype=torch.bool, device=aux_hidden.device).tril()
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        kvs = [_DraftKeyValues(full_causal[start:], scale) for _ in range(self.cfg.num_layers)]
        hidden = self.combine(aux_hidden[:, :end])
        for j in range(num_steps):
            tokens = F.pad(input_ids[:, 1 + j :], (0, 1 + j), value=0)[:, :S]
            if tokens_of_step is not None:
                tokens = tokens_of_step(j, tokens)
            first = 0 if j == 0 else start
            hidden = self._draft_step(
                j, tokens[:, first:end], hidden, position_ids[:, first:end] + j, kvs, start, full_causal
            )
            yield hidden

    def _draft_step(self, j, tokens, hidden, positions, kvs, start, full_causal) -> torch.Tensor:
        """One draft step (module docstring) through every decoder layer, layer i keeping its keys/values in
        ``kvs[i]``. Step 0 reads indices [0, end) (its keys/values are what every later query attends to; layers
        below the last run on all of them, causally) and the last layer keeps [start, end); later steps read and
        return [start, end). Shape: tokens, positions [B, L], hidden [B, L, H] -> [B, end - start, H]."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        layers = self.decoder_layers
        for i, layer in enumerate(layers):
            if i == 0:
                x, residual = layer.pre_attention(self.embed_tokens(tokens), hidden)
            else:
                x, residual = layer.pre_attention_hidden(hidden)
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            kv, causal = kvs[i], None
            if j == 0:
                kv.keys0, kv.values0 = k, v
                if i == len(layers) - 1:
                    q, residual = q[:, :, start:], residual[:, start:]
                else:
                    causal = full_causal
            else:
                kv.diag_k.append(k)
                kv.diag_v.append(v)
            hidden = layer.post_attention(layer.self_attn.out(kv.attend(q, causal).to(x.dtype)), residual)
        return hidden

    @torch.no_grad()
    def propose_greedy(self, aux_hidden: torch.Tensor, input_ids: torch.Tensor, num_steps: int) -> torch.Tensor:
        """Greedy proposals of every chain start (temperature-0 drafting, as vLLM runs it).

        Shape: aux_hidden [B, S, n_aux * H_t], input_ids [B, S] -> [B, S, num_steps] target token ids;
        ``out[b, t, j]`` is the draft's guess for ``input_ids[b, t+2+j]`` given the context up to ``t+1``.
        """
        logits = self.unroll(aux_hidden, input_ids, num_steps, free_running=True)
        return torch.stack([self.draft_ids[lg.argmax(-1)] for lg in logits], dim=-1)

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocabulary logits into the target vocabulary (-inf elsewhere), as vLLM does.
        Shape: [..., draft_vocab] -> [..., vocab]."""
        if self.cfg.draft_vocab_size == self.cfg.vocab_size:
            return draft_logits
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        out[..., self.draft_ids] = draft_logits
        return out

    # ------------------------------------------------------------------ loss
    def ttt_loss(
        self,
        aux_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        num_steps: int,
        target_logprobs: torch.Tensor | None = None,
        step_weights: Sequence[float] | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """EAGLE-3 training-time-test loss.

        Step j of chain t predicts ``input_ids[t+2+j]``; the term counts when ``loss_mask[t+2+j]`` is true.
        With ``target_logprobs`` the term is the soft cross-entropy
        ``-sum_v p_policy(v | x_<=t+1+j) * log q_draft(v)`` over the draft vocabulary (policy mass outside the
        draft vocabulary is dropped, not renormalised); without it, the hard cross-entropy of the token (terms
        whose token is outside the draft vocabulary are skipped). The loss is
        ``sum_j w_j * mean_j / sum_j w_j`` (default ``w_j = 0.8^j``).

        Shape: aux_hidden [B, S, n_aux * H_t] (already detached from the policy), input_ids [B, S],
        loss_mask [B, S] (bool / 0-1), target_logprobs [B, S, V] (log-probs of the policy's next-token
        distribution at each position; or [B, S, draft_vocab_size], already restricted to the draft vocabulary's
        ids, as :func:`~nemo_rl_spec.speculative.offline.train_draft_on_sequences` caches them) -> scalar loss, metrics ``draft_loss_step{j}``, ``draft_acc_step{j}``
        (top-1 agreement with the token, a proxy of per-position acceptance at temperature 0).
        """
        if aux_hidden.requires_grad:
            raise ValueError("aux_hidden requires grad: detach the policy's hidden states before the draft loss")
        if step_weights is None:
            step_weights = [0.8**j for j in range(num_steps)]
        S = input_ids.shape[1]
        mask = loss_mask.bool()
        all_logits = self.unroll(aux_hidden, input_ids, num_steps, position_ids)
        total = aux_hidden.new_zeros((), dtype=torch.float32)
        metrics: dict[str, float] = {}
        draft_ids = self.draft_ids
        for j, logits in enumerate(all_logits):
            shift = 2 + j
            if shift >= S:
                break
            logits = logits[:, : S - shift]
            tokens = input_ids[:, shift:]
            valid = mask[:, shift:]
            logq = torch.log_softmax(logits, dim=-1)
            if target_logprobs is not None:
                target = target_logprobs[:, shift - 1 : S - 1].float()
                if target.shape[-1] != self.cfg.draft_vocab_size:
                    target = target.index_select(-1, draft_ids)
                per_tok = -(target.exp() * logq).sum(-1)
            else:
                draft_tok = self.target_to_draft[tokens]
                valid = valid & (draft_tok >= 0)
                per_tok = -logq.gather(-1, draft_tok.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            n = valid.sum()
            step_loss = (per_tok * valid).sum() / n.clamp_min(1)
            total = total + step_weights[j] * step_loss
            pred = draft_ids[logits.argmax(-1)]
            metrics[f"draft_loss_step{j}"] = float(step_loss.detach())
            metrics[f"draft_acc_step{j}"] = float(((pred == tokens) & valid).sum() / n.clamp_min(1))
        return total / float(sum(step_weights[: len(all_logits)])), metrics

    # ------------------------------------------------------------------ export
    def export_state_dict(self, include_embeddings: bool = False) -> dict[str, torch.Tensor]:
        """Checkpoint-named tensors vLLM's Eagle3LlamaForCausalLM loads (``fc.weight``, ``midlayer.*``, ``layers.<i>.*``
        for decoder layers i >= 1, ``norm.weight``, ``lm_head.weight``, and ``d2t``/``t2d`` for a reduced vocabulary).
        Without
        ``embed_tokens.weight`` vLLM shares the target's embedding (the default)."""
        out = {}
        for name, t in self.state_dict().items():
            if name in ("d2t", "t2d") and self.cfg.draft_vocab_size == self.cfg.vocab_size:
                continue
            if name == "embed_tokens.weight" and not include_embeddings:
                continue
            out[name] = t.detach().clone().contiguous()
        return out

    def save_pretrained(self, out_dir: str | Path, include_embeddings: bool = False) -> Path:
        """Write ``config.json`` + ``model.safetensors`` loadable by vLLM
        (``speculative_config={"method": "eagle3", "model": out_dir, ...}``) and by :meth:`from_pretrained`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_FILE).write_text(json.dumps(self.cfg.to_hf_dict(), indent=2) + "\n")
        save_file(self.export_state_dict(include_embeddings), str(out / WEIGHTS_FILE))
        return out

    @classmethod
    def from_pretrained(cls, path: str | Path, target_embeddings: torch.Tensor | None = None) -> Eagle3DraftHead:
        """Load a head written by :meth:`save_pretrained`. The embedding comes from the checkpoint if it has
        one, else from ``target_embeddings`` (required then for training/inference here)."""
        path = Path(path)
        cfg = Eagle3Config.from_hf_dict(json.loads((path / CONFIG_FILE).read_text()))
        head = cls(cfg)
        state = load_file(str(path / WEIGHTS_FILE))
        if "d2t" in state:
            head.set_draft_vocab(state.pop("d2t") + torch.arange(cfg.draft_vocab_size))
            state.pop("t2d", None)
        if target_embeddings is not None and "embed_tokens.weight" not in state:
            head.set_target_embeddings(target_embeddings)
        missing, unexpected = head.load_state_dict(state, strict=False)
        allowed_missing = {"d2t", "t2d", "embed_tokens.weight"}
        if set(missing) - allowed_missing or unexpected:
            raise RuntimeError(f"bad EAGLE-3 checkpoint {path}: missing {missing}, unexpected {unexpected}")
        return head


def draft_vocab_from_counts(
    token_counts: torch.Tensor, draft_vocab_size: int, always_include: Sequence[int] = ()
) -> torch.Tensor:
    """Reduced draft vocabulary: the ``draft_vocab_size`` most frequent target ids (ties to the lower id), plus
    ``always_include`` (e.g. EOS), returned sorted. Shape: token_counts [V] -> [draft_vocab_size] int64."""
    counts = token_counts.double().clone()
    for t in always_include:
        counts[t] = float("inf")
    order = torch.argsort(-counts, stable=True)  # larger count first; ties keep the lower id first
    return order[:draft_vocab_size].sort().values
