"""Triton backend of ``dspark_dist::verify_decide``: the replicated decide step over every shard's statistics.

Grid (request,): one program per request holds the request's K+1 rows as the lanes of a ``BLOCK_K``-wide vector
and loops over the P shards (P and K are small) to merge the gathered first exchange ``stats`` [P, N, K+1, F]:

* the target argmax of every row (NaN as -inf, ties to the lowest global id) and the greedy accepted prefix;
* for sampling, the merged softmax statistics of target/T (rows 0..K) and draft/T (rows < K, draft logits), the
  target (and draft) probability of each draft from the shard that owns it, the accept uniforms
  ``uniform(request, j, ACCEPT, 0)`` (``triton.rng``), and then token acceptance (``u q < p``) or block acceptance
  (rho_i and tau over the rows in one loop, with S_i from the second exchange when given);
* the stop-token cut, the verify length (rows available, ``verify_lens``, survival >= thresholds);
* the rows sampling needs (the residual plan [N, R, PLAN_WIDTH]: the emitting row, or every row 0..L for block
  verification), with each draft row's normaliser (its merged statistics, or the drafter's own
  ``l(d) - draft_logprob`` where draft_logprobs give it);
* with the second exchange, the emitted token: the residual's winner, or the race over p after a full acceptance or
  where the residual's mass is below RESIDUAL_EPS; and the outputs ``(tokens, num_accepted, accept_mask)``.

Everything runs in the one kernel (no torch ops after it). The helpers address the request's statistics as
``req_ptr`` (its cells of shard 0: ``stats + n (K+1) F``) and ``p_stride`` (N (K+1) F, one shard further), the
second exchange likewise (``res_req``, ``res_p_stride``); lane j of a [BLOCK_K] vector is row j.

Same meaning as ``local_verify.verify_decide``: tokens, num_accepted and accept_mask equal; the plan's floats to
rtol 1e-5, atol 1e-6 (the merged sums and exponentials rounded in another order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.verify_chain import RESIDUAL_EPS
from ..triton.rng import STREAM_ACCEPT, key_args, load_key, uniform
from ..triton.verify_chain import packed_last_row
from . import layout as L

_NONE = 2 ** 30      # an id above EMPTY_ID: no winner
NONE_ID = tl.constexpr(_NONE)
NEG_INF = tl.constexpr(float("-inf"))
AMAX_VAL, AMAX_ID = tl.constexpr(L.AMAX_VAL), tl.constexpr(L.AMAX_ID)
T_MAX, T_SUM, T_BAD, T_AT = (tl.constexpr(x) for x in (L.T_MAX, L.T_SUM, L.T_BAD, L.T_AT))
Q_MAX, Q_SUM, Q_BAD, Q_AT = (tl.constexpr(x) for x in (L.Q_MAX, L.Q_SUM, L.Q_BAD, L.Q_AT))
RES_MASS, RES_SCORE, RES_ID = (tl.constexpr(x) for x in (L.RES_MASS, L.RES_SCORE, L.RES_ID))
RES_GSCORE, RES_GID = (tl.constexpr(x) for x in (L.RES_GSCORE, L.RES_GID))
RES_WIDTH, PLAN_WIDTH = tl.constexpr(L.RES_WIDTH), tl.constexpr(L.PLAN_WIDTH)
PLAN_ROW, PLAN_NEED, PLAN_RHO = (tl.constexpr(x) for x in (L.PLAN_ROW, L.PLAN_NEED, L.PLAN_RHO))
PLAN_T_MAX, PLAN_T_SUM, PLAN_T_BAD = (tl.constexpr(x) for x in (L.PLAN_T_MAX, L.PLAN_T_SUM, L.PLAN_T_BAD))
PLAN_Q_MAX, PLAN_Q_SUM, PLAN_Q_BAD = (tl.constexpr(x) for x in (L.PLAN_Q_MAX, L.PLAN_Q_SUM, L.PLAN_Q_BAD))


@triton.jit
def _scalar(value, dtype: tl.constexpr):
    """A scalar tensor holding ``value`` (a loop-carried start value)."""
    return tl.sum(tl.full((1,), value, dtype), axis=0)


@triton.jit
def _pick(vec, lanes, idx):
    """``vec[idx]`` of a lane vector, as a scalar (NaN and infinities of other lanes are not read)."""
    return tl.sum(tl.where(lanes == idx, vec, tl.zeros_like(vec)), axis=0)


@triton.jit
def _lowest_max(best, best_id, value, ids):
    """One shard of an argmax over shards: NaN as -inf, the larger value wins, ties go to the lower id."""
    value = tl.where(value != value, NEG_INF, value)
    take = (value > best) | ((value == best) & (ids < best_id))
    return tl.where(take, value, best), tl.where(take, ids, best_id)


@triton.jit
def _target_argmax(req_ptr, p_stride, F, P, lanes, rows_live):
    """int64 [BLOCK_K]: the global argmax id of every row over the shards' AMAX_VAL / AMAX_ID."""
    best = tl.full(lanes.shape, NEG_INF, tl.float32)
    best_id = tl.full(lanes.shape, NONE_ID, tl.int64)
    for p in range(P):
        row = req_ptr + p * p_stride + lanes * F
        val = tl.load(row + AMAX_VAL, mask=rows_live, other=NEG_INF)
        ids = tl.load(row + AMAX_ID, mask=rows_live, other=0.0).to(tl.int64)
        best, best_id = _lowest_max(best, best_id, val, ids)
    return best_id


