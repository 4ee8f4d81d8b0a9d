"""The local pieces of the vocabulary-parallel ops as ``torch.library`` custom ops (namespace ``dspark_dist``).

An engine with its own communicator calls these and moves their outputs itself:

=========================  ===========================================================  ==========================
op                         inputs (one shard: global ids [vocab_start, vocab_start + Vl))  output
=========================  ===========================================================  ==========================
``verify_stats``           target [N, K+1, Vl] / [R, Vl], draft_tokens, draft logits       float32 [N, K+1, F]: the
                           [N, K, Vl], temperature [N], vocab_start, V                     first exchange's buffer
``verify_decide``          all-gathered stats [P, N, K+1, F], shards [P, 2], optional      VerifyOutput's tensors and
                           all-gathered residuals [P, N, R, 5], dk.verify_chain's args     the plan [N, R, 9]
``verify_residual``        the shard's logits, the plan                                    float32 [N, R, 5]
``draft_step``             U_k [N, Vl], v [N, r], W2 shard [Vl, r], temperature, position  packed int64 [N] (MAX it),
                                                                                           stats [N, 5], logits
``draft_logprobs``         all-gathered draft stats [P, N, K, 5], tokens [N, K]            float32 [N, K]
=========================  ===========================================================  ==========================

Layouts: ``dspark_kernels.distributed.layout``. Every schema is plain tensors and integers (no Python objects), so
a CUDA kernel implements each op as it stands. Backends: "reference" (pure PyTorch) for every piece; "triton" and
"cuda" for ``verify_stats``, ``verify_decide``, ``draft_step`` and ``verify_residual``
(``torch.ops.dspark_C.<piece>``, csrc/include/dspark/dist_*.cuh; the SIMT harness runs them on CPU tensors under
``DSPARK_SIMT=1``); ``draft_logprobs`` (a few elementwise ops on [P, N, K, 5]) is the reference everywhere. Calling
a piece with a backend it does not have raises; the composite ops pick per piece (``piece_backend``). Every backend
of the pieces with kernels checks their shapes, dtypes, devices and the shard's span before reading anything (no
host synchronisation): the CUDA launchers (a RuntimeError), the reference and Triton backends through ``checks`` (a
ValueError), each naming the argument.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import _ext
from ..ops._common import resolve_backend
from ..ops._registry import CudaKernel
from . import checks, local_draft, local_verify
from . import layout as L

KERNEL_PIECES = ("verify_stats", "verify_decide", "draft_step", "verify_residual")   # Triton and CUDA kernels


def piece_backend(backend: Optional[str], device: torch.device, piece: str) -> str:
    """The backend a composite op (``distributed.verify_chain`` / ``draft_block``) uses for one local piece: ``dk``'s
    rule (``ops._common.resolve_backend``: "auto" is "cuda" on a GPU whose extension has the kernel, "triton" on
    another GPU; "cuda" on CPU tensors runs the SIMT harness under ``DSPARK_SIMT=1``) for the pieces with kernels,
    the reference for ``draft_logprobs``; the pieces have no CPU kernel, so "cpu" (auto's choice on CPU tensors) is
    the reference."""
    chosen = resolve_backend(backend, device, piece) if piece in KERNEL_PIECES else "reference"
    return "reference" if chosen == "cpu" else chosen


_ROWS_ANY_STRIDE = {"draft_step": (0,)}   # inputs whose launcher takes rows any stride apart (U_k, a slice of U)


def _cuda_kernel(piece: str):
    """``torch.ops.dspark_C.<piece>`` (or the SIMT build's) on contiguous inputs: a copy only where the launcher
    could not read the tensor as it is (a row slice of a larger tensor is read in place where the launcher allows)."""
    kernel, strided = CudaKernel(piece), _ROWS_ANY_STRIDE.get(piece, ())

    def ready(i, a):
        if not isinstance(a, torch.Tensor):
            return a
        return a if (a.is_contiguous() or (i in strided and a.stride(-1) == 1)) else a.contiguous()
    return lambda *args: kernel(*(ready(i, a) for i, a in enumerate(args)))


def _register_fakes(piece: str, op, fake) -> None:
    """``fake`` (a function of the op's parameters without ``backend``) for ``dspark_dist::<piece>`` (``op``) and for
    the extension's ``dspark_C::<piece>`` / ``dspark_simt::<piece>``."""
    op.register_fake(lambda *args: fake(*args[:-1]))
    _ext.register_fake(piece, fake)


def _impl(piece: str, backend: str, reference_impl):
    """The implementation of ``piece`` for a concrete backend string (the custom ops' dispatch). The CUDA launcher
    checks its arguments; the reference and Triton backends of the pieces with kernels run ``checks.<piece>``
    first (the same checks)."""
    if backend not in ("reference", "cuda", "triton") or (backend != "reference" and piece not in KERNEL_PIECES):
        raise ValueError(f"dspark_dist::{piece} has no {backend!r} backend (Triton and CUDA: "
                         f"{', '.join(KERNEL_PIECES)})")
    if backend == "cuda":
        return _cuda_kernel(piece)
    impl = reference_impl if backend == "reference" else _triton_impl(piece)
    if piece not in KERNEL_PIECES:   # draft_logprobs: torch ops on the gathered statistics
        return impl

    def checked(*args):
        getattr(checks, piece)(*args)
        return impl(*args)
    return checked


def _triton_impl(piece: str):
    """The Triton backend of a piece with kernels."""
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
                 draft_logits_shard: Optional[torch.Tensor], temperature: Optional[torch.Tensor], vocab_start: int,
                 vocab_size: int, backend: str) -> torch.Tensor:
    return _impl("verify_stats", backend, local_verify.verify_stats)(
        target_shard, cu_seqlens, draft_tokens, draft_logits_shard, temperature, vocab_start, vocab_size)


def _verify_stats_fake(target_shard, cu_seqlens, draft_tokens, draft_logits_shard, temperature, vocab_start,
                       vocab_size):
    n, k = draft_tokens.shape
    width = L.StatsLayout(temperature is not None, draft_logits_shard is not None).width
    return draft_tokens.new_empty((n, k + 1, width), dtype=torch.float32)


_register_fakes("verify_stats", verify_stats, _verify_stats_fake)


@torch.library.custom_op("dspark_dist::verify_decide", mutates_args=())
def verify_decide(stats: torch.Tensor, shards: torch.Tensor, residual: Optional[torch.Tensor],
                  cu_seqlens: Optional[torch.Tensor], num_rows: int, draft_tokens: torch.Tensor,
                  draft_logprobs: Optional[torch.Tensor], verify_lens: Optional[torch.Tensor],
                  survival: Optional[torch.Tensor], thresholds: Optional[torch.Tensor],
                  temperature: Optional[torch.Tensor], rng_key: torch.Tensor, stop_token_ids: Optional[torch.Tensor],
                  method: str, has_draft_logits: bool, vocab_size: int, backend: str,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _impl("verify_decide", backend, local_verify.verify_decide)(
        stats, shards, residual, cu_seqlens, num_rows, draft_tokens, draft_logprobs, verify_lens, survival,
        thresholds, temperature, rng_key, stop_token_ids, method, has_draft_logits, vocab_size)


def _verify_decide_fake(stats, shards, residual, cu_seqlens, num_rows, draft_tokens, draft_logprobs, verify_lens,
                        survival, thresholds, temperature, rng_key, stop_token_ids, method, has_draft_logits,
                        vocab_size):
    n, k = draft_tokens.shape
    new = draft_tokens.new_empty
    return (new((n, k + 1), dtype=torch.int64), new((n,), dtype=torch.int32), new((n, k), dtype=torch.bool),
            new((n, L.plan_slots(temperature is not None, method, k), L.PLAN_WIDTH), dtype=torch.float32))


_register_fakes("verify_decide", verify_decide, _verify_decide_fake)


@torch.library.custom_op("dspark_dist::verify_residual", mutates_args=())
def verify_residual(target_shard: torch.Tensor, cu_seqlens: Optional[torch.Tensor], draft_tokens: torch.Tensor,
                    draft_logits_shard: Optional[torch.Tensor], plan: torch.Tensor, temperature: torch.Tensor,
                    rng_key: torch.Tensor, vocab_start: int, vocab_size: int, backend: str) -> torch.Tensor:
    return _impl("verify_residual", backend, local_verify.verify_residual)(
        target_shard, cu_seqlens, draft_tokens, draft_logits_shard, plan, temperature, rng_key, vocab_start, vocab_size)


def _verify_residual_fake(target_shard, cu_seqlens, draft_tokens, draft_logits_shard, plan, temperature, rng_key,
                          vocab_start, vocab_size):
    return plan.new_empty((plan.shape[0], plan.shape[1], L.RES_WIDTH))


_register_fakes("verify_residual", verify_residual, _verify_residual_fake)


@torch.library.custom_op("dspark_dist::draft_step", mutates_args=())
def draft_step(base_logits_k: torch.Tensor, v: torch.Tensor, w2_shard: torch.Tensor,
               temperature: Optional[torch.Tensor], rng_key: torch.Tensor, position: int, vocab_start: int,
               return_logits: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _impl("draft_step", backend, local_draft.draft_step)(base_logits_k, v, w2_shard, temperature, rng_key,
                                                                position, vocab_start, return_logits)


def _draft_step_fake(base_logits_k, v, w2_shard, temperature, rng_key, position, vocab_start, return_logits):
    n, local = base_logits_k.shape
    new = base_logits_k.new_empty
    return (new((n,), dtype=torch.int64), new((n, L.DRAFT_WIDTH), dtype=torch.float32),
            new((n, local) if return_logits else (0,), dtype=torch.float32))


_register_fakes("draft_step", draft_step, _draft_step_fake)


@torch.library.custom_op("dspark_dist::draft_logprobs", mutates_args=())
def draft_logprobs(stats: torch.Tensor, tokens: torch.Tensor, backend: str) -> torch.Tensor:
    _impl("draft_logprobs", backend, None)
    return local_draft.draft_logprobs(stats, tokens)


@draft_logprobs.register_fake
def _(stats, tokens, backend):
    return stats.new_empty(tuple(tokens.shape), dtype=torch.float32)
