"""Paged KV cache and the ragged-batch attention used by the target and the drafter.

Layout: one flat pool of slots per layer, ``k[layer, slot, kv_head, head_dim]``; request ``r`` keeps position
``pos`` at ``slot = block_table[r, pos // block_size] * block_size + pos % block_size`` (the layout
``dk.accept_prefix_scan`` computes KV slots for). Positions past a request's committed length may hold stale
rows from rejected drafts: attention masks them by position and the next verify overwrites them, so "dropping"
rejected KV rows is pure bookkeeping (no copy, no host work).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import batch_invariant


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_seqs: int, max_seq_len: int, *,
                 block_size: int = 16, dtype=torch.float32, device=None, block_table: Optional[torch.Tensor] = None,
                 shuffle_seed: Optional[int] = None):
        self.block_size, self.max_seq_len = int(block_size), int(max_seq_len)
        blocks_per_seq = math.ceil(self.max_seq_len / self.block_size)
        if block_table is None:
            order = torch.arange(num_seqs * blocks_per_seq)
            if shuffle_seed is not None:  # exercise non-contiguous pages in tests
                order = torch.randperm(order.numel(), generator=torch.Generator().manual_seed(shuffle_seed))
            block_table = order.view(num_seqs, blocks_per_seq).to(device=device, dtype=torch.int32)
        self.block_table = block_table
        num_slots = (int(block_table.max()) + 1) * self.block_size if block_table.numel() else 0
        # zeros, not empty: masked-out slots must never hold NaN (0 * NaN poisons attention)
        self.k = torch.zeros(num_layers, num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def slots(self, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        blk = self.block_table[req, torch.div(pos, self.block_size, rounding_mode="floor")].long()
        return blk * self.block_size + pos % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def gather(self, layer: int, kv_slots: torch.Tensor):
        """kv_slots ``[N, L]`` -> k, v ``[N, kv_heads, L, head_dim]``."""
        n, length = kv_slots.shape
        flat = kv_slots.reshape(-1)
        k = self.k[layer].index_select(0, flat).view(n, length, *self.k.shape[2:]).transpose(1, 2)
        v = self.v[layer].index_select(0, flat).view(n, length, *self.v.shape[2:]).transpose(1, 2)
        return k, v


class RaggedBatch(NamedTuple):
    """Metadata of a packed ragged forward, built once and shared by every layer (device tensors only)."""
    pos: torch.Tensor       # int64 [T] position of each packed row
    req: torch.Tensor       # int64 [T] request of each packed row
    slots: torch.Tensor     # int64 [T] KV slot each row writes
    pad_index: torch.Tensor  # int64 [T] row -> index into the padded [N * max_q] layout
    kv_slots: torch.Tensor  # int64 [N, L] slots of positions 0..L-1 of every request
    mask: torch.Tensor      # bool [N, 1, max_q, L] key position <= query position
    num_seqs: int
    max_q: int


def ragged_batch(cache: PagedKVCache, positions: torch.Tensor, cu_seqlens: torch.Tensor, max_q: int,
                 kv_len: int) -> RaggedBatch:
    """Rows ``cu_seqlens[r]..cu_seqlens[r+1]`` belong to request r (at most ``max_q`` each); keys are read for
    positions ``0..kv_len-1`` (a host-side upper bound, so no sync)."""
    n, t = cu_seqlens.numel() - 1, positions.numel()
    dev = positions.device
    rows = torch.arange(t, device=dev)
    cu = cu_seqlens.long()
    req = torch.searchsorted(cu[1:], rows, right=True)
    pos = positions.long()
    pad_index = req * max_q + (rows - cu[req])
    q_pos = torch.zeros(n * max_q, dtype=torch.long, device=dev).index_copy_(0, pad_index, pos)
    key_pos = torch.arange(kv_len, device=dev)
    mask = (key_pos.view(1, 1, 1, -1) <= q_pos.view(n, 1, max_q, 1))
    all_req = torch.arange(n, device=dev).view(n, 1).expand(n, kv_len)
    kv_slots = cache.slots(all_req, key_pos.view(1, -1).expand(n, kv_len))
    return RaggedBatch(pos, req, cache.slots(req, pos), pad_index, kv_slots, mask, n, max_q)


def ragged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, b: RaggedBatch, scale: float) -> torch.Tensor:
    """q ``[T, H, D]`` (rows already written to the cache) -> ``[T, H * D]``; causal by position, per request.
    16-bit CPU tensors go through the batch-invariant kernel (``batch_invariant.row_attention``)."""
    if q.dtype == cache.k.dtype and batch_invariant.enabled_for(q, cache.k):
        return batch_invariant.row_attention(q, cache.k[layer], cache.v[layer], b.kv_slots, b.req, b.pos, scale)
    t, h, d = q.shape
    qp = q.new_zeros(b.num_seqs * b.max_q, h, d).index_copy_(0, b.pad_index, q)
    qp = qp.view(b.num_seqs, b.max_q, h, d).transpose(1, 2)
    k, v = cache.gather(layer, b.kv_slots)
    out = sdpa_gqa(qp, k.to(q.dtype), v.to(q.dtype), b.mask, scale)
    return out.transpose(1, 2).reshape(b.num_seqs * b.max_q, h * d).index_select(0, b.pad_index)


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query attention without repeating K/V: the g query heads sharing a KV head become g * Q query
    rows of that head. q ``[N, H, Q, D]``, k/v ``[N, KV, L, D]``, mask bool ``[N, 1, Q or 1, L]``."""
    n, h, nq, d = q.shape
    kv, length = k.shape[1], k.shape[2]
    g = h // kv
    mask = mask.expand(n, 1, nq, length).unsqueeze(2).expand(n, 1, g, nq, length).reshape(n, 1, g * nq, length)
    out = F.scaled_dot_product_attention(q.reshape(n, kv, g * nq, d), k, v, attn_mask=mask, scale=scale)
    return out.reshape(n, h, nq, d)
