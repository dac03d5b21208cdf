"""Llama / Qwen2-family decoder-only transformer (RMSNorm, RoPE, GQA, SwiGLU).

One module for every role: draft, target, SUN prefill module and shared
decoder have this architecture and differ only in weights. Parameter names are
Hugging Face's, so HF safetensors load as they are. No generation logic here:
`forward` maps tokens + a past KV (as tensors) to logits + the present KV, the
same contract the ONNX graphs export and prefill-only tuning differentiates.

Ragged batches: `past` holds B sequences right-padded to P entries; row b is
valid for its first past_lengths[b] entries. New tokens of row b take positions
past_lengths[b] .. past_lengths[b]+T-1 and are appended after the padding.

Engines use `forward_cached` instead: the same math, but the KV lives in a cache
object that writes new entries in place and hands back views (no copy of the
past per layer and step), attention runs per sequence over its own length (no
padded copy of a ragged batch), GQA reads K/V without repeating them, and the
linear layers pick the faster BLAS path for few rows (`fast_linear`).
`forward` stays the functional reference (ONNX export, tuning).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

KV = List[Tuple[torch.Tensor, torch.Tensor]]  # per layer (k, v): [B, n_kv, L, head_dim]


@dataclass
class ModelConfig:
    arch: str = "llama"              # "llama" or "qwen2" (= llama + q/k/v bias)
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0                # 0: hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # HF dict, e.g. {"rope_type": "llama3", ...}
    rms_norm_eps: float = 1e-5
    max_position: int = 2048
    tie_embeddings: bool = True
    qkv_bias: bool = False
    extra: dict = field(default_factory=dict)  # metadata kept for exporters (bos/eos ids, ...)

    def __post_init__(self):
        if self.arch not in ("llama", "qwen2"):
            raise ValueError(f"unsupported architecture {self.arch!r}: use 'llama' or 'qwen2'")
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    # -- Hugging Face config.json <-> ModelConfig --------------------------------
    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        mt = hf.get("model_type", "llama")
        if mt not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"unsupported model_type {mt!r} (llama and qwen2 families only)")
        heads = hf["num_attention_heads"]
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        rp = hf.get("rope_parameters")  # transformers 5 folds theta + scaling in here
        if rp:
            rope_theta = rope_theta or rp.get("rope_theta")
            if rp.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        return cls(
            arch="qwen2" if mt == "qwen2" else "llama",
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
            num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(rope_theta or 10000.0), rope_scaling=rope_scaling,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position=hf.get("max_position_embeddings", 2048),
            tie_embeddings=bool(hf.get("tie_word_embeddings", mt != "qwen2")),
            qkv_bias=(mt == "qwen2") or bool(hf.get("attention_bias", False)),
        )

    def to_hf(self) -> dict:
        hf = {
            "model_type": self.arch,
            "architectures": ["Qwen2ForCausalLM" if self.arch == "qwen2" else "LlamaForCausalLM"],
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings, "hidden_act": "silu",
        }
        if self.rope_scaling:
            hf["rope_scaling"] = dict(self.rope_scaling)
        if self.arch == "llama":
            hf["attention_bias"] = self.qkv_bias
            hf["mlp_bias"] = False
        return hf

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        return cls(**json.loads(text))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies, with llama3 / linear scaling when configured."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "llama3":
        factor, low, high = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        low_wl, high_wl = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = torch.where(is_mid, mid, scaled)
    elif kind == "linear":
        inv = inv / sc["factor"]
    elif kind == "freq_factors":
        # llama.cpp's rope_freqs tensor (a GGUF of a Llama 3.1-style model): each frequency
        # divided by its factor -- any per-frequency scaling, llama3's included
        inv = inv / torch.tensor(sc["factors"], dtype=torch.float64)
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


# Small-M trap (MKL, fp32, one thread, measured here): F.linear over 2..5 rows costs
# 1.5-3x one row (its gemm repacks the weight per call), and one row runs MKL's gemv at
# 10-13 GB/s. mm(W, x^T) with >= 2 columns takes MKL's skinny path instead, ~17-19 GB/s
# at 1..5 rows -- when the weight is not much longer along K than along N. Time ratio
# F.linear / skinny, one weight read each (cold), by rows:
#   (N, K)        1     2     3     4     5     6
#   1536 x 576    1.74  2.69  1.88  1.82  1.34  1.17   wide: q/k/v/o, gate/up, lm_head
#   4864 x 896    1.38  3.19  3.16  2.15  1.69  1.02
#   151936 x 896  1.37  3.00  3.27  2.78  2.10  1.24
#   576 x 1536    1.25  1.77  1.00  0.95  0.70  0.56   down_proj, K < 2048
#   896 x 4864    0.52  0.99  1.23  0.71  0.70  0.64   down_proj, K > 2048: keep F.linear
# A single row is padded to two (rows are independent; the copy only picks the kernel).
# Only at one thread: with 2 threads on the loaded 2-core box the skinny path stalled
# far worse than F.linear (4.6 s vs 0.5 s per step); other machines are unmeasured.
SKINNY = torch.backends.mkl.is_available()
SKINNY_MAX_ROWS = 5


def _skinny(rows: int, n: int, k: int) -> bool:
    return rows <= SKINNY_MAX_ROWS and (k <= n or (rows <= 2 and k <= 2048))


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None):
    """F.linear(x, weight, bias), with the kernel chosen by the shapes (above)."""
    rows = x.numel() // x.shape[-1]
    if not (SKINNY and _skinny(rows, *weight.shape) and x.dtype in (torch.float32, torch.float64)
            and torch.get_num_threads() == 1):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1])
    if rows == 1:
        x2 = torch.cat((x2, x2))
    y = torch.mm(weight, x2.t())[:, :rows].t().contiguous()
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


def _lin(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return fast_linear(x, m.weight, m.bias)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # HF's rotate_half convention: pairs are (i, i + d/2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        hd, bias = cfg.head_dim, cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, past: Optional[Tuple[torch.Tensor, torch.Tensor]]):
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past is not None:
            k = torch.cat((past[0], k), dim=2)
            v = torch.cat((past[1], v), dim=2)
        rep = c.num_heads // c.num_kv_heads
        kk = k.repeat_interleave(rep, dim=1) if rep > 1 else k
        vv = v.repeat_interleave(rep, dim=1) if rep > 1 else v
        y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        y = y.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim)
        return self.o_proj(y), (k, v)

    def forward_cached(self, x, cos, sin, cache, layer: int):
        """Fast path: new K/V written into `cache`, attention per sequence over views."""
        B, T, _ = x.shape
        c = self.cfg
        q = _lin(self.q_proj, x).view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = _lin(self.k_proj, x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = _lin(self.v_proj, x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # enable_gqa: query head h reads kv head h // rep in the kernel, K/V are not repeated
        ys = [F.scaled_dot_product_attention(q[b:b + 1], kb, vb, attn_mask=mask, enable_gqa=True)
              for b, (kb, vb, mask) in enumerate(cache.update(layer, k, v))]
        y = ys[0] if B == 1 else torch.cat(ys)                     # [B, H, T, hd]
        return _lin(self.o_proj, y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward_cached(self, x):
        return _lin(self.down_proj, F.silu(_lin(self.gate_proj, x)) * _lin(self.up_proj, x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, past):
        a, present = self.self_attn(self.input_layernorm(x), cos, sin, mask, past)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), present

    def forward_cached(self, x, cos, sin, cache, layer: int):
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), cos, sin, cache, layer)
        return x + self.mlp.forward_cached(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg).float(), persistent=False)

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state_dict) -> "Transformer":
        """Build around existing tensors (no random init, no copy); strict names and shapes."""
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(state_dict, strict=True, assign=True)
        # non-persistent buffers are not in a state_dict: rebuild them off the meta device
        model.register_buffer("inv_freq", rope_inv_freq(cfg).float(), persistent=False)
        return model.eval()

    def output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_embeddings else self.lm_head.weight

    def forward(self, tokens: torch.Tensor, past: Optional[KV] = None,
                past_lengths: Optional[torch.Tensor] = None, return_hidden: bool = False,
                logits_last_only: bool = False):
        """tokens [B, T] -> (logits [B, T, V], present KV [B, n_kv, P+T, hd] per layer).

        past: per layer (k, v) [B, n_kv, P, hd], row b valid for past_lengths[b]
        entries (default: all P). With return_hidden the final-norm hidden states
        are returned as a third value (SUN and draft heads use them).
        """
        B, T = tokens.shape
        dev = tokens.device
        P = 0 if past is None else past[0][0].shape[2]
        if past_lengths is None:
            past_lengths = torch.full((B,), P, dtype=torch.long, device=dev)
        positions = past_lengths[:, None] + torch.arange(T, device=dev)[None, :]  # [B, T]
        x = self.model.embed_tokens(tokens)
        ang = positions[..., None].to(torch.float32) * self.inv_freq.to(dev)     # [B, T, hd/2]
        ang = torch.cat((ang, ang), dim=-1)[:, None]                               # [B, 1, T, hd]
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        # key j < P is valid iff j < past_lengths[b]; new key P+t is visible to query t' >= t
        kidx = torch.arange(P, device=dev)
        kpos = torch.cat((kidx[None, :].expand(B, P), positions), dim=1)            # [B, P+T]
        valid = torch.cat((kidx[None, :] < past_lengths[:, None],
                           torch.ones(B, T, dtype=torch.bool, device=dev)), dim=1)
        mask = valid[:, None, :] & (kpos[:, None, :] <= positions[:, :, None])   # [B, T, P+T]
        mask = mask[:, None]                                                       # [B, 1, T, P+T]
        present = []
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, cos, sin, mask, None if past is None else past[i])
            present.append(kv)
        h = self.model.norm(x)
        logits = F.linear(h[:, -1:] if logits_last_only else h, self.output_weight())
        if return_hidden:
            return logits, present, h
        return logits, present

    def forward_cached(self, tokens: torch.Tensor, cache, last_only: bool = False) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T or 1, V]; the KV lives in `cache` (engines' fast path).

        `cache` (edge.model.kv.BatchCache) gives `positions` [B, T] of the new tokens and
        `update(layer, k, v)`, which stores k, v [B, n_kv, T, hd] and returns per
        sequence (K, V, mask): views [1, n_kv, L_b, hd] incl. the new entries and a
        bool mask [T, L_b] (None when T == 1). Same math as `forward`; only the last
        position's logits with `last_only` (a prefill needs no more).
        """
        x = self.model.embed_tokens(tokens)
        cos, sin = _rope(self.inv_freq, cache.positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer.forward_cached(x, cos, sin, cache, i)
        if last_only:
            x = x[:, -1:]
        return fast_linear(self.model.norm(x), self.output_weight())


def _rope(inv_freq: torch.Tensor, positions: torch.Tensor, dtype):
    ang = positions[..., None].to(torch.float32) * inv_freq.to(positions.device)  # [B, T, hd/2]
    ang = torch.cat((ang, ang), dim=-1)[:, None]                                    # [B, 1, T, hd]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def tiny_config(arch: str = "llama", **kw) -> ModelConfig:
    """A small random-init config for tests and CI demos."""
    base = dict(arch=arch, vocab_size=256, hidden_size=64, intermediate_size=128,
                num_layers=2, num_heads=4, num_kv_heads=2, max_position=512,
                qkv_bias=(arch == "qwen2"), tie_embeddings=(arch != "qwen2"))
    base.update(kw)
    return ModelConfig(**base)
