"""Triton backend of ``dspark_dist::verify_stats``: the first exchange's buffer of one vocabulary shard.

Grid (request, row): one program per target row loops over the shard's vocabulary in ``BLOCK_V``-wide tiles and
keeps, across tiles, the running argmax of the raw logits (NaN as -inf, lowest column on ties: per-lane
``argmax_update``), and for sampling the online softmax statistics of target/T (and of draft/T on rows < K: max,
sum rescaled to the running max, the NaN / +inf flag). At the end it reads target/T (and draft/T) at the row's draft
where the shard owns it, and writes its row of ``StatsLayout`` directly.

Same meaning as ``local_verify.verify_stats``: ids and argmax values equal; the softmax sums to float rounding
(summed per tile, rescaled as the max moves).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.verify_chain import gather_target_rows
from ..triton.rng import argmax_finish, argmax_update
from . import layout as L
from .local_verify import _draft_rows

_BLOCK_V = 1024
_NONE = 2 ** 30   # the index of a column past the shard
NONE_ID = tl.constexpr(_NONE)


@triton.jit
def _tile_stats(x, inside, m, s, bad):
    """One tile of the online softmax statistics (running max ``m``, sum ``s`` of exp(x - m), NaN / +inf flag)."""
    odd = (x != x) | (x == float("inf"))
    clean = tl.where(odd | ~inside, float("-inf"), x)
    new_m = tl.maximum(m, tl.max(clean, axis=0))
    ref = tl.where(new_m > float("-inf"), new_m, 0.0)
    s = s * tl.exp(m - ref) + tl.sum(tl.exp(clean - ref), axis=0)
    bad = tl.maximum(bad, tl.max(tl.where(odd & inside, 1.0, 0.0), axis=0))
    return new_m, s, bad


@triton.jit
def _stats_kernel(t_ptr, stride_t, t_row_ptr, d_ptr, stride_d, at_ptr, temp_ptr, out_ptr, local, k_len, vocab_start,
                  width, SAMPLED: tl.constexpr, HAS_DRAFT: tl.constexpr, BLOCK_V: tl.constexpr):
    p = tl.program_id(0)
    n = p // (k_len + 1)
    j = p % (k_len + 1)
    trow = tl.load(t_row_ptr + p) * stride_t
    drow = (n * k_len + tl.minimum(j, k_len - 1)).to(tl.int64) * stride_d
    has_q = j < k_len
    lanes = tl.arange(0, BLOCK_V)
    best = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    best_i = tl.full((BLOCK_V,), NONE_ID, tl.int32)
    t = 1.0
    if SAMPLED:
        t = tl.load(temp_ptr + n)
        t = tl.where(t > 0, t, 1.0)
    zero = tl.sum(tl.zeros((BLOCK_V,), tl.float32), axis=0)
    tm, ts, tbad = zero + float("-inf"), zero, zero
    qm, qs, qbad = zero + float("-inf"), zero, zero
    for c0 in range(0, local, BLOCK_V):
        cols = c0 + lanes
        inside = cols < local
        x = tl.load(t_ptr + trow + cols, mask=inside, other=0.0).to(tl.float32)
        raw = tl.where((x != x) | ~inside, float("-inf"), x)
        best, best_i = argmax_update(best, best_i, raw, cols)
        if SAMPLED:
            tm, ts, tbad = _tile_stats(x / t, inside, tm, ts, tbad)
            if HAS_DRAFT:
                dmask = inside & has_q
                y = tl.load(d_ptr + drow + cols, mask=dmask, other=0.0).to(tl.float32) / t
                qm, qs, qbad = _tile_stats(y, dmask, qm, qs, qbad)
    out = out_ptr + p.to(tl.int64) * width
    amax = argmax_finish(best, best_i, NONE_ID)
    tl.store(out + 0, tl.max(best, axis=0))
    tl.store(out + 1, (tl.where(amax == NONE_ID, 0, amax) + vocab_start).to(tl.float32))   # all -inf: id 0
    if SAMPLED:
        at = tl.load(at_ptr + p)                 # the draft's local column, -1: not on this shard / row K
        owned = at >= 0
        col = tl.maximum(at, 0)
        tl.store(out + 2, tm)
        tl.store(out + 3, ts)
        tl.store(out + 4, tbad)
        tl.store(out + 5, tl.where(owned, tl.load(t_ptr + trow + col).to(tl.float32) / t, float("-inf")))
        if HAS_DRAFT:
            tl.store(out + 6, tl.where(has_q, qm, float("-inf")))
            tl.store(out + 7, tl.where(has_q, qs, 0.0))
            tl.store(out + 8, tl.where(has_q, qbad, 0.0))
            dat = tl.load(d_ptr + drow + col, mask=owned & has_q, other=0.0).to(tl.float32) / t
            tl.store(out + 9, tl.where(owned & has_q, dat, float("-inf")))


def verify_stats(target_shard, cu_seqlens, draft_tokens, draft_logits_shard, temperature, vocab_start, vocab_size,
                 block_v=None):
    """See ``local_verify.verify_stats``. ``block_v``: the tile width (a power of two; tests use small ones)."""
    n, k_len = draft_tokens.shape
    dev = draft_tokens.device
    local = target_shard.shape[-1]
    lay = L.StatsLayout(temperature is not None, draft_logits_shard is not None)
    out = torch.empty(n, k_len + 1, lay.width, dtype=torch.float32, device=dev)
    if n == 0:
        return out
    req = torch.arange(n, device=dev).unsqueeze(-1)
    rows = torch.arange(k_len + 1, device=dev)
    if cu_seqlens is None:
        rows2d, trow = target_shard.reshape(-1, local), req * (k_len + 1) + rows
    elif target_shard.shape[0] == 0:   # no packed row at all: gather_target_rows reads zeros
        rows2d, _ = gather_target_rows(target_shard, cu_seqlens, k_len)
        rows2d, trow = rows2d.reshape(-1, local), req * (k_len + 1) + rows
    else:                              # the physical row, clamped as gather_target_rows reads it
        rows2d = target_shard
        trow = (cu_seqlens.to(torch.int64)[:-1].unsqueeze(-1) + rows).clamp(0, target_shard.shape[0] - 1)
    if rows2d.stride(-1) != 1:
        rows2d = rows2d.contiguous()
    _, _, idx, owned = _draft_rows(draft_tokens, vocab_start, local, vocab_size)
    at = torch.cat([torch.where(owned, idx, -1), idx.new_full((n, 1), -1)], dim=1).to(torch.int32).contiguous()
    d2d = rows2d
    if draft_logits_shard is not None:
        d2d = draft_logits_shard.reshape(-1, local)
        if d2d.stride(-1) != 1:
            d2d = d2d.contiguous()
    block = block_v or min(_BLOCK_V, triton.next_power_of_2(local))
    _stats_kernel[(n * (k_len + 1),)](
        rows2d, rows2d.stride(0), trow.reshape(-1).contiguous(), d2d, d2d.stride(0), at,
        temperature.contiguous() if temperature is not None else out, out, local, k_len, vocab_start, lay.width,
        SAMPLED=lay.sampled, HAS_DRAFT=lay.draft, BLOCK_V=block)
    return out
