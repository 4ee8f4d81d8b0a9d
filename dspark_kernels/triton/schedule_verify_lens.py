"""Triton schedule_verify_lens: one program holds the whole flattened ``[N, K]`` survival and sorts it.

Same meaning as ``dspark_kernels.reference.schedule_verify_lens`` (read that first). The program

1. loads the survival as one power-of-two block over the flattened ``[N, K]`` order, cleans it (NaN -> 0, clamped
   to [0, 1]) and takes the running minimum along K (log2(K) doubling steps with ``tl.gather``);
2. sorts the candidates (r, j), ``min_len < j <= max_len``, with one bitonic sort (``_sort``) of int64 keys
   ``(0x7fffffff - float32 bits of a) << 32 | flat index``: ascending keys = descending survival, ties by flat index
   (r, then j), i.e. the reference's stable descending sort (the cleaned survival is exactly a float32, and
   non-negative float32 bit patterns order like their values);
3. sums survivals in fixed point (int64, ``a * 2**SHIFT`` with ``SHIFT = 62 - log2(BLOCK)``, so no sum overflows):
   integer prefix sums are exact whatever the scan order, so Theta after m admissions is one function of (m, the
   exact sum) - admitting a zero survival leaves tau bit-identical (the exact mode's strict test never admits it),
   and ties in the survival give ties in Theta. ``tau = n + sum * 2**-SHIFT`` and ``Theta = tau * SPS(B)`` are then
   float64, with the cost table interpolated in-kernel by the reference's rules;
4. picks ``m*`` (exact: the first admission that does not strictly raise Theta; argmax: the first maximum, on the
   budget survival's own sorted curve when given, then the ``min_gain`` fall-back), and writes each request's
   ``min_len + #(its candidates with key <= key of the m*-th admission)`` and the prefix sums, one chunk of
   requests at a time. Inactive requests (``active``) hold no candidate, count in neither B nor tau, and get
   ``L = 0`` and no rows.

The reference sums in float64 in its own order, so the two Thetas can differ in the last bits; integer outputs
differ only where the reference's own comparison hinges on that rounding. Survival below ``2**-SHIFT``
(``2**-48`` at the largest block) counts as 0 in the sums.

The ``conf_logits`` path computes the survival with ``dk.survival_from_conf`` (the reference's function) before
the kernel, so both backends see bit-identical survival on every device.
"""

import struct

import torch
import triton
import triton.language as tl

from ..calibration import survival_from_conf

MAX_ELEMENTS = 16384  # N * K (and N' * K' of the budget survival) that one program sorts

