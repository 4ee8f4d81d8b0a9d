"""Triton draft_block: the full proposal as K skinny matrix products, a few launches per position; top-k proposals
by a walk per request.

Same meaning and randomness as ``dspark_kernels.reference.draft_block`` (read that first). The only dependency between
positions is N tokens (hence N rows of W1), so the full proposal runs, per position k:

1. (gated / rnn) ``_head_kernel``, a program per request: ``v = sigmoid(Wg [h_k; e] + bg) * e`` or the rnn step
   (``[g, c, o] = Wj [s; e; h_k] + bj``, the state ping-ponged between two scratch rows), with ``e = W1[x]`` of the
   token before the position (the anchor, or the previous position's token), into a float32 scratch row;
2. ``_sweep_kernel`` over (vocabulary blocks x request groups): ``logits = U_k + W2 @ v`` for BLOCK_V rows of W2 and
   BLOCK_N requests with ``tl.dot`` (v: W1's rows of the tokens for the vanilla head, else the scratch rows; a
   16-bit W2 multiplies v's rows in W2's type, split into hi + lo rows unless they are W1's rows of that type, an fp32
   one in float32), the logits stored when asked for, and per (request, block) the winner (the argmax, NaN as -inf,
   or the Gumbel race of ``logits / T`` with ``u = uniform(request, k, STREAM_DRAFT, token)``), its scaled logit and
   the softmax statistics of ``logits / T`` (T = 1 for greedy requests) into partials ``[N, blocks]``;
3. ``_merge_kernel``, a program per request: the blocks' partials merged (ties to the lowest id) into the token (the
   target id of the drafted id with ``draft_to_target``) and its log-probability (NaN for a row with a NaN or +inf
   logit, or only -inf ones, as torch gives), written to ``tokens[:, k]``, which the next position reads.

After the block, ``_conf_kernel`` (a program per request) computes every position's confidence logit ``w . [h_k; e] +
b`` and the survival product ``prod sigmoid(z / T_sts)``: the hidden states are read once.

Top-k proposals (top_k > 0): ``_topk_kernel`` writes each row's top_k candidate ids (increasing), and
``_draft_block_kernel`` walks each request's K positions over its candidates (one program per request: a position
reads top_k rows of W2, not V).

Everything is float32 whatever the input dtypes (tensor-core products of 16-bit operands are exact, sums float32);
offsets are 64-bit (N*K*V and V*r may pass 2**31).
"""

import torch
import triton
import triton.language as tl

from .rng import STREAM_DRAFT, argmax_finish, gumbel_score, key_args, load_key, uniform

NEG_INF = tl.constexpr(float("-inf"))
HEAD_VANILLA = tl.constexpr(0)
HEAD_GATED = tl.constexpr(1)
HEAD_RNN = tl.constexpr(2)
_HEAD_IDS = {"vanilla": 0, "gated": 1, "rnn": 2}

_TILE = 8192      # elements of one BLOCK_V x BLOCK_R (or BLOCK_R x BLOCK_C) tile on a GPU (registers)
_TILE_INTERPRET = 1 << 17   # on CPU tensors (TRITON_INTERPRET=1) a block costs per op, not per element
_MAX_BLOCK_R = 64
_NUM_WARPS = 8