@triton.jit
def _merged_stats(req_ptr, p_stride, F, P, lanes, rows_live, SM: tl.constexpr, SS: tl.constexpr,
                  SB: tl.constexpr):
    """(max, sum, bad) float32 / float32 / bool [BLOCK_K] of each row over the shards (``merge_softmax_stats``)."""
    top = tl.full(lanes.shape, NEG_INF, tl.float32)
    for p in range(P):
        row = req_ptr + p * p_stride + lanes * F
        top = tl.maximum(top, tl.load(row + SM, mask=rows_live, other=NEG_INF))
    total = tl.zeros_like(top)
    bad = tl.zeros_like(top)
    for p in range(P):
        row = req_ptr + p * p_stride + lanes * F
        m = tl.load(row + SM, mask=rows_live, other=NEG_INF)
        s = tl.load(row + SS, mask=rows_live, other=0.0)
        total += s * tl.where(m > NEG_INF, tl.exp(m - top), 0.0)
        bad = tl.maximum(bad, tl.load(row + SB, mask=rows_live, other=0.0))
    return top, total, (bad > 0) | ~(top > NEG_INF)


@triton.jit
def _prob(x, m, s, bad):
    """softmax(row)[x] from a scaled logit and the row's merged statistics (NaN for a bad row)."""
    return tl.where(bad, float("nan"), tl.exp(x - m) / s)


@triton.jit
def _at_owner(req_ptr, p_stride, F, P, shards_ptr, safe, lanes, drafts_live, SLOT: tl.constexpr):
    """float32 [BLOCK_K]: slot ``SLOT`` of each row from the first shard holding the row's draft (shard 0 if
    none does, as ``layout.owner_of``)."""
    at = tl.load(req_ptr + lanes * F + SLOT, mask=drafts_live, other=NEG_INF)
    found = tl.full(lanes.shape, 0, tl.int1)
    for p in range(P):
        start = tl.load(shards_ptr + 2 * p).to(tl.int64)
        size = tl.load(shards_ptr + 2 * p + 1).to(tl.int64)
        inside = (safe >= start) & (safe < start + size) & drafts_live
        val = tl.load(req_ptr + p * p_stride + lanes * F + SLOT, mask=inside, other=NEG_INF)
        at = tl.where(inside & ~found, val, at)
        found = found | inside
    return at


