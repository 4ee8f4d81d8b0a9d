"""Paged KV cache and the ragged-batch attention used by the target and the drafter.

Layout: one flat pool of slots per layer, ``k[layer, slot, kv_head, head_dim]``; request ``r`` keeps position
``pos`` at ``slot = block_table[r, pos // block_size] * block_size + pos % block_size`` (the layout
``dk.accept_prefix_scan`` computes KV slots for). Positions past a request's committed length may hold stale
rows from rejected drafts (and, in the drafter's cache, the draft block's rows): attention masks them by position
and the next write overwrites them, so "dropping" rejected KV rows is pure bookkeeping (no copy, no host work). One slot past the pool, ``trash_slot``, takes the
writes of padding rows (a CUDA graph's verify batch padded to its bucket). A cache whose block table it built
itself without shuffling holds each request's positions contiguously, so attention reads them as a view.
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
                 shuffle_seed: Optional[int] = None, contiguous: Optional[bool] = None):
        """``contiguous``: whether ``block_table`` is the in-order one (request r owns blocks r * B .. r * B + B - 1,
        B blocks of max_seq_len), so that attention reads a view; by default, whether this cache builds its own
        table in order (no ``block_table``, no ``shuffle_seed``). The table is the cache's: a caller with a table
        of its own passes it here rather than editing this one."""
        self.block_size, self.max_seq_len = int(block_size), int(max_seq_len)
        blocks_per_seq = math.ceil(self.max_seq_len / self.block_size)
        if block_table is None:
            order = torch.arange(num_seqs * blocks_per_seq)
            if shuffle_seed is not None:  # exercise non-contiguous pages in tests
                order = torch.randperm(order.numel(), generator=torch.Generator().manual_seed(shuffle_seed))
            block_table = order.view(num_seqs, blocks_per_seq).to(device=device, dtype=torch.int32)
            contiguous = shuffle_seed is None if contiguous is None else contiguous
        self.block_table = block_table
        self.contiguous = bool(contiguous)  # request r's position p at slot r * seq_stride + p
        self.seq_stride = blocks_per_seq * self.block_size
        num_slots = (int(block_table.max()) + 1) * self.block_size if block_table.numel() else 0
        self.trash_slot = num_slots
        # zeros, not empty: masked-out slots must never hold NaN (0 * NaN poisons attention)
        self.k = torch.zeros(num_layers, num_slots + 1, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def slots(self, req: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        blk = self.block_table[req, torch.div(pos, self.block_size, rounding_mode="floor")].long()
        return blk * self.block_size + pos % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v.dtype))

    def gather(self, layer: int, kv_slots: torch.Tensor):
        """kv_slots ``[N, L]`` (``slots`` of positions 0..L-1 of requests 0..N-1) -> k, v ``[N, kv_heads, L,
        head_dim]``: a view where the cache is contiguous, else a copy."""
        n, length = kv_slots.shape
        if self.contiguous and length <= self.seq_stride and n * self.seq_stride < self.k.shape[1]:
            rows = self.k.shape[2:]
            k = self.k[layer, :n * self.seq_stride].view(n, self.seq_stride, *rows)[:, :length].transpose(1, 2)
            v = self.v[layer, :n * self.seq_stride].view(n, self.seq_stride, *rows)[:, :length].transpose(1, 2)
            return k, v
        flat = kv_slots.reshape(-1)
        k = self.k[layer].index_select(0, flat).view(n, length, *self.k.shape[2:]).transpose(1, 2)
        v = self.v[layer].index_select(0, flat).view(n, length, *self.v.shape[2:]).transpose(1, 2)
        return k, v


class RaggedBatch(NamedTuple):
    """Metadata of a packed ragged forward, built once and shared by every layer (device tensors only)."""
    pos: torch.Tensor       # int64 [T] position of each packed row
    req: torch.Tensor       # int64 [T] request of each packed row
    slots: torch.Tensor     # int64 [T] KV slot each row writes (the trash slot for a padding row)
    pad_index: torch.Tensor  # int64 [T] row -> index into the padded [N * max_q] layout (N * max_q: padding)
    pad_read: torch.Tensor  # int64 [T] the same, 0 for a padding row (which reads any row)
    kv_slots: torch.Tensor  # int64 [N, L] slots of positions 0..L-1 of every request
    mask: torch.Tensor      # bool [N, 1, max_q, L] key position <= query position
    num_seqs: int
    max_q: int
    bias: Optional[torch.Tensor] = None  # attention_bias(mask) for sdpa_gqa, when the forward attends through it


def ragged_batch(cache: PagedKVCache, positions: torch.Tensor, cu_seqlens: torch.Tensor, max_q: int,
                 kv_len: int, padded: bool = False) -> RaggedBatch:
    """Rows ``cu_seqlens[r]..cu_seqlens[r+1]`` belong to request r (at most ``max_q`` each); keys are read for
    positions ``0..kv_len-1`` (a host-side upper bound, so no sync). ``padded``: rows from ``cu_seqlens[N]`` on
    are padding (a batch of a fixed size): they write the trash slot and their outputs mean nothing."""
    n, t = cu_seqlens.numel() - 1, positions.numel()
    dev = positions.device
    rows = torch.arange(t, device=dev)
    cu = cu_seqlens.long()
    req = torch.searchsorted(cu[1:], rows, right=True)
    pos = positions.long()
    if padded:
        valid = rows < cu[-1]
        req = req.clamp(max=max(n - 1, 0))
        pad_read = torch.where(valid, req * max_q + (rows - cu[req]), 0)
        pad_index = torch.where(valid, pad_read, n * max_q)
        slots = torch.where(valid, cache.slots(req, torch.where(valid, pos, 0)), cache.trash_slot)
    else:
        pad_index = pad_read = req * max_q + (rows - cu[req])
        slots = cache.slots(req, pos)
    q_pos = torch.zeros(n * max_q + 1, dtype=torch.long, device=dev).index_copy_(0, pad_index, pos)[:n * max_q]
    key_pos = torch.arange(kv_len, device=dev)
    mask = (key_pos.view(1, 1, 1, -1) <= q_pos.view(n, 1, max_q, 1))
    all_req = torch.arange(n, device=dev).view(n, 1).expand(n, kv_len)
    kv_slots = cache.slots(all_req, key_pos.view(1, -1).expand(n, kv_len))
    return RaggedBatch(pos, req, slots, pad_index, pad_read, kv_slots, mask, n, max_q)


def uses_row_attention(x: torch.Tensor, cache: PagedKVCache) -> bool:
    """Whether ``ragged_attention`` serves queries of x's dtype and device through the batch-invariant kernel (16-bit
    CPU tensors, the cache of the same dtype) rather than ``sdpa_gqa``."""
    return x.dtype == cache.k.dtype and batch_invariant.enabled_for(x, cache.k)


def ragged_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, b: RaggedBatch, scale: float) -> torch.Tensor:
    """q ``[T, H, D]`` (rows already written to the cache) -> ``[T, H * D]``; causal by position, per request.
    16-bit CPU tensors go through the batch-invariant kernel (``batch_invariant.row_attention``), the rest through
    ``sdpa_gqa`` with ``b.bias`` (built from ``b.mask`` here when the batch carries none)."""
    if uses_row_attention(q, cache):
        return batch_invariant.row_attention(q, cache.k[layer], cache.v[layer], b.kv_slots, b.req, b.pos, scale)
    t, h, d = q.shape
    rows = b.num_seqs * b.max_q
    qp = q.new_zeros(rows + 1, h, d).index_copy_(0, b.pad_index, q)[:rows]
    qp = qp.view(b.num_seqs, b.max_q, h, d).transpose(1, 2)
    k, v = cache.gather(layer, b.kv_slots)
    out = sdpa_gqa(qp, k.to(q.dtype), v.to(q.dtype), b.mask if b.bias is None else b.bias, scale)
    return out.transpose(1, 2).reshape(rows, h * d).index_select(0, b.pad_read)


def attention_bias(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of a boolean mask ``[N, 1, Q, L]`` in ``sdpa_gqa``'s folded layout: ``[N, 1, groups * Q,
    L]`` (row ``j Q + i`` is mask row i; ``[N, 1, 1, L]`` when Q = 1, broadcast over every row) of ``dtype``, 0 where
    the mask holds and -inf elsewhere, what ``scaled_dot_product_attention`` would convert the boolean mask to.
    Built once per forward and shared by every layer. Its rows are padded to a multiple of 16 elements, so the
    memory-efficient CUDA kernel reads it as it is (an unaligned mask is padded by a copy on every call)."""
    n, _, nq, length = mask.shape
    g = groups if nq > 1 else 1
    full = torch.full((n, 1, g, nq, length + (-length % 16)), float("-inf"), dtype=dtype, device=mask.device)
    full[..., :length].masked_fill_(mask.unsqueeze(2), 0.0)
    return full.view(n, 1, g * nq, -1)[..., :length]


def sdpa_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query attention without repeating K/V: the g query heads sharing a KV head become g * Q query
    rows of that head, so one pass over a KV head's keys serves all g of them (the decode layout of FlashInfer's
    kernels; ``enable_gqa`` instead streams each KV head once per query head, or, with a mask on a kernel without
    grouped heads, repeats K/V). q ``[N, H, Q, D]``, k/v ``[N, KV, L, D]``; mask bool ``[N, 1, Q or 1, L]``, or
    ``attention_bias`` of it in q's dtype (what a forward builds once for all its layers)."""
    n, h, nq, d = q.shape
    kv = k.shape[1]
    if mask.dtype == torch.bool:
        mask = attention_bias(mask, h // kv, q.dtype)
    out = F.scaled_dot_product_attention(q.reshape(n, kv, h // kv * nq, d), k, v, attn_mask=mask, scale=scale)
    return out.reshape(n, h, nq, d)
