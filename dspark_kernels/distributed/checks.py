"""Argument checks of the local pieces (``ops``) on the reference and Triton backends: what the CUDA launchers
(csrc/torch/dist_*.cpp) check, so every backend refuses the same bad input with an error naming the argument and
no kernel reads past an input. Shapes, dtypes, devices and the integer arguments only: no tensor value is read
(no host synchronisation)."""

from __future__ import annotations

import torch

from ..ops._common import FLOAT_DTYPES, INT_DTYPES, check_tensor
from ..ops.verify_chain import METHODS
from .layout import MAX_VOCAB, PLAN_WIDTH, RES_WIDTH, StatsLayout, plan_slots

_F32 = (torch.float32,)


def _drafts(draft_tokens) -> tuple:
    """(N, K, device) of int ``[N, K]`` drafts, K >= 1."""
    check_tensor("draft_tokens", draft_tokens, ndim=2, dtypes=INT_DTYPES)
    n, k_len = draft_tokens.shape
    if k_len < 1:
        raise ValueError(f"draft_tokens must have K >= 1 columns, got shape {tuple(draft_tokens.shape)}")
    return n, k_len, draft_tokens.device


def _target(target_shard, cu_seqlens, n: int, k_len: int, dev) -> int:
    """The shard's width Vl >= 1 of dense ``[N, K+1, Vl]`` or packed ``[R, Vl]`` (with cu_seqlens ``[N+1]``) rows."""
    if cu_seqlens is None:
        check_tensor("target_shard", target_shard, shape=(n, k_len + 1, None), dtypes=FLOAT_DTYPES, device=dev)
    else:
        check_tensor("target_shard", target_shard, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
        check_tensor("cu_seqlens", cu_seqlens, shape=(n + 1,), dtypes=INT_DTYPES, device=dev)
    if target_shard.shape[-1] < 1:
        raise ValueError("target_shard must have at least one column (the shard's size)")
    return target_shard.shape[-1]


def _span(vocab_start: int, local: int, vocab_size: int) -> None:
    if not (0 <= vocab_start and vocab_start + local <= vocab_size <= MAX_VOCAB):
        raise ValueError(f"the shard [vocab_start, vocab_start + Vl) = [{vocab_start}, {vocab_start + local}) must "
                         f"lie in [0, vocab_size = {vocab_size}) with vocab_size <= 2^24")


def _rng_key(rng_key, dev) -> None:
    check_tensor("rng_key", rng_key, shape=(2,), dtypes=(torch.int64,))
    if rng_key.device != dev and rng_key.device.type != "cpu":
        raise ValueError(f"rng_key must be on {dev} or the CPU, got {rng_key.device}")


def verify_stats(target_shard, cu_seqlens, draft_tokens, draft_logits_shard, temperature, vocab_start,
                 vocab_size) -> None:
    n, k_len, dev = _drafts(draft_tokens)
    local = _target(target_shard, cu_seqlens, n, k_len, dev)
    _span(vocab_start, local, vocab_size)
    check_tensor("draft_logits_shard", draft_logits_shard, shape=(n, k_len, local), dtypes=FLOAT_DTYPES,
                 device=dev, optional=True)
    check_tensor("temperature", temperature, shape=(n,), dtypes=_F32, device=dev, optional=True)


def verify_decide(stats, shards, residual, cu_seqlens, num_rows, draft_tokens, draft_logprobs, verify_lens, survival,
                  thresholds, temperature, rng_key, stop_token_ids, method, has_draft_logits, vocab_size) -> None:
    n, k_len, dev = _drafts(draft_tokens)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not 1 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size must be in [1, 2^24], got {vocab_size}")
    sampled = temperature is not None
    width = StatsLayout(sampled, sampled and has_draft_logits).width
    check_tensor("stats", stats, shape=(None, n, k_len + 1, width), dtypes=_F32, device=dev)
    shard_count = stats.shape[0]
    if shard_count < 1:
        raise ValueError("stats must hold at least one shard")
    check_tensor("shards", shards, shape=(shard_count, 2), dtypes=(torch.int64,), device=dev)
    check_tensor("residual", residual, shape=(shard_count, n, plan_slots(sampled, method, k_len), RES_WIDTH),
                 dtypes=_F32, device=dev, optional=True)
    check_tensor("cu_seqlens", cu_seqlens, shape=(n + 1,), dtypes=INT_DTYPES, device=dev, optional=True)
    check_tensor("draft_logprobs", draft_logprobs, shape=(n, k_len), dtypes=_F32, device=dev, optional=True)
    check_tensor("verify_lens", verify_lens, shape=(n,), dtypes=INT_DTYPES, device=dev, optional=True)
    if (survival is None) != (thresholds is None):
        raise ValueError("survival and thresholds must be given together")
    check_tensor("survival", survival, shape=(n, k_len), dtypes=FLOAT_DTYPES, device=dev, optional=True)
    check_tensor("thresholds", thresholds, shape=(k_len,), dtypes=FLOAT_DTYPES, device=dev, optional=True)
    check_tensor("temperature", temperature, shape=(n,), dtypes=_F32, device=dev, optional=True)
    _rng_key(rng_key, dev)
    check_tensor("stop_token_ids", stop_token_ids, ndim=1, dtypes=INT_DTYPES, device=dev, optional=True)


def verify_residual(target_shard, cu_seqlens, draft_tokens, draft_logits_shard, plan, temperature, rng_key,
                    vocab_start, vocab_size) -> None:
    n, k_len, dev = _drafts(draft_tokens)
    local = _target(target_shard, cu_seqlens, n, k_len, dev)
    _span(vocab_start, local, vocab_size)
    check_tensor("draft_logits_shard", draft_logits_shard, shape=(n, k_len, local), dtypes=FLOAT_DTYPES,
                 device=dev, optional=True)
    check_tensor("plan", plan, shape=(n, None, PLAN_WIDTH), dtypes=_F32, device=dev)
    check_tensor("temperature", temperature, shape=(n,), dtypes=_F32, device=dev)
    _rng_key(rng_key, dev)


def draft_step(base_logits_k, v, w2_shard, temperature, rng_key, position, vocab_start, return_logits) -> None:
    check_tensor("base_logits_k", base_logits_k, ndim=2, dtypes=FLOAT_DTYPES)
    n, local = base_logits_k.shape
    dev = base_logits_k.device
    if local < 1:
        raise ValueError("base_logits_k must have at least one column (the shard's size)")
    check_tensor("v", v, shape=(n, None), dtypes=_F32, device=dev)
    if v.shape[1] < 1:
        raise ValueError(f"v must have r >= 1 columns, got shape {tuple(v.shape)}")
    check_tensor("w2_shard", w2_shard, shape=(local, v.shape[1]), dtypes=FLOAT_DTYPES, device=dev)
    check_tensor("temperature", temperature, shape=(n,), dtypes=_F32, device=dev, optional=True)
    _rng_key(rng_key, dev)
    if not 0 <= position < 2 ** 24:
        raise ValueError(f"position must be in [0, 2^24), got {position}")
    _span(vocab_start, local, MAX_VOCAB)
