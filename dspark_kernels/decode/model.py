"""A compact Qwen3 / Llama target model over packed ragged tokens and a paged KV cache.

Linear layers are ``RowLinear``: batch-invariant on CPU tensors with 16-bit weights (``batch_invariant.py``), so a token
scores the same in a 1-row decode forward and an 8-row verify forward. Parameter names follow the Hugging Face
layout without the ``model.`` prefix (``layers.0.self_attn.q_proj.weight``, ``norm.weight``, ``lm_head.weight``), so
a checkpoint's state dict loads directly (see ``checkpoint.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kv_cache import PagedKVCache, RaggedBatch, attention_bias, ragged_attention, ragged_batch, uses_row_attention
from .batch_invariant import RowLinear


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = True             # Qwen3: RMSNorm on each query / key head; Llama: none
    tie_word_embeddings: bool = False
    extra: dict = field(default_factory=dict)  # the rest of config.json (drafter fields live here)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        """From a Hugging Face ``config.json`` dict (qwen3, llama, or a DSpark draft built on qwen3; without
        ``model_type``, the model ``architectures`` names)."""
        model_type = _model_type(cfg)
        _refuse_quantized(cfg)
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {missing}")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # the MLP is SiLU-gated; transformers applies ACT2FN[hidden_act]
            raise ValueError(f"unsupported hidden_act {act!r} (supported: 'silu')")
        theta, rope_scaling = _rope_from_hf(cfg, model_type)
        _refuse_sliding_window(cfg, model_type)
        heads = int(cfg["num_attention_heads"])
        kv_heads = _kv_heads(cfg, model_type, heads)
        names = {f.name for f in fields(cls)}
        return cls(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads, num_key_value_heads=kv_heads,
            # transformers' defaults: Qwen3Config 128, LlamaConfig hidden_size / heads
            head_dim=int(cfg.get("head_dim") or (128 if model_type == "qwen3" else cfg["hidden_size"] // heads)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta), rope_scaling=rope_scaling,
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=model_type == "llama" and bool(cfg.get("mlp_bias", False)),  # Qwen3's MLP has none, ever
            qk_norm=model_type == "qwen3", tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            extra={k: v for k, v in cfg.items() if k not in names},
        )


_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3Model": "qwen3", "LlamaForCausalLM": "llama",
                  "LlamaModel": "llama"}


def _kv_heads(cfg: dict, model_type: str, heads: int) -> int:
    """``num_key_value_heads`` as transformers reads it: null means multi-head attention; absent, Qwen3Config's
    default of 32 (LlamaConfig's is null)."""
    absent = "num_key_value_heads" not in cfg
    raw = cfg.get("num_key_value_heads", 32 if model_type == "qwen3" else None)
    kv_heads = heads if raw is None else int(raw)
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        default = " (absent from config.json: Qwen3's default)" if absent and raw is not None else ""
        raise ValueError(f"num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads "
                         f"({kv_heads}{default})")
    return kv_heads


def _model_type(cfg: dict) -> str:
    """``model_type`` ('qwen3' or 'llama'), or where it is absent the one type every entry of ``architectures``
    names; anything else refused."""
    if not cfg.get("model_type"):
        archs = cfg.get("architectures") or []
        kinds = {_ARCHITECTURES.get(a) for a in archs}
        if len(kinds) != 1 or None in kinds:
            raise ValueError(f"config.json has no model_type and its architectures {archs} do not name one "
                             f"supported model ({', '.join(_ARCHITECTURES)}): set model_type ('qwen3' or 'llama')")
        return kinds.pop()
    if cfg["model_type"] not in ("qwen3", "llama"):
        raise ValueError(f"unsupported model_type {cfg['model_type']!r} (supported: 'qwen3', 'llama')")
    return cfg["model_type"]


def _refuse_quantized(cfg: dict) -> None:
    """transformers dequantizes (or runs quantized) what ``quantization_config`` describes; this model does not."""
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(f"quantized checkpoints are not supported (config.json has a quantization_config, "
                         f"quant_method {method!r})")


def _rope_from_hf(cfg: dict, model_type: str) -> Tuple[float, Optional[dict]]:
    """``(rope_theta, llama3 rope_scaling or None)`` as transformers reads them: ``rope_scaling`` before
    ``rope_parameters``; llama3 scaling standardised and validated; other RoPE types refused."""
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: 'default', 'llama3')")
    if rope_type == "default":
        return theta, None
    if "original_max_position_embeddings" in cfg:
        rope["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    rope.setdefault("original_max_position_embeddings",
                    cfg.get("max_position_embeddings", 2048 if model_type == "llama" else 32768))
    lacking = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in rope]
    if lacking:
        raise ValueError(f"llama3 rope_scaling lacks {lacking}")
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {partial} with llama3 RoPE (supported: 1.0)")
    return theta, rope


