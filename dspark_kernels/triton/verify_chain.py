"""Triton verify_chain: one program per request walks its chain; every vocabulary pass is a BLOCK_V-wide loop.

Same meaning and randomness as ``dspark_kernels.reference.verify_chain`` (read that first). Per request:
the verify length from the packed rows / ``verify_lens`` / survival thresholds; then, row by row, the softmax
statistics (max and sum of ``x / T``) of the target row and the draft row, from which ``p(d)`` and ``q(d)`` follow;
the accept rule (greedy, token or block); the stop-token cut; and one last pass over the emitting row that draws the
correction (exponential race over the residual) and the bonus (Gumbel-max over ``target / T``) with the same
uniforms, keeping the one the rule asks for.
"""

import torch
import triton
import triton.language as tl

from .rng import (STREAM_ACCEPT, STREAM_RESIDUAL, argmax_finish, argmax_update, gumbel_score, key_args, load_key,
                  race_score,
                  uniform)

RESIDUAL_EPS = tl.constexpr(1e-6)
NEG_INF = tl.constexpr(float("-inf"))
ALL = tl.constexpr(tl.PropagateNan.ALL)   # max/min propagate NaN as torch.clamp does


@triton.jit
def _load_scaled(row_ptr, cols, V, t):
    """A BLOCK_V chunk of a row divided by the temperature (-inf past V)."""
    return tl.load(row_ptr + cols, mask=cols < V, other=NEG_INF).to(tl.float32) / t


@triton.jit
def _softmax_stats(row_ptr, V, t, BLOCK_V: tl.constexpr):
    """(max, sum exp(x / t - max)) of one row, online over BLOCK_V chunks."""
    m = tl.full([BLOCK_V], NEG_INF, tl.float32)
    s = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V).to(tl.int64)
        x = _load_scaled(row_ptr, cols, V, t)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)   # exp(-inf - 0) = 0, never exp(-inf + inf)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    m_all = tl.max(m, axis=0)
    s_all = tl.sum(s * tl.exp(m - tl.where(m_all == NEG_INF, 0.0, m_all)), axis=0)
    return m_all, s_all


@triton.jit
def _argmax_row(row_ptr, V, BLOCK_V: tl.constexpr):
    """argmax of a row; NaN counts as -inf, ties go to the lowest index (0 for a row of -inf / NaN)."""
    best = tl.full([BLOCK_V], NEG_INF, tl.float32)
    best_i = tl.arange(0, BLOCK_V).to(tl.int64)
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V).to(tl.int64)
        x = tl.load(row_ptr + cols, mask=cols < V, other=NEG_INF).to(tl.float32)
        best, best_i = argmax_update(best, best_i, tl.where(x != x, NEG_INF, x), cols)
    return argmax_finish(best, best_i, V + BLOCK_V)


@triton.jit
def _prob(row_ptr, tok, valid, t, m, s):
    """softmax(row / t)[tok] from the row's statistics (0 for an invalid token)."""
    x = tl.load(row_ptr + tl.where(valid, tok, 0)).to(tl.float32) / t
    return tl.where(valid, tl.exp(x - m) / s, 0.0)


@triton.jit
def _residual_chunk(row, drow, cols, V, t, m_t, s_t, m_q, s_q, d, valid, rho, HAS_DRAFT_LOGITS: tl.constexpr):
    """A chunk of ``x = row / t`` and of ``max(rho p - q, 0)`` (0 past V), ``p = softmax(row / t)`` from its
    statistics, ``q = softmax(drow / t)`` or one-hot at ``d``; NaN propagates as in ``torch.clamp``."""
    x = _load_scaled(row, cols, V, t)
    p = tl.exp(x - m_t) / s_t
    if HAS_DRAFT_LOGITS:
        q = tl.exp(_load_scaled(drow, cols, V, t) - m_q) / s_q
    else:
        q = tl.where((cols == d) & valid, 1.0, 0.0)
    return x, tl.where(cols < V, tl.maximum(rho * p - q, 0.0, propagate_nan=ALL), 0.0)


