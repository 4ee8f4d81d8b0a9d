"""Reference (pure PyTorch) local pieces of a vocabulary-parallel draft_block: the spec of the shard passes.

Position k of the Markov head is ``logits_k = U_k + W2 @ v_k``; with W2 sharded by vocabulary rows like the LM
head, a shard computes its slice of logits_k from the replicated head vector v_k (``head_vector``) and reduces it
to one packed int64 per request (``draft_step``): its winner's race key and global id, ordered so that an integer
MAX over the shards gives the unsharded winner (``pack_key`` / ``unpack_id``). After the block, the per-position
softmax statistics of every shard give the drafted tokens' log-probabilities (``draft_logprobs``).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..rng import STREAM_DRAFT, argmax_nan_low, uniform
from . import layout as L
from .layout import ids_to_slots, slots_to_ids

_ID_MASK = 2 ** 31 - 1


def pack_key(value: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 whose signed order is (value, then lower id first): value's float32 bits mapped to a monotone
    unsigned order in the high 32 bits, ``2^31 - 1 - id`` in the low ones. NaN counts as -inf and -0.0 as +0.0
    (torch.argmax's rule), so an integer MAX all-reduce is the package's argmax over the shards' winners."""
    v = torch.where(torch.isnan(value), float("-inf"), value.float()) + 0.0
    bits = v.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    ordered = torch.where(bits >= 2 ** 31, 0xFFFFFFFF - bits, bits + 2 ** 31)       # monotone uint32 of v
    return (ordered - 2 ** 31) * 2 ** 32 + (_ID_MASK - ids.to(torch.int64))


def unpack_id(packed: torch.Tensor) -> torch.Tensor:
    """The global token id of a ``pack_key`` value."""
    return _ID_MASK - (packed & 0xFFFFFFFF)


def head_vector(kind: str, e: torch.Tensor, h: Optional[torch.Tensor], state: torch.Tensor, wg, bg, wj, bj):
    """(v [N, r], new rnn state) of the Markov head at one position from e = W1[x_{k-1}] (replicated work)."""
    if kind == "vanilla":
        return e, state
    if kind == "gated":
        return torch.sigmoid(torch.cat([h, e], dim=-1) @ wg.float().T + bg.float()) * e, state
    gate, cand, out = (torch.cat([state, e, h], dim=-1) @ wj.float().T + bj.float()).chunk(3, dim=-1)
    state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
    return torch.tanh(out), state


def draft_step(base_logits_k: torch.Tensor, v: torch.Tensor, w2_shard: torch.Tensor,
               temperature: Optional[torch.Tensor], rng_key: torch.Tensor, position: int, vocab_start: int,
               return_logits: bool):
    """One position on one shard.

    Args: base_logits_k float [N, Vl] (U at this position), v float32 [N, r], w2_shard float [Vl, r],
    temperature float32 [N] or None (all greedy).
    Returns: (packed int64 [N] for the MAX all-reduce, stats float32 [N, DRAFT_WIDTH] (softmax statistics of
    logits/T' over the shard, T' = T for sampled requests and 1 for greedy ones, the shard winner's scaled logit
    and id), logits float32 [N, Vl] or an empty tensor).
    """
    n, local = base_logits_k.shape
    dev = base_logits_k.device
    logits = base_logits_k.float() + v @ w2_shard.float().T
    safe_t = torch.ones(n, 1, device=dev)
    key = logits
    if temperature is not None:
        sampled = temperature > 0
        safe_t = torch.where(sampled, temperature, 1.0).unsqueeze(-1)
        ids = vocab_start + torch.arange(local, device=dev)
        u = uniform(rng_key, torch.arange(n, device=dev).unsqueeze(-1), position, STREAM_DRAFT, ids)
        key = torch.where(sampled.unsqueeze(-1), logits / safe_t - torch.log(-torch.log(u)), logits)
    win = argmax_nan_low(key).unsqueeze(-1)
    packed = pack_key(key.gather(-1, win).squeeze(-1), win.squeeze(-1) + vocab_start)
    scaled = logits / safe_t
    stats = torch.empty(n, L.DRAFT_WIDTH, device=dev)
    stats[:, L.DRAFT_MAX], stats[:, L.DRAFT_SUM], stats[:, L.DRAFT_BAD] = L.local_softmax_stats(scaled)
    stats[:, L.DRAFT_LWIN] = scaled.gather(-1, win).squeeze(-1)
    stats[:, L.DRAFT_ID] = ids_to_slots(win.squeeze(-1) + vocab_start)
    return packed, stats, logits if return_logits else logits.new_empty(0)


def draft_logprobs(stats: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32 [N, K]: log_softmax(logits_k / T')[tokens] from every shard's stats [P, N, K, DRAFT_WIDTH] (the
    drafted token is the winner of exactly one shard); NaN for a row torch.log_softmax makes NaN."""
    m, s, bad = L.merge_softmax_stats(stats[..., L.DRAFT_MAX], stats[..., L.DRAFT_SUM], stats[..., L.DRAFT_BAD])
    mine = slots_to_ids(stats[..., L.DRAFT_ID]) == tokens.to(torch.int64)
    lwin = torch.where(mine, stats[..., L.DRAFT_LWIN], float("-inf")).amax(0)
    return torch.where(bad, float("nan"), (lwin - m) - torch.log(s))
