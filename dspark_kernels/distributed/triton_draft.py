"""Triton backend of ``dspark_dist::draft_step``: one position of the Markov head on one vocabulary shard.

Grid (request, vocabulary block): each program computes its block of ``logits = U_k + W2_shard @ v`` (the rank
dimension in tiles), the race key of every column (the logit for greedy requests, ``logits/T - log(-log(u))`` with
``u = uniform(request, position, DRAFT, vocab_start + column)`` for sampled ones), the block's best key and its
lowest column, the softmax statistics of ``logits/T'`` and the winner's scaled logit, into a partial
``[N, blocks, 6]``; a few torch ops merge the blocks (the argmax rule over global ids, the statistics as in
``layout.merge_softmax_stats``) into the op's outputs. Same meaning as ``local_draft.draft_step``: packed keys and
winners equal, statistics to float rounding (the dot products are summed in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.rng import STREAM_DRAFT, gumbel_score, key_args, load_key, uniform
from . import layout as L
from .local_draft import pack_key

_BLOCK_V = 128
_BLOCK_R = 32
_NONE = 2 ** 30   # a column index larger than any block's


@triton.jit(do_not_specialize=["seed", "offset"])
def _draft_step_kernel(u_ptr, stride_un, v_ptr, w2_ptr, temp_ptr, key_ptr, seed, offset, KEY_IN_MEMORY: tl.constexpr, part_ptr, logits_ptr, local, rank,
                       position, vocab_start, HAS_TEMP: tl.constexpr, RETURN_LOGITS: tl.constexpr,
                       BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, NONE: tl.constexpr):
    n = tl.program_id(0)
    blk = tl.program_id(1)
    cols = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = cols < local
    acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        v = tl.load(v_ptr + n * rank + rs, mask=rs < rank, other=0.0)
        w = tl.load(w2_ptr + cols[:, None].to(tl.int64) * rank + rs[None, :],
                    mask=inside[:, None] & (rs[None, :] < rank), other=0.0).to(tl.float32)
        acc += tl.sum(w * v[None, :], axis=1)
    logits = tl.load(u_ptr + n.to(tl.int64) * stride_un + cols, mask=inside, other=0.0).to(tl.float32) + acc
    if RETURN_LOGITS:
        tl.store(logits_ptr + n.to(tl.int64) * local + cols, logits, mask=inside)
    safe_t = 1.0
    key = tl.where(logits != logits, float("-inf"), logits)
    if HAS_TEMP:
        t = tl.load(temp_ptr + n)
        sampled = t > 0
        safe_t = tl.where(sampled, t, 1.0)
        k0, k1, off_lo = load_key(key_ptr, seed, offset, KEY_IN_MEMORY)
        u = uniform(k0, k1, off_lo, n, position, STREAM_DRAFT, (vocab_start + cols).to(tl.int64))
        key = tl.where(sampled, gumbel_score(logits / safe_t, u), key)
    key = tl.where(inside, key, float("-inf"))
    best = tl.max(key, axis=0)
    win = tl.min(tl.where((key == best) & inside, cols, NONE), axis=0)
    scaled = logits / safe_t
    odd = (scaled != scaled) | (scaled == float("inf"))
    clean = tl.where(odd | ~inside, float("-inf"), scaled)
    m = tl.max(clean, axis=0)
    s = tl.sum(tl.exp(clean - tl.where(m > float("-inf"), m, 0.0)), axis=0)   # 0 for a block with no finite logit
    bad = tl.max(tl.where(odd & inside, 1.0, 0.0), axis=0)
    lwin = tl.sum(tl.where(cols == win, scaled, 0.0), axis=0)
    out = part_ptr + (n * tl.num_programs(1) + blk) * 6
    tl.store(out + 0, best)
    tl.store(out + 1, win.to(tl.float32))
    tl.store(out + 2, m)
    tl.store(out + 3, s)
    tl.store(out + 4, bad)
    tl.store(out + 5, lwin)


def draft_step(base_logits_k, v, w2_shard, temperature, rng_key, position, vocab_start, return_logits):
    """See ``local_draft.draft_step``."""
    n, local = base_logits_k.shape
    rank = v.shape[1]
    dev = base_logits_k.device
    blocks = triton.cdiv(local, _BLOCK_V)
    part = torch.empty(n, blocks, 6, dtype=torch.float32, device=dev)
    logits = torch.empty(n, local, dtype=torch.float32, device=dev) if return_logits else part.new_empty(0)
    base = base_logits_k if base_logits_k.stride(-1) == 1 else base_logits_k.contiguous()
    temps = temperature.contiguous() if temperature is not None else part
    _draft_step_kernel[(n, blocks)](
        base, base.stride(0), v.float().contiguous(), w2_shard.contiguous(), temps, *key_args(rng_key, dev), part, logits, local,
        rank, position, vocab_start, HAS_TEMP=temperature is not None, RETURN_LOGITS=bool(return_logits),
        BLOCK_V=_BLOCK_V, BLOCK_R=_BLOCK_R, NONE=_NONE)
    ids = part[..., 1].to(torch.int64) + vocab_start
    best, winner = L.argmax_lowest(part[..., 0], ids, 1)
    stats = torch.empty(n, L.DRAFT_WIDTH, dtype=torch.float32, device=dev)
    m, s, _ = L.merge_softmax_stats(part[..., 2], part[..., 3], part[..., 4], dim=1)
    # the shard's own flag (NaN / +inf seen): whether the whole row has a finite logit is for the final merge
    stats[:, L.DRAFT_MAX], stats[:, L.DRAFT_SUM], stats[:, L.DRAFT_BAD] = m, s, part[..., 4].amax(1)
    stats[:, L.DRAFT_LWIN] = part[..., 5].gather(1, (winner - vocab_start).div(_BLOCK_V, rounding_mode="floor")
                                                 .unsqueeze(-1)).squeeze(-1)
    stats[:, L.DRAFT_ID] = L.ids_to_slots(winner)
    return pack_key(best, winner), stats, logits