@triton.jit
def _verify_len(cu_ptr, verify_lens_ptr, survival_ptr, thresholds_ptr, r, total_rows, K, kcols,
                PACKED: tl.constexpr, HAS_VERIFY_LENS: tl.constexpr, HAS_THRESHOLDS: tl.constexpr):
    """(first row, whether the request has rows, verify length L) from the packed rows, ``verify_lens`` and the
    survival thresholds."""
    if PACKED:
        start = tl.load(cu_ptr + r).to(tl.int64)
        count = tl.load(cu_ptr + r + 1).to(tl.int64) - start
        rows_left = tl.where(start >= 0, total_rows - start, 0)
        last = tl.minimum(tl.maximum(tl.minimum(count, rows_left) - 1, -1), K)
    else:
        start = r * (K + 1)
        last = K + 0 * r
    L = tl.maximum(last, 0)
    if HAS_VERIFY_LENS:
        L = tl.minimum(L, tl.minimum(tl.maximum(tl.load(verify_lens_ptr + r).to(tl.int64), 0), K))
    if HAS_THRESHOLDS:
        sv = tl.load(survival_ptr + r * K + kcols, mask=kcols < K, other=0.0).to(tl.float32)
        th = tl.load(thresholds_ptr + kcols, mask=kcols < K, other=1.0).to(tl.float32)
        fails = ~(sv >= th)
        L = tl.minimum(L, tl.min(tl.where(fails | (kcols >= K), kcols, K), axis=0).to(tl.int64))
    return start, last >= 0, L