def _refuse_sliding_window(cfg: dict, model_type: str) -> None:
    """Attention here is full in every layer; transformers' Qwen3 masks keys outside a window in layers >=
    ``max_window_layers`` when ``use_sliding_window`` (or as ``layer_types`` says): such a config is refused."""
    if model_type != "qwen3":
        return
    window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
    types = cfg.get("layer_types") or [
        "sliding_attention" if window is not None and i >= int(cfg.get("max_window_layers", 28)) else "full_attention"
        for i in range(int(cfg["num_hidden_layers"]))]
    if any(t != "full_attention" for t in types):
        raise ValueError(f"unsupported sliding-window attention (use_sliding_window / sliding_window / "
                         f"max_window_layers / layer_types give layer types {types}; supported: every layer "
                         f"'full_attention')")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    s = cfg.rope_scaling
    if s:  # llama3: scale low frequencies, keep high ones, blend in between
        factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        blended = (1 - smooth) * inv / factor + smooth * inv
        inv = torch.where(wavelen > old / lo, inv / factor, torch.where(wavelen < old / hi, inv, blended))
    return inv


class RopeTable:
    """float32 inverse frequencies per device, kept out of the module's buffers so that ``.to(bfloat16)`` never
    rounds them."""

    def __init__(self, cfg: ModelConfig):
        self.cpu, self.per_device = rope_inv_freq(cfg), {}

    def __call__(self, device) -> torch.Tensor:
        if device not in self.per_device:
            self.per_device[device] = self.cpu.to(device)
        return self.per_device[device]


def apply_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x ``[..., T, H, D]``, pos ``[..., T]`` (rotate-half convention, as in Hugging Face)."""
    freqs = pos.unsqueeze(-1).float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(x.dtype).unsqueeze(-2), emb.sin().to(x.dtype).unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool):
        super().__init__()
        h, kv, d, bias = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.attention_bias
        self.h, self.kv, self.d = h, kv, d
        self.q_proj = RowLinear(cfg.hidden_size, h * d, bias=bias)
        self.k_proj = RowLinear(cfg.hidden_size, kv * d, bias=bias)
        self.v_proj = RowLinear(cfg.hidden_size, kv * d, bias=bias)
        self.o_proj = RowLinear(h * d, cfg.hidden_size, bias=bias)
        if qk_norm:
            self.q_norm, self.k_norm = RMSNorm(d, cfg.rms_norm_eps), RMSNorm(d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def project_q(self, x, pos, inv_freq):
        return apply_rope(self.q_norm(self.q_proj(x).unflatten(-1, (self.h, self.d))), pos, inv_freq)

    def project_kv(self, x, pos, inv_freq):
        k = apply_rope(self.k_norm(self.k_proj(x).unflatten(-1, (self.kv, self.d))), pos, inv_freq)
        return k, self.v_proj(x).unflatten(-1, (self.kv, self.d))

    def forward(self, x, cache: PagedKVCache, layer: int, b: RaggedBatch, inv_freq):
        k, v = self.project_kv(x, b.pos, inv_freq)
        cache.write(layer, b.slots, k, v)
        return self.o_proj(ragged_attention(self.project_q(x, b.pos, inv_freq), cache, layer, b, self.d ** -0.5))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = RowLinear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = RowLinear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = RowLinear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, qk_norm: bool):
        super().__init__()
        self.self_attn, self.mlp = Attention(cfg, qk_norm), MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cache, layer, b, inv_freq):
        x = x + self.self_attn(self.input_layernorm(x), cache, layer, b, inv_freq)
        return x + self.mlp(self.post_attention_layernorm(x))


class TargetOutput(NamedTuple):
    logits: torch.Tensor            # [len(logit_rows) or T, V] in the model's dtype (the ops read bf16 as it is)
    hidden: Optional[torch.Tensor]  # [T, len(hidden_layer_ids) * d]: the drafter's context features


def init_random_(module: nn.Module, seed: int, std: float, plain) -> None:
    """Random test weights in place: norm weights ``1 + 0.1 N(0, 1)``; parameters for which ``plain(name, p)``
    holds ``std N(0, 1)``; every other matrix ``N(0, 1) / sqrt(fan_in)``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                scale = std if plain(name, p) else p.shape[-1] ** -0.5
                p.copy_(torch.randn(p.shape, generator=g) * scale)