@triton.jit
def _tanh(x):
    """tanh from one exp (no tanh in tl core): sign(x) (1 - e^{-2|x|}) / (1 + e^{-2|x|}); NaN stays NaN."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _argmax_key(x):
    """The argmax key of rng.argmax_nan_low: NaN -> -inf, everything else (infinities too) as it is."""
    return tl.where(x != x, NEG_INF, x)


@triton.jit
def _load_he(h_row, e_row, e_ok, cols, D, R):
    """Columns ``cols`` of ``[h_k; e]`` (length D + R) in float32, 0 past the end."""
    h = tl.load(h_row + cols, mask=cols < D, other=0.0).to(tl.float32)
    e = tl.load(e_row + (cols - D), mask=(cols >= D) & (cols < D + R) & e_ok, other=0.0).to(tl.float32)
    return h + e


@triton.jit
def _gated_v(v_row, wg_ptr, bg_ptr, h_row, e_row, e_ok, D, R, rs_ar, cs_ar, BLOCK_R: tl.constexpr,
             BLOCK_C: tl.constexpr):
    """``v = sigmoid(Wg [h_k; e] + bg) * e`` into the scratch row, BLOCK_R x BLOCK_C tiles of Wg."""
    for rs in range(0, R, BLOCK_R):
        rows = rs + rs_ar
        rmask = rows < R
        acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
        for cs in range(0, D + R, BLOCK_C):
            cols = cs + cs_ar
            z = _load_he(h_row, e_row, e_ok, cols, D, R)
            w = tl.load(wg_ptr + rows[:, None] * (D + R) + cols[None, :],
                        mask=rmask[:, None] & (cols[None, :] < D + R), other=0.0).to(tl.float32)
            acc += w * z[None, :]
        gate = tl.sigmoid(tl.sum(acc, axis=1) + tl.load(bg_ptr + rows, mask=rmask, other=0.0).to(tl.float32))
        e = tl.load(e_row + rows, mask=rmask & e_ok, other=0.0).to(tl.float32)
        tl.store(v_row + rows, gate * e, mask=rmask)


@triton.jit
def _rnn_preacts(rows, rmask, s_old, wj_ptr, bj_ptr, h_row, e_row, e_ok, D, R, cs_ar, BLOCK_R: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    """Rows ``rows`` of the three parts ``[g, c, o] = Wj [s; e; h_k] + bj`` (Wj rows r..2r hold c, 2r..3r o)."""
    acc_g = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    acc_c = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    acc_o = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for cs in range(0, 2 * R + D, BLOCK_C):
        cols = cs + cs_ar                                  # z = [s; e; h_k]
        z = tl.load(s_old + cols, mask=cols < R, other=0.0)
        z += tl.load(e_row + (cols - R), mask=(cols >= R) & (cols < 2 * R) & e_ok, other=0.0).to(tl.float32)
        z += tl.load(h_row + (cols - 2 * R), mask=(cols >= 2 * R) & (cols < 2 * R + D), other=0.0).to(tl.float32)
        wmask = rmask[:, None] & (cols[None, :] < 2 * R + D)
        w_g = wj_ptr + rows[:, None] * (2 * R + D) + cols[None, :]
        acc_g += tl.load(w_g, mask=wmask, other=0.0).to(tl.float32) * z[None, :]
        acc_c += tl.load(w_g + R * (2 * R + D), mask=wmask, other=0.0).to(tl.float32) * z[None, :]
        acc_o += tl.load(w_g + 2 * R * (2 * R + D), mask=wmask, other=0.0).to(tl.float32) * z[None, :]
    gate = tl.sum(acc_g, axis=1) + tl.load(bj_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    cand = tl.sum(acc_c, axis=1) + tl.load(bj_ptr + R + rows, mask=rmask, other=0.0).to(tl.float32)
    out = tl.sum(acc_o, axis=1) + tl.load(bj_ptr + 2 * R + rows, mask=rmask, other=0.0).to(tl.float32)
    return gate, cand, out


@triton.jit
def _rnn_v(v_row, s_old, s_new, wj_ptr, bj_ptr, h_row, e_row, e_ok, D, R, rs_ar, cs_ar, BLOCK_R: tl.constexpr,
           BLOCK_C: tl.constexpr):
    """The rnn head's step: ``s_new = sigmoid(g) s_old + (1 - sigmoid(g)) tanh(c)``, ``v = tanh(o)``."""
    for rs in range(0, R, BLOCK_R):
        rows = rs + rs_ar
        rmask = rows < R
        gate, cand, out = _rnn_preacts(rows, rmask, s_old, wj_ptr, bj_ptr, h_row, e_row, e_ok, D, R, cs_ar, BLOCK_R,
                                       BLOCK_C)
        sg = tl.sigmoid(gate)
        s = sg * tl.load(s_old + rows, mask=rmask, other=0.0) + (1 - sg) * _tanh(cand)
        tl.store(s_new + rows, s, mask=rmask)
        tl.store(v_row + rows, _tanh(out), mask=rmask)


