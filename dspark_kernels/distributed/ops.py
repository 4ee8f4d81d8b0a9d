"""The local pieces of the vocabulary-parallel ops as ``torch.library`` custom ops (namespace ``dspark_dist``).

An engine with its own communicator calls these and moves their outputs itself:

=========================  ===========================================================  ==========================
op                         inputs (one shard: global ids [vocab_start, vocab_start + Vl))  output
=========================  ===========================================================  ==========================
``verify_stats``           target [N, K+1, Vl] / [R, Vl], draft_tokens, draft logits       float32 [N, K+1, F]: the
                           [N, K, Vl], temperature [N], rng_key, vocab_start, V, top_m     first exchange's buffer
``verify_decide``          all-gathered stats [P, N, K+1, F], shards [P, 2], optional      VerifyOutput's tensors and
                           all-gathered residuals [P, N, R, 3], dk.verify_chain's args     the plan [N, R, 9]
``verify_residual``        the shard's logits, the plan                                    float32 [N, R, 3]
``draft_step``             U_k [N, Vl], v [N, r], W2 shard [Vl, r], temperature, position  packed int64 [N] (MAX it),
                                                                                           stats [N, 5], logits
``draft_logprobs``         all-gathered draft stats [P, N, K, 5], tokens [N, K]            float32 [N, K]
=========================  ===========================================================  ==========================

Layouts: ``dspark_kernels.distributed.layout``. Every schema is plain tensors and integers (no Python objects), so
a CUDA kernel can implement each op as it stands: ``verify_stats`` is verify_chain's per-chunk stats pass with a
chunk offset added to the token ids, ``verify_residual`` its exact fallback pass, ``verify_decide`` its decide step
reading P partials instead of ``chunks``. Backends: "reference" (pure PyTorch) for every piece, "triton" for
``verify_stats``, ``verify_decide``, ``draft_step`` and ``verify_residual``. No CUDA kernels yet; calling a piece
with a backend it does not have raises (the composite ops pick per piece: ``piece_backend``).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from . import layout as L
from . import local_draft, local_verify

LOCAL_BACKENDS = ("auto", "reference", "triton")
TRITON_PIECES = ("verify_stats", "verify_decide", "draft_step", "verify_residual")   # the pieces with a Triton kernel


def piece_backend(backend: Optional[str], device: torch.device, piece: str) -> str:
    """The backend a composite op (``distributed.verify_chain`` / ``draft_block``) uses for one local piece:
    "triton" where the piece has a Triton kernel and ``backend`` is "triton" (or "auto" on a GPU), else
    "reference". "cuda" raises: no local piece has a CUDA kernel yet."""
    if backend is None:
        backend = "auto"
    if backend not in LOCAL_BACKENDS:
        if backend == "cuda":
            raise ValueError("backend='cuda': the distributed local pieces have no CUDA kernels yet; use 'triton' or "
                             "'reference'")
        raise ValueError(f"backend must be one of {LOCAL_BACKENDS}, got {backend!r}")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend='triton' needs tensors on a GPU, or TRITON_INTERPRET=1 for CPU tensors; got {device}")
    wants_triton = backend == "triton" or (backend == "auto" and device.type == "cuda")
    return "triton" if wants_triton and piece in TRITON_PIECES else "reference"


def _triton_impl(piece: str, backend: str, reference_impl):
    """The implementation of ``piece`` for a concrete backend string (the custom ops' dispatch)."""
    if backend == "reference":
        return reference_impl
    if backend != "triton" or piece not in TRITON_PIECES:
        raise ValueError(f"dspark_dist::{piece} has no {backend!r} backend (Triton: {', '.join(TRITON_PIECES)})")
    from .. import triton as _patched  # noqa: F401  (the interpreter fix of the oldest supported Triton)
    if piece == "draft_step":
        from .triton_draft import draft_step
        return draft_step
    if piece == "verify_stats":
        from .triton_stats import verify_stats
        return verify_stats
    if piece == "verify_decide":
        from .triton_decide import verify_decide
        return verify_decide
    from .triton_verify import verify_residual
    return verify_residual


@torch.library.custom_op("dspark_dist::verify_stats", mutates_args=())
def verify_stats(target_shard: torch.Tensor, cu_seqlens: Optional[torch.Tensor], draft_tokens: torch.Tensor,
                 draft_logits_shard: Optional[torch.Tensor], temperature: Optional[torch.Tensor],
                 rng_key: torch.Tensor, vocab_start: int, vocab_size: int, top_m: int, backend: str) -> torch.Tensor:
    return _triton_impl("verify_stats", backend, local_verify.verify_stats)(
        target_shard, cu_seqlens, draft_tokens, draft_logits_shard, temperature, rng_key, vocab_start, vocab_size,
        top_m)


@verify_stats.register_fake
def _(target_shard, cu_seqlens, draft_tokens, draft_logits_shard, temperature, rng_key, vocab_start, vocab_size,
      top_m, backend):
    n, k = draft_tokens.shape
    width = L.StatsLayout(temperature is not None, draft_logits_shard is not None, top_m).width
    return draft_tokens.new_empty((n, k + 1, width), dtype=torch.float32)


@torch.library.custom_op("dspark_dist::verify_decide", mutates_args=())
def verify_decide(stats: torch.Tensor, shards: torch.Tensor, residual: Optional[torch.Tensor],
                  cu_seqlens: Optional[torch.Tensor], num_rows: int, draft_tokens: torch.Tensor,
                  draft_logprobs: Optional[torch.Tensor], verify_lens: Optional[torch.Tensor],
                  survival: Optional[torch.Tensor], thresholds: Optional[torch.Tensor],
                  temperature: Optional[torch.Tensor], rng_key: torch.Tensor, stop_token_ids: Optional[torch.Tensor],
                  method: str, has_draft_logits: bool, top_m: int, vocab_size: int, backend: str,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _triton_impl("verify_decide", backend, local_verify.verify_decide)(
        stats, shards, residual, cu_seqlens, num_rows, draft_tokens, draft_logprobs, verify_lens, survival,
        thresholds, temperature, rng_key, stop_token_ids, method, has_draft_logits, top_m, vocab_size)


def plan_slots(sampled: bool, method: str, k_len: int) -> int:
    """Slots per request of the residual plan and of the second exchange: 0 greedy, 1 token, K block."""
    return 0 if not sampled else (1 if method == "token" else k_len)


@verify_decide.register_fake
def _(stats, shards, residual, cu_seqlens, num_rows, draft_tokens, draft_logprobs, verify_lens, survival, thresholds,
      temperature, rng_key, stop_token_ids, method, has_draft_logits, top_m, vocab_size, backend):
    n, k = draft_tokens.shape
    new = draft_tokens.new_empty
    return (new((n, k + 1), dtype=torch.int64), new((n,), dtype=torch.int32), new((n, k), dtype=torch.bool),
            new((n, plan_slots(temperature is not None, method, k), L.PLAN_WIDTH), dtype=torch.float32))


@torch.library.custom_op("dspark_dist::verify_residual", mutates_args=())
def verify_residual(target_shard: torch.Tensor, cu_seqlens: Optional[torch.Tensor], draft_tokens: torch.Tensor,
                    draft_logits_shard: Optional[torch.Tensor], plan: torch.Tensor, temperature: torch.Tensor,
                    rng_key: torch.Tensor, vocab_start: int, vocab_size: int, backend: str) -> torch.Tensor:
    return _triton_impl("verify_residual", backend, local_verify.verify_residual)(
        target_shard, cu_seqlens, draft_tokens, draft_logits_shard, plan, temperature, rng_key, vocab_start, vocab_size)


@verify_residual.register_fake
def _(target_shard, cu_seqlens, draft_tokens, draft_logits_shard, plan, temperature, rng_key, vocab_start,
      vocab_size, backend):
    return plan.new_empty((plan.shape[0], plan.shape[1], L.RES_WIDTH))


@torch.library.custom_op("dspark_dist::draft_step", mutates_args=())
def draft_step(base_logits_k: torch.Tensor, v: torch.Tensor, w2_shard: torch.Tensor,
               temperature: Optional[torch.Tensor], rng_key: torch.Tensor, position: int, vocab_start: int,
               return_logits: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _triton_impl("draft_step", backend, local_draft.draft_step)(base_logits_k, v, w2_shard, temperature, rng_key, position, vocab_start, return_logits)


@draft_step.register_fake
def _(base_logits_k, v, w2_shard, temperature, rng_key, position, vocab_start, return_logits, backend):
    n, local = base_logits_k.shape
    new = base_logits_k.new_empty
    return (new((n,), dtype=torch.int64), new((n, L.DRAFT_WIDTH), dtype=torch.float32),
            new((n, local) if return_logits else (0,), dtype=torch.float32))


@torch.library.custom_op("dspark_dist::draft_logprobs", mutates_args=())
def draft_logprobs(stats: torch.Tensor, tokens: torch.Tensor, backend: str) -> torch.Tensor:
    _triton_impl("draft_logprobs", backend, None)
    return local_draft.draft_logprobs(stats, tokens)


@draft_logprobs.register_fake
def _(stats, tokens, backend):
    return stats.new_empty(tuple(tokens.shape), dtype=torch.float32)
