"""``dspark_kernels.distributed.verify_chain``: chain verification over vocabulary-parallel logits."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..ops._common import INT_DTYPES, check_tensor, temperature_tensor
from ..ops.verify_chain import METHODS, VerifyOutput, check_rows, check_verify_options
from ..rng import make_rng_key
from . import comm, ops
from .layout import MAX_VOCAB


def verify_chain(
    target_logits_shard: torch.Tensor,
    draft_tokens: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
    draft_logits_shard: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    draft_logprobs: Optional[torch.Tensor] = None,
    verify_lens: Optional[torch.Tensor] = None,
    survival: Optional[torch.Tensor] = None,
    thresholds: Optional[torch.Tensor] = None,
    temperature: Union[float, torch.Tensor] = 0.0,
    seed=0,
    offset=0,
    stop_token_ids: Optional[torch.Tensor] = None,
    method: str = "token",
    validate: bool = True,
    backend: Optional[str] = "auto",
) -> VerifyOutput:
    """``dk.verify_chain`` over logits sharded by vocabulary across the ranks of ``group``.

    Each rank passes its logits for the global token ids ``[vocab_start, vocab_start + Vl)``; the shards of the
    group must tile ``[0, vocab_size)`` (in any rank order). Every other argument is ``dk.verify_chain``'s, the same
    on every rank (draft tokens, lengths, temperatures, the random key, stop tokens are replicated). Every rank
    returns the same ``VerifyOutput``, equal to ``dk.verify_chain(backend="reference")`` on the gathered logits.

    Args:
        target_logits_shard: float ``[N, K+1, Vl]`` or packed ``[R, Vl]`` (with ``cu_seqlens``).
        draft_logits_shard: float ``[N, K, Vl]``, the same slice of the draft logits, or None (one-hot drafts).
        draft_logprobs: float32 ``[N, K]``, the globally normalised ``log q(d_j)`` (``distributed.draft_block``
            returns them).
        validate: read the gathered shard metadata on the host and raise the same error on every rank when the
            shards do not tile ``[0, vocab_size)``, a rank's shapes or modes differ, or a rank's arguments fail
            their checks (one tiny all-gather, which then synchronises with a GPU group). With False nothing is
            read back: the layout is trusted, and a rank whose arguments fail raises alone.
        backend: of the local pieces: "auto" | "cuda" | "triton" | "reference" (``ops.piece_backend``: each
            piece's CUDA kernel where "cuda" is asked or, with "auto", on a GPU whose extension has it; Triton
            where asked or on a GPU without the extension; the reference elsewhere).

    The two passes of ``dk.verify_chain`` with the merges replicated: the first exchange carries each row's argmax,
    softmax statistics and logits at the drafts (a few floats per (row, shard)); every rank then runs the accept
    chain and names the rows to sample from; the second exchange carries, per such row and shard, the residual's
    mass and race winner and the race over p.

    Collectives: one all-gather of the metadata (P x 8 int64 or so), one all-gather of the per-(row, shard)
    statistics, and for sampling (a temperature tensor, or a float > 0) one all-gather of a fixed-size second
    exchange (token: 20 bytes per request; block: 20 bytes per (request, row)). No logits row is exchanged and
    nothing is read on the host (unless ``validate``).
    """
    n = k_len = rows = local = 0
    error, stats_backend, decide_backend = None, "reference", "reference"
    try:
        check_tensor("draft_tokens", draft_tokens, ndim=2, dtypes=INT_DTYPES)
        n, k_len = draft_tokens.shape
        dev = draft_tokens.device
        stats_backend = ops.piece_backend(backend, dev, "verify_stats")
        decide_backend = ops.piece_backend(backend, dev, "verify_decide")
        residual_backend = ops.piece_backend(backend, dev, "verify_residual")
        if k_len < 1:
            raise ValueError(f"draft_tokens must have K >= 1 columns, got shape {tuple(draft_tokens.shape)}")
        _check_args(target_logits_shard, draft_tokens, draft_logits_shard, cu_seqlens, draft_logprobs, verify_lens,
                    survival, thresholds, stop_token_ids, method, vocab_start, vocab_size)
        rows = target_logits_shard.shape[0] if cu_seqlens is not None else -1
        local = target_logits_shard.shape[-1]
        temps = temperature_tensor(temperature, n, dev)
        rng_key = make_rng_key(seed, offset, dev)
    except (ValueError, TypeError) as e:
        error, dev, temps = e, getattr(draft_tokens, "device", torch.device("cpu")), None
    sampled = temps is not None
    signature = [("N (draft_tokens.shape[0])", n), ("K (draft_tokens.shape[1])", k_len),
                 ("R (packed target rows, -1 dense)", rows), ("cu_seqlens given", cu_seqlens is not None),
                 ("draft_logits_shard given", draft_logits_shard is not None),
                 ("draft_logprobs given", draft_logprobs is not None), ("verify_lens given", verify_lens is not None),
                 ("survival given", survival is not None), ("sampling (temperature)", sampled),
                 ("method", METHODS.index(method) if method in METHODS else -1)]
    shards = comm.shard_table(group, dev, vocab_start=int(vocab_start), local_size=local, vocab_size=int(vocab_size),
                              signature=signature, validate=validate, local_error=error)
    has_draft = draft_logits_shard is not None
    stats = ops.verify_stats(target_logits_shard, cu_seqlens, draft_tokens, draft_logits_shard, temps, vocab_start,
                             vocab_size, stats_backend)
    stats = comm.all_gather(stats, group)
    decide = lambda residual: ops.verify_decide(
        stats, shards, residual, cu_seqlens, max(rows, 0), draft_tokens, draft_logprobs, verify_lens, survival,
        thresholds, temps, rng_key, stop_token_ids, method, has_draft, vocab_size, decide_backend)
    tokens, num_accepted, accept_mask, plan = decide(None)
    if sampled:  # the second exchange: always issued (fixed size), so no rank needs to know whether it is needed
        residual = ops.verify_residual(target_logits_shard, cu_seqlens, draft_tokens, draft_logits_shard, plan, temps,
                                       rng_key, vocab_start, vocab_size, residual_backend)
        tokens, num_accepted, accept_mask, _ = decide(comm.all_gather(residual, group))
    return VerifyOutput(tokens, num_accepted, accept_mask)


def _check_args(target, draft_tokens, draft_logits, cu_seqlens, draft_logprobs, verify_lens, survival, thresholds,
                stop_token_ids, method, vocab_start, vocab_size) -> None:
    """dk.verify_chain's argument checks, on a shard."""
    n, k_len, local, dev = check_rows(target, cu_seqlens, draft_tokens, "target_logits_shard")
    for name, value in (("vocab_start", vocab_start), ("vocab_size", vocab_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if local < 1 or vocab_start < 0 or vocab_start + local > vocab_size or vocab_size > MAX_VOCAB:
        raise ValueError(f"the shard [vocab_start, vocab_start + Vl) = [{vocab_start}, {vocab_start + local}) must be "
                         f"a non-empty part of [0, vocab_size = {vocab_size}) with vocab_size <= 2^24")
    check_verify_options(n, k_len, local, dev, draft_logits, draft_logprobs, verify_lens, survival, thresholds,
                         stop_token_ids, method, draft_logits_name="draft_logits_shard")
