"""``dk.accept_prefix_scan``: verification results -> the whole batch's bookkeeping for the next step, one launch."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .. import reference
from ._common import INT_DTYPES, check_tensor, resolve_backend
from ._registry import CpuKernel, CudaKernel, TritonKernel, define_op


class ScanOutput(NamedTuple):
    """Result of :func:`accept_prefix_scan` (N requests, K drafts each; e_r = tokens emitted by request r).

    Attributes:
        cu_out: int32 ``[N+1]``, exclusive prefix sum of e (``cu_out[0] = 0``, ``cu_out[N]`` = total emitted).
        out_tokens: int64 ``[N*(K+1)]``, the emitted tokens packed request after request, -1 from ``cu_out[N]`` on.
        new_seq_lens: int32 ``[N]``, ``seq_lens + e``.
        next_anchor: int64 ``[N]``, last emitted token of each request (-1 if it emitted none).
        hidden_rows: int32 ``[N*(K+1)]``, packed like ``out_tokens``: the verify-batch row whose target hidden
            state the drafter context gains for each emitted token (-1 after the end).
        kv_slots: int64 ``[N*(K+1)]`` packed like ``out_tokens`` (paged-KV slots of the kept positions, -1 after
            the end or where undefined), or None without ``block_table``.
        finished: bool ``[N]``, the request emitted a stop token or reached ``max_seq_lens``.
    """

    cu_out: torch.Tensor
    out_tokens: torch.Tensor
    new_seq_lens: torch.Tensor
    next_anchor: torch.Tensor
    hidden_rows: torch.Tensor
    kv_slots: Optional[torch.Tensor]
    finished: torch.Tensor


def _fake(tokens, seq_lens, num_accepted, accept_mask, verify_cu_seqlens, block_table, block_size, max_seq_lens,
          stop_token_ids):
    n, kp1 = tokens.shape
    new = tokens.new_empty
    return (new((n + 1,), dtype=torch.int32), new((n * kp1,), dtype=torch.int64), new((n,), dtype=torch.int32),
            new((n,), dtype=torch.int64), new((n * kp1,), dtype=torch.int32),
            new((n * kp1 if block_table is not None else 0,), dtype=torch.int64), new((n,), dtype=torch.bool))


def _check_args(tokens, seq_lens, num_accepted, accept_mask, verify_cu_seqlens, block_table, block_size, max_seq_lens,
                stop_token_ids):
    check_tensor("tokens", tokens, ndim=2, dtypes=INT_DTYPES)
    if tokens.shape[1] < 1:
        raise ValueError(f"tokens must have shape [N, K+1] with K+1 >= 1, got {tuple(tokens.shape)}")
    n, kp1 = tokens.shape
    dev = tokens.device
    check_tensor("seq_lens", seq_lens, shape=(n,), dtypes=INT_DTYPES, device=dev)
    if (num_accepted is None) == (accept_mask is None):
        raise ValueError("exactly one of num_accepted and accept_mask must be given")
    check_tensor("num_accepted", num_accepted, shape=(n,), dtypes=INT_DTYPES, device=dev, optional=True)
    check_tensor("accept_mask", accept_mask, shape=(n, kp1 - 1), dtypes=(torch.bool,), device=dev, optional=True)
    check_tensor("verify_cu_seqlens", verify_cu_seqlens, shape=(n + 1,), dtypes=INT_DTYPES, device=dev,
                 optional=True)
    check_tensor("block_table", block_table, ndim=2, dtypes=INT_DTYPES, device=dev, optional=True)
    if block_table is not None and block_table.shape[0] != n:
        raise ValueError(f"block_table must have shape [{n}, max_blocks], got {tuple(block_table.shape)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    check_tensor("max_seq_lens", max_seq_lens, shape=(n,), dtypes=INT_DTYPES, device=dev, optional=True)
    check_tensor("stop_token_ids", stop_token_ids, ndim=1, dtypes=INT_DTYPES, device=dev, optional=True)


ACCEPT_PREFIX_SCAN = define_op(
    "accept_prefix_scan",
    "(Tensor tokens, Tensor seq_lens, Tensor? num_accepted, Tensor? accept_mask, Tensor? verify_cu_seqlens, "
    "Tensor? block_table, int block_size, Tensor? max_seq_lens, Tensor? stop_token_ids) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _fake,
    {"reference": reference.accept_prefix_scan,
     "cpu": CpuKernel("accept_prefix_scan", reference.accept_prefix_scan),
     "triton": TritonKernel("accept_prefix_scan", "accept_prefix_scan"),
     "cuda": CudaKernel("accept_prefix_scan")},
    _check_args,
)


def accept_prefix_scan(tokens: torch.Tensor, seq_lens: torch.Tensor, *, num_accepted: Optional[torch.Tensor] = None,
                       accept_mask: Optional[torch.Tensor] = None, verify_cu_seqlens: Optional[torch.Tensor] = None,
                       block_table: Optional[torch.Tensor] = None, block_size: Optional[int] = None,
                       max_seq_lens: Optional[torch.Tensor] = None, stop_token_ids: Optional[torch.Tensor] = None,
                       backend: Optional[str] = "auto") -> ScanOutput:
    """Turn one step's verification results into packed outputs, new lengths, next anchors, drafter rows, KV slots.

    Request r has committed tokens ``t_1..t_S`` (``S = seq_lens[r]``); its anchor ``t_S`` sits at position S-1 and
    the verify batch scored ``[anchor, d_1..d_L]`` at positions S-1..S-1+L. With ``n_r`` accepted drafts, request r
    emits ``e_r = n_r + (tokens[r, n_r] >= 0)`` tokens (the accepted drafts and the bonus/correction token; a -1
    there means no bonus, e.g. after an accepted stop token), truncated to ``max(max_seq_lens[r] - S, 0)`` when
    ``max_seq_lens`` is given. Never synchronises with the host.

    Args:
        tokens: int32/int64 ``[N, K+1]`` from ``dk.verify_chain``: accepted drafts, then the bonus/correction
            token, then -1. Entries ``tokens[r, :e_r]`` are committed as given.
        seq_lens: int32/int64 ``[N]``, committed lengths S before this step.
        num_accepted: int32/int64 ``[N]`` accepted drafts (clamped to [0, K]); or
        accept_mask: bool ``[N, K]`` per-position accept flags (only the leading run of True counts).
            Exactly one of the two.
        verify_cu_seqlens: int32/int64 ``[N+1]`` row offsets of the packed verify batch (default dense,
            ``r * (K+1)``), used for ``hidden_rows``.
        block_table: int32/int64 ``[N, max_blocks]`` paged-KV block ids (negative = unallocated); with it,
        block_size: tokens per block (int > 0), ``kv_slots`` is returned.
        max_seq_lens: int32/int64 ``[N]`` length limits.
        stop_token_ids: int32/int64 ``[S]`` stop tokens.
        backend: "auto" | "cpu" | "cuda" | "triton" | "reference" ("auto": CUDA or Triton on a GPU, the CPU
            kernel on CPU tensors where it builds, else the reference; ``DSPARK_BACKEND`` sets the default).

    Returns:
        :class:`ScanOutput` with
        ``cu_out`` int32 ``[N+1]`` (exclusive prefix sum of e),
        ``out_tokens`` int64 ``[N*(K+1)]`` (``out_tokens[cu_out[r] + i] = tokens[r, i]``, i < e_r; -1 after
        ``cu_out[N]``),
        ``new_seq_lens`` int32 ``[N]`` (``S + e``),
        ``next_anchor`` int64 ``[N]`` (``tokens[r, e_r - 1]``, -1 if ``e_r == 0``),
        ``hidden_rows`` int32 ``[N*(K+1)]`` (``verify_cu_seqlens[r] + i`` at ``cu_out[r] + i``: the rows
        ``[anchor, d_1..]`` whose target hidden states the drafter context gains; -1 after the end and for rows
        outside the request's own verify rows),
        ``kv_slots`` int64 ``[N*(K+1)]`` or None (slot of position ``p = S - 1 + i`` at ``cu_out[r] + i``,
        ``block_table[r, p // block_size] * block_size + p % block_size``; the target KV keeps exactly these
        positions; -1 after the end and where ``p < 0``, ``p // block_size >= max_blocks`` or the block id is
        negative, never an out-of-bounds read),
        ``finished`` bool ``[N]`` (an emitted token is a stop token, or ``new_seq_lens >= max_seq_lens``).

    Defined results for values that cannot be checked without a sync: ``num_accepted`` outside [0, K] is
    clamped; ``seq_lens > max_seq_lens`` emits nothing (and is finished); a bad ``block_table`` entry or position
    gives slot -1.
    """
    if block_table is not None and block_size is None:
        raise ValueError("block_size must be a positive int when block_table is given, got None")
    _check_args(tokens, seq_lens, num_accepted, accept_mask, verify_cu_seqlens, block_table,
                1 if block_size is None else block_size, max_seq_lens, stop_token_ids)
    dev = tokens.device
    res = ACCEPT_PREFIX_SCAN(tokens, seq_lens, num_accepted, accept_mask, verify_cu_seqlens, block_table,
                             int(block_size) if block_table is not None else 1, max_seq_lens, stop_token_ids,
                             backend=resolve_backend(backend, dev, ACCEPT_PREFIX_SCAN.name))
    cu_out, out_tokens, new_seq_lens, next_anchor, hidden_rows, kv_slots, finished = res
    return ScanOutput(cu_out, out_tokens, new_seq_lens, next_anchor, hidden_rows,
                      kv_slots if block_table is not None else None, finished)
