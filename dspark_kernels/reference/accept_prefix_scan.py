"""Reference accept-prefix scan: verification results -> the batch's bookkeeping, in one pass, no host sync.

Per request r (K drafts, ``tokens[r]`` = accepted drafts then the bonus/correction token, -1 after):

* ``n_r`` accepted drafts = ``num_accepted[r]`` clamped to [0, K], or the number of leading True entries of
  ``accept_mask[r]``;
* ``e_r`` emitted tokens = ``n_r + (tokens[r, n_r] >= 0)`` (a -1 there: verify emitted no bonus, e.g. after an
  accepted stop token), then ``min(e_r, max(max_seq_lens[r] - seq_lens[r], 0))`` when length limits are given;
* the tokens ``tokens[r, :e_r]`` are committed; they are packed at ``cu_out[r] .. cu_out[r+1]``.

Everything is written against that ``e``; each packed output slot ``o = cu_out[r] + i`` (``i < e_r``) is
"emitted token i of request r", and the slots from ``cu_out[N]`` on are -1.
"""

from typing import Optional, Tuple

import torch


def _pack(values: torch.Tensor, cu_out: torch.Tensor, valid: torch.Tensor, fill: int) -> torch.Tensor:
    """Pack ``values[r, i]`` (``[N, W]``) for ``valid[r, i]`` at flat slot ``cu_out[r] + i``; other slots = fill.

    Returns a ``[N * W]`` tensor of ``values``' dtype. Invalid entries are routed to a scratch slot past the end
    (no boolean indexing, so no host sync).
    """
    n, w = values.shape
    total = n * w
    slot = cu_out[:-1].to(torch.int64).unsqueeze(1) + torch.arange(w, device=values.device)
    slot = torch.where(valid, slot, torch.full_like(slot, total))
    buf = torch.full((total + 1,), fill, dtype=values.dtype, device=values.device)
    buf.scatter_(0, slot.reshape(-1), values.reshape(-1))
    return buf[:total].clone()


