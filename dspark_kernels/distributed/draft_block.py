"""``dspark_kernels.distributed.draft_block``: Markov-head block drafting over a vocabulary-parallel head."""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..ops._common import FLOAT_DTYPES, INT_DTYPES, check_tensor, temperature_tensor
from ..ops.draft_block import HEAD_KINDS, ConfidenceHead, DraftBlockOutput, MarkovHead
from ..reference.draft_block import markov_embed
from ..rng import make_rng_key
from . import comm, ops
from .layout import MAX_VOCAB
from .local_draft import head_vector, unpack_id


def draft_block(
    base_logits_shard: torch.Tensor,
    anchor_tokens: torch.Tensor,
    head_shard: MarkovHead,
    *,
    vocab_start: int,
    vocab_size: int,
    group=None,
    hidden: Optional[torch.Tensor] = None,
    confidence: Optional[ConfidenceHead] = None,
    temperature: Union[float, torch.Tensor] = 0.0,
    seed=0,
    offset=0,
    return_logits: bool = False,
    validate: bool = True,
    backend: Optional[str] = "auto",
) -> DraftBlockOutput:
    """``dk.draft_block`` with the vocabulary split across the ranks of ``group``.

    Each rank passes the backbone's base logits for the global ids ``[vocab_start, vocab_start + Vl)``
    (``base_logits_shard [N, K, Vl]``) and a ``MarkovHead`` whose ``w2`` is the same row slice of W2 (``[Vl, r]``,
    like a vocabulary-parallel LM head) while ``w1 [V, r]``, ``wg``, ``bg``, ``wj``, ``bj``, ``hidden`` and the
    confidence head are replicated: every rank computes the head vector v_k itself, so a position costs one
    collective (an int64 MAX of N packed (key, id) pairs), never an exchange of embedding rows.

    Every rank returns the same tokens, ``draft_logprobs`` (log q of each token under the whole row's softmax),
    ``conf_logits`` and ``survival``, equal to ``dk.draft_block`` on the gathered inputs; ``logits`` (with
    ``return_logits``) is this rank's slice ``[N, K, Vl]``, the ``draft_logits_shard`` of
    ``distributed.verify_chain``. ``validate``: as in ``distributed.verify_chain``; ``backend`` of the per-position
    piece: "auto" | "cuda" | "triton" | "reference" (``ops.piece_backend``).

    Collectives: the metadata all-gather, K all-reduces (MAX) of N int64, one all-gather of [N, K, 5] float32.
    """
    error = None
    n = k_len = local = rank = 0
    dev = getattr(base_logits_shard, "device", torch.device("cpu"))
    try:
        backend = ops.piece_backend(backend, dev, "draft_step")
        n, k_len, local, rank = _check_args(base_logits_shard, anchor_tokens, head_shard, hidden, confidence,
                                            vocab_start, vocab_size)
        temps = temperature_tensor(temperature, n, dev)
        rng_key = make_rng_key(seed, offset, dev)
    except (ValueError, TypeError) as e:
        error, temps = e, None
    signature = [("N (base_logits_shard.shape[0])", n), ("K (base_logits_shard.shape[1])", k_len),
                 ("r (head_shard.w2.shape[1])", rank), ("head kind", HEAD_KINDS.index(head_shard.kind)
                                                        if getattr(head_shard, "kind", None) in HEAD_KINDS else -1),
                 ("confidence head given", confidence is not None), ("sampling (temperature)", temps is not None)]
    comm.shard_table(group, dev, vocab_start=int(vocab_start), local_size=local, vocab_size=int(vocab_size),
                     signature=signature, validate=validate, local_error=error)

    state = torch.zeros(n, rank, dtype=torch.float32, device=dev)
    prev = anchor_tokens.to(torch.int64)
    tokens, stats, logits, conf = [], [], [], []
    for k in range(k_len):
        e = markov_embed(head_shard.w1, prev)
        h = hidden[:, k].float() if hidden is not None else None
        v, state = head_vector(head_shard.kind, e, h, state, head_shard.wg, head_shard.bg, head_shard.wj,
                               head_shard.bj)
        packed, part, lg = ops.draft_step(base_logits_shard[:, k], v.float().contiguous(), head_shard.w2, temps,
                                          rng_key, k, vocab_start, bool(return_logits), backend)
        prev = unpack_id(comm.all_reduce_max(packed, group))
        tokens.append(prev)
        stats.append(part)
        logits.append(lg)
        if confidence is not None:
            conf.append(torch.cat([h, e], dim=-1) @ confidence.weight.float().reshape(-1) + _bias(confidence, dev))
    tokens = torch.stack(tokens, dim=1)
    logprobs = ops.draft_logprobs(comm.all_gather(torch.stack(stats, dim=1), group), tokens, "reference")
    conf_logits = survival = None
    if confidence is not None:
        conf_logits = torch.stack(conf, dim=1)
        sts = confidence.sts_temperatures
        temps_k = sts.float() if sts is not None else torch.ones(k_len, device=dev)
        survival = torch.cumprod(torch.sigmoid(conf_logits / temps_k), dim=-1)
    out_logits = torch.stack(logits, dim=1) if return_logits else None
    return DraftBlockOutput(tokens, out_logits, conf_logits, survival, logprobs)