@triton.jit
def _leading(cond, lanes, k_len):
    """int32: how many of the lanes 0..K-1 hold True before the first False."""
    return tl.min(tl.where(~cond & (lanes < k_len), lanes, k_len), axis=0)


@triton.jit
def _verify_length(n, cu_ptr, num_rows, vlens_ptr, surv_ptr, thr_ptr, lanes, k_len, PACKED: tl.constexpr,
                   HAS_VLENS: tl.constexpr, HAS_SURV: tl.constexpr):
    """(has rows: bool, verify length L: int32) of request ``n``: the smallest of the rows available (packed),
    ``verify_lens`` and the leading run of survival >= thresholds."""
    last = tl.cast(k_len, tl.int32)
    if PACKED:
        last = packed_last_row(tl.load(cu_ptr + n).to(tl.int64), tl.load(cu_ptr + n + 1).to(tl.int64), num_rows,
                               k_len).to(tl.int32)
    length = tl.maximum(last, 0)
    if HAS_VLENS:
        vl = tl.load(vlens_ptr + n).to(tl.int64)
        length = tl.minimum(length, tl.minimum(tl.maximum(vl, 0), k_len).to(tl.int32))
    if HAS_SURV:
        live = lanes < k_len
        surv = tl.load(surv_ptr + n * k_len + lanes, mask=live, other=0.0).to(tl.float32)
        thr = tl.load(thr_ptr + lanes, mask=live, other=0.0).to(tl.float32)
        length = tl.minimum(length, _leading(surv >= thr, lanes, k_len))
    return last >= 0, length


@triton.jit
def _draft_probs(req_ptr, p_stride, F, P, shards_ptr, safe, valid, lanes, tm, ts, tbad, qm, qs, qbad, lp_ptr, n,
                 k_len, HAS_DRAFT: tl.constexpr, HAS_LOGPROBS: tl.constexpr):
    """(p(d_j), q(d_j), the draft rows' normalisers (m, s, bad)) float32 [BLOCK_K] of each row's draft (rows < K):
    target from T_AT of the owning shard, draft from Q_AT (draft logits), from ``draft_logprobs``, or one-hot; with
    both draft logits and logprobs a row's normaliser is the drafter's own, ``Q_AT - logprob``, where finite."""
    live = lanes < k_len
    t_at = _at_owner(req_ptr, p_stride, F, P, shards_ptr, safe, lanes, live, T_AT)
    p_d = _prob(t_at, tm, ts, tbad) * valid.to(tl.float32)
    q_d = valid.to(tl.float32)
    if HAS_DRAFT:
        q_at = _at_owner(req_ptr, p_stride, F, P, shards_ptr, safe, lanes, live, Q_AT)
        q_d = _prob(q_at, qm, qs, qbad)
    if HAS_LOGPROBS:
        lp = tl.load(lp_ptr + n * k_len + lanes, mask=live, other=0.0).to(tl.float32)
        q_d = tl.exp(lp)
        if HAS_DRAFT:
            c = q_at - lp
            given = valid & (c == c) & (tl.abs(c) < float("inf"))
            qm = tl.where(given, c, qm)
            qs = tl.where(given, 1.0, qs)
            qbad = tl.where(given, False, qbad)
    return p_d, q_d, qm, qs, qbad


@triton.jit
def _residual_mass(res_ptr, res_p_stride, P, slot, live):
    """float32: the second exchange's mass at ``slot`` of the request summed over the shards (0 where not live)."""
    total = _scalar(0.0, tl.float32)
    for p in range(P):
        total += tl.load(res_ptr + p * res_p_stride + slot * RES_WIDTH + RES_MASS, mask=live, other=0.0)
    return total


@triton.jit
def _shard_argmax(cell_ptr, p_stride, P, VAL: tl.constexpr, ID: tl.constexpr):
    """int64: the id of the best (value, id) pair over the shards' cells ``cell_ptr + p * p_stride`` (slots VAL
    and ID; NaN as -inf, ties to the lowest id)."""
    best = _scalar(NEG_INF, tl.float32)
    best_id = _scalar(NONE_ID, tl.int64)
    for p in range(P):
        cell = cell_ptr + p * p_stride
        best, best_id = _lowest_max(best, best_id, tl.load(cell + VAL), tl.load(cell + ID).to(tl.int64))
    return best_id