def accept_prefix_scan(tokens: torch.Tensor, seq_lens: torch.Tensor, num_accepted: Optional[torch.Tensor],
                       accept_mask: Optional[torch.Tensor], verify_cu_seqlens: Optional[torch.Tensor],
                       block_table: Optional[torch.Tensor], block_size: int, max_seq_lens: Optional[torch.Tensor],
                       stop_token_ids: Optional[torch.Tensor]
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]:
    """Accept-prefix scan of one decode step (the flat arguments of ``torch.ops.dspark.accept_prefix_scan``).

    Args:
        tokens: int ``[N, K+1]``, accepted drafts then the bonus/correction token, -1 after (``verify_chain``).
        seq_lens: int ``[N]``, committed length S of each request (the anchor sits at position S-1).
        num_accepted: int ``[N]`` or None; exactly one of ``num_accepted`` / ``accept_mask`` is given.
        accept_mask: bool ``[N, K]`` or None; only its leading run of True counts.
        verify_cu_seqlens: int ``[N+1]`` or None, row offsets of the packed verify batch (default ``r * (K+1)``).
        block_table: int ``[N, max_blocks]`` or None, paged-KV block ids.
        block_size: tokens per KV block (> 0; ignored without ``block_table``).
        max_seq_lens: int ``[N]`` or None, length limits.
        stop_token_ids: int ``[S]`` or None.

    Returns:
        cu_out: int32 ``[N+1]``, exclusive prefix sum of the emitted counts e (``cu_out[0] = 0``).
        out_tokens: int64 ``[N*(K+1)]``, ``out_tokens[cu_out[r] + i] = tokens[r, i]`` for ``i < e_r``, -1 after
            ``cu_out[N]``.
        new_seq_lens: int32 ``[N]``, ``seq_lens + e``.
        next_anchor: int64 ``[N]``, ``tokens[r, e_r - 1]``, or -1 when ``e_r == 0``.
        hidden_rows: int32 ``[N*(K+1)]``, ``hidden_rows[cu_out[r] + i] = verify_cu_seqlens[r] + i``: the verify rows
            ``[anchor, d_1, ...]`` whose hidden states the drafter context gains; -1 after ``cu_out[N]``, and -1
            for a row outside the request's own rows ``[verify_cu_seqlens[r], verify_cu_seqlens[r+1])`` (only
            possible with inconsistent inputs).
        kv_slots: int64 ``[N*(K+1)]`` (``[0]`` without ``block_table``): slot of position ``p = S - 1 + i``,
            ``block_table[r, p // bs] * bs + p % bs``; -1 after ``cu_out[N]``, and -1 where ``p < 0``, where
            ``p // bs`` is outside ``[0, max_blocks)`` or where the block id is negative. Never reads out of bounds.
        finished: bool ``[N]``, an emitted token is in ``stop_token_ids``, or ``new_seq_lens >= max_seq_lens``.
    """
    n, kp1 = tokens.shape
    k = kp1 - 1
    dev = tokens.device
    tokens = tokens.to(torch.int64)
    seq = seq_lens.to(torch.int64)
    i = torch.arange(kp1, device=dev).unsqueeze(0)  # [1, K+1], emitted-token index

    # accepted drafts n_r
    if num_accepted is not None:
        n_acc = num_accepted.to(torch.int64).clamp(0, k)
    else:
        n_acc = torch.cumprod(accept_mask.to(torch.int64), dim=1).sum(dim=1)  # leading run of True

    # emitted tokens e_r = n_r + (bonus present), truncated at the length limit
    bonus = tokens.gather(1, n_acc.unsqueeze(1)).squeeze(1) >= 0
    e = n_acc + bonus.to(torch.int64)
    if max_seq_lens is not None:
        limit = max_seq_lens.to(torch.int64)
        gap = limit - seq  # wraps where the true difference passes int64's range (then positive and huge)
        room = torch.where(limit <= seq, 0, torch.where(gap < 0, torch.iinfo(torch.int64).max, gap))
        e = torch.minimum(e, room)  # room: max(limit - S, 0) exactly (capped at int64's largest)
    keep = i < e.unsqueeze(1)  # [N, K+1]: emitted token i of request r is kept

    cu_out = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    cu_out[1:] = torch.cumsum(e, dim=0)

    out_tokens = _pack(tokens, cu_out, keep, -1)
    new_seq_lens = seq + e
    last = tokens.gather(1, (e - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    next_anchor = torch.where(e > 0, last, torch.full_like(last, -1))

    # drafter rows: the verify rows [anchor, d_1, ...] of request r start at verify_cu_seqlens[r]
    if verify_cu_seqlens is not None:
        row_start = verify_cu_seqlens[:-1].to(torch.int64)
        row_end = verify_cu_seqlens[1:].to(torch.int64)
    else:
        row_start = torch.arange(n, device=dev, dtype=torch.int64) * kp1
        row_end = row_start + kp1
    rows = row_start.unsqueeze(1) + i
    inside = (rows >= row_start.unsqueeze(1)) & (rows < row_end.unsqueeze(1))     # an offset that wraps is outside
    rows = torch.where(inside, rows, torch.full_like(rows, -1))
    hidden_rows = _pack(rows, cu_out, keep, -1)

    # KV slots of the kept positions S-1, S, ..., S-2+e_r
    if block_table is not None:
        max_blocks = block_table.shape[1]
        pos = seq.unsqueeze(1) - 1 + i
        blk = torch.div(pos, block_size, rounding_mode="floor")
        in_table = (pos >= 0) & (blk >= 0) & (blk < max_blocks)
        block_id = block_table.to(torch.int64).gather(1, blk.clamp(0, max(max_blocks - 1, 0))) if max_blocks > 0 \
            else torch.full_like(pos, -1)
        slots = block_id * block_size + pos.remainder(block_size)
        ok = in_table & (block_id >= 0)
        slots = torch.where(ok, slots, torch.full_like(slots, -1))
        kv_slots = _pack(slots, cu_out, keep, -1)
    else:
        kv_slots = torch.empty(0, dtype=torch.int64, device=dev)

    # finished: a kept token is a stop token, or the length limit is reached
    if stop_token_ids is not None and stop_token_ids.numel() > 0:
        is_stop = torch.isin(tokens, stop_token_ids.to(device=dev, dtype=torch.int64)) & keep
        finished = is_stop.any(dim=1)
    else:
        finished = torch.zeros(n, dtype=torch.bool, device=dev)
    if max_seq_lens is not None:
        finished = finished | (e >= room)  # S + e >= max_seq_lens, exactly (no int64 overflow)

    return (cu_out.to(torch.int32), out_tokens, new_seq_lens.to(torch.int32), next_anchor,
            hidden_rows.to(torch.int32), kv_slots, finished)
