"""Triton accept_prefix_scan: one program walks the batch in BLOCK_N-request chunks with a running carry.

Same meaning as ``dspark_kernels.reference.accept_prefix_scan`` (read that first). Each chunk loads a
``[BLOCK_N, BLOCK_K]`` tile of ``tokens`` (BLOCK_K >= K+1), finds the accepted count ``n_r`` (clamped
``num_accepted``, or the leading run of ``accept_mask``), the emitted count ``e_r`` (bonus present, length limit),
the exclusive prefix sum of ``e`` (``tl.cumsum`` within the chunk plus the carry of the chunks before), and writes the
packed outputs at ``cu_out[r] + i`` directly. After the last chunk, the slots from ``cu_out[N]`` on are set to -1.
Every load is masked (``num_accepted`` clamped to [0, K], block-table columns checked against ``max_blocks``, verify
rows compared, not dereferenced), and all indexing is 64-bit.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_prefix_scan_kernel(
    tokens_ptr, seq_ptr, nacc_ptr, mask_ptr, vcu_ptr, table_ptr, maxlen_ptr, stops_ptr,
    cu_ptr, out_ptr, newseq_ptr, anchor_ptr, rows_ptr, slots_ptr, fin_ptr,
    N, K, max_blocks, block_size, n_stops,
    HAS_NUM_ACCEPTED: tl.constexpr, HAS_VERIFY_CU: tl.constexpr, HAS_TABLE: tl.constexpr,
    HAS_MAX_LEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
):
    kp1 = K + 1
    cols = tl.arange(0, BLOCK_K).to(tl.int64)[None, :]     # emitted-token index i, [1, BLOCK_K]
    carry = tl.zeros([], tl.int64)                         # emitted tokens of the chunks before
    tl.store(cu_ptr, 0)
    for n0 in range(0, N, BLOCK_N):
        r = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
        rv = r < N
        tok = tl.load(tokens_ptr + r[:, None] * kp1 + cols, mask=rv[:, None] & (cols < kp1), other=-1).to(tl.int64)
        seq = tl.load(seq_ptr + r, mask=rv, other=0).to(tl.int64)

        # accepted drafts n_r in [0, K]
        if HAS_NUM_ACCEPTED:
            n_acc = tl.load(nacc_ptr + r, mask=rv, other=0).to(tl.int64)
            n_acc = tl.minimum(tl.maximum(n_acc, 0), K)
        else:
            in_k = rv[:, None] & (cols < K)
            acc = tl.load(mask_ptr + r[:, None] * K + cols, mask=in_k, other=0)
            n_acc = tl.min(tl.where(in_k & (acc == 0), cols, K), axis=1)   # first False, else K

        # emitted tokens e_r = n_r + (bonus present), truncated at the length limit
        bonus = tl.sum(tl.where(cols == n_acc[:, None], tok, 0), axis=1)
        e = n_acc + (bonus >= 0).to(tl.int64)
        if HAS_MAX_LEN:
            max_len = tl.load(maxlen_ptr + r, mask=rv, other=0).to(tl.int64)
            gap = max_len - seq  # wraps where the true difference passes int64's range (then huge)
            room = tl.where(max_len <= seq, 0, tl.where(gap < 0, 9223372036854775807, gap))
            e = tl.minimum(e, room)
        e = tl.where(rv, e, 0)
        keep = cols < e[:, None]                           # [BLOCK_N, BLOCK_K]; False on rows past N

        # exclusive prefix sum of e across the whole batch
        incl = tl.cumsum(e, axis=0)
        start = carry + incl - e
        tl.store(cu_ptr + 1 + r, (carry + incl).to(tl.int32), mask=rv)
        carry += tl.sum(e, axis=0)
        slot = start[:, None] + cols

        tl.store(out_ptr + slot, tok, mask=keep)
        new_seq = seq + e
        tl.store(newseq_ptr + r, new_seq.to(tl.int32), mask=rv)
        last = tl.sum(tl.where(cols == (e - 1)[:, None], tok, 0), axis=1)
        tl.store(anchor_ptr + r, tl.where(e > 0, last, -1), mask=rv)

        # drafter rows [anchor, d_1, ...] of request r start at verify_cu_seqlens[r]
        if HAS_VERIFY_CU:
            row_start = tl.load(vcu_ptr + r, mask=rv, other=0).to(tl.int64)
            row_end = tl.load(vcu_ptr + r + 1, mask=rv, other=0).to(tl.int64)
        else:
            row_start = r * kp1
            row_end = row_start + kp1
        rows = row_start[:, None] + cols
        rows = tl.where((rows >= row_start[:, None]) & (rows < row_end[:, None]), rows, -1)   # an offset that wraps: -1
        tl.store(rows_ptr + slot, rows.to(tl.int32), mask=keep)

        # KV slots of the kept positions S-1, ..., S-2+e_r
        if HAS_TABLE:
            pos = seq[:, None] - 1 + cols
            pos_ok = pos >= 0
            pos0 = tl.where(pos_ok, pos, 0)
            blk = pos0 // block_size
            in_table = pos_ok & (blk < max_blocks)
            block_id = tl.load(table_ptr + r[:, None] * max_blocks + tl.where(in_table, blk, 0),
                               mask=keep & in_table, other=-1).to(tl.int64)
            slots = tl.where(in_table & (block_id >= 0), block_id * block_size + pos0 % block_size, -1)
            tl.store(slots_ptr + slot, slots, mask=keep)

        # finished: a kept token is a stop token, or the length limit is reached
        is_stop = tl.zeros([BLOCK_N, BLOCK_K], tl.int1)
        for si in range(0, n_stops):
            is_stop = is_stop | (tok == tl.load(stops_ptr + si).to(tl.int64))
        finished = tl.max((is_stop & keep).to(tl.int32), axis=1) > 0
        if HAS_MAX_LEN:
            finished = finished | (e >= room)  # S + e >= max_len, exactly
        tl.store(fin_ptr + r, finished.to(tl.uint8), mask=rv)

    # packed slots from cu_out[N] on: -1
    total_slots = (tl.zeros([], tl.int64) + N) * kp1
    for t0 in range(carry, total_slots, BLOCK_T):
        s = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        sm = s < total_slots
        tl.store(out_ptr + s, tl.full([BLOCK_T], -1, tl.int64), mask=sm)
        tl.store(rows_ptr + s, tl.full([BLOCK_T], -1, tl.int32), mask=sm)
        if HAS_TABLE:
            tl.store(slots_ptr + s, tl.full([BLOCK_T], -1, tl.int64), mask=sm)


def accept_prefix_scan(tokens, seq_lens, num_accepted, accept_mask, verify_cu_seqlens, block_table, block_size,
                       max_seq_lens, stop_token_ids):
    """Same flat arguments and results as ``dspark_kernels.reference.accept_prefix_scan`` (checked by the wrapper;
    tensors contiguous, as the registry passes them)."""
    n, kp1 = tokens.shape
    k = kp1 - 1
    dev = tokens.device
    cu_out = torch.empty(n + 1, dtype=torch.int32, device=dev)
    out_tokens = torch.empty(n * kp1, dtype=torch.int64, device=dev)
    new_seq_lens = torch.empty(n, dtype=torch.int32, device=dev)
    next_anchor = torch.empty(n, dtype=torch.int64, device=dev)
    hidden_rows = torch.empty(n * kp1, dtype=torch.int32, device=dev)
    kv_slots = torch.empty(n * kp1 if block_table is not None else 0, dtype=torch.int64, device=dev)
    finished = torch.empty(n, dtype=torch.bool, device=dev)
    if n == 0:
        cu_out.zero_()
        return cu_out, out_tokens, new_seq_lens, next_anchor, hidden_rows, kv_slots, finished
    dummy = tokens  # never read when its HAS_* flag is off
    max_blocks = block_table.shape[1] if block_table is not None else 0
    n_stops = stop_token_ids.numel() if stop_token_ids is not None else 0
    block_k = triton.next_power_of_2(kp1)
    block_n = max(1, min(triton.next_power_of_2(n), 1024 // block_k))  # a 1024-element tile: no spills
    _accept_prefix_scan_kernel[(1,)](
        tokens, seq_lens,
        num_accepted if num_accepted is not None else dummy,
        accept_mask.view(torch.uint8) if accept_mask is not None else dummy,
        verify_cu_seqlens if verify_cu_seqlens is not None else dummy,
        block_table if block_table is not None else dummy,
        max_seq_lens if max_seq_lens is not None else dummy,
        stop_token_ids if n_stops > 0 else dummy,
        cu_out, out_tokens, new_seq_lens, next_anchor, hidden_rows, kv_slots if block_table is not None else out_tokens,
        finished.view(torch.uint8),
        n, k, max_blocks, block_size, n_stops,
        HAS_NUM_ACCEPTED=num_accepted is not None, HAS_VERIFY_CU=verify_cu_seqlens is not None,
        HAS_TABLE=block_table is not None, HAS_MAX_LEN=max_seq_lens is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_T=1024, num_warps=4,
    )
    return cu_out, out_tokens, new_seq_lens, next_anchor, hidden_rows, kv_slots, finished
