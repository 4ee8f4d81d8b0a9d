"""``dk.verify_chain``: fused chain verification (greedy, lossless token-level or block rejection sampling)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch

from .. import reference
from ..rng import make_rng_key
from ._common import (FLOAT_DTYPES, INT_DTYPES, check_rng_key, check_tensor, requested_backend,
                      resolve_backend, temperature_tensor)
from ._registry import CpuKernel, CudaKernel, TritonKernel, define_op

METHODS = ("token", "block")
CUDA_MAX_K = 16         # the CUDA kernels' draft positions a request (csrc/include/dspark/verify_chain.h, kMaxK)
CUDA_MAX_TOP_K = 1024   # and columns of a top-k draft row (kMaxTopK); "auto" runs Triton beyond either


class VerifyOutput(NamedTuple):
    tokens: torch.Tensor        # int64 [N, K+1]: accepted drafts, then the bonus/correction token, -1 after
    num_accepted: torch.Tensor  # int32 [N]
    accept_mask: torch.Tensor   # bool [N, K]


def _fake(target_logits, cu_seqlens, draft_tokens, draft_logits, target_to_draft, draft_candidates, draft_logprobs,
          verify_lens, survival, thresholds, temperature, rng_key, stop_token_ids, method):
    n, k = draft_tokens.shape
    new = draft_tokens.new_empty
    return new((n, k + 1), dtype=torch.int64), new((n,), dtype=torch.int32), new((n, k), dtype=torch.bool)


def check_rows(target_logits, cu_seqlens, draft_tokens, target_name: str = "target_logits") -> tuple:
    """(N, K, V, device) of checked target rows (named ``target_name``) and drafts."""
    check_tensor("draft_tokens", draft_tokens, ndim=2, dtypes=INT_DTYPES)
    n, k_len = draft_tokens.shape
    dev = draft_tokens.device
    if k_len < 1:
        raise ValueError(f"draft_tokens must have K >= 1 columns, got shape {tuple(draft_tokens.shape)}")
    if cu_seqlens is None:
        check_tensor(target_name, target_logits, shape=(n, k_len + 1, None), dtypes=FLOAT_DTYPES, device=dev)
    else:
        check_tensor(target_name, target_logits, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
        check_tensor("cu_seqlens", cu_seqlens, shape=(n + 1,), dtypes=INT_DTYPES, device=dev)
    vocab = target_logits.shape[-1]
    if vocab < 1:
        raise ValueError(f"{target_name} must have V >= 1")
    return n, k_len, vocab, dev


def _check_args(target_logits, cu_seqlens, draft_tokens, draft_logits, target_to_draft, draft_candidates,
                draft_logprobs, verify_lens, survival, thresholds, temperature, rng_key, stop_token_ids, method):
    n, k_len, vocab, dev = check_rows(target_logits, cu_seqlens, draft_tokens)
    _, width = draft_layout(draft_logits, None, target_to_draft, draft_candidates, n, k_len, vocab, dev)
    check_verify_options(n, k_len, vocab, dev, draft_logits, draft_logprobs, verify_lens, survival, thresholds,
                         stop_token_ids, method, draft_width=width)
    check_tensor("temperature", temperature, shape=(n,), dtypes=(torch.float32,), device=dev, optional=True)
    check_rng_key(rng_key, dev)


VERIFY_CHAIN = define_op(
    "verify_chain",
    "(Tensor target_logits, Tensor? cu_seqlens, Tensor draft_tokens, Tensor? draft_logits, Tensor? target_to_draft, "
    "Tensor? draft_candidates, Tensor? draft_logprobs, Tensor? verify_lens, Tensor? survival, Tensor? thresholds, "
    "Tensor? temperature, Tensor rng_key, Tensor? stop_token_ids, str method) -> (Tensor, Tensor, Tensor)",
    _fake,
    {"reference": reference.verify_chain, "cpu": CpuKernel("verify_chain", reference.verify_chain),
     "triton": TritonKernel("verify_chain", "verify_chain"),
     "cuda": CudaKernel("verify_chain")},
    _check_args,
)


def verify_chain(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    cu_seqlens: Optional[torch.Tensor] = None,
    draft_logits: Optional[torch.Tensor] = None,
    draft_to_target: Optional[torch.Tensor] = None,
    target_to_draft: Optional[torch.Tensor] = None,
    draft_candidates: Optional[torch.Tensor] = None,
    draft_logprobs: Optional[torch.Tensor] = None,
    verify_lens: Optional[torch.Tensor] = None,
    survival: Optional[torch.Tensor] = None,
    thresholds: Optional[torch.Tensor] = None,
    temperature: Union[float, torch.Tensor] = 0.0,
    seed=0,
    offset=0,
    stop_token_ids: Optional[torch.Tensor] = None,
    method: str = "token",
    backend: Optional[str] = "auto",
) -> VerifyOutput:
    """Verify each request's draft chain ``[anchor, d_1..d_L]`` against one target forward.

    Args:
        target_logits: float32/bf16/fp16, dense ``[N, K+1, V]`` or packed ``[R, V]`` with ``cu_seqlens``; row j of
            a request scores draft ``d_{j+1}`` and row L the bonus token.
        draft_tokens: int32/int64 ``[N, K]``.
        cu_seqlens: int32/int64 ``[N+1]``, the packed layout's row offsets (request r owns rows
            ``cu[r]..cu[r+1]-1``, so its verify length is ``cu[r+1] - cu[r] - 1``; rows past R are not its own,
            and it owns none unless ``0 <= cu[r] < R`` and ``cu[r+1] > cu[r]``).
        draft_logits: float ``[N, K, V]``, the logits the drafts were sampled from (``draft_block(...,
            return_logits=True)``); None means one-hot drafts (``q(d_j) = 1``). ``[N, K, Vd]`` with
            ``draft_to_target``, ``[N, K, k]`` with ``draft_candidates``: the kernels read these rows as they are.
            ``q`` of a row is ``softmax(draft_logits / T)`` over its columns, each column at its target id (the
            reference's module docstring has the exact rule).
        draft_to_target: int32/int64 ``[Vd]`` (needs ``draft_logits``): the target ids of a reduced draft
            vocabulary (``MarkovHead.draft_to_target``); q is zero at every target id off the map. The op turns it
            into ``target_to_draft`` (``target_to_draft_map``: a V-entry int32 table, a few small launches); pass
            that table instead to build it once. Entries should be distinct (``MarkovHead`` checks them): where
            several columns map to one id, the last column gives that id its q; an entry outside [0, V) places its
            column nowhere (its logit still counts in the row's normaliser) and is never used as an index.
        target_to_draft: int32 ``[V]``, ``target_to_draft_map(draft_to_target, V)`` (excludes ``draft_to_target``):
            the draft column of each target id, -1 for none; an entry outside ``[0, Vd)`` counts as none.
        draft_candidates: int32/int64 ``[N, K, k]`` (needs ``draft_logits [N, K, k]``, excludes the maps): the
            sparse form of top-k proposals (``draft_block(..., top_k=k)``'s ``candidates``): the target id of each
            column of each draft row; q is zero at every other id. Ids outside [0, V) and repeated ids follow the
            ``draft_to_target`` rules.
        draft_logprobs: float32 ``[N, K]`` (needs ``draft_logits``): ``log q_j(d_j)``, the log-probability at the
            request's temperature with which each draft was sampled (``draft_block`` returns it). The accept tests
            use ``q(d_j) = exp(draft_logprobs)``, and the draft rows are normalised with it (``q_j(x) =
            exp(l_j(x) - l_j(d_j) + draft_logprobs_j)``, ``l = draft_logits / T``), so sampling reads one draft
            row per request (the one it samples the correction from) and no row's normaliser is summed. Must equal
            ``log_softmax(draft_logits / T)`` at the drafts for the result to be lossless.
        verify_lens: int ``[N]``, verify at most this many drafts (clamped to [0, K]).
        survival, thresholds: float ``[N, K]`` and ``[K]``: verify the leading positions with
            ``survival[r, j] >= thresholds[j]``. Combined lengths take the minimum.
        temperature: float or float ``[N]``; 0 (or negative / NaN in a tensor) = greedy for that request.
        seed, offset: the random key (ints or one-element int tensors, device tensors allowed).
        stop_token_ids: int ``[S]``; an accepted stop token ends acceptance right after it, with no bonus token.
        method: "token" (standard rejection sampling) or "block" (Sun et al., 2024); both lossless.
        backend: "auto" | "cpu" | "cuda" | "triton" | "reference" ("auto": CUDA or Triton on a GPU, the CPU
            kernel on CPU tensors where it builds, else the reference; ``DSPARK_BACKEND`` sets the default). Every
            mode and draft layout has a CPU kernel. The CUDA kernels take K <= 16 and top-k rows of at most 1024
            columns ("cuda" raises beyond; "auto" then runs Triton on a GPU).

    Returns:
        ``VerifyOutput(tokens int64 [N, K+1], num_accepted int32 [N], accept_mask bool [N, K])``: ``tokens`` holds
        the accepted drafts, then the bonus/correction token, then -1. Defined results for values that are not
        checked: a draft outside [0, V) is rejected at its position; NaN logits never yield a token outside
        [0, V); packed rows outside ``[0, R)`` are never read, and a request with no rows emits nothing.
    """
    n, k_len, vocab, dev = check_rows(target_logits, cu_seqlens, draft_tokens)
    target_to_draft, width = draft_layout(draft_logits, draft_to_target, target_to_draft, draft_candidates, n, k_len,
                                          vocab, dev)
    check_verify_options(n, k_len, vocab, dev, draft_logits, draft_logprobs, verify_lens, survival, thresholds,
                         stop_token_ids, method, draft_width=width)
    temps = temperature_tensor(temperature, n, dev)
    rng_key = make_rng_key(seed, offset, dev)
    chosen = resolve_backend(backend, dev, VERIFY_CHAIN.name)
    if chosen == "cuda" and requested_backend(backend) == "auto" and (
            k_len > CUDA_MAX_K or (draft_candidates is not None and width > CUDA_MAX_TOP_K)):
        chosen = "triton"  # "auto" never picks a backend that cannot take the call; Triton has neither limit
    return VerifyOutput(*VERIFY_CHAIN(
        target_logits, cu_seqlens, draft_tokens, draft_logits, target_to_draft, draft_candidates, draft_logprobs,
        verify_lens, survival, thresholds, temps, rng_key, stop_token_ids, method, backend=chosen))


def target_to_draft_map(draft_to_target: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 ``[V]``: the draft column each target id takes (the last column that maps to it), -1 where none does;
    entries of ``draft_to_target`` (int ``[Vd]``) outside [0, V) are dropped. Device ops only, no host read."""
    check_tensor("draft_to_target", draft_to_target, ndim=1, dtypes=INT_DTYPES)
    ids = draft_to_target.to(torch.int64)
    valid = (ids >= 0) & (ids < vocab)
    cols = torch.arange(ids.shape[0], device=ids.device, dtype=torch.int64)
    out = torch.full((vocab + 1,), -1, dtype=torch.int64, device=ids.device)    # entry V: the dropped ones
    out.scatter_reduce_(0, torch.where(valid, ids, vocab), cols, "amax")
    return out[:vocab].to(torch.int32)


def draft_layout(draft_logits, draft_to_target, target_to_draft, draft_candidates, n: int, k_len: int, vocab: int,
                 dev):
    """Checks the draft rows' layout; returns (target_to_draft or None, the width the draft rows must have)."""
    maps = [name for name, t in (("draft_to_target", draft_to_target), ("target_to_draft", target_to_draft),
                                 ("draft_candidates", draft_candidates)) if t is not None]
    if len(maps) > 1:
        raise ValueError(f"give at most one of draft_to_target, target_to_draft and draft_candidates, not both "
                         f"{maps[0]} and {maps[1]}")
    if not maps:
        return None, vocab
    name = maps[0]
    if draft_logits is None:
        raise ValueError(f"{name} needs draft_logits (the rows over the draft ids it maps)")
    check_tensor("draft_logits", draft_logits, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
    if draft_logits.shape[-1] < 1:
        raise ValueError(f"draft_logits must have at least one column (a draft row to sample from), got shape "
                         f"{tuple(draft_logits.shape)}")
    if name == "draft_candidates":
        check_tensor(name, draft_candidates, shape=(n, k_len, None), dtypes=INT_DTYPES, device=dev)
        return None, draft_candidates.shape[-1]
    if name == "draft_to_target":
        check_tensor(name, draft_to_target, ndim=1, dtypes=INT_DTYPES, device=dev)
        return target_to_draft_map(draft_to_target, vocab), draft_to_target.shape[0]
    check_tensor(name, target_to_draft, shape=(vocab,), dtypes=(torch.int32,), device=dev)
    return target_to_draft, draft_logits.shape[-1]


def check_verify_options(n: int, k_len: int, vocab: int, dev: torch.device, draft_logits, draft_logprobs,
                         verify_lens, survival, thresholds, stop_token_ids, method: str,
                         draft_logits_name: str = "draft_logits", draft_width: Optional[int] = None) -> None:
    """The checks of verify_chain's arguments beyond the target rows and drafts (shared with the vocabulary-parallel
    op, whose draft rows are a shard of ``vocab`` tokens named ``draft_logits_name``). ``draft_width``: the draft
    rows' columns (``vocab`` when None)."""
    check_tensor(draft_logits_name, draft_logits, shape=(n, k_len, vocab if draft_width is None else draft_width),
                 dtypes=FLOAT_DTYPES, device=dev, optional=True)
    check_tensor("draft_logprobs", draft_logprobs, shape=(n, k_len), dtypes=(torch.float32,), device=dev,
                 optional=True)
    if draft_logprobs is not None and draft_logits is None:
        raise ValueError(f"draft_logprobs needs {draft_logits_name} (the residual is sampled from the draft rows)")
    check_tensor("verify_lens", verify_lens, shape=(n,), dtypes=INT_DTYPES, device=dev, optional=True)
    if (survival is None) != (thresholds is None):
        raise ValueError("survival and thresholds must be given together")
    check_tensor("survival", survival, shape=(n, k_len), dtypes=FLOAT_DTYPES, device=dev, optional=True)
    check_tensor("thresholds", thresholds, shape=(k_len,), dtypes=FLOAT_DTYPES, device=dev, optional=True)
    check_tensor("stop_token_ids", stop_token_ids, ndim=1, dtypes=INT_DTYPES, device=dev, optional=True)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