@triton.jit
def _draft_stats(drow, V, t, HAS_DRAFT_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Softmax statistics of a draft row, or those of a one-hot row (m = 0, s = 1) without draft logits."""
    m_q = tl.zeros([], tl.float32)
    s_q = tl.full([], 1.0, tl.float32)
    if HAS_DRAFT_LOGITS:
        m_q, s_q = _softmax_stats(drow, V, t, BLOCK_V)
    return m_q, s_q


@triton.jit
def _draft_prob(drow, d, valid, t, m_q, s_q, HAS_DRAFT_LOGITS: tl.constexpr):
    """q(d): from the draft row, or 1 for a valid one-hot draft."""
    if HAS_DRAFT_LOGITS:
        q_d = _prob(drow, d, valid, t, m_q, s_q)
    else:
        q_d = tl.where(valid, 1.0, 0.0)
    return q_d


@triton.jit
def _walk_greedy(row0, draft0, L, V, BLOCK_V: tl.constexpr):
    """Accepted drafts of a greedy request: the leading drafts equal to their row's argmax."""
    n_acc = tl.zeros([], tl.int64)
    alive = tl.full([], 1, tl.int1)
    for j in range(0, L):
        if alive:
            d = tl.load(draft0 + j).to(tl.int64)
            ok = (d >= 0) & (d < V) & (d == _argmax_row(row0 + j * V, V, BLOCK_V))
            n_acc += ok.to(tl.int64)
            alive = ok
    return n_acc


@triton.jit
def _walk_token(row0, drow0, draft0, L, V, t, k0, k1, offset_lo, r,
                HAS_DRAFT_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Accepted drafts under token-level rejection sampling: accept d_j while ``u_j q(d_j) < p(d_j)``."""
    n_acc = tl.zeros([], tl.int64)
    alive = tl.full([], 1, tl.int1)
    for j in range(0, L):
        if alive:
            row, drow = row0 + j * V, drow0 + j * V
            d = tl.load(draft0 + j).to(tl.int64)
            valid = (d >= 0) & (d < V)
            m_t, s_t = _softmax_stats(row, V, t, BLOCK_V)
            m_q, s_q = _draft_stats(drow, V, t, HAS_DRAFT_LOGITS, BLOCK_V)
            p_d = _prob(row, d, valid, t, m_t, s_t)
            q_d = _draft_prob(drow, d, valid, t, m_q, s_q, HAS_DRAFT_LOGITS)
            u = uniform(k0, k1, offset_lo, r, j, STREAM_ACCEPT, 0)
            ok = u * q_d < p_d
            n_acc += ok.to(tl.int64)
            alive = ok
    return n_acc


@triton.jit
def _block_accept_prob(row, drow, d, valid, V, t, m_t, s_t, m_q, s_q, rho, HAS_DRAFT_LOGITS: tl.constexpr,
                       BLOCK_V: tl.constexpr):
    """h_j = S_j / (S_j + 1 - rho_j), S_j the residual mass of row j; 0/0 -> 1, NaN -> 0 (never accept)."""
    mass = tl.zeros([BLOCK_V], tl.float32)
    for vs in range(0, V, BLOCK_V):
        cols = vs + tl.arange(0, BLOCK_V).to(tl.int64)
        _, res = _residual_chunk(row, drow, cols, V, t, m_t, s_t, m_q, s_q, d, valid, rho, HAS_DRAFT_LOGITS)
        mass += res
    s_mass = tl.sum(mass, axis=0)
    denom = s_mass + 1.0 - rho
    zero_or_nan = tl.where(denom == 0, 1.0, 0.0)
    return tl.where(denom > 0, s_mass / tl.where(denom > 0, denom, 1.0), zero_or_nan)


@triton.jit
def _next_rho(rho, p_d, q_d):
    """rho_{j+1} = min(rho_j p/q, 1), with p/0 = inf and 0/0 = 0 (a draft q calls impossible; an invalid draft);
    NaN -> 0 (never accept)."""
    ratio = tl.where(q_d > 0, p_d / tl.where(q_d > 0, q_d, 1.0), tl.where(p_d > 0, float("inf"), 0.0))
    nxt = tl.minimum(rho * ratio, 1.0, propagate_nan=ALL)
    return tl.where(nxt != nxt, 0.0, nxt)


@triton.jit
def _walk_block(row0, drow0, draft0, L, K, V, t, k0, k1, offset_lo, r,
                HAS_DRAFT_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr):
    """(tau, rho_tau) of block verification (Sun et al., 2024): the last j whose test ``eta_j <= h_j`` passes."""
    n_acc = tl.zeros([], tl.int64)
    rho = tl.full([], 1.0, tl.float32)        # rho_j while walking
    rho_tau = tl.full([], 1.0, tl.float32)
    for j in range(0, L + 1):
        row, drow = row0 + j * V, drow0 + tl.minimum(j, K - 1) * V
        if j < L:
            d = tl.load(draft0 + j).to(tl.int64)
        else:
            d = tl.zeros([], tl.int64) - 1
        valid = (d >= 0) & (d < V)
        m_t, s_t = _softmax_stats(row, V, t, BLOCK_V)
        m_q, s_q = _draft_stats(drow, V, t, HAS_DRAFT_LOGITS, BLOCK_V)
        if j >= 1:
            h = rho
            if j < L:
                h = _block_accept_prob(row, drow, d, valid, V, t, m_t, s_t, m_q, s_q, rho, HAS_DRAFT_LOGITS, BLOCK_V)
            if uniform(k0, k1, offset_lo, r, j - 1, STREAM_ACCEPT, 0) <= h:
                n_acc = tl.zeros([], tl.int64) + j
                rho_tau = rho
        if j < L:
            p_d = _prob(row, d, valid, t, m_t, s_t)
            q_d = _draft_prob(drow, d, valid, t, m_q, s_q, HAS_DRAFT_LOGITS)
            rho = _next_rho(rho, p_d, q_d)
    return n_acc, rho_tau


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
def _emit_sampled(row, drow0, draft0, n_acc, L, K, V, t, rho_e, k0, k1, offset_lo, r,
                  HAS_DRAFT_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr):
    """The token a sampled request emits at row n_acc: one pass draws the correction (exponential race over the
    residual) and the bonus (Gumbel-max over ``row / t``) with the same uniforms; the bonus where every draft was
    accepted or the residual mass is below RESIDUAL_EPS."""
    m_t, s_t = _softmax_stats(row, V, t, BLOCK_V)
    full = n_acc >= L
    jq = tl.minimum(n_acc, K - 1)
    drow = drow0 + jq * V
    m_q, s_q = _draft_stats(drow, V, t, HAS_DRAFT_LOGITS, BLOCK_V)
    d_next = tl.load(draft0 + jq).to(tl.int64)
    valid_next = (d_next >= 0) & (d_next < V)
    mass = tl.zeros([BLOCK_V], tl.float32)
    best_r = tl.full([BLOCK_V], NEG_INF, tl.float32)
    best_ri = tl.arange(0, BLOCK_V).to(tl.int64)
    best_g = tl.full([BLOCK_V], NEG_INF, tl.float32)
    best_gi = tl.arange(0, BLOCK_V).to(tl.int64)
    for vs in range(0, V, BLOCK_V):
        cols = vs + tl.arange(0, BLOCK_V).to(tl.int64)
        x, res = _residual_chunk(row, drow, cols, V, t, m_t, s_t, m_q, s_q, d_next, valid_next, rho_e,
                                 HAS_DRAFT_LOGITS)
        res = tl.where(full, 0.0, res)
        mass += res
        u = uniform(k0, k1, offset_lo, r, n_acc, STREAM_RESIDUAL, cols)
        best_r, best_ri = argmax_update(best_r, best_ri, tl.where(cols < V, race_score(res, u), NEG_INF), cols)
        best_g, best_gi = argmax_update(best_g, best_gi, tl.where(cols < V, gumbel_score(x, u), NEG_INF), cols)
    from_res = argmax_finish(best_r, best_ri, V + BLOCK_V)
    from_p = argmax_finish(best_g, best_gi, V + BLOCK_V)
    use_p = full | ~(tl.sum(mass, axis=0) >= RESIDUAL_EPS)
    return tl.where(use_p, from_p, from_res).to(tl.int64)


@triton.jit(do_not_specialize=["seed", "offset"])
def _verify_chain_kernel(
    target_ptr, cu_ptr, drafts_ptr, draft_logits_ptr, verify_lens_ptr, survival_ptr, thresholds_ptr, temp_ptr,
    rng_key_ptr, seed, offset, KEY_IN_MEMORY: tl.constexpr, stops_ptr, tokens_ptr, num_acc_ptr, mask_ptr,
    total_rows, K, V, n_stops,
    PACKED: tl.constexpr, HAS_DRAFT_LOGITS: tl.constexpr, HAS_VERIFY_LENS: tl.constexpr,
    HAS_THRESHOLDS: tl.constexpr, BLOCK_METHOD: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    k0, k1, offset_lo = load_key(rng_key_ptr, seed, offset, KEY_IN_MEMORY)
    kcols = tl.arange(0, BLOCK_K)
    start, has_rows, L = _verify_len(cu_ptr, verify_lens_ptr, survival_ptr, thresholds_ptr, r, total_rows, K, kcols,
                                     PACKED, HAS_VERIFY_LENS, HAS_THRESHOLDS)
    temp = tl.load(temp_ptr + r)
    sampled = temp > 0
    t = tl.where(sampled, temp, 1.0)
    row0 = target_ptr + tl.minimum(tl.maximum(start, 0), tl.maximum(total_rows - 1, 0)) * V
    drow0 = draft_logits_ptr + r * K * V
    draft0 = drafts_ptr + r * K

    # the accepted drafts: n_acc (greedy / token), or tau and rho_tau (block); a request with no rows has none
    n_acc = tl.zeros([], tl.int64)
    rho_tau = tl.full([], 1.0, tl.float32)
    if has_rows:
        if sampled:
            if BLOCK_METHOD:
                n_acc, rho_tau = _walk_block(row0, drow0, draft0, L, K, V, t, k0, k1, offset_lo, r,
                                             HAS_DRAFT_LOGITS, BLOCK_V)
            else:
                n_acc = _walk_token(row0, drow0, draft0, L, V, t, k0, k1, offset_lo, r, HAS_DRAFT_LOGITS, BLOCK_V)
        else:
            n_acc = _walk_greedy(row0, draft0, L, V, BLOCK_V)
    n_acc, stopped = _stop_cut(draft0, stops_ptr, n_stops, n_acc, kcols, BLOCK_K)

    # the token emitted at row n_acc
    emitted = tl.zeros([], tl.int64)
    if has_rows:
        if sampled:
            rho_e = rho_tau if BLOCK_METHOD else 1.0
            emitted = _emit_sampled(row0 + n_acc * V, drow0, draft0, n_acc, L, K, V, t, rho_e, k0, k1, offset_lo,
                                    r, HAS_DRAFT_LOGITS, BLOCK_V)
        else:
            emitted = _argmax_row(row0 + n_acc * V, V, BLOCK_V).to(tl.int64)

    # outputs
    kk = kcols.to(tl.int64)   # BLOCK_K > K: columns 0..K of tokens
    drafts_all = tl.load(draft0 + kk, mask=kk < K, other=-1).to(tl.int64)
    out = tl.where(kk < n_acc, drafts_all, -1)
    out = tl.where((kk == n_acc) & has_rows & ~stopped, emitted, out)
    tl.store(tokens_ptr + r * (K + 1) + kk, out, mask=kk < K + 1)
    tl.store(num_acc_ptr + r, n_acc.to(tl.int32))
    tl.store(mask_ptr + r * K + kk, (kk < n_acc).to(tl.uint8), mask=kk < K)


def verify_chain(target_logits, cu_seqlens, draft_tokens, draft_logits, draft_logprobs, verify_lens, survival,
                 thresholds, temperature, rng_key, stop_token_ids, method):
    """Same flat arguments and results as ``dspark_kernels.reference.verify_chain`` (checked by the wrapper; tensors
    contiguous, as the registry passes them).

    ``draft_logprobs`` is accepted and not used: this kernel reads each draft row anyway, and ``q(d_j)`` from the
    row equals ``exp(draft_logprobs)`` when the log-probabilities are what the contract says they are."""
    n, k = draft_tokens.shape
    v = target_logits.shape[-1]
    dev = draft_tokens.device
    tokens = torch.empty(n, k + 1, dtype=torch.int64, device=dev)
    num_acc = torch.empty(n, dtype=torch.int32, device=dev)
    mask = torch.empty(n, k, dtype=torch.bool, device=dev)
    if n == 0:
        return tokens, num_acc, mask
    target = target_logits
    total_rows = target.shape[0] if cu_seqlens is not None else n * (k + 1)
    dummy = draft_tokens  # never read when its HAS_* flag is off
    stops = stop_token_ids if stop_token_ids is not None else dummy
    _verify_chain_kernel[(n,)](
        target, cu_seqlens if cu_seqlens is not None else dummy, draft_tokens,
        draft_logits if draft_logits is not None else target,
        verify_lens if verify_lens is not None else dummy,
        survival if survival is not None else target,
        thresholds if thresholds is not None else target,
        temperature if temperature is not None else torch.zeros(n, device=dev), *key_args(rng_key, dev), stops, tokens, num_acc,
        mask.view(torch.uint8),
        total_rows, k, v, stop_token_ids.numel() if stop_token_ids is not None else 0,
        PACKED=cu_seqlens is not None, HAS_DRAFT_LOGITS=draft_logits is not None,
        HAS_VERIFY_LENS=verify_lens is not None, HAS_THRESHOLDS=thresholds is not None,
        BLOCK_METHOD=method == "block", BLOCK_V=min(1024, triton.next_power_of_2(v)),
        BLOCK_K=triton.next_power_of_2(k + 1),
    )
    return tokens, num_acc, mask