@triton.jit
def _confidence(cw_ptr, cb_ptr, sts_ptr, k, h_row, e_row, e_ok, D, R, cs_ar, HAS_STS: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """(the confidence logit ``z_k = w . [h_k; e] + b``, ``sigmoid(z_k / T_sts_k)``)."""
    cacc = tl.zeros([BLOCK_C], tl.float32)
    for cs in range(0, D + R, BLOCK_C):
        cols = cs + cs_ar
        w = tl.load(cw_ptr + cols, mask=cols < D + R, other=0.0).to(tl.float32)
        cacc += w * _load_he(h_row, e_row, e_ok, cols, D, R)
    z_k = tl.sum(cacc, axis=0) + tl.load(cb_ptr).to(tl.float32)
    if HAS_STS:
        z_t = z_k / tl.load(sts_ptr + k).to(tl.float32)
    else:
        z_t = z_k
    return z_k, tl.sigmoid(z_t)


@triton.jit
def _e4m3_to_f32(b):
    """float8 e4m3 (fn) bytes (int32 0..255) as float32, exactly, in integer arithmetic (any GPU arch):
    (8 + m) 2^(e - 10) for a normal number, m 2^-9 for a subnormal, NaN for S.1111.111 (e4m3fn has no infinity)."""
    e = (b >> 3) & 15
    m = b & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (8 + m).to(tl.float32) * tl.exp2((e - 10).to(tl.float32)))
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _logits_chunk(u_row, w2_ptr, w2s_ptr, e_row, e_ok, v_row, cols, vmask, R, rs_ar, HEAD: tl.constexpr,
                  W2_FP8: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """``U_k + W2 @ v`` at ``cols`` in float32 (v read from W1 for the vanilla head, else the scratch row; each
    row's dot product times its scale with an fp8 W2)."""
    acc = tl.zeros([BLOCK_V, BLOCK_R], tl.float32)
    for rs in range(0, R, BLOCK_R):
        rr = rs + rs_ar
        rmask = rr < R
        if HEAD == HEAD_VANILLA:
            vv = tl.load(e_row + rr, mask=rmask & e_ok, other=0.0).to(tl.float32)
        else:
            vv = tl.load(v_row + rr, mask=rmask, other=0.0)
        wmask = vmask[:, None] & rmask[None, :]
        if W2_FP8:  # W2's bytes (uint8), decoded here: no fp8 type needed, so every arch compiles it
            w = _e4m3_to_f32(tl.load(w2_ptr + cols[:, None] * R + rr[None, :], mask=wmask, other=0).to(tl.int32))
        else:
            w = tl.load(w2_ptr + cols[:, None] * R + rr[None, :], mask=wmask, other=0.0).to(tl.float32)
        acc += w * vv[None, :]
    bias = tl.sum(acc, axis=1)
    if HAS_SCALE:
        bias = bias * tl.load(w2s_ptr + cols, mask=vmask, other=0.0)
    return tl.load(u_row + cols, mask=vmask, other=0.0).to(tl.float32) + bias


@triton.jit
def _vocab_pass(u_row, logits_row, cand_row, w2_ptr, w2s_ptr, e_row, e_ok, v_row, V, W, R, t, sampled, k0, k1,
                offset_lo, n, k, vs_ar, rs_ar, HEAD: tl.constexpr, W2_FP8: tl.constexpr, HAS_SCALE: tl.constexpr,
                TOPK: tl.constexpr, RETURN_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """One pass over the W proposal columns (every draft id, W = V; or, TOPK, the candidates of the row, W = top_k,
    ids in increasing order): the logits (stored when asked for), the greedy or Gumbel-max argmax, and the softmax
    statistics of logits / T (T = 1 for greedy rows). Returns (drafted id, log_softmax(logits / T)[its column])."""
    none = tl.cast(V, tl.int64) + BLOCK_V  # past every column, in 64 bits (V may be near 2^31)
    best = tl.full([BLOCK_V], NEG_INF, tl.float32)
    if TOPK:
        best_i = tl.full([BLOCK_V], none, tl.int64)
    else:
        best_i = tl.where(vs_ar < W, vs_ar, none)
    best_l = tl.full([BLOCK_V], NEG_INF, tl.float32)   # the scaled logit of each lane's running winner
    run_m = tl.full([BLOCK_V], NEG_INF, tl.float32)
    run_s = tl.zeros([BLOCK_V], tl.float32)
    bad = tl.zeros([BLOCK_V], tl.int32)                # a NaN scaled logit was seen
    for vs in range(0, W, BLOCK_V):
        lanes = vs + vs_ar
        vmask = lanes < W
        if TOPK:
            cols = tl.where(vmask, tl.load(cand_row + lanes, mask=vmask, other=0), none)
        else:
            cols = lanes
        x = _logits_chunk(u_row, w2_ptr, w2s_ptr, e_row, e_ok, v_row, cols, vmask, R, rs_ar, HEAD, W2_FP8,
                          HAS_SCALE, BLOCK_V, BLOCK_R)
        if RETURN_LOGITS:
            tl.store(logits_row + lanes, x, mask=vmask)
        xs = x / t
        if sampled:
            score = gumbel_score(xs, uniform(k0, k1, offset_lo, n, k, STREAM_DRAFT, cols))
        else:
            score = x
        score = tl.where(vmask, _argmax_key(score), NEG_INF)
        better = (score > best) | ((score == best) & (cols < best_i))  # a lane's ids increase: the lower id on ties
        best_l = tl.where(better, xs, best_l)
        best = tl.where(better, score, best)
        best_i = tl.where(better, cols, best_i)
        bad = bad | ((xs != xs) & vmask).to(tl.int32)
        xk = tl.where(vmask, _argmax_key(xs), NEG_INF)
        new_m = tl.maximum(run_m, xk)
        live = new_m > NEG_INF
        safe_m = tl.where(live, new_m, 0.0)
        run_s = tl.where(live, run_s * tl.exp(run_m - safe_m) + tl.exp(xk - safe_m), 0.0)
        run_m = new_m
    token = argmax_finish(best, best_i, none).to(tl.int64)
    win_l = tl.sum(tl.where(best_i == token, best_l, 0.0), axis=0)
    top_m = tl.max(run_m, axis=0)
    ok = (top_m > NEG_INF) & (top_m < float("inf")) & (tl.max(bad, axis=0) == 0)
    safe_top = tl.where(ok, top_m, 0.0)
    total = tl.sum(tl.where(run_m > NEG_INF, run_s * tl.exp(run_m - safe_top), 0.0), axis=0)
    return token, tl.where(ok, (win_l - safe_top) - tl.log(total), float("nan"))


@triton.jit(do_not_specialize=["seed", "offset"])
def _draft_block_kernel(
    base_ptr, anchor_ptr, w1_ptr, w2_ptr, w2s_ptr, d2t_ptr, wg_ptr, bg_ptr, wj_ptr, bj_ptr, hidden_ptr, cw_ptr, cb_ptr,
    sts_ptr, cand_ptr,
    temp_ptr, rng_key_ptr, seed, offset, KEY_IN_MEMORY: tl.constexpr, scratch_ptr, tokens_ptr, logits_ptr, conf_ptr, surv_ptr, logprob_ptr,
    K, V, W, VT, R, D,
    HEAD: tl.constexpr, W2_FP8: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_MAP: tl.constexpr,
    HAS_CONF: tl.constexpr, HAS_STS: tl.constexpr, TOPK: tl.constexpr,
    RETURN_LOGITS: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    k0, k1, offset_lo = load_key(rng_key_ptr, seed, offset, KEY_IN_MEMORY)
    temp = tl.load(temp_ptr + n).to(tl.float32)
    sampled = temp > 0
    t = tl.where(sampled, temp, 1.0)
    prev = tl.load(anchor_ptr + n).to(tl.int64)
    surv = tl.full([], 1.0, tl.float32)
    v_row = scratch_ptr + n * 3 * R          # v, then the rnn state in two ping-pong rows
    rs_ar = tl.arange(0, BLOCK_R).to(tl.int64)
    cs_ar = tl.arange(0, BLOCK_C).to(tl.int64)
    vs_ar = tl.arange(0, BLOCK_V).to(tl.int64)

    for k in range(0, K):
        row = n * K + k                     # int64
        e_ok = (prev >= 0) & (prev < VT)
        e_row = w1_ptr + tl.where(e_ok, prev, 0) * R
        h_row = hidden_ptr + row * D
        # the head's vector v (gated / rnn) into the scratch row, between barriers: the previous position's
        # vocabulary pass has read v before it is overwritten, and v is complete before this one reads it
        if HEAD == HEAD_GATED:
            tl.debug_barrier()
            _gated_v(v_row, wg_ptr, bg_ptr, h_row, e_row, e_ok, D, R, rs_ar, cs_ar, BLOCK_R, BLOCK_C)
            tl.debug_barrier()
        elif HEAD == HEAD_RNN:
            tl.debug_barrier()
            _rnn_v(v_row, v_row + R * (1 + k % 2), v_row + R * (2 - k % 2), wj_ptr, bj_ptr, h_row, e_row, e_ok, D,
                   R, rs_ar, cs_ar, BLOCK_R, BLOCK_C)
            tl.debug_barrier()
        if HAS_CONF:
            z_k, c_k = _confidence(cw_ptr, cb_ptr, sts_ptr, k, h_row, e_row, e_ok, D, R, cs_ar, HAS_STS, BLOCK_C)
            surv = surv * c_k
            tl.store(conf_ptr + row, z_k)
            tl.store(surv_ptr + row, surv)
        prev, logprob = _vocab_pass(base_ptr + row * V, logits_ptr + row * W, cand_ptr + row * W, w2_ptr, w2s_ptr,
                                    e_row, e_ok, v_row, V, W, R, t, sampled, k0, k1, offset_lo, n, k, vs_ar, rs_ar,
                                    HEAD, W2_FP8, HAS_SCALE, TOPK, RETURN_LOGITS, BLOCK_V, BLOCK_R)
        if HAS_MAP:
            prev = tl.load(d2t_ptr + prev).to(tl.int64)  # the drafted id is in [0, V)
        tl.store(tokens_ptr + row, prev)
        tl.store(logprob_ptr + row, logprob)


@triton.jit
def _order_key(u_row, cols, vmask):
    """int64 keys of ``reference.topk_candidates`` (the float order, NaN lowest, -0 = +0, ties to the lower id);
    the smallest int64 past the row's end."""
    x = tl.load(u_row + cols, mask=vmask, other=0.0).to(tl.float32)
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = tl.where(x != x, -2147483648, ordered).to(tl.int64)
    key = ordered * 4294967296 + (4294967295 - cols)
    return tl.where(vmask, key, -9223372036854775807 - 1)


@triton.jit
def _topk_kernel(base_ptr, cand_ptr, V, TOP, BLOCK_V: tl.constexpr):
    """Row ``pid`` of U: the ids of its TOP largest keys, in increasing id order. TOP max passes find the TOP-th
    largest key (keys are distinct), one more stores the ids at or above it in id order (a readable O(TOP V)
    selection; the CUDA kernel radix-selects in 5 passes)."""
    row = tl.program_id(0).to(tl.int64)
    u_row = base_ptr + row * V
    vs_ar = tl.arange(0, BLOCK_V).to(tl.int64)
    floor = tl.full([], 9223372036854775807, tl.int64)   # the keys below it are still in play
    for _i in range(0, TOP):
        best = tl.full([BLOCK_V], -9223372036854775807 - 1, tl.int64)
        for vs in range(0, V, BLOCK_V):
            cols = vs + vs_ar
            key = _order_key(u_row, cols, cols < V)
            best = tl.maximum(best, tl.where(key < floor, key, -9223372036854775807 - 1))
        floor = tl.max(best, axis=0)
    count = tl.full([], 0, tl.int64)
    for vs in range(0, V, BLOCK_V):
        cols = vs + vs_ar
        keep = (_order_key(u_row, cols, cols < V) >= floor) & (cols < V)
        at = count + tl.cumsum(keep.to(tl.int64), axis=0) - 1
        tl.store(cand_ptr + row * TOP + at, cols, mask=keep)
        count += tl.sum(keep.to(tl.int64), axis=0)


@triton.jit
def _head_kernel(tokens_ptr, anchor_ptr, w1_ptr, wg_ptr, bg_ptr, wj_ptr, bj_ptr, hidden_ptr, scratch_ptr, k, K, VT, R,
                 D, HEAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Request n's head vector v of position k (gated / rnn) into scratch row 0 of n (the rnn state in rows 1, 2)."""
    n = tl.program_id(0).to(tl.int64)
    if k == 0:
        prev = tl.load(anchor_ptr + n).to(tl.int64)
    else:
        prev = tl.load(tokens_ptr + n * K + k - 1)
    e_ok = (prev >= 0) & (prev < VT)
    e_row = w1_ptr + tl.where(e_ok, prev, 0) * R
    h_row = hidden_ptr + (n * K + k) * D
    v_row = scratch_ptr + n * 3 * R
    rs_ar = tl.arange(0, BLOCK_R).to(tl.int64)
    cs_ar = tl.arange(0, BLOCK_C).to(tl.int64)
    if HEAD == HEAD_GATED:
        _gated_v(v_row, wg_ptr, bg_ptr, h_row, e_row, e_ok, D, R, rs_ar, cs_ar, BLOCK_R, BLOCK_C)
    else:
        _rnn_v(v_row, v_row + R * (1 + k % 2), v_row + R * (2 - k % 2), wj_ptr, bj_ptr, h_row, e_row, e_ok, D, R, rs_ar,
               cs_ar, BLOCK_R, BLOCK_C)


@triton.jit
def _w2_tile(w2_ptr, rows, vmask, rs, rmask, R, W2_FP8: tl.constexpr):
    """W2's rows ``rows`` at columns ``rs`` as stored (an fp8 W2's bytes decoded to float32; zero outside)."""
    wmask = vmask[:, None] & rmask[None, :]
    if W2_FP8:  # one return: the compiler types a function's returns alike, this branch's float32 and W2's own
        w = _e4m3_to_f32(tl.load(w2_ptr + rows[:, None] * R + rs[None, :], mask=wmask, other=0).to(tl.int32))
    else:
        w = tl.load(w2_ptr + rows[:, None] * R + rs[None, :], mask=wmask, other=0.0)
    return w


@triton.jit
def _bf16_rne(x):
    """float32 x rounded to the nearest bf16 (ties to even), as float32: a bf16 value, so the conversion to bf16
    that follows is exact whatever its rounding (the interpreter's is not to nearest); NaN stays NaN."""
    b = x.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))


@triton.jit
def _mm(a, b, F32: tl.constexpr):
    """a @ b with float32 accumulation: on tensor cores in a's and b's 16-bit type, or (F32: the interpreter, whose dot
    does not take bf16) their values as float32, the same exact products."""
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit(do_not_specialize=["seed", "offset"])
def _sweep_kernel(base_ptr, tokens_ptr, anchor_ptr, w1_ptr, scratch_ptr, w2_ptr, w2s_ptr, temp_ptr, key_ptr, seed,
                  offset, KEY_IN_MEMORY: tl.constexpr, logits_ptr, part_ptr, ids_ptr, k, N, K, V, VT, R,
                  V_W1: tl.constexpr, W2_FP8: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_TEMP: tl.constexpr,
                  RETURN_LOGITS: tl.constexpr, DOT: tl.constexpr, F32: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (vocabulary block b, request group g) of position k: logits = U_k + W2 v over BLOCK_V rows x BLOCK_N
    requests, and per request the block's partial: (key, scaled logit of the winner, max, sum, NaN seen) and the
    winner's id.

    DOT: 0 float32 products (fp32 W2 or fp16 W2), 1 v split into bf16 hi + lo rows times a bf16 (or fp8-as-bf16) W2,
    2 W1's bf16 rows as they are times a bf16 W2."""
    b = tl.program_id(0)
    blocks = tl.num_programs(0)
    ns = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    nmask = ns < N
    cols = (b * BLOCK_V + tl.arange(0, BLOCK_V)).to(tl.int64)
    vmask = cols < V
    if V_W1:
        if k == 0:
            prev = tl.load(anchor_ptr + ns, mask=nmask, other=-1).to(tl.int64)
        else:
            prev = tl.load(tokens_ptr + ns * K + k - 1, mask=nmask, other=-1)
        ok = nmask & (prev >= 0) & (prev < VT)
        vrow = w1_ptr + tl.where(ok, prev, 0) * R
    else:
        ok = nmask
        vrow = scratch_ptr + ns * 3 * R
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        rmask = rs < R
        vt = tl.load(vrow[:, None] + rs[None, :], mask=ok[:, None] & rmask[None, :], other=0.0)
        w = tl.trans(_w2_tile(w2_ptr, cols, vmask, rs, rmask, R, W2_FP8))
        if DOT == 2:
            acc += _mm(vt, w.to(tl.bfloat16), F32)
        elif DOT == 1:
            vf = vt.to(tl.float32)
            hi = _bf16_rne(vf)
            lo = tl.where(hi - hi == 0, _bf16_rne(vf - hi), 0.0)  # (an infinite or NaN hi carries no lo)
            wb = w.to(tl.bfloat16)
            acc += _mm(hi.to(tl.bfloat16), wb, F32) + _mm(lo.to(tl.bfloat16), wb, F32)
        else:
            acc += tl.dot(vt.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    if HAS_SCALE:
        acc = acc * tl.load(w2s_ptr + cols, mask=vmask, other=0.0)[None, :]
    both = nmask[:, None] & vmask[None, :]
    rows = (ns * K + k) * V
    logits = tl.load(base_ptr + rows[:, None] + cols[None, :], mask=both, other=0.0).to(tl.float32) + acc
    if RETURN_LOGITS:
        tl.store(logits_ptr + rows[:, None] + cols[None, :], logits, mask=both)
    safe_t = tl.full([BLOCK_N], 1.0, tl.float32)
    key = _argmax_key(logits)
    if HAS_TEMP:
        t = tl.load(temp_ptr + ns, mask=nmask, other=0.0)
        sampled = t > 0
        safe_t = tl.where(sampled, t, 1.0)
        k0, k1, off_lo = load_key(key_ptr, seed, offset, KEY_IN_MEMORY)
        u = uniform(k0, k1, off_lo, ns[:, None], k, STREAM_DRAFT, cols[None, :])
        key = tl.where(sampled[:, None], gumbel_score(logits / safe_t[:, None], u), key)
    scaled = logits / safe_t[:, None]
    key = tl.where(vmask[None, :], key, NEG_INF)
    best = tl.max(key, axis=1)
    none = tl.cast(V, tl.int64) + BLOCK_V  # past every column, in 64 bits (V may be near 2^31)
    win = tl.min(tl.where((key == best[:, None]) & vmask[None, :], cols[None, :], none), axis=1)
    lwin = tl.sum(tl.where(cols[None, :] == win[:, None], scaled, 0.0), axis=1)
    bad = tl.max(((scaled != scaled) & vmask[None, :]).to(tl.int32), axis=1)
    clean = tl.where(vmask[None, :], _argmax_key(scaled), NEG_INF)
    m = tl.max(clean, axis=1)
    s = tl.sum(tl.exp(clean - tl.where(m > NEG_INF, m, 0.0)[:, None]), axis=1)   # 0 for a block of no mass
    out = part_ptr + (ns * blocks + b) * 5
    tl.store(out + 0, best, mask=nmask)
    tl.store(out + 1, lwin, mask=nmask)
    tl.store(out + 2, m, mask=nmask)
    tl.store(out + 3, s, mask=nmask)
    tl.store(out + 4, bad.to(tl.float32), mask=nmask)
    tl.store(ids_ptr + ns * blocks + b, win.to(tl.int32), mask=nmask)


@triton.jit
def _merge_kernel(part_ptr, ids_ptr, d2t_ptr, tokens_ptr, logprob_ptr, k, K, blocks, none, HAS_MAP: tl.constexpr,
                  BLOCK_B: tl.constexpr):
    """Request n's partials of position k over the blocks: its token (tokens[n, k]) and log-probability."""
    n = tl.program_id(0).to(tl.int64)
    best = tl.full([BLOCK_B], NEG_INF, tl.float32)
    best_i = tl.full([BLOCK_B], none, tl.int32)
    best_l = tl.zeros([BLOCK_B], tl.float32)
    run_m = tl.full([BLOCK_B], NEG_INF, tl.float32)
    run_s = tl.zeros([BLOCK_B], tl.float32)
    bad = tl.zeros([BLOCK_B], tl.float32)
    for b0 in range(0, blocks, BLOCK_B):
        bs = b0 + tl.arange(0, BLOCK_B)
        bm = bs < blocks
        p = part_ptr + (n * blocks + bs) * 5
        key = tl.load(p + 0, mask=bm, other=NEG_INF)
        idx = tl.load(ids_ptr + n * blocks + bs, mask=bm, other=none)
        better = (key > best) | ((key == best) & (idx < best_i))
        best_l = tl.where(better, tl.load(p + 1, mask=bm, other=0.0), best_l)
        best = tl.where(better, key, best)
        best_i = tl.where(better, idx, best_i)
        m = tl.load(p + 2, mask=bm, other=NEG_INF)
        s = tl.load(p + 3, mask=bm, other=0.0)
        bad = tl.maximum(bad, tl.load(p + 4, mask=bm, other=0.0))
        new_m = tl.maximum(run_m, m)
        live = new_m > NEG_INF
        safe = tl.where(live, new_m, 0.0)
        run_s = tl.where(live, run_s * tl.exp(run_m - safe) + s * tl.exp(m - safe), 0.0)
        run_m = new_m
    top = tl.max(best, axis=0)
    win = tl.min(tl.where(best == top, best_i, none), axis=0)
    win_l = tl.sum(tl.where(best_i == win, best_l, 0.0), axis=0)
    top_m = tl.max(run_m, axis=0)
    ok = (top_m > NEG_INF) & (top_m < float("inf")) & (tl.max(bad, axis=0) == 0)
    safe_top = tl.where(ok, top_m, 0.0)
    total = tl.sum(tl.where(run_m > NEG_INF, run_s * tl.exp(run_m - safe_top), 0.0), axis=0)
    token = win.to(tl.int64)
    if HAS_MAP:
        token = tl.load(d2t_ptr + token).to(tl.int64)
    tl.store(tokens_ptr + n * K + k, token)
    tl.store(logprob_ptr + n * K + k, tl.where(ok, (win_l - safe_top) - tl.log(total), float("nan")))


@triton.jit
def _conf_kernel(tokens_ptr, anchor_ptr, w1_ptr, hidden_ptr, cw_ptr, cb_ptr, sts_ptr, conf_ptr, surv_ptr, K, VT, R,
                 D, HAS_STS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Request n's confidence logits and survival over its K positions (e = W1 of each position's previous token)."""
    n = tl.program_id(0).to(tl.int64)
    cs_ar = tl.arange(0, BLOCK_C).to(tl.int64)
    surv = tl.full([], 1.0, tl.float32)
    prev = tl.load(anchor_ptr + n).to(tl.int64)
    for k in range(0, K):
        e_ok = (prev >= 0) & (prev < VT)
        e_row = w1_ptr + tl.where(e_ok, prev, 0) * R
        z_k, c_k = _confidence(cw_ptr, cb_ptr, sts_ptr, k, hidden_ptr + (n * K + k) * D, e_row, e_ok, D, R, cs_ar,
                               HAS_STS, BLOCK_C)
        surv = surv * c_k
        tl.store(conf_ptr + n * K + k, z_k)
        tl.store(surv_ptr + n * K + k, surv)
        prev = tl.load(tokens_ptr + n * K + k)


def _sweep_blocks(n: int, vocab: int, rank: int, on_gpu: bool, fp32_dot: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_V, BLOCK_R) of the sweep: every dimension at least 16 (tl.dot); on a GPU a register-sized
    BLOCK_N x BLOCK_V accumulator (4096 elements, 2048 for an fp32 W2's float32 dot, whose operands take registers
    too: sized so that 8 warps compile with no spills on sm_80 and sm_90) and 64-wide r blocks; in the interpreter
    (CPU tensors) blocks of many rows, since a program costs per operation, not per element."""
    block_r = min(64, max(16, triton.next_power_of_2(max(rank, 1))))
    block_n = min(64, max(16, triton.next_power_of_2(max(n, 1))))
    budget = (2048 if fp32_dot else 4096) if on_gpu else 1 << 16
    block_v = min(max(16, triton.next_power_of_2(vocab)), max(16, budget // block_n), 128 if on_gpu else 1 << 16)
    return block_n, block_v, block_r


def _dot_mode(head_kind, w1, w2) -> int:
    """The sweep's DOT (see _sweep_kernel)."""
    if w2.dtype == torch.float8_e4m3fn or w2.dtype == torch.bfloat16:
        return 2 if head_kind == "vanilla" and w1.dtype == torch.bfloat16 else 1
    return 0


def _full_proposal(base, anchor_tokens, head_kind, w1, w2, w2_scale, draft_to_target, wg, bg, wj, bj, hidden,
                   temperature, rng_key, return_logits, tokens, logits, logprobs):
    """Positions 0..K-1 of the full proposal, a head launch (gated / rnn), a sweep and a merge each."""
    n, k_len, v = base.shape
    rank = w1.shape[1]
    d = hidden.shape[2] if hidden is not None else 0
    dev = base.device
    on_gpu = dev.type == "cuda"
    dot = _dot_mode(head_kind, w1, w2)
    block_n, block_v, block_r = _sweep_blocks(n, v, rank, on_gpu, dot == 0)
    blocks = triton.cdiv(v, block_v)
    part = torch.empty(n, blocks, 5, dtype=torch.float32, device=dev)
    ids = torch.empty(n, blocks, dtype=torch.int32, device=dev)
    scratch = torch.zeros(n, 3, max(rank, 1), dtype=torch.float32, device=dev) if head_kind != "vanilla" else base
    fp8 = w2.dtype == torch.float8_e4m3fn
    temps = temperature if temperature is not None else base
    dummy = base  # never read where its flag / head kind is off
    key = key_args(rng_key, dev)
    tile = _TILE if on_gpu else _TILE_INTERPRET
    _, head_r, head_c = _blocks(1, rank, d + 2 * rank, {"vanilla": 1, "gated": 2, "rnn": 3}[head_kind], tile)
    for k in range(k_len):
        if head_kind != "vanilla":
            _head_kernel[(n,)](tokens, anchor_tokens, w1, wg if wg is not None else dummy,
                               bg if bg is not None else dummy, wj if wj is not None else dummy,
                               bj if bj is not None else dummy, hidden, scratch, k, k_len, w1.shape[0], rank, d,
                               HEAD=_HEAD_IDS[head_kind], BLOCK_R=head_r, BLOCK_C=head_c, num_warps=_NUM_WARPS)
        _sweep_kernel[(blocks, triton.cdiv(n, block_n))](
            base, tokens, anchor_tokens, w1, scratch, w2.view(torch.uint8) if fp8 else w2,
            w2_scale if w2_scale is not None else dummy, temps, *key, logits, part, ids, k, n, k_len, v, w1.shape[0],
            rank,
            V_W1=head_kind == "vanilla", W2_FP8=fp8, HAS_SCALE=w2_scale is not None,
            HAS_TEMP=temperature is not None, RETURN_LOGITS=bool(return_logits),
            DOT=dot, F32=not on_gpu, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_R=block_r,
            num_warps=_NUM_WARPS)
        _merge_kernel[(n,)](part, ids, draft_to_target if draft_to_target is not None else dummy, tokens, logprobs, k,
                            k_len, blocks, min(v + block_v, 2 ** 31 - 1), HAS_MAP=draft_to_target is not None,
                            BLOCK_B=min(1024, max(16, triton.next_power_of_2(blocks))))


def _blocks(vocab: int, rank: int, width: int, tiles: int, tile: int = _TILE) -> tuple[int, int, int]:
    """(BLOCK_V, BLOCK_R, BLOCK_C): r blocks of at most 64; a BLOCK_V x BLOCK_R tile of about ``_TILE`` elements
    (half that when r is not a multiple of 16: unvectorised loads need more registers), and ``tiles`` BLOCK_R x
    BLOCK_C tiles of about ``_TILE`` elements in all (sized so that 8 warps compile with no spills at r = 256)."""
    block_r = min(_MAX_BLOCK_R, triton.next_power_of_2(max(rank, 1)))
    block_v = min(triton.next_power_of_2(vocab), max(16, tile // block_r // (1 if rank % 16 == 0 else 2)))
    block_c = min(triton.next_power_of_2(max(width, 1)), max(16, _floor_pow2(tile // (block_r * tiles))))
    return block_v, block_r, block_c


def _floor_pow2(x: int) -> int:
    return 1 << (max(x, 1).bit_length() - 1)


def draft_block(base_logits, anchor_tokens, head_kind, w1, w2, w2_scale, draft_to_target, wg, bg, wj, bj, hidden,
                conf_weight, conf_bias, sts_temperatures, temperature, rng_key, return_logits, top_k):
    """Same flat arguments and results as ``dspark_kernels.reference.draft_block`` (checked by the wrapper; tensors
    contiguous, as the registry passes them)."""
    n, k, v = base_logits.shape
    rank = w1.shape[1]
    d = hidden.shape[2] if hidden is not None else 0
    dev = base_logits.device
    f32 = dict(dtype=torch.float32, device=dev)
    tokens = torch.empty(n, k, dtype=torch.int64, device=dev)
    width = top_k if top_k > 0 else v
    logits = torch.empty(n, k, width, **f32) if return_logits else torch.empty(0, **f32)
    has_conf = conf_weight is not None
    conf = torch.empty(n, k, **f32) if has_conf else torch.empty(0, **f32)
    survival = torch.empty(n, k, **f32) if has_conf else torch.empty(0, **f32)
    logprobs = torch.empty(n, k, **f32)
    cands = torch.empty(n, k, top_k, dtype=torch.int64, device=dev) if top_k > 0 else torch.empty(0, **f32)
    if n == 0:
        return tokens, logits, conf, survival, logprobs, _candidates(cands, draft_to_target, return_logits)
    base = base_logits
    tile = _TILE if dev.type == "cuda" else _TILE_INTERPRET
    if top_k == 0:
        _full_proposal(base, anchor_tokens, head_kind, w1, w2, w2_scale, draft_to_target, wg, bg, wj, bj, hidden,
                       temperature, rng_key, return_logits, tokens, logits, logprobs)
        if has_conf:
            block_c = min(triton.next_power_of_2(max(d + rank, 1)), max(16, tile // 64))
            _conf_kernel[(n,)](tokens, anchor_tokens, w1, hidden, conf_weight, conf_bias.reshape(1),
                               sts_temperatures if sts_temperatures is not None else base, conf, survival, k,
                               w1.shape[0], rank, d, HAS_STS=sts_temperatures is not None, BLOCK_C=block_c,
                               num_warps=_NUM_WARPS)
        return tokens, logits, conf, survival, logprobs, _candidates(cands, draft_to_target, return_logits)
    _topk_kernel[(n * k,)](base, cands, v, top_k, BLOCK_V=min(triton.next_power_of_2(v), tile // 8))
    scratch = torch.zeros(n, 3, max(rank, 1), **f32) if head_kind != "vanilla" else base
    dummy = base  # never read where its flag / head kind is off
    fp8 = w2.dtype == torch.float8_e4m3fn
    cols = max(d + rank, 2 * rank + d if head_kind == "rnn" else 0)
    block_v, block_r, block_c = _blocks(width, rank, cols, {"vanilla": 1, "gated": 2, "rnn": 3}[head_kind], tile)
    _draft_block_kernel[(n,)](
        base, anchor_tokens, w1, w2.view(torch.uint8) if fp8 else w2, w2_scale if w2_scale is not None else dummy,
        draft_to_target if draft_to_target is not None else dummy,
        wg if wg is not None else dummy, bg if bg is not None else dummy,
        wj if wj is not None else dummy, bj if bj is not None else dummy,
        hidden if hidden is not None else dummy,
        conf_weight if has_conf else dummy,
        conf_bias.reshape(1) if has_conf else dummy,
        sts_temperatures if sts_temperatures is not None else dummy, cands,
        temperature if temperature is not None else torch.zeros(n, device=dev), *key_args(rng_key, base.device), scratch,
        tokens, logits, conf, survival, logprobs,
        k, v, width, w1.shape[0], rank, d,
        HEAD=_HEAD_IDS[head_kind], W2_FP8=fp8, HAS_SCALE=w2_scale is not None, HAS_MAP=draft_to_target is not None,
        HAS_CONF=has_conf,
        HAS_STS=sts_temperatures is not None, TOPK=True, RETURN_LOGITS=bool(return_logits), BLOCK_V=block_v,
        BLOCK_R=block_r, BLOCK_C=block_c,
        num_warps=_NUM_WARPS,
    )
    return tokens, logits, conf, survival, logprobs, _candidates(cands, draft_to_target, return_logits)


def _candidates(cands, draft_to_target, return_logits):
    """The candidates output: the target ids of the sparse logits' columns (top-k with logits), else empty."""
    if cands.dim() != 3 or not return_logits:
        return torch.empty(0, dtype=torch.int64, device=cands.device)
    return draft_to_target.to(torch.int64)[cands] if draft_to_target is not None else cands