@triton.jit
def _residual_winner(res_ptr, res_p_stride, P, slot):
    """int64: the second exchange's race winner at ``slot`` of the request over the shards."""
    return _shard_argmax(res_ptr + slot * RES_WIDTH, res_p_stride, P, RES_SCORE, RES_ID)


@triton.jit
def _block_accept(p_d, q_d, u, res_ptr, res_p_stride, P, lanes, length, k_len, HAS_RES: tl.constexpr):
    """(tau int32, rho float32 [BLOCK_K]) of block verification: rho_0 = 1, rho_i = min(rho_{i-1} p / q, 1) (NaN
    -> 0), h_i = S_i / (S_i + 1 - rho_i) (0/0 -> 1, NaN -> 0), h_L = rho_L; tau = the last i <= L with u_i <= h_i."""
    ratio = p_d / q_d
    ratio = tl.where(ratio != ratio, 0.0, ratio)
    rho_vec = tl.where(lanes == 0, 1.0, 0.0)
    rho = _scalar(1.0, tl.float32)
    tau = length * 0
    for i in range(1, k_len + 1):
        prod = rho * _pick(ratio, lanes, i - 1)
        rho = tl.where(prod != prod, 0.0, tl.where(prod < 1.0, prod, 1.0))
        rho_vec = tl.where(lanes == i, rho, rho_vec)
        mass = rho * 0.0
        if HAS_RES:
            mass = _residual_mass(res_ptr, res_p_stride, P, i, i < k_len)
        denom = mass + 1.0 - rho
        h = tl.where(denom > 0, mass / denom, tl.where(denom == 0, 1.0, 0.0))
        h = tl.where(i < k_len, h, 0.0)
        h = tl.where(i == length, rho, h)
        eta = _pick(u, lanes, i - 1)
        tau = tl.where((eta <= h) & (i <= length), i, tau)
    return tau, rho_vec


@triton.jit
def _stop_cut(drafts, lanes, n_acc, stops_ptr, n_stops, k_len):
    """(n_acc, stopped): acceptance ends right after the first accepted stop token."""
    is_stop = tl.full(lanes.shape, 0, tl.int1)
    for s in range(n_stops):
        is_stop = is_stop | (drafts == tl.load(stops_ptr + s).to(tl.int64))
    first = tl.min(tl.where(is_stop & (lanes < n_acc), lanes, k_len), axis=0)
    stopped = first < n_acc
    return tl.where(stopped, first + 1, n_acc), stopped


@triton.jit
def _store_outputs(n, drafts, lanes, n_acc, has_rows, stopped, emitted, tokens_ptr, num_ptr, mask_ptr, k_len):
    """tokens int64 [N, K+1], num_accepted int32 [N], accept_mask uint8 [N, K] of request ``n``."""
    n_acc = tl.where(has_rows, n_acc, 0)
    accept = lanes < n_acc
    tok = tl.where(accept & (lanes < k_len), drafts, -1)
    tok = tl.where((lanes == n_acc) & has_rows & ~stopped, emitted, tok)
    tl.store(tokens_ptr + n * (k_len + 1) + lanes, tok, mask=lanes <= k_len)
    tl.store(num_ptr + n, n_acc.to(tl.int32))
    tl.store(mask_ptr + n * k_len + lanes, accept.to(tl.uint8), mask=lanes < k_len)


