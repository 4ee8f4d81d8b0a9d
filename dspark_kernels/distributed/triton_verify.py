"""Triton backend of ``dspark_dist::verify_residual``: the exact residual pass over one vocabulary shard.

Grid (planned slot, vocabulary block): the program of slot (request n, row j) with NEED set reads target row j and
draft row min(j, K-1) of its block (nothing when NEED is clear: the loads are masked), forms
``w = max(rho p - q, 0)`` from the plan's merged statistics (NaN kept: a NaN mass tells block verification
"never accept"), and writes the block's mass, the residual race's winner (score ``w / -log(u)``) and the race over p
(key ``target/T - log(-log(u))``), lowest column on ties; a few torch ops merge the blocks. Same meaning as
``local_verify.verify_residual``; masses to float rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.verify_chain import gather_target_rows
from ..triton.rng import STREAM_RESIDUAL, gumbel_score, key_args, load_key, race_score, uniform
from . import layout as L
from .local_verify import _draft_rows

_BLOCK_V = 256
_NONE = 2 ** 30


@triton.jit
def _prob(x, m, s, bad):
    return tl.where(bad > 0, float("nan"), tl.exp(x - m) / s)


@triton.jit(do_not_specialize=["seed", "offset"])
def _residual_kernel(t_ptr, t_row_ptr, d_ptr, d_row_ptr, dtok_ptr, plan_ptr, temp_ptr, key_ptr, seed, offset,
                     KEY_IN_MEMORY: tl.constexpr, part_ptr, local, vocab_start, HAS_DRAFT: tl.constexpr,
                     BLOCK_V: tl.constexpr, NONE: tl.constexpr):
    slot = tl.program_id(0)
    blk = tl.program_id(1)
    n = tl.load(t_row_ptr + 3 * slot + 1)
    plan = plan_ptr + slot * 9
    live = tl.where(tl.load(plan + 1) > 0, local, 0)    # columns to read: none for a slot not needed
    row = tl.load(t_row_ptr + 3 * slot + 2)            # the plan's row clamped into [0, K]
    cols = blk * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = cols < live
    t = tl.load(temp_ptr + n)
    t = tl.where(t > 0, t, 1.0)
    trow = tl.load(t_row_ptr + 3 * slot)
    x = tl.load(t_ptr + trow * local + cols, mask=inside, other=0.0).to(tl.float32) / t
    p = _prob(x, tl.load(plan + 3), tl.load(plan + 4), tl.load(plan + 5))
    if HAS_DRAFT:
        drow = tl.load(d_row_ptr + slot)
        y = tl.load(d_ptr + drow * local + cols, mask=inside, other=0.0).to(tl.float32) / t
        q = _prob(y, tl.load(plan + 6), tl.load(plan + 7), tl.load(plan + 8))
    else:
        q = tl.where(vocab_start + cols == tl.load(dtok_ptr + slot), 1.0, 0.0)
    d = tl.load(plan + 2) * p - q
    w = tl.where(d > 0, d, tl.where(d != d, d, 0.0))          # clamp(min=0) that keeps NaN, as torch's
    w = tl.where(inside, w, 0.0)
    k0, k1, off_lo = load_key(key_ptr, seed, offset, KEY_IN_MEMORY)
    u = uniform(k0, k1, off_lo, n, row, STREAM_RESIDUAL, (vocab_start + cols).to(tl.int64))
    score = tl.where(inside, race_score(w, u), float("-inf"))
    best = tl.max(score, axis=0)
    win = tl.min(tl.where((score == best) & (cols < local), cols, NONE), axis=0)
    key = tl.where(inside, gumbel_score(x, u), float("-inf"))
    gbest = tl.max(key, axis=0)
    gwin = tl.min(tl.where((key == gbest) & (cols < local), cols, NONE), axis=0)
    out = part_ptr + (slot * tl.num_programs(1) + blk) * 5
    tl.store(out + 0, tl.sum(w, axis=0))
    tl.store(out + 1, best)
    tl.store(out + 2, win.to(tl.float32))
    tl.store(out + 3, gbest)
    tl.store(out + 4, gwin.to(tl.float32))


def verify_residual(target_shard, cu_seqlens, draft_tokens, draft_logits_shard, plan, temperature, rng_key,
                    vocab_start, vocab_size):
    """See ``local_verify.verify_residual``."""
    n, k_len = draft_tokens.shape
    slots = plan.shape[1]
    dev = draft_tokens.device
    local = target_shard.shape[-1]
    out = torch.zeros(n, slots, L.RES_WIDTH, device=dev)
    if slots == 0:
        return out
    row = plan[..., L.PLAN_ROW].to(torch.int64).clamp(0, k_len)
    qrow = row.clamp(max=k_len - 1)
    req = torch.arange(n, device=dev).unsqueeze(-1).expand(n, slots)
    if cu_seqlens is None:
        rows2d, trow = target_shard.reshape(-1, local), req * (k_len + 1) + row
    else:   # packed: the physical row, clamped as gather_target_rows reads it
        rows2d = target_shard
        trow = (cu_seqlens.to(torch.int64)[:-1].unsqueeze(-1) + row).clamp(0, max(target_shard.shape[0] - 1, 0))
        if target_shard.shape[0] == 0:
            rows2d, _ = gather_target_rows(target_shard, cu_seqlens, k_len)
            rows2d, trow = rows2d.reshape(-1, local), req * (k_len + 1) + row
    t_rows = torch.stack([trow, req, row], dim=-1).contiguous()   # (physical row, request, row)
    valid, safe, _, _ = _draft_rows(draft_tokens, 0, vocab_size, vocab_size)
    dtok = torch.where(valid, safe, -1).gather(1, qrow).contiguous()
    d2d = draft_logits_shard.reshape(-1, local).contiguous() if draft_logits_shard is not None else plan
    d_rows = (req * k_len + qrow).contiguous()
    blocks = triton.cdiv(local, _BLOCK_V)
    part = torch.empty(n * slots, blocks, 5, device=dev)
    _residual_kernel[(n * slots, blocks)](
        rows2d.contiguous(), t_rows, d2d, d_rows, dtok, plan.contiguous(), temperature.contiguous(),
        *key_args(rng_key, part.device), part, local, vocab_start, HAS_DRAFT=draft_logits_shard is not None,
        BLOCK_V=_BLOCK_V, NONE=_NONE)
    need = plan[..., L.PLAN_NEED] > 0
    out[..., L.RES_MASS] = torch.where(need, part[..., 0].sum(1).view(n, slots), 0.0)
    for s_slot, i_slot, c in ((L.RES_SCORE, L.RES_ID, 1), (L.RES_GSCORE, L.RES_GID, 3)):
        best, winner = L.argmax_lowest(part[..., c], part[..., c + 1].to(torch.int64) + vocab_start, 1)
        out[..., s_slot] = torch.where(need, best.view(n, slots), float("-inf"))
        out[..., i_slot] = L.ids_to_slots(torch.where(need, winner.view(n, slots), L.EMPTY_ID))
    return out
