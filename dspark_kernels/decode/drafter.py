"""The DSpark drafter: parallel backbone + Markov head + confidence head (DeepSpec's Qwen3DSparkModel layout).

Backbone: context = ``hidden_norm(fc(concat of the target's hidden states at target_layer_ids))``; each layer's
keys/values are ``[context; block]`` and its queries the block ``[anchor, MASK x (K-1)]`` at positions
``S-1..S+K-2``; non-causal inside the block; the context is the positions strictly before the anchor
(``0..S-2``). Context keys/values never change once written, so they live in a paged KV cache that shares the
target's block table: row at position p goes to the same slot in both caches. The block's keys/values go to the
same cache at the block's positions (not yet committed: the commit overwrites them), so attention reads the cache
in place. The embedding and the LM head are the
target's (shared, not copied). Parameter names match the published ``dspark_qwen3_*_block7`` checkpoints.

A drafter over a reduced vocabulary (``draft_vocab_size`` Vd < V in its config, as speculators / vLLM drafters
store it) has an LM head of its own (``lm_head.weight [Vd, d]``), a Markov W2 over the Vd draft ids (W1 keeps the V
target rows: the previous token is a target id), and a ``d2t`` buffer of offsets (``target id = d + d2t[d]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn

from ..ops.draft_block import draft_to_target_from_offsets
from . import batch_invariant
from .batch_invariant import RowLinear
from .kv_cache import PagedKVCache, attention_bias, sdpa_gqa
from .model import MLP, Attention, ModelConfig, RMSNorm, RopeTable, init_random_

MARKOV_KINDS = ("vanilla", "gated", "rnn")


@dataclass
class DrafterConfig:
    backbone: ModelConfig      # hidden size, heads, rope, ... (num_hidden_layers = draft layers)
    block_size: int
    mask_token_id: int
    target_layer_ids: List[int]
    markov_rank: int = 0
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = True
    draft_vocab_size: int = 0  # Vd < V: a reduced draft vocabulary; 0: the target's

    @classmethod
    def from_hf(cls, cfg: dict) -> "DrafterConfig":
        cfg = _with_dflash_config(cfg)
        missing = [k for k in ("block_size", "mask_token_id", "target_layer_ids") if k not in cfg]
        if missing:
            raise ValueError(f"draft config.json lacks {missing} (not a DSpark/DFlash draft?)")
        rank = int(cfg.get("markov_rank", 0))
        kind = str(cfg.get("markov_head_type", "vanilla")).lower()
        if rank < 0 or (rank > 0 and kind not in MARKOV_KINDS):
            raise ValueError(f"bad Markov head: markov_rank={rank}, markov_head_type={kind!r}")
        backbone = ModelConfig.from_hf({**cfg, "model_type": "qwen3"})
        vd = int(cfg.get("draft_vocab_size") or 0)
        if not 0 <= vd <= backbone.vocab_size:
            raise ValueError(f"draft_vocab_size {vd} must lie in [1, vocab_size = {backbone.vocab_size}]")
        return cls(backbone, int(cfg["block_size"]), int(cfg["mask_token_id"]),
                   [int(i) for i in cfg["target_layer_ids"]], rank, kind,
                   bool(cfg.get("enable_confidence_head", False)), bool(cfg.get("confidence_head_with_markov", True)),
                   0 if vd == backbone.vocab_size else vd)

    def to_hf(self) -> dict:
        b = self.backbone
        cfg = {**b.extra, "architectures": ["Qwen3DSparkModel"], "model_type": "qwen3",
               "vocab_size": b.vocab_size, "hidden_size": b.hidden_size, "intermediate_size": b.intermediate_size,
               "num_hidden_layers": b.num_hidden_layers, "num_attention_heads": b.num_attention_heads,
               "num_key_value_heads": b.num_key_value_heads, "head_dim": b.head_dim, "rms_norm_eps": b.rms_norm_eps,
               "rope_theta": b.rope_theta, "attention_bias": b.attention_bias, "tie_word_embeddings": False,
               "block_size": self.block_size, "mask_token_id": self.mask_token_id,
               "target_layer_ids": list(self.target_layer_ids), "markov_rank": self.markov_rank,
               "enable_confidence_head": self.enable_confidence_head,
               # where vLLM's DFlash / DSpark draft models read these two
               "dflash_config": {"mask_token_id": self.mask_token_id,
                                 "target_layer_ids": list(self.target_layer_ids)}}
        cfg.pop("rope_parameters", None)
        if b.rope_scaling:
            cfg["rope_scaling"] = b.rope_scaling
        if self.draft_vocab_size:
            cfg["draft_vocab_size"] = self.draft_vocab_size
        if self.markov_rank > 0:
            cfg["markov_head_type"] = self.markov_head_type
        if self.enable_confidence_head:
            cfg["confidence_head_with_markov"] = self.confidence_head_with_markov
        return cfg


def _with_dflash_config(cfg: dict) -> dict:
    """``mask_token_id`` and ``target_layer_ids`` where vLLM's DFlash / DSpark drafts read them: from
    ``dflash_config``, else from the top level. A config that gives one of them both ways, differently, is
    refused rather than read one way here and another there."""
    inner = cfg.get("dflash_config") or {}
    differ = [k for k in ("mask_token_id", "target_layer_ids") if k in inner and k in cfg and inner[k] != cfg[k]]
    if differ:
        raise ValueError(f"draft config.json gives {differ} at the top level ({[cfg[k] for k in differ]}) and "
                         f"otherwise in dflash_config ({[inner[k] for k in differ]})")
    return {**cfg, **{k: inner[k] for k in ("mask_token_id", "target_layer_ids") if k in inner}}


def check_layer_ids(layer_ids, num_target_layers: int) -> None:
    """As DeepSpec: ids in [-1, L-1) (-1 = embeddings), strictly increasing, never the final layer (whose
    Hugging Face hidden state is already normed). Raises ValueError naming the ids that do not fit."""
    ids, n = list(layer_ids), int(num_target_layers)
    bad = [i for i in ids if not -1 <= i < n - 1]
    if bad:
        final = " (the final layer is not allowed: its hidden state is already normed)" if n - 1 in bad else ""
        raise ValueError(f"target_layer_ids {ids} do not fit a target of {n} layers: {bad} outside [-1, {n - 1})"
                         f"{final}")
    if not ids or ids != sorted(set(ids)):
        raise ValueError(f"target_layer_ids {ids} must be non-empty and strictly increasing (target of {n} layers)")


class MarkovHeadModule(nn.Module):
    """W1 = markov_w1 (Embedding [V, r]), W2 = markov_w2 (Linear(r, Vd), weight [Vd, r]; Vd = V without a reduced
    vocabulary); gated: gate_proj (Linear(d + r, r)); rnn: joint_proj (Linear(2r + d, 3r)). Applied by
    ``dk.draft_block``."""

    def __init__(self, kind: str, vocab: int, rank: int, hidden: int, draft_vocab: int = 0):
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab, rank)
        self.markov_w2 = nn.Linear(rank, draft_vocab or vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)


class ConfidenceHeadModule(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn, self.mlp = Attention(cfg, qk_norm=True), MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DSparkDrafter(nn.Module):
    """``num_target_layers``: the target's layer count; when given (``for_target`` and ``load_drafter`` give it),
    ``target_layer_ids`` are checked against it here, at creation, and again by ``save_drafter``."""

    def __init__(self, cfg: DrafterConfig, embed_tokens: nn.Embedding, lm_head_weight: torch.Tensor,
                 num_target_layers: Optional[int] = None):
        super().__init__()
        b = cfg.backbone
        if num_target_layers is not None:
            check_layer_ids(cfg.target_layer_ids, num_target_layers)
        self.num_target_layers = num_target_layers
        if embed_tokens.weight.shape != (b.vocab_size, b.hidden_size):
            raise ValueError(f"the drafter expects a [{b.vocab_size}, {b.hidden_size}] target embedding, got "
                             f"{tuple(embed_tokens.weight.shape)} (target and drafter vocabularies differ?)")
        if isinstance(cfg.block_size, bool) or not isinstance(cfg.block_size, int) or cfg.block_size < 1:
            raise ValueError(f"block_size (K, drafts per block) must be an int >= 1, got {cfg.block_size!r}")
        if not 0 <= cfg.mask_token_id < b.vocab_size:
            raise ValueError(f"mask_token_id {cfg.mask_token_id} is outside the vocabulary [0, {b.vocab_size})")
        self.config = cfg
        self.layers = nn.ModuleList(DrafterLayer(b) for _ in range(b.num_hidden_layers))
        self.norm = RMSNorm(b.hidden_size, b.rms_norm_eps)
        self.fc = RowLinear(len(cfg.target_layer_ids) * b.hidden_size, b.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(b.hidden_size, b.rms_norm_eps)
        rank, vd = cfg.markov_rank, cfg.draft_vocab_size
        self.markov_head = (MarkovHeadModule(cfg.markov_head_type, b.vocab_size, rank, b.hidden_size, vd) if rank
                            else None)
        self.confidence_head = None
        if cfg.enable_confidence_head:
            with_markov = cfg.confidence_head_with_markov and rank > 0
            self.confidence_head = ConfidenceHeadModule(b.hidden_size + (rank if with_markov else 0))
        if vd:  # a reduced vocabulary: an LM head of its own and the draft ids' target offsets (registered last)
            self.lm_head = RowLinear(b.hidden_size, vd, bias=False)
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64))
        self.rope = RopeTable(b)
        # shared with the target: kept out of state_dict()/parameters() (plain attributes)
        self.__dict__["embed_tokens"], self.__dict__["lm_head_weight"] = embed_tokens, lm_head_weight
        self.cache: Optional[PagedKVCache] = None

    @classmethod
    def for_target(cls, cfg: DrafterConfig, target) -> "DSparkDrafter":
        """A drafter for ``target`` (TargetModel or HFTarget): its embedding and LM head, its layer count checked."""
        return cls(cfg, target.input_embeddings, target.lm_head_weight, num_target_layers=target.num_layers)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def draft_lm_head(self) -> torch.Tensor:
        """``[Vd, d]``: the LM head of the draft ids (the target's with the full vocabulary)."""
        return self.lm_head.weight if self.config.draft_vocab_size else self.lm_head_weight

    def draft_to_target(self) -> Optional[torch.Tensor]:
        """int64 ``[Vd]`` target id of each draft id (``d + d2t[d]``), or None with the full vocabulary."""
        return draft_to_target_from_offsets(self.d2t) if self.config.draft_vocab_size else None

    def init_random(self, seed: int = 0, std: float = 0.3) -> "DSparkDrafter":
        init_random_(self, seed, std, plain=lambda name, p: p.dim() == 1 or "markov_w1" in name)
        return self

    def set_draft_ids(self, target_ids: torch.Tensor) -> "DSparkDrafter":
        """The target id of each of the Vd draft ids (stored as the ``d2t`` offsets); a reduced drafter only."""
        if not self.config.draft_vocab_size:
            raise ValueError("set_draft_ids: this drafter has the full vocabulary (draft_vocab_size is 0)")
        if tuple(target_ids.shape) != tuple(self.d2t.shape):
            raise ValueError(f"target_ids must have shape {tuple(self.d2t.shape)}, got {tuple(target_ids.shape)}")
        ids = target_ids.to(self.d2t.device, torch.int64)
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        return self

    def alloc_cache(self, target_cache: PagedKVCache) -> PagedKVCache:
        b, w = self.config.backbone, self.fc.weight
        self.cache = PagedKVCache(b.num_hidden_layers, b.num_key_value_heads, b.head_dim, 0, target_cache.max_seq_len,
                                  block_size=target_cache.block_size, dtype=w.dtype, device=w.device,
                                  block_table=target_cache.block_table, contiguous=target_cache.contiguous)
        return self.cache

    def write_context(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Target hidden states ``[T, n_ids * d]`` of rows at ``positions`` -> context K/V written at ``slots``."""
        ctx = self.hidden_norm(self.fc(hidden.to(self.fc.weight.dtype)))
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, positions, self.rope(ctx.device))
            self.cache.write(i, slots, k, v)

    def forward_block(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, kv_len: int):
        """anchor ``[N]`` at positions ``anchor_pos [N]`` (context = cached positions ``< anchor_pos``, with
        ``anchor_pos <= kv_len``, a host bound) -> base logits ``U [N, K, Vd]`` (the head's dtype) and hidden
        ``h [N, K, d]``.

        The block's keys and values are written into the cache at the block's own positions ``anchor_pos ..
        anchor_pos + K - 1`` (past the committed context: the next commit overwrites those it keeps) and every
        layer attends over the cache in place, positions ``0 .. kv_len + K - 1``, those below ``anchor_pos + K``
        unmasked: no copy of the context, static shapes for a fixed ``kv_len``."""
        n, k_len, dev = anchor.shape[0], self.block_size, anchor.device
        length = kv_len + k_len
        if length > self.cache.seq_stride:
            raise ValueError(f"forward_block: kv_len ({kv_len}) + block ({k_len}) exceeds the drafter cache's "
                             f"{self.cache.seq_stride} positions a request")
        ids = torch.full((n, k_len), self.config.mask_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchor
        x = self.embed_tokens(ids).to(self.fc.weight.dtype)
        pos = anchor_pos.long().view(n, 1) + torch.arange(k_len, device=dev)
        req = torch.arange(n, device=dev).view(n, 1)
        key_pos, inv_freq = torch.arange(length, device=dev), self.rope(dev)
        kv_slots = self.cache.slots(req.expand(n, length), key_pos.view(1, -1).expand(n, length))
        block_slots = self.cache.slots(req.expand(n, k_len), pos).view(-1)
        bias = attention_bias((key_pos.view(1, -1) <= pos[:, -1:]).view(n, 1, 1, length), 1, x.dtype)
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            hx = layer.input_layernorm(x)
            q = attn.project_q(hx, pos, inv_freq).transpose(1, 2)
            kb, vb = attn.project_kv(hx, pos, inv_freq)
            self.cache.write(i, block_slots, kb.flatten(0, 1), vb.flatten(0, 1))
            kc, vc = self.cache.gather(i, kv_slots)
            o = sdpa_gqa(q, kc.to(x.dtype), vc.to(x.dtype), bias, attn.d ** -0.5)
            x = x + attn.o_proj(o.transpose(1, 2).flatten(2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        h = self.norm(x)
        head = self.draft_lm_head
        return batch_invariant.linear(h.to(head.dtype), head), h