@triton.jit
def _store_plan(cell, live, row, need, rho, tm, ts, tbad, qm, qs, qbad, HAS_DRAFT: tl.constexpr):
    """One plan slot per lane (``layout.PLAN_*``) where ``live``."""
    tl.store(cell + PLAN_ROW, row.to(tl.float32), mask=live)
    tl.store(cell + PLAN_NEED, need.to(tl.float32), mask=live)
    tl.store(cell + PLAN_RHO, rho, mask=live)
    tl.store(cell + PLAN_T_MAX, tm, mask=live)
    tl.store(cell + PLAN_T_SUM, ts, mask=live)
    tl.store(cell + PLAN_T_BAD, tbad.to(tl.float32), mask=live)
    if HAS_DRAFT:
        tl.store(cell + PLAN_Q_MAX, qm, mask=live)
        tl.store(cell + PLAN_Q_SUM, qs, mask=live)
        tl.store(cell + PLAN_Q_BAD, qbad.to(tl.float32), mask=live)


@triton.jit
def _sampled_accept(req_ptr, p_stride, F, P, shards_ptr, res_req, res_p_stride, lp_ptr, temp_ptr, n, safe, valid,
                    lanes, length, n_acc, k0, k1, off_lo, k_len, BLOCK_METHOD: tl.constexpr, HAS_DRAFT: tl.constexpr,
                    HAS_LOGPROBS: tl.constexpr, HAS_RES: tl.constexpr):
    """(n_acc, rho [BLOCK_K], sampled, target stats, draft normalisers) of a sampling call: token or block
    acceptance for a sampled request, the greedy ``n_acc`` kept for a temperature-0 one."""
    rows_live = lanes <= k_len
    tm, ts, tbad = _merged_stats(req_ptr, p_stride, F, P, lanes, rows_live, T_MAX, T_SUM, T_BAD)
    qm, qs, qbad = tl.zeros_like(tm), tl.zeros_like(ts), tbad & ~tbad
    if HAS_DRAFT:
        qm, qs, qbad = _merged_stats(req_ptr, p_stride, F, P, lanes, lanes < k_len, Q_MAX, Q_SUM, Q_BAD)
    p_d, q_d, qm, qs, qbad = _draft_probs(req_ptr, p_stride, F, P, shards_ptr, safe, valid, lanes, tm, ts, tbad, qm,
                                          qs, qbad, lp_ptr, n, k_len, HAS_DRAFT, HAS_LOGPROBS)
    u = uniform(k0, k1, off_lo, n, lanes, STREAM_ACCEPT, tl.zeros(lanes.shape, tl.int64))
    if BLOCK_METHOD:
        n_s, rho = _block_accept(p_d, q_d, u, res_req, res_p_stride, P, lanes, length, k_len, HAS_RES)
    else:
        n_s = _leading((u * q_d < p_d) & (lanes < length), lanes, k_len)
        rho = tl.where(rows_live, 1.0, 1.0)
    sampled = tl.load(temp_ptr + n) > 0
    return tl.where(sampled, n_s, n_acc), rho, sampled, tm, ts, tbad, qm, qs, qbad


@triton.jit
def _sampled_emit(res_req, res_p_stride, P, plan_ptr, n, lanes, length, n_acc, has_rows, stopped, sampled, rho, tm,
                  ts, tbad, qm, qs, qbad, emitted, k_len, BLOCK_METHOD: tl.constexpr, HAS_DRAFT: tl.constexpr,
                  HAS_RES: tl.constexpr, EPS: tl.constexpr):
    """The residual plan (token: the emitting row n_acc; block: every row 0..K, needed up to L), and with the
    second exchange the emitted token at n_acc: the race over p after a full acceptance or where the residual's
    mass is below EPS, else the residual's winner (-1 before the second exchange)."""
    last_q = lanes == k_len                                   # row K reads draft row K-1's normaliser
    qm = tl.where(last_q, _pick(qm, lanes, k_len - 1), qm)
    qs = tl.where(last_q, _pick(qs, lanes, k_len - 1), qs)
    qbad = tl.where(last_q, _pick(qbad.to(tl.int32), lanes, k_len - 1) > 0, qbad)
    if BLOCK_METHOD:
        slot = n_acc
        needed = tl.where(sampled, (lanes <= length) & has_rows, False)
        _store_plan(plan_ptr + (n * (k_len + 1) + lanes) * PLAN_WIDTH, lanes <= k_len, lanes, needed, rho, tm, ts,
                    tbad, qm, qs, qbad, HAS_DRAFT)
    else:
        slot = n_acc * 0
        on = lanes == n_acc
        _store_plan(plan_ptr + n * PLAN_WIDTH + lanes * 0, on, lanes, sampled & has_rows & ~stopped, rho, tm, ts,
                    tbad, qm, qs, qbad, HAS_DRAFT)
    token = n_acc.to(tl.int64) * 0 - 1
    if HAS_RES:
        cell = res_req + slot * RES_WIDTH
        use_p = (n_acc >= length) | ~(_residual_mass(res_req, res_p_stride, P, slot, slot >= 0) >= EPS)
        token = tl.where(use_p, _shard_argmax(cell, res_p_stride, P, RES_GSCORE, RES_GID),
                         _shard_argmax(cell, res_p_stride, P, RES_SCORE, RES_ID))
    return tl.where(sampled, token, emitted)


