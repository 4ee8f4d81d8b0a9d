"""Triton verify_chain: the CUDA kernels' decomposition (csrc/include/dspark/verify_chain.cuh), for GPUs without nvcc.

Same meaning and randomness as ``dspark_kernels.reference.verify_chain`` (read that first). Three kernels, each a
program per (request, row, vocabulary chunk) with a per-request "last program" ticket that merges the programs'
partials and finishes the request:

* ``_rows_kernel`` (pass A): the argmax of greedy rows 0..L, or the softmax statistics of target / T of sampled rows
  0..L-1, the target logit at each draft (the chunk holding it) and the draft logit at its column; without
  draft_logprobs the statistics of draft rows 0..L-1 over their own columns. The ticket's program runs the chain
  (greedy, token or block acceptance, stop tokens), writes the outputs and names the emitting row for pass B.
* ``_mass_kernel`` (block verification): ``S_i = sum max(rho_i p_i - q_i, 0)`` for rows 1..L-1; its ticket takes tau.
* ``_sample_kernel`` (pass B): over the emitting row only, the residual race, its mass and the Gumbel race over p
  with the same uniforms; its ticket keeps the race the rule asks for.

Draft rows are read in their own layout: dense ``[N, K, V]``, reduced ``[N, K, Vd]`` through ``target_to_draft``,
top-k ``[N, K, k]`` with their candidate ids. Tickets are int32 words zeroed once per (device, stream) and left
zeroed by every launch.
"""

import torch
import triton
import triton.language as tl

from .rng import (STREAM_ACCEPT, STREAM_RESIDUAL, argmax_finish, argmax_update, gumbel_score, key_args, load_key,
                  race_score, uniform)

RESIDUAL_EPS = tl.constexpr(1e-6)
NEG_INF = tl.constexpr(float("-inf"))
ALL = tl.constexpr(tl.PropagateNan.ALL)   # max/min propagate NaN as torch.clamp does
BIG = tl.constexpr(2 ** 62)
Q_ONEHOT, Q_DENSE, Q_REDUCED, Q_TOPK = (tl.constexpr(k) for k in (1, 2, 3, 4))  # where q comes from (QKind)
F_EMIT, F_FULL, F_PENDING = (tl.constexpr(f) for f in (1, 2, 4))                 # state flags
S_ROW, S_FLAGS, S_START, S_HOT = (tl.constexpr(i) for i in range(4))              # state_i slots
S_T, S_RHO, S_PT, S_PQ = (tl.constexpr(i) for i in (0, 1, 2, 5))                 # state_f slots (PT, PQ: m, s, bad)
OWN = tl.constexpr(2.0)          # PQ bad: pass B sums the draft row's statistics itself
MIN_CHUNK, MIN_SAMPLE_CHUNK = 2048, 1024


# ------------------------------------------------------------------------------------------------ helpers
@triton.jit
def packed_last_row(start, end, total_rows, K):
    """The last packed target row of a request owning ``[start, min(end, R))`` (reference.packed_last_row): -1 for
    none, at most K. Nothing overflows, whatever the int64 offsets."""
    owns = (start >= 0) & (start < total_rows) & (end > start)
    rows = tl.where(owns, tl.minimum(end, total_rows), 0) - tl.where(owns, start, 0)
    return tl.minimum(rows, K + 1) - 1


@triton.jit
def _request(cu_ptr, lens_ptr, surv_ptr, thr_ptr, temp_ptr, r, total_rows, K, PACKED: tl.constexpr,
             HAS_LENS: tl.constexpr, HAS_THR: tl.constexpr, SAMPLING: tl.constexpr, BLOCK_K: tl.constexpr):
    """(first row, last row present (-1: none), verify length L, temperature, sampled) of request r."""
    kcols = tl.arange(0, BLOCK_K)
    if PACKED:
        start = tl.load(cu_ptr + r).to(tl.int64)
        last = packed_last_row(start, tl.load(cu_ptr + r + 1).to(tl.int64), total_rows, K)
    else:
        start = r * (K + 1)
        last = K + 0 * r
    L = tl.maximum(last, 0)
    if HAS_LENS:
        L = tl.minimum(L, tl.minimum(tl.maximum(tl.load(lens_ptr + r).to(tl.int64), 0), K))
    if HAS_THR:
        sv = tl.load(surv_ptr + r * K + kcols, mask=kcols < K, other=0.0).to(tl.float32)
        th = tl.load(thr_ptr + kcols, mask=kcols < K, other=1.0).to(tl.float32)
        L = tl.minimum(L, tl.min(tl.where(~(sv >= th) | (kcols >= K), kcols, K), axis=0).to(tl.int64))
    t = tl.zeros([], tl.float32)
    if SAMPLING:
        t = tl.load(temp_ptr + r)
    sampled = t > 0
    return start, last, L, tl.where(sampled, t, 1.0), sampled


@triton.jit
def _chunk_argmax(row_ptr, begin, end, BLOCK_V: tl.constexpr):
    """(max, argmax) of the raw values [begin, end) of a row: NaN as -inf, ties to the lowest index (an all -inf
    chunk gives its first index)."""
    best = tl.full([BLOCK_V], NEG_INF, tl.float32)
    best_i = begin + tl.arange(0, BLOCK_V).to(tl.int64)
    for s in range(begin, end, BLOCK_V):
        cols = s + tl.arange(0, BLOCK_V).to(tl.int64)
        x = tl.load(row_ptr + cols, mask=cols < end, other=NEG_INF).to(tl.float32)
        best, best_i = argmax_update(best, best_i, tl.where(x != x, NEG_INF, x), cols)
    return tl.max(best, axis=0), argmax_finish(best, best_i, BIG)