def _bias(confidence: ConfidenceHead, dev) -> torch.Tensor:
    b = confidence.bias
    return b.float().reshape(()) if isinstance(b, torch.Tensor) else torch.full((), float(b), device=dev)


def _check_args(base, anchor_tokens, head, hidden, confidence, vocab_start, vocab_size):
    """dk.draft_block's argument checks on a shard; returns (N, K, Vl, r)."""
    check_tensor("base_logits_shard", base, ndim=3, dtypes=FLOAT_DTYPES)
    n, k_len, local = base.shape
    dev = base.device
    if k_len < 1 or local < 1:
        raise ValueError(f"base_logits_shard must have K >= 1 and Vl >= 1, got shape {tuple(base.shape)}")
    for name, value in (("vocab_start", vocab_start), ("vocab_size", vocab_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if vocab_start < 0 or vocab_start + local > vocab_size or vocab_size > MAX_VOCAB:
        raise ValueError(f"the shard [vocab_start, vocab_start + Vl) = [{vocab_start}, {vocab_start + local}) must be "
                         f"part of [0, vocab_size = {vocab_size}) with vocab_size <= 2^24")
    check_tensor("anchor_tokens", anchor_tokens, shape=(n,), dtypes=INT_DTYPES, device=dev)
    if not isinstance(head, MarkovHead):
        raise TypeError(f"head_shard must be a dk.MarkovHead, got {type(head).__name__}")
    if head.kind not in HEAD_KINDS:
        raise ValueError(f"head_shard.kind must be one of {HEAD_KINDS}, got {head.kind!r}")
    if head.draft_to_target is not None:
        raise ValueError("head_shard.draft_to_target: distributed.draft_block drafts over the target vocabulary "
                         "only; a reduced draft vocabulary is not sharded yet (use dk.draft_block)")
    check_tensor("head_shard.w1", head.w1, shape=(vocab_size, None), dtypes=FLOAT_DTYPES, device=dev)
    rank = head.w1.shape[1]
    check_tensor("head_shard.w2", head.w2, shape=(local, rank), dtypes=FLOAT_DTYPES, device=dev)
    if (head.kind != "vanilla" or confidence is not None) and hidden is None:
        raise ValueError(f"hidden [N, K, d] is required by the {head.kind} head"
                         + (" and the confidence head" if confidence is not None else ""))
    check_tensor("hidden", hidden, shape=(n, k_len, None), dtypes=FLOAT_DTYPES, device=dev, optional=True)
    d = hidden.shape[2] if hidden is not None else 0
    if head.kind == "gated":
        check_tensor("head_shard.wg", head.wg, shape=(rank, d + rank), dtypes=FLOAT_DTYPES, device=dev)
        check_tensor("head_shard.bg", head.bg, shape=(rank,), dtypes=FLOAT_DTYPES, device=dev)
    elif head.kind == "rnn":
        check_tensor("head_shard.wj", head.wj, shape=(3 * rank, 2 * rank + d), dtypes=FLOAT_DTYPES, device=dev)
        check_tensor("head_shard.bj", head.bj, shape=(3 * rank,), dtypes=FLOAT_DTYPES, device=dev)
    if confidence is not None:
        check_tensor("confidence.weight", confidence.weight, dtypes=FLOAT_DTYPES, device=dev)
        if confidence.weight.numel() != d + rank:
            raise ValueError(f"confidence.weight must have d + r = {d + rank} elements, got shape "
                             f"{tuple(confidence.weight.shape)}")
        check_tensor("confidence.sts_temperatures", confidence.sts_temperatures, shape=(k_len,), dtypes=FLOAT_DTYPES,
                     device=dev, optional=True)
    return n, k_len, local, rank