INT64_MAX = tl.constexpr(0x7FFFFFFFFFFFFFFF)
NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _running_min(x, pos, idx, AXIS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Running minimum along rows of length <= BLOCK_K (Hillis-Steele, log2(BLOCK_K) steps of ``tl.gather``).

    ``pos``: position within the row; ``idx``: index along AXIS (element ``idx - d`` is ``d`` earlier in the row).
    """
    for s in tl.static_range(15):
        if (1 << s) < BLOCK_K:
            prev = tl.gather(x, tl.maximum(idx - (1 << s), 0), AXIS)
            x = tl.where(pos >= (1 << s), tl.minimum(x, prev), x)
    return x


@triton.jit
def _indicator(n_dims: tl.constexpr, j: tl.constexpr):
    ar = tl.arange(0, 2)
    return tl.reshape(ar, [1] * (n_dims - j - 1) + [2] + [1] * j)


@triton.jit
def _compare_and_swap(x, flip, i: tl.constexpr, n_dims: tl.constexpr):
    """Bitonic compare-and-swap along the i-th innermost axis of a [2] * n_dims hypercube of int64 keys."""
    is_right = _indicator(n_dims, i)
    left = tl.sum(tl.where(is_right == 0, x, 0), n_dims - 1 - i, keep_dims=True)
    right = tl.sum(tl.where(is_right == 1, x, 0), n_dims - 1 - i, keep_dims=True)
    y = tl.where(is_right == 1, left, right)
    return tl.where((x > y) != (flip ^ is_right), y, x)


@triton.jit
def _sort(x, LOG_N: tl.constexpr):
    """Ascending bitonic sort of a 1-D int64 block of 2**LOG_N keys.

    ``tl.sort``'s hypercube network, with the partner found by two plain sums over the size-2 axis instead of a
    custom-combine reduction (which the interpreter runs element by element: minutes at 16384 keys).
    """
    if LOG_N > 0:
        h = tl.reshape(x, [2] * LOG_N)
        for stage in tl.static_range(1, LOG_N + 1):
            if stage < LOG_N:
                flip = _indicator(LOG_N, stage)
            else:
                flip = 0
            for i in tl.static_range(stage):
                h = _compare_and_swap(h, flip, stage - 1 - i, LOG_N)
        x = tl.reshape(h, x.shape)
    return x


@triton.jit
def _clean(x):
    """float32: NaN -> 0, clamped to [0, 1], -0.0 -> +0.0 (so the bit pattern orders like the value)."""
    x = x.to(tl.float32)
    x = tl.where(x != x, 0.0, x)
    x = tl.minimum(tl.maximum(x, 0.0), 1.0)
    return tl.where(x > 0.0, x, 0.0)


@triton.jit
def _key(a, f, cand):
    """Sort key of candidate survival a at flat index f: ascending key = descending a, then ascending f."""
    hi = (0x7FFFFFFF - a.to(tl.int32, bitcast=True)).to(tl.int64)
    return tl.where(cand, (hi << 32) | f.to(tl.int64), INT64_MAX)


@triton.jit
def _to_fixed(a, SHIFT: tl.constexpr):
    return (a.to(tl.float64) * (tl.full([], 1, tl.int64) << SHIFT).to(tl.float64)).to(tl.int64)


@triton.jit
def _sps(x, counts_ptr, times_ptr, P, overhead):
    """Steps per second at float64 token counts x (any shape): 1000 / (interpolated step time + overhead)."""
    c_first = tl.load(counts_ptr).to(tl.float64)
    c_last = tl.load(counts_ptr + P - 1).to(tl.float64)
    t_first = tl.load(times_ptr).to(tl.float64)
    t_last = tl.load(times_ptr + P - 1).to(tl.float64)
    above_count = tl.zeros(x.shape, tl.int32)  # searchsorted(counts, x, right=True)
    for i in range(0, P):
        above_count += (tl.load(counts_ptr + i).to(tl.float64) <= x).to(tl.int32)
    two = P > 1
    seg = tl.minimum(tl.maximum(above_count - 1, 0), tl.maximum(P - 2, 0))
    c0 = tl.load(counts_ptr + seg).to(tl.float64)
    t0 = tl.load(times_ptr + seg).to(tl.float64)
    c1 = tl.load(counts_ptr + seg + 1, mask=two & (seg >= 0), other=0.0).to(tl.float64)
    t1 = tl.load(times_ptr + seg + 1, mask=two & (seg >= 0), other=0.0).to(tl.float64)
    slope = tl.where(two, (t1 - t0) / tl.where(two, c1 - c0, 1.0), 0.0)
    xc = tl.maximum(x, c_first)
    inside = t0 + (xc - c0) * slope
    above = t_last + (xc - c_last) * tl.maximum(slope, 0.0)
    time = tl.where(two, tl.where(xc > c_last, above, inside), t_first)
    return 1000.0 / (time + overhead)


@triton.jit
def _theta(total_fixed, b, n, counts_ptr, times_ptr, P, overhead, SHIFT: tl.constexpr):
    """Theta = tau * SPS(B), tau = n + total_fixed * 2**-SHIFT (float64)."""
    inv = 1.0 / (tl.full([], 1, tl.int64) << SHIFT).to(tl.float64)
    tau = (tl.zeros([], tl.int64) + n).to(tl.float64) + total_fixed.to(tl.float64) * inv
    return tau * _sps(b.to(tl.float64), counts_ptr, times_ptr, P, overhead)


@triton.jit
def _active(active_ptr, row, mask, HAS_ACTIVE: tl.constexpr):
    """Whether each request ``row`` (where ``mask``) is active: ``active[row]``, or True without the mask."""
    if HAS_ACTIVE:
        return mask & (tl.load(active_ptr + row, mask=mask, other=0) != 0)
    else:
        return mask


@triton.jit
def _curve(ptr, active_ptr, n, k, lo, hi, counts_ptr, times_ptr, P, overhead, BLOCK: tl.constexpr,
           SHIFT: tl.constexpr, BLOCK_ROW: tl.constexpr, HAS_ACTIVE: tl.constexpr):
    """Admission curve of a survival ``[n, k]`` with candidates ``lo <= j < hi`` (0-based j) of its active rows.

    Returns (sorted keys [BLOCK], theta [BLOCK] after admitting p+1 candidates (p < M), theta after none,
    theta after admitting p (p < M; the exact mode's "before"), M).
    """
    f = tl.arange(0, BLOCK)
    kk = tl.maximum(k, 1)
    j = f % kk
    valid = f < n * k
    on = _active(active_ptr, f // kk, valid, HAS_ACTIVE)
    x = _clean(tl.load(ptr + f, mask=valid, other=0.0))
    a = _running_min(x, j, f, 0, BLOCK_ROW)
    fixed = tl.where(on, _to_fixed(a, SHIFT), 0)
    s0 = tl.sum(tl.where(j < lo, fixed, 0), axis=0)
    skey = _sort(_key(a, f, on & (j >= lo) & (j < hi)), 62 - SHIFT)
    p = tl.arange(0, BLOCK)
    if HAS_ACTIVE:  # BLOCK >= n (the wrapper's block covers the rows too)
        n_on = tl.sum(_active(active_ptr, p, p < n, HAS_ACTIVE).to(tl.int32), axis=0)
    else:
        n_on = n
    m = n_on * (hi - lo)
    sval = (0x7FFFFFFF - (skey >> 32).to(tl.int32)).to(tl.float32, bitcast=True)
    sfixed = tl.where(p < m, _to_fixed(sval, SHIFT), 0)
    incl = tl.cumsum(sfixed, axis=0)
    b0 = n_on * (1 + lo)
    theta = _theta(s0 + incl, b0 + 1 + p, n_on, counts_ptr, times_ptr, P, overhead, SHIFT)
    before = _theta(s0 + incl - sfixed, b0 + p, n_on, counts_ptr, times_ptr, P, overhead, SHIFT)
    theta0 = _theta(s0, b0, n_on, counts_ptr, times_ptr, P, overhead, SHIFT)
    return skey, theta, theta0, before, m


@triton.jit
def _theta_at(theta, theta0, p, m):
    """Theta after m admissions (m = 0: theta0, else theta[m - 1])."""
    return tl.where(m == 0, theta0, tl.max(tl.where(p == m - 1, theta, NEG_INF), axis=0))


@triton.jit
def _first_argmax(theta, theta0, p, m):
    """First maximum of [theta0, theta[0], ..., theta[m-1]]."""
    top = tl.max(tl.where(p < m, theta, NEG_INF), axis=0)
    first = tl.min(tl.where((p < m) & (theta == top), p, m), axis=0)
    return tl.where(theta0 >= top, 0, first + 1)


@triton.jit(do_not_specialize=["overhead_bits", "gain_bits"])
def _schedule_verify_lens_kernel(
    surv_ptr, budget_ptr, active_ptr, counts_ptr, times_ptr, lens_ptr, cu_ptr, theta_ptr,
    N, K, NB, KB, P, min_len, max_len, overhead_bits, gain_bits,
    EXACT: tl.constexpr, HAS_BUDGET: tl.constexpr, BLOCK: tl.constexpr, SHIFT: tl.constexpr,
    BLOCK_B: tl.constexpr, SHIFT_B: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_KB: tl.constexpr, HAS_ACTIVE: tl.constexpr,
):
    # float64 scalars travel as their bit patterns (a Python float argument would be float32)
    overhead = (tl.zeros([], tl.int64) + overhead_bits).to(tl.float64, bitcast=True)
    gain = (tl.zeros([], tl.int64) + gain_bits).to(tl.float64, bitcast=True)

    skey, theta, theta0, before, m = _curve(surv_ptr, active_ptr, N, K, min_len, max_len, counts_ptr, times_ptr, P,
                                            overhead, BLOCK, SHIFT, BLOCK_K, HAS_ACTIVE)
    p = tl.arange(0, BLOCK)
    if EXACT:
        # admissions while each strictly raises Theta
        m_star = tl.min(tl.where((p < m) & ~(theta > before), p, m), axis=0)
    else:
        if HAS_BUDGET:
            hi_b = tl.minimum(max_len, KB)
            lo_b = tl.minimum(min_len, hi_b)
            _bk, theta_b, theta_b0, _bb, m_b = _curve(budget_ptr, active_ptr, NB, KB, lo_b, hi_b, counts_ptr,
                                                      times_ptr, P, overhead, BLOCK_B, SHIFT_B, BLOCK_KB, False)
            m_star = tl.minimum(_first_argmax(theta_b, theta_b0, tl.arange(0, BLOCK_B), m_b), m)
        else:
            m_star = _first_argmax(theta, theta0, p, m)
        # fall back to verifying everything unless the schedule beats it by min_gain
        theta_all = _theta_at(theta, theta0, p, m)
        m_star = tl.where(_theta_at(theta, theta0, p, m_star) < gain * theta_all, m, m_star)
    tl.store(theta_ptr, _theta_at(theta, theta0, p, m_star).to(tl.float32))
    thr = tl.max(tl.where(p == m_star - 1, skey, -1), axis=0)  # the first m_star admissions: key <= thr

    # per active request: min_len + admitted candidates, and the prefix sums of its rows, 1 + L
    cols = tl.arange(0, BLOCK_K)[None, :]
    carry = tl.zeros([], tl.int32)
    tl.store(cu_ptr, 0)
    for r0 in range(0, N, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        rv = r < N
        on = _active(active_ptr, r, rv, HAS_ACTIVE)
        in_row = on[:, None] & (cols < K)
        f = r[:, None] * K + cols
        x = _clean(tl.load(surv_ptr + f, mask=in_row, other=0.0))
        idx = tl.broadcast_to(cols, [BLOCK_R, BLOCK_K])
        a = _running_min(x, idx, idx, 1, BLOCK_K)
        key = _key(a, f, in_row & (cols >= min_len) & (cols < max_len))
        lens = tl.where(on, min_len + tl.sum((key <= thr).to(tl.int32), axis=1), 0)
        tl.store(lens_ptr + r, lens, mask=rv)
        rows = tl.where(on, 1 + lens, 0)
        tl.store(cu_ptr + 1 + r, carry + tl.cumsum(rows, axis=0), mask=rv)
        carry += tl.sum(rows, axis=0)


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _block_and_shift(elements: int):
    block = triton.next_power_of_2(max(elements, 1))
    return block, 62 - (block.bit_length() - 1)


def _check_size(name: str, x: torch.Tensor) -> None:
    if x.numel() > MAX_ELEMENTS:
        raise ValueError(f"the triton backend of schedule_verify_lens sorts {name} in one program and supports "
                         f"N*K <= {MAX_ELEMENTS}; got {name} of shape {tuple(x.shape)} ({x.numel()} elements); "
                         f"use backend='reference' (or 'cuda') for larger batches")


def schedule_verify_lens(survival, conf_logits, sts_temperatures, token_counts, step_time_ms, fixed_overhead_ms,
                         min_len, max_len, mode, budget_survival, min_gain, active):
    """Same flat arguments and results as ``dspark_kernels.reference.schedule_verify_lens`` (checked by the wrapper).

    Raises ValueError when ``N * K`` (or ``N' * K'`` of ``budget_survival``) exceeds ``MAX_ELEMENTS``.
    """
    if survival is None:
        survival = survival_from_conf(conf_logits, sts_temperatures)
    n, k = survival.shape
    dev = survival.device
    use_budget = mode != "exact" and budget_survival is not None
    _check_size("survival" if conf_logits is None else "conf_logits", survival)
    if use_budget:
        _check_size("budget_survival", budget_survival)
    verify_lens = torch.empty(n, dtype=torch.int32, device=dev)
    cu_seqlens = torch.empty(n + 1, dtype=torch.int32, device=dev)
    theta = torch.empty((), dtype=torch.float32, device=dev)
    if n == 0:
        cu_seqlens.zero_()
        theta.zero_()
        return verify_lens, cu_seqlens, theta
    budget = budget_survival if use_budget else survival
    nb, kb = budget.shape
    block, shift = _block_and_shift(n * k if active is None else max(n * k, n))
    block_b, shift_b = _block_and_shift(nb * kb) if use_budget else (1, 62)
    block_k = triton.next_power_of_2(max(k, 1))
    block_r = max(1, min(triton.next_power_of_2(n), 4096 // block_k))
    big = max(block, block_b)
    _schedule_verify_lens_kernel[(1,)](
        survival, budget, survival if active is None else active, token_counts, step_time_ms, verify_lens, cu_seqlens, theta,
        n, k, nb, kb, token_counts.shape[0], min_len, max_len, _f64_bits(fixed_overhead_ms),
        _f64_bits(1.0 + float(min_gain)),
        EXACT=mode == "exact", HAS_BUDGET=use_budget, BLOCK=block, SHIFT=shift, BLOCK_B=block_b, SHIFT_B=shift_b,
        BLOCK_R=block_r, BLOCK_K=block_k, BLOCK_KB=triton.next_power_of_2(max(kb, 1)), HAS_ACTIVE=active is not None,
        num_warps=4 if big <= 1024 else (8 if big <= 4096 else 16),
        enable_fp_fusion=False,  # float64 Theta: separately rounded multiplies and adds, as in the reference
    )
    return verify_lens, cu_seqlens, theta