class TargetModel(nn.Module):
    """Qwen3 / Llama decoder. ``forward`` runs packed ragged rows at per-request positions on a paged cache."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, cfg.qk_norm) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = RowLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RopeTable(cfg)
        self.cache: Optional[PagedKVCache] = None
        self.hidden_layer_ids: List[int] = []

    def init_random(self, seed: int = 0, std: float = 0.3) -> "TargetModel":
        """Random weights for tests (peaked enough that sampling tests have power); norms stay near 1."""
        init_random_(self, seed, std, plain=lambda name, p: p.dim() == 1 or "embed" in name)
        return self

    def alloc_cache(self, num_seqs: int, max_seq_len: int, *, block_size: int = 16, shuffle_seed=None):
        cfg, w = self.config, self.embed_tokens.weight
        self.cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_seqs,
                                  max_seq_len, block_size=block_size, dtype=w.dtype, device=w.device,
                                  shuffle_seed=shuffle_seed)
        return self.cache

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, max_q: int,
                kv_len: int, logit_rows: Optional[torch.Tensor] = None, padded: bool = False) -> TargetOutput:
        """tokens, positions ``[T]``; rows ``cu_seqlens[r]:cu_seqlens[r+1]`` belong to request r (at most ``max_q``);
        keys cover positions ``< kv_len`` (host bound). Writes the rows' KV, returns float32 logits of
        ``logit_rows`` (all rows if None) and the hidden states after layers ``self.hidden_layer_ids``
        (-1 = embeddings; DeepSpec's ``hidden_states[i + 1]``). ``padded``: rows from ``cu_seqlens[N]`` on are
        padding (``kv_cache.ragged_batch``)."""
        b = ragged_batch(self.cache, positions, cu_seqlens, max_q, kv_len, padded)
        x = self.embed_tokens(tokens)
        if not uses_row_attention(x, self.cache):  # every layer's additive mask, built once
            cfg = self.config
            b = b._replace(bias=attention_bias(b.mask, cfg.num_attention_heads // cfg.num_key_value_heads, x.dtype))
        inv_freq = self.rope(x.device)
        keep = {i: None for i in self.hidden_layer_ids}
        if -1 in keep:
            keep[-1] = x
        for i, layer in enumerate(self.layers):
            x = layer(x, self.cache, i, b, inv_freq)
            if i in keep:
                keep[i] = x
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)
        hidden = torch.cat([keep[i] for i in self.hidden_layer_ids], -1) if self.hidden_layer_ids else None
        return TargetOutput(self.lm_head(self.norm(x)), hidden)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight


@torch.no_grad()
def greedy_reference(target, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     stop_token_ids: Sequence[int] = ()) -> List[List[int]]:
    """Plain autoregressive greedy decoding with the same target (one token per step); the losslessness oracle."""
    outs = []
    for prompt in prompts:
        dev = target.input_embeddings.weight.device
        target.alloc_cache(1, len(prompt) + max_new_tokens + 1)
        seq, out = list(prompt), []
        pos0 = 0
        while len(out) < max_new_tokens:
            toks = torch.tensor(seq[pos0:], device=dev)
            cu = torch.tensor([0, toks.numel()], dtype=torch.int32, device=dev)
            pos = torch.arange(pos0, len(seq), device=dev)
            logits = target(toks, pos, cu, toks.numel(), len(seq)).logits
            nxt = int(logits[-1].argmax())
            out.append(nxt)
            seq.append(nxt)
            pos0 = len(seq) - 1
            if nxt in stop_token_ids:
                break
        outs.append(out)
    return outs