@triton.jit(do_not_specialize=["seed", "offset"])
def _decide_kernel(stats_ptr, shards_ptr, res_ptr, cu_ptr, drafts_ptr, lp_ptr, vlens_ptr, surv_ptr, thr_ptr,
                   temp_ptr, key_ptr, seed, offset, KEY_IN_MEMORY: tl.constexpr, stops_ptr, tokens_ptr, num_ptr,
                   mask_ptr, plan_ptr, n_req, k_len, P, F, num_rows, n_stops, vocab_size, res_slots,
                   SAMPLED: tl.constexpr, BLOCK_METHOD: tl.constexpr, HAS_DRAFT: tl.constexpr,
                   HAS_LOGPROBS: tl.constexpr, HAS_RES: tl.constexpr, PACKED: tl.constexpr, HAS_VLENS: tl.constexpr,
                   HAS_SURV: tl.constexpr, BLOCK_K: tl.constexpr, EPS: tl.constexpr):
    """One request per program. Reads stats float32 [P, N, K+1, F], shards int64 [P, 2], residual float32
    [P, N, R, RES_WIDTH] (HAS_RES), cu_seqlens int [N+1] (PACKED), draft_tokens int [N, K], draft_logprobs float32
    [N, K] (HAS_LOGPROBS), verify_lens int [N] (HAS_VLENS), survival float [N, K] and thresholds float [K]
    (HAS_SURV), temperature float32 [N] (SAMPLED), rng_key int64 [2], stop ids int [n_stops]; writes tokens int64
    [N, K+1], num_accepted int32 [N], accept_mask uint8 [N, K] and (SAMPLED) the plan float32 [N, R, PLAN_WIDTH]."""
    n = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_K)
    p_stride = tl.cast(n_req, tl.int64) * (k_len + 1) * F
    req_ptr = stats_ptr + n * (k_len + 1) * F
    res_p_stride = tl.cast(n_req, tl.int64) * res_slots * RES_WIDTH
    res_req = res_ptr + n * res_slots * RES_WIDTH
    drafts = tl.load(drafts_ptr + n * k_len + lanes, mask=lanes < k_len, other=-1).to(tl.int64)
    valid = (drafts >= 0) & (drafts < vocab_size)
    safe = tl.where(valid, drafts, 0)
    has_rows, length = _verify_length(n, cu_ptr, num_rows, vlens_ptr, surv_ptr, thr_ptr, lanes, k_len, PACKED,
                                      HAS_VLENS, HAS_SURV)
    amax = _target_argmax(req_ptr, p_stride, F, P, lanes, lanes <= k_len)
    n_acc = _leading((drafts == amax) & valid & (lanes < length), lanes, k_len)
    if SAMPLED:
        k0, k1, off_lo = load_key(key_ptr, seed, offset, KEY_IN_MEMORY)
        n_acc, rho, sampled, tm, ts, tbad, qm, qs, qbad = _sampled_accept(
            req_ptr, p_stride, F, P, shards_ptr, res_req, res_p_stride, lp_ptr, temp_ptr, n, safe, valid, lanes,
            length, n_acc, k0, k1, off_lo, k_len, BLOCK_METHOD, HAS_DRAFT, HAS_LOGPROBS, HAS_RES)
    n_acc, stopped = _stop_cut(drafts, lanes, n_acc, stops_ptr, n_stops, k_len)
    emitted = _pick(amax, lanes, n_acc)
    if SAMPLED:
        emitted = _sampled_emit(res_req, res_p_stride, P, plan_ptr, n, lanes, length, n_acc, has_rows, stopped,
                                sampled, rho, tm, ts, tbad, qm, qs, qbad, emitted, k_len, BLOCK_METHOD, HAS_DRAFT,
                                HAS_RES, EPS)
    _store_outputs(n, drafts, lanes, n_acc, has_rows, stopped, emitted, tokens_ptr, num_ptr, mask_ptr, k_len)