@triton.jit
def _chunk_stats(row_ptr, begin, end, t, BLOCK_V: tl.constexpr):
    """(max, sum exp(x / t - max), bad) over [begin, end) of a row; NaN and +inf are left out and set bad."""
    m = tl.full([BLOCK_V], NEG_INF, tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    bad = tl.zeros([BLOCK_V], tl.int32)
    for start in range(begin, end, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V).to(tl.int64)
        inside = cols < end
        x = tl.load(row_ptr + cols, mask=inside, other=0.0).to(tl.float32) / t
        odd = inside & ((x != x) | (x == float("inf")))
        bad = bad | odd.to(tl.int32)
        x = tl.where(odd | ~inside, NEG_INF, x)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    m_all = tl.max(m, axis=0)
    s_all = tl.sum(s * tl.exp(m - tl.where(m_all == NEG_INF, 0.0, m_all)), axis=0)
    return m_all, s_all, tl.max(bad, axis=0).to(tl.float32)


@triton.jit
def _merge_stats(m, s, bad, axis: tl.constexpr):
    """Merge softmax statistics (m, s, bad) along ``axis``."""
    top = tl.max(m, axis=axis)
    top_safe = tl.where(top == NEG_INF, 0.0, top)
    scale = tl.where(m > NEG_INF, tl.exp(m - tl.expand_dims(top_safe, axis)), 0.0)
    return top, tl.sum(s * scale, axis=axis), tl.max(bad, axis=axis)


@triton.jit
def _prob(x, m, s, bad):
    """softmax(row)[x] of a scaled logit from the row's statistics (NaN for a row softmax makes all-NaN)."""
    return tl.where((bad != 0) | ~(m > NEG_INF), float("nan"), tl.exp(x - m) / s)


@triton.jit
def _pick(x, idx, at):
    """x[at] of a vector (0 where at is outside)."""
    return tl.sum(tl.where(idx == at, x, 0), axis=0)


@triton.jit
def _topk_columns(cand_ptr, cols, width, BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr):
    """The top-k column naming each id of ``cols`` (the last one), -1 for none."""
    found = tl.full([BLOCK_V], -1, tl.int64)
    for c0 in range(0, width, BLOCK_W):
        cc = c0 + tl.arange(0, BLOCK_W).to(tl.int64)
        ids = tl.load(cand_ptr + cc, mask=cc < width, other=-1).to(tl.int64)
        hit = cols[:, None] == ids[None, :]
        found = tl.maximum(found, tl.max(tl.where(hit, cc[None, :], -1), axis=1))
    return found


@triton.jit
def _q_tile(dl_ptr, inv_ptr, cand_ptr, cols, valid, t, qm, qs, qbad, hot, width, QKIND: tl.constexpr,
            BLOCK_V: tl.constexpr, BLOCK_W: tl.constexpr):
    """q at target ids ``cols`` of one draft row (pointers at the row): one-hot at ``hot``, or the row's softmax
    (statistics qm, qs, qbad) at each id's column, 0 where there is none."""
    if QKIND == Q_ONEHOT:
        q = tl.where(cols == hot, 1.0, 0.0)
    elif QKIND == Q_DENSE:
        q = _prob(tl.load(dl_ptr + cols, mask=valid, other=0.0).to(tl.float32) / t, qm, qs, qbad)
    else:
        if QKIND == Q_REDUCED:
            col = tl.load(inv_ptr + cols, mask=valid, other=-1).to(tl.int64)
        else:
            col = _topk_columns(cand_ptr, cols, width, BLOCK_V, BLOCK_W)
        on = valid & (col >= 0) & (col < width)
        y = tl.load(dl_ptr + tl.where(on, col, 0), mask=on, other=0.0).to(tl.float32) / t
        q = tl.where(on, _prob(y, qm, qs, qbad), 0.0)
    return q


@triton.jit
def _own_norm(dl_ptr, width, t, qm, qs, qbad, BLOCK_V: tl.constexpr):
    """A draft row's normaliser: the one given, or its own statistics where ``qbad`` says OWN."""
    if qbad == OWN:
        qm, qs, qbad = _chunk_stats(dl_ptr, 0, width, t, BLOCK_V)
    return qm, qs, qbad


@triton.jit
def _draft_column(cand_ptr, inv_ptr, d, width, V, QKIND: tl.constexpr, BLOCK_W: tl.constexpr):
    """The column of a valid draft token d in its draft row (pointers at the row), -1 for none."""
    col = tl.zeros([], tl.int64) - 1
    if QKIND == Q_DENSE:
        col = d
    elif QKIND == Q_REDUCED:
        c = tl.load(inv_ptr + d).to(tl.int64)
        col = tl.where((c >= 0) & (c < width), c, -1)
    elif QKIND == Q_TOPK:
        for c0 in range(0, width, BLOCK_W):
            cc = c0 + tl.arange(0, BLOCK_W).to(tl.int64)
            ids = tl.load(cand_ptr + cc, mask=cc < width, other=-1).to(tl.int64)
            col = tl.maximum(col, tl.max(tl.where(ids == d, cc, -1), axis=0))
    return col


@triton.jit
def _stop_cut(draft0, stops_ptr, n_stops, n_acc, kcols, BLOCK_K: tl.constexpr):
    """(accepted count, stopped): an accepted stop token ends acceptance right after it, with no bonus."""
    stopped = tl.zeros([], tl.int1)
    if n_stops > 0:
        acc_drafts = tl.load(draft0 + kcols, mask=kcols < n_acc, other=-1).to(tl.int64)
        is_stop = tl.zeros([BLOCK_K], tl.int1)
        for si in range(0, n_stops):
            is_stop = is_stop | ((acc_drafts == tl.load(stops_ptr + si).to(tl.int64)) & (kcols < n_acc))
        first = tl.min(tl.where(is_stop, kcols, BLOCK_K), axis=0).to(tl.int64)
        stopped = first < n_acc
        n_acc = tl.where(stopped, first + 1, n_acc)
    return n_acc, stopped


@triton.jit
def _write_outputs(tokens_ptr, num_acc_ptr, mask_ptr, draft0, r, K, n_acc, emit, emitted, BLOCK_K: tl.constexpr):
    """Accepted drafts, then ``emitted`` at n_acc where ``emit`` (else -1, for pass B), then -1."""
    kk = tl.arange(0, BLOCK_K).to(tl.int64)
    drafts = tl.load(draft0 + kk, mask=kk < K, other=-1).to(tl.int64)
    out = tl.where(kk < n_acc, drafts, -1)
    out = tl.where((kk == n_acc) & emit, emitted, out)
    tl.store(tokens_ptr + r * (K + 1) + kk, out, mask=kk < K + 1)
    tl.store(num_acc_ptr + r, n_acc.to(tl.int32))
    tl.store(mask_ptr + r * K + kk, (kk < n_acc).to(tl.uint8), mask=kk < K)


@triton.jit
def _store_emit(si_ptr, sf_ptr, r, n_acc, stopped, L, start, t, rho, kk, tm, ts, tb, qm, qs, qb, hot):
    """The state pass B reads: the emitting row n_acc, its flags and normalisers (vectors over rows)."""
    flags = tl.where(stopped, 0, F_EMIT + tl.where(n_acc >= L, F_FULL, 0))
    tl.store(si_ptr + r * 4 + S_ROW, n_acc)
    tl.store(si_ptr + r * 4 + S_FLAGS, flags.to(tl.int64))
    tl.store(si_ptr + r * 4 + S_START, start)
    tl.store(si_ptr + r * 4 + S_HOT, _pick(hot, kk, n_acc).to(tl.int64))
    tl.store(sf_ptr + r * 8 + S_T, t)
    tl.store(sf_ptr + r * 8 + S_RHO, rho)
    tl.store(sf_ptr + r * 8 + S_PT, _pick(tm, kk, n_acc))
    tl.store(sf_ptr + r * 8 + S_PT + 1, _pick(ts, kk, n_acc))
    tl.store(sf_ptr + r * 8 + S_PT + 2, _pick(tb, kk, n_acc))
    tl.store(sf_ptr + r * 8 + S_PQ, _pick(qm, kk, n_acc))
    tl.store(sf_ptr + r * 8 + S_PQ + 1, _pick(qs, kk, n_acc))
    tl.store(sf_ptr + r * 8 + S_PQ + 2, _pick(qb, kk, n_acc))


@triton.jit
def _block_tau(rho, mass, kk, L, k0, k1, offset_lo, r):
    """Block verification's (tau, rho_tau) from rho_0..rho_L and S_1..S_{L-1} (vectors over rows)."""
    denom = mass + 1.0 - rho
    h = tl.where(denom > 0, mass / tl.where(denom > 0, denom, 1.0), tl.where(denom == 0, 1.0, 0.0))
    h = tl.where(kk == L, rho, h)
    eta = uniform(k0, k1, offset_lo, r, tl.maximum(kk - 1, 0), STREAM_ACCEPT, 0)
    ok = (kk >= 1) & (kk <= L) & (eta <= h)
    tau = tl.max(tl.where(ok, kk, 0), axis=0)
    return tau, _pick(rho, kk, tau)


# ------------------------------------------------------------------------------------------------ A. rows
@triton.jit
def _finish_greedy(amax_v, amax_i, drafts_ptr, stops_ptr, n_stops, tokens_ptr, num_acc_ptr, mask_ptr, si_ptr, r,
                   has, L, K, V, chunks, SAMPLING: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """The finisher of a greedy request (or one without rows): every output."""
    kk = tl.arange(0, BLOCK_K).to(tl.int64)
    cc = tl.arange(0, BLOCK_C).to(tl.int64)
    draft0 = drafts_ptr + r * K
    d = tl.load(draft0 + kk, mask=kk < K, other=-1).to(tl.int64)
    live = (has & (kk <= L))[:, None] & (cc < chunks)[None, :]
    at = (r * (K + 1) + kk)[:, None] * chunks + cc[None, :]
    v = tl.load(amax_v + at, mask=live, other=NEG_INF, cache_modifier=".cg")
    i = tl.load(amax_i + at, mask=live, other=BIG, cache_modifier=".cg")
    top = tl.max(v, axis=1)
    idx = tl.min(tl.where(v == top[:, None], i, BIG), axis=1)
    ok = (kk < L) & (d >= 0) & (d < V) & (d == idx)
    n_acc = tl.minimum(tl.min(tl.where(ok | (kk >= L), BIG, kk), axis=0), L)
    n_acc = tl.where(has, n_acc, 0)
    n_acc, stopped = _stop_cut(draft0, stops_ptr, n_stops, n_acc, kk, BLOCK_K)
    _write_outputs(tokens_ptr, num_acc_ptr, mask_ptr, draft0, r, K, n_acc, has & ~stopped, _pick(idx, kk, n_acc),
                   BLOCK_K)
    if SAMPLING:
        tl.store(si_ptr + r * 4 + S_FLAGS, tl.zeros([], tl.int64))


@triton.jit
def _row_stats(part, base, rows_live, stride, chunks, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """Merged (m, s, bad) of rows' chunk partials part[(base + row) * stride + c, 0..2], rows where rows_live."""
    cc = tl.arange(0, BLOCK_C).to(tl.int64)
    kk = tl.arange(0, BLOCK_K).to(tl.int64)
    live = rows_live[:, None] & (cc < chunks)[None, :]
    at = ((base + kk)[:, None] * stride + cc[None, :]) * 3
    m = tl.load(part + at, mask=live, other=NEG_INF, cache_modifier=".cg")
    s = tl.load(part + at + 1, mask=live, other=0.0, cache_modifier=".cg")
    b = tl.load(part + at + 2, mask=live, other=0.0, cache_modifier=".cg")
    return _merge_stats(m, s, b, 1)


@triton.jit
def _finish_sampled(tpart, dpart, at_t, atq_l, atq_c, lp_ptr, drafts_ptr, stops_ptr, n_stops, tokens_ptr,
                    num_acc_ptr, mask_ptr, rho_ptr, rowt, rowq, si_ptr, sf_ptr, k0, k1, offset_lo, r, start, L, t,
                    K, V, chunks, dchunks, HAS_LOGPROBS: tl.constexpr, QKIND: tl.constexpr,
                    BLOCK_METHOD: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """The finisher of a sampled request: the accept chain (token or block), stop tokens, the outputs but the
    emitted token, and the state of pass B (or of the mass pass)."""
    kk = tl.arange(0, BLOCK_K).to(tl.int64)
    draft0 = drafts_ptr + r * K
    d = tl.load(draft0 + kk, mask=kk < K, other=-1).to(tl.int64)
    valid = (d >= 0) & (d < V)
    rows = kk < L
    tm, ts, tb = _row_stats(tpart, r * (K + 1), rows, chunks, chunks, BLOCK_K, BLOCK_C)
    at = tl.load(at_t + r * K + kk, mask=rows & valid, other=0.0, cache_modifier=".cg")
    p_d = tl.where(rows & valid, _prob(at / t, tm, ts, tb), 0.0)
    qm = tl.zeros([BLOCK_K], tl.float32)
    qs = tl.zeros([BLOCK_K], tl.float32)
    qb = tl.zeros([BLOCK_K], tl.float32)
    q_d = tl.where(valid, 1.0, 0.0)
    if QKIND != Q_ONEHOT:
        al = tl.load(atq_l + r * K + kk, mask=rows & valid, other=0.0, cache_modifier=".cg")
        acol = tl.load(atq_c + r * K + kk, mask=rows & valid, other=-1, cache_modifier=".cg")
        if HAS_LOGPROBS:
            lp = tl.load(lp_ptr + r * K + kk, mask=rows, other=0.0)
            q_d = tl.exp(lp)
            c = tl.where(acol >= 0, al / t - lp, float("nan"))
            fin = (c == c) & (tl.abs(c) < float("inf"))
            qm = tl.where(fin, c, NEG_INF)
            qs = tl.where(fin, 1.0, 0.0)
            qb = tl.where(fin, 0.0, OWN)
        else:
            qm, qs, qb = _row_stats(dpart, r * K, rows, dchunks, dchunks, BLOCK_K, BLOCK_C)
            q_d = tl.where(acol >= 0, _prob(al / t, qm, qs, qb), 0.0)
    u = uniform(k0, k1, offset_lo, r, kk, STREAM_ACCEPT, 0)
    n_acc = tl.minimum(tl.min(tl.where((u * q_d < p_d) | (kk >= L), BIG, kk), axis=0), L)
    rho_tau = tl.full([], 1.0, tl.float32)
    pending = tl.zeros([], tl.int1)
    if BLOCK_METHOD:
        ratio = p_d / q_d
        ratio = tl.where(ratio != ratio, 0.0, ratio)
        rho = tl.where(kk == 0, 1.0, 0.0)
        for i in tl.static_range(1, BLOCK_K):
            v = _pick(rho, kk, i - 1) * _pick(ratio, kk, i - 1)
            v = tl.where(v != v, 0.0, tl.minimum(v, 1.0))
            rho = tl.where(kk == i, v, rho)
        pending = L >= 2
        if pending:  # S_1 .. S_{L-1} first (the mass pass)
            tl.store(rho_ptr + r * (K + 1) + kk, rho, mask=kk <= L)
            _store_rows(rowt, r * K, rows, tm, ts, tb, BLOCK_K)
            _store_rows(rowq, r * K, rows, qm, qs, qb, BLOCK_K)
            tl.store(si_ptr + r * 4 + S_ROW, L)
            tl.store(si_ptr + r * 4 + S_FLAGS, tl.zeros([], tl.int64) + F_PENDING)
            tl.store(si_ptr + r * 4 + S_START, start)
            tl.store(sf_ptr + r * 8 + S_T, t)
        else:
            n_acc, rho_tau = _block_tau(rho, tl.zeros([BLOCK_K], tl.float32), kk, L, k0, k1, offset_lo, r)
    if ~pending:
        n_acc, stopped = _stop_cut(draft0, stops_ptr, n_stops, n_acc, kk, BLOCK_K)
        _write_outputs(tokens_ptr, num_acc_ptr, mask_ptr, draft0, r, K, n_acc, tl.zeros([], tl.int1), n_acc,
                       BLOCK_K)
        _store_emit(si_ptr, sf_ptr, r, n_acc, stopped, L, start, t, rho_tau, kk, tm, ts, tb, qm, qs, qb,
                    tl.where(valid, d, -1))


@triton.jit
def _store_rows(ptr, base, rows, m, s, b, BLOCK_K: tl.constexpr):
    kk = tl.arange(0, BLOCK_K).to(tl.int64)
    tl.store(ptr + (base + kk) * 3, m, mask=rows)
    tl.store(ptr + (base + kk) * 3 + 1, s, mask=rows)
    tl.store(ptr + (base + kk) * 3 + 2, b, mask=rows)


@triton.jit(do_not_specialize=["seed", "offset"])
def _rows_kernel(target_ptr, cu_ptr, drafts_ptr, dl_ptr, inv_ptr, cand_ptr, lp_ptr, lens_ptr, surv_ptr, thr_ptr,
                 temp_ptr, key_ptr, seed, offset, KEY_IN_MEMORY: tl.constexpr, stops_ptr, n_stops, tokens_ptr,
                 num_acc_ptr, mask_ptr, amax_v, amax_i, tpart, dpart, at_t, atq_l, atq_c, rho_ptr, rowt, rowq,
                 si_ptr, sf_ptr, tickets, total_rows, K, V, W, chunk, chunks, dchunk, dchunks,
                 PACKED: tl.constexpr, HAS_LENS: tl.constexpr, HAS_THR: tl.constexpr, SAMPLING: tl.constexpr,
                 HAS_LOGPROBS: tl.constexpr, DRAFT_STATS: tl.constexpr, QKIND: tl.constexpr,
                 BLOCK_METHOD: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
                 BLOCK_W: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    titems = (K + 1) * chunks
    per_req = titems
    if DRAFT_STATS:
        per_req += K * dchunks
    r = pid // per_req
    item = pid - r * per_req
    start, last, L, t, sampled = _request(cu_ptr, lens_ptr, surv_ptr, thr_ptr, temp_ptr, r, total_rows, K, PACKED,
                                          HAS_LENS, HAS_THR, SAMPLING, BLOCK_K)
    has = last >= 0
    rows = tl.where(has, tl.where(sampled, L, L + 1), 0)
    drows = tl.zeros([], tl.int64)
    if DRAFT_STATS:
        drows = tl.where(has & sampled, L, 0)
    is_target = item < titems
    j = tl.where(is_target, item // chunks, (item - titems) // dchunks)
    c = tl.where(is_target, item - j * chunks, item - titems - j * dchunks)
    work = tl.where(is_target, j < rows, j < drows)
    if work & is_target:
        row = target_ptr + (start + j) * V
        begin = c * chunk
        end = tl.minimum(begin + chunk, V)
        slot = (r * (K + 1) + j) * chunks + c
        if sampled:
            m, s, bad = _chunk_stats(row, begin, end, t, BLOCK_V)
            tl.store(tpart + slot * 3, m)
            tl.store(tpart + slot * 3 + 1, s)
            tl.store(tpart + slot * 3 + 2, bad)
            d = tl.load(drafts_ptr + r * K + j).to(tl.int64)
            if (d >= begin) & (d < end):
                tl.store(at_t + r * K + j, tl.load(row + d).to(tl.float32))
            if QKIND != Q_ONEHOT:
                if (c == 0) & (d >= 0) & (d < V):
                    drow = dl_ptr + (r * K + j) * W
                    col = _draft_column(cand_ptr + (r * K + j) * W, inv_ptr, d, W, V, QKIND, BLOCK_W)
                    logit = tl.load(drow + tl.maximum(col, 0), mask=col >= 0, other=0.0).to(tl.float32)
                    tl.store(atq_l + r * K + j, logit)
                    tl.store(atq_c + r * K + j, col)
        else:
            v, i = _chunk_argmax(row, begin, end, BLOCK_V)
            tl.store(amax_v + slot, v)
            tl.store(amax_i + slot, i)
    if work & ~is_target:
        begin = c * dchunk
        m, s, bad = _chunk_stats(dl_ptr + (r * K + j) * W, begin, tl.minimum(begin + dchunk, W), t, BLOCK_V)
        slot = (r * K + j) * dchunks + c
        tl.store(dpart + slot * 3, m)
        tl.store(dpart + slot * 3 + 1, s)
        tl.store(dpart + slot * 3 + 2, bad)
    if work | (item == 0):
        total = tl.where(rows > 0, rows * chunks, 1) + drows * dchunks
        if tl.atomic_add(tickets + r, 1, sem="acq_rel") == total - 1:
            tl.atomic_xchg(tickets + r, 0)
            k0, k1, offset_lo = load_key(key_ptr, seed, offset, KEY_IN_MEMORY)
            if has & sampled:
                _finish_sampled(tpart, dpart, at_t, atq_l, atq_c, lp_ptr, drafts_ptr, stops_ptr, n_stops, tokens_ptr,
                                num_acc_ptr, mask_ptr, rho_ptr, rowt, rowq, si_ptr, sf_ptr, k0, k1, offset_lo, r,
                                start, L, t, K, V, chunks, dchunks, HAS_LOGPROBS, QKIND, BLOCK_METHOD, BLOCK_K,
                                BLOCK_C)
            else:
                _finish_greedy(amax_v, amax_i, drafts_ptr, stops_ptr, n_stops, tokens_ptr, num_acc_ptr, mask_ptr,
                               si_ptr, r, has, L, K, V, chunks, SAMPLING, BLOCK_K, BLOCK_C)


# ------------------------------------------------------------------------------------------------ M. mass
@triton.jit
def _finish_mass(masspart, rho_ptr, rowt, rowq, drafts_ptr, stops_ptr, n_stops, tokens_ptr, num_acc_ptr, mask_ptr,
                 si_ptr, sf_ptr, k0, k1, offset_lo, r, start, L, t, K, V, chunks, BLOCK_K: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """Block verification's tau from the masses, then the stop cut, the outputs and pass B's state."""
    kk = tl.arange(0, BLOCK_K).to(tl.int64)
    cc = tl.arange(0, BLOCK_C).to(tl.int64)
    live = ((kk >= 1) & (kk < L))[:, None] & (cc < chunks)[None, :]
    mass = tl.sum(tl.load(masspart + (r * K + kk)[:, None] * chunks + cc[None, :], mask=live, other=0.0,
                          cache_modifier=".cg"), axis=1)
    rho = tl.load(rho_ptr + r * (K + 1) + kk, mask=kk <= L, other=0.0)
    n_acc, rho_tau = _block_tau(rho, mass, kk, L, k0, k1, offset_lo, r)
    draft0 = drafts_ptr + r * K
    d = tl.load(draft0 + kk, mask=kk < K, other=-1).to(tl.int64)
    n_acc, stopped = _stop_cut(draft0, stops_ptr, n_stops, n_acc, kk, BLOCK_K)
    _write_outputs(tokens_ptr, num_acc_ptr, mask_ptr, draft0, r, K, n_acc, tl.zeros([], tl.int1), n_acc, BLOCK_K)
    rows = kk < L
    at = (r * K + kk) * 3
    _store_emit(si_ptr, sf_ptr, r, n_acc, stopped, L, start, t, rho_tau, kk,
                tl.load(rowt + at, mask=rows, other=0.0), tl.load(rowt + at + 1, mask=rows, other=0.0),
                tl.load(rowt + at + 2, mask=rows, other=0.0), tl.load(rowq + at, mask=rows, other=0.0),
                tl.load(rowq + at + 1, mask=rows, other=0.0), tl.load(rowq + at + 2, mask=rows, other=0.0),
                tl.where((d >= 0) & (d < V), d, -1))


@triton.jit(do_not_specialize=["seed", "offset"])
def _mass_kernel(target_ptr, drafts_ptr, dl_ptr, inv_ptr, cand_ptr, key_ptr, seed, offset, KEY_IN_MEMORY: tl.constexpr,
                 stops_ptr, n_stops, tokens_ptr, num_acc_ptr, mask_ptr, rho_ptr, rowt, rowq, si_ptr, sf_ptr, masspart,
                 tickets, N, K, V, W, chunk, chunks, QKIND: tl.constexpr, BLOCK_V: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    item = pid // chunks
    c = pid - item * chunks
    r = item // (K - 1)
    i = item - r * (K - 1) + 1
    flags = tl.load(si_ptr + r * 4 + S_FLAGS)
    L = tl.load(si_ptr + r * 4 + S_ROW)
    if ((flags & F_PENDING) != 0) & (i < L):
        start = tl.load(si_ptr + r * 4 + S_START)
        t = tl.load(sf_ptr + r * 8 + S_T)
        rho = tl.load(rho_ptr + r * (K + 1) + i)
        tm = tl.load(rowt + (r * K + i) * 3)
        ts = tl.load(rowt + (r * K + i) * 3 + 1)
        tb = tl.load(rowt + (r * K + i) * 3 + 2)
        qm = tl.load(rowq + (r * K + i) * 3)
        qs = tl.load(rowq + (r * K + i) * 3 + 1)
        qb = tl.load(rowq + (r * K + i) * 3 + 2)
        d = tl.load(drafts_ptr + r * K + i).to(tl.int64)
        hot = tl.where((d >= 0) & (d < V), d, -1)
        drow = dl_ptr + (r * K + i) * W
        if QKIND != Q_ONEHOT:
            qm, qs, qb = _own_norm(drow, W, t, qm, qs, qb, BLOCK_V)
        trow = target_ptr + (start + i) * V
        begin = c * chunk
        end = tl.minimum(begin + chunk, V)
        mass = tl.zeros([BLOCK_V], tl.float32)
        for s in range(begin, end, BLOCK_V):
            cols = s + tl.arange(0, BLOCK_V).to(tl.int64)
            valid = cols < end
            p = _prob(tl.load(trow + cols, mask=valid, other=0.0).to(tl.float32) / t, tm, ts, tb)
            q = _q_tile(drow, inv_ptr, cand_ptr + (r * K + i) * W, cols, valid, t, qm, qs, qb, hot, W, QKIND,
                        BLOCK_V, BLOCK_W)
            mass += tl.where(valid, tl.maximum(rho * p - q, 0.0, propagate_nan=ALL), 0.0)
        tl.store(masspart + (r * K + i) * chunks + c, tl.sum(mass, axis=0))
        if tl.atomic_add(tickets + N + r, 1, sem="acq_rel") == (L - 1) * chunks - 1:
            tl.atomic_xchg(tickets + N + r, 0)
            k0, k1, offset_lo = load_key(key_ptr, seed, offset, KEY_IN_MEMORY)
            _finish_mass(masspart, rho_ptr, rowt, rowq, drafts_ptr, stops_ptr, n_stops, tokens_ptr, num_acc_ptr,
                         mask_ptr, si_ptr, sf_ptr, k0, k1, offset_lo, r, start, L, t, K, V, chunks, BLOCK_K, BLOCK_C)


# ------------------------------------------------------------------------------------------------ B. sample
@triton.jit(do_not_specialize=["seed", "offset"])
def _sample_kernel(target_ptr, dl_ptr, inv_ptr, cand_ptr, key_ptr, seed, offset, KEY_IN_MEMORY: tl.constexpr,
                   tokens_ptr, si_ptr, sf_ptr, res_v, res_i, gum_v, gum_i, mass_ptr, tickets, N, K, V, W, chunk,
                   chunks, QKIND: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_W: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    r = pid // chunks
    c = pid - r * chunks
    flags = tl.load(si_ptr + r * 4 + S_FLAGS)
    if (flags & F_EMIT) != 0:
        row = tl.load(si_ptr + r * 4 + S_ROW)
        start = tl.load(si_ptr + r * 4 + S_START)
        hot = tl.load(si_ptr + r * 4 + S_HOT)
        t = tl.load(sf_ptr + r * 8 + S_T)
        rho = tl.load(sf_ptr + r * 8 + S_RHO)
        tm = tl.load(sf_ptr + r * 8 + S_PT)
        ts = tl.load(sf_ptr + r * 8 + S_PT + 1)
        tb = tl.load(sf_ptr + r * 8 + S_PT + 2)
        qm = tl.load(sf_ptr + r * 8 + S_PQ)
        qs = tl.load(sf_ptr + r * 8 + S_PQ + 1)
        qb = tl.load(sf_ptr + r * 8 + S_PQ + 2)
        full = (flags & F_FULL) != 0
        jq = tl.minimum(row, K - 1)
        drow = dl_ptr + (r * K + jq) * W
        if QKIND != Q_ONEHOT:
            if ~full:
                qm, qs, qb = _own_norm(drow, W, t, qm, qs, qb, BLOCK_V)
        k0, k1, offset_lo = load_key(key_ptr, seed, offset, KEY_IN_MEMORY)
        trow = target_ptr + (start + row) * V
        begin = c * chunk
        end = tl.minimum(begin + chunk, V)
        best_r = tl.full([BLOCK_V], NEG_INF, tl.float32)
        best_ri = begin + tl.arange(0, BLOCK_V).to(tl.int64)
        best_g = tl.full([BLOCK_V], NEG_INF, tl.float32)
        best_gi = begin + tl.arange(0, BLOCK_V).to(tl.int64)
        mass = tl.zeros([BLOCK_V], tl.float32)
        for s in range(begin, end, BLOCK_V):
            cols = s + tl.arange(0, BLOCK_V).to(tl.int64)
            valid = cols < end
            x = tl.load(trow + cols, mask=valid, other=0.0).to(tl.float32) / t
            u = uniform(k0, k1, offset_lo, r, row, STREAM_RESIDUAL, cols)
            best_g, best_gi = argmax_update(best_g, best_gi, tl.where(valid, gumbel_score(x, u), NEG_INF), cols)
            if ~full:
                q = _q_tile(drow, inv_ptr, cand_ptr + (r * K + jq) * W, cols, valid, t, qm, qs, qb, hot, W, QKIND,
                            BLOCK_V, BLOCK_W)
                w = tl.where(valid, tl.maximum(rho * _prob(x, tm, ts, tb) - q, 0.0, propagate_nan=ALL), 0.0)
                mass += w
                best_r, best_ri = argmax_update(best_r, best_ri, tl.where(valid, race_score(w, u), NEG_INF), cols)
        slot = r * chunks + c
        tl.store(res_v + slot, tl.max(best_r, axis=0))
        tl.store(res_i + slot, argmax_finish(best_r, best_ri, BIG))
        tl.store(gum_v + slot, tl.max(best_g, axis=0))
        tl.store(gum_i + slot, argmax_finish(best_g, best_gi, BIG))
        tl.store(mass_ptr + slot, tl.sum(mass, axis=0))
        if tl.atomic_add(tickets + 2 * N + r, 1, sem="acq_rel") == chunks - 1:
            tl.atomic_xchg(tickets + 2 * N + r, 0)
            cc = tl.arange(0, BLOCK_C).to(tl.int64)
            at = r * chunks + cc
            live = cc < chunks
            rv = tl.load(res_v + at, mask=live, other=NEG_INF, cache_modifier=".cg")
            ri = tl.load(res_i + at, mask=live, other=BIG, cache_modifier=".cg")
            gv = tl.load(gum_v + at, mask=live, other=NEG_INF, cache_modifier=".cg")
            gi = tl.load(gum_i + at, mask=live, other=BIG, cache_modifier=".cg")
            total = tl.sum(tl.load(mass_ptr + at, mask=live, other=0.0, cache_modifier=".cg"), axis=0)
            from_res = tl.min(tl.where(rv == tl.max(rv, axis=0), ri, BIG), axis=0)
            from_p = tl.min(tl.where(gv == tl.max(gv, axis=0), gi, BIG), axis=0)
            use_p = full | ~(total >= RESIDUAL_EPS)
            tl.store(tokens_ptr + r * (K + 1) + row, tl.where(use_p, from_p, from_res))


# ------------------------------------------------------------------------------------------------ host side
_TICKETS: dict = {}


def _tickets(device, count: int) -> torch.Tensor:
    """int32 tickets zeroed once per (device, stream); every launch leaves them zeroed."""
    dev = torch.device(device)
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    buf = _TICKETS.get((dev, stream))
    if buf is None or buf.numel() < count:
        buf = torch.zeros(2 * count, dtype=torch.int32, device=dev)
        _TICKETS[(dev, stream)] = buf
    return buf


def _sm_count(device) -> int:
    dev = torch.device(device)
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132


def _split(width: int, rows: int, ctas: int, min_chunk: int) -> tuple:
    """(chunk, chunks) of a row of ``width`` so that ``rows`` rows make about ``ctas`` programs (split_v)."""
    want = max(1, -(-ctas // max(rows, 1)))
    chunk = max(-(-width // want), min_chunk)
    chunk = -(-chunk // 32) * 32
    return chunk, -(-width // chunk)


def verify_chain(target_logits, cu_seqlens, draft_tokens, draft_logits, target_to_draft, draft_candidates,
                 draft_logprobs, verify_lens, survival, thresholds, temperature, rng_key, stop_token_ids, method):
    """Same flat arguments and results as ``dspark_kernels.reference.verify_chain`` (checked by the wrapper; tensors
    contiguous, as the registry passes them)."""
    n, k = draft_tokens.shape
    v = target_logits.shape[-1]
    dev = draft_tokens.device
    tokens = torch.empty(n, k + 1, dtype=torch.int64, device=dev)
    num_acc = torch.empty(n, dtype=torch.int32, device=dev)
    mask = torch.empty(n, k, dtype=torch.bool, device=dev)
    if n == 0:
        return tokens, num_acc, mask
    width = draft_logits.shape[-1] if draft_logits is not None else v
    qkind = (1 if draft_logits is None else 3 if target_to_draft is not None else
             4 if draft_candidates is not None else 2)
    sampling = temperature is not None
    draft_stats = sampling and draft_logits is not None and draft_logprobs is None
    ctas = 2 * _sm_count(dev)
    chunk, chunks = _split(v, n * (k + 1), ctas, MIN_CHUNK)
    dchunk, dchunks = _split(width, n * k, ctas, MIN_CHUNK)
    bchunk, bchunks = _split(v, n, ctas, MIN_SAMPLE_CHUNK)
    f32 = dict(dtype=torch.float32, device=dev)
    i64 = dict(dtype=torch.int64, device=dev)
    rows = n * (k + 1)
    ws = dict(amax_v=torch.empty(rows * chunks, **f32), amax_i=torch.empty(rows * chunks, **i64),
              tpart=torch.empty(rows * chunks * 3, **f32), dpart=torch.empty(n * k * dchunks * 3, **f32),
              at_t=torch.empty(n * k, **f32), atq_l=torch.empty(n * k, **f32), atq_c=torch.empty(n * k, **i64),
              rho=torch.empty(rows, **f32), rowt=torch.empty(n * k * 3, **f32), rowq=torch.empty(n * k * 3, **f32),
              si=torch.empty(n * 4, **i64), sf=torch.empty(n * 8, **f32))
    tickets = _tickets(dev, 3 * n)
    dummy = draft_tokens   # never read where its flag is off
    dl = draft_logits if draft_logits is not None else target_logits
    inv = target_to_draft if target_to_draft is not None else dummy
    cands = draft_candidates if draft_candidates is not None else dummy
    stops = stop_token_ids if stop_token_ids is not None else dummy
    n_stops = stop_token_ids.numel() if stop_token_ids is not None else 0
    key = key_args(rng_key, dev)
    block_v = min(1024, triton.next_power_of_2(max(chunk, dchunk, bchunk)))
    # passes M and B hold more per element (q, the races), top-k rows a [BLOCK_V, BLOCK_W] id comparison
    block_vb = min(256 if qkind == 4 else 512, block_v)
    block_k = triton.next_power_of_2(k + 1)
    block_w = min(16, triton.next_power_of_2(width))
    total_rows = target_logits.shape[0] if cu_seqlens is not None else rows
    _rows_kernel[(n * ((k + 1) * chunks + (k * dchunks if draft_stats else 0)),)](
        target_logits, cu_seqlens if cu_seqlens is not None else dummy, draft_tokens, dl, inv, cands,
        draft_logprobs if draft_logprobs is not None else dl, verify_lens if verify_lens is not None else dummy,
        survival if survival is not None else target_logits, thresholds if thresholds is not None else target_logits,
        temperature if sampling else target_logits, *key, stops, n_stops, tokens, num_acc, mask.view(torch.uint8),
        ws["amax_v"], ws["amax_i"], ws["tpart"], ws["dpart"], ws["at_t"], ws["atq_l"], ws["atq_c"], ws["rho"],
        ws["rowt"], ws["rowq"], ws["si"], ws["sf"], tickets, total_rows, k, v, width, chunk, chunks, dchunk, dchunks,
        PACKED=cu_seqlens is not None, HAS_LENS=verify_lens is not None, HAS_THR=thresholds is not None,
        SAMPLING=sampling, HAS_LOGPROBS=draft_logprobs is not None, DRAFT_STATS=draft_stats, QKIND=qkind,
        BLOCK_METHOD=method == "block", BLOCK_V=block_v, BLOCK_K=block_k,
        BLOCK_C=triton.next_power_of_2(max(chunks, dchunks)), BLOCK_W=block_w)
    if not sampling:
        return tokens, num_acc, mask
    if method == "block" and k > 1:
        masspart = torch.empty(n * k * chunks, **f32)
        _mass_kernel[(n * (k - 1) * chunks,)](
            target_logits, draft_tokens, dl, inv, cands, *key, stops, n_stops, tokens, num_acc,
            mask.view(torch.uint8), ws["rho"], ws["rowt"], ws["rowq"], ws["si"], ws["sf"], masspart, tickets, n, k, v,
            width, chunk, chunks, QKIND=qkind, BLOCK_V=block_vb, BLOCK_K=block_k,
            BLOCK_C=triton.next_power_of_2(chunks), BLOCK_W=block_w)
    parts = [torch.empty(n * bchunks, **kw) for kw in (f32, i64, f32, i64, f32)]
    _sample_kernel[(n * bchunks,)](
        target_logits, dl, inv, cands, *key, tokens, ws["si"], ws["sf"], *parts, tickets, n, k, v, width, bchunk,
        bchunks, QKIND=qkind, BLOCK_V=block_vb, BLOCK_C=triton.next_power_of_2(bchunks), BLOCK_W=block_w)
    return tokens, num_acc, mask