def verify_decide(stats, shards, residual, cu_seqlens, num_rows, draft_tokens, draft_logprobs, verify_lens, survival,
                  thresholds, temperature, rng_key, stop_token_ids, method, has_draft_logits, vocab_size):
    """See ``local_verify.verify_decide``. stats float32 [P, N, K+1, F], shards int64 [P, 2], residual float32
    [P, N, R, RES_WIDTH] or None, cu_seqlens int [N+1] or None, draft_tokens int [N, K], draft_logprobs float32
    [N, K] or None, verify_lens int [N] or None, survival float [N, K] and thresholds float [K] or None,
    temperature float32 [N] or None (greedy), rng_key int64 [2], stop_token_ids int [S] or None ->
    tokens int64 [N, K+1], num_accepted int32 [N], accept_mask bool [N, K], plan float32 [N, R, PLAN_WIDTH]
    (R = 0 greedy, 1 token, K+1 block). One launch; nothing is read on the host."""
    n, k_len = draft_tokens.shape
    dev = draft_tokens.device
    sampled = temperature is not None
    slots = 0 if not sampled else (1 if method == "token" else k_len + 1)
    tokens = torch.empty(n, k_len + 1, dtype=torch.int64, device=dev)
    num_accepted = torch.empty(n, dtype=torch.int32, device=dev)
    accept_mask = torch.empty(n, k_len, dtype=torch.bool, device=dev)
    plan = torch.zeros(n, slots, L.PLAN_WIDTH, dtype=torch.float32, device=dev)
    if n == 0:
        return tokens, num_accepted, accept_mask, plan
    stats = stats.contiguous()
    spare = stats                                      # the pointer of an absent optional input (never read)
    given = lambda x: x.contiguous() if x is not None else spare  # noqa: E731
    res_slots = residual.shape[2] if residual is not None else 1
    _decide_kernel[(n,)](
        stats, shards.contiguous(), given(residual), given(cu_seqlens), draft_tokens.contiguous(),
        given(draft_logprobs), given(verify_lens), given(survival), given(thresholds), given(temperature),
        *key_args(rng_key, tokens.device), given(stop_token_ids), tokens, num_accepted, accept_mask.view(torch.uint8),
        plan, n, k_len, stats.shape[0], stats.shape[-1], num_rows,
        stop_token_ids.numel() if stop_token_ids is not None else 0, vocab_size, res_slots, SAMPLED=sampled,
        BLOCK_METHOD=method != "token", HAS_DRAFT=sampled and has_draft_logits,
        HAS_LOGPROBS=sampled and draft_logprobs is not None, HAS_RES=residual is not None,
        PACKED=cu_seqlens is not None, HAS_VLENS=verify_lens is not None,
        HAS_SURV=survival is not None and thresholds is not None, BLOCK_K=triton.next_power_of_2(k_len + 1),
        EPS=RESIDUAL_EPS)
    return tokens, num_accepted, accept_mask, plan
