"""Packed layouts of what vocabulary shards exchange, and the softmax-statistics algebra every piece shares.

Every exchanged buffer is float32 with a fixed number of slots per (request, row); token ids travel as float32
values, exact below 2^24 (``ids_to_slots`` / ``slots_to_ids``; the ops require V <= 2^24), so one all-gather moves
one contiguous tensor, a CUDA kernel can write the send buffer directly, and no slot holds a NaN or denormal bit
pattern that a copy or a comparison could alter.

First exchange (``StatsLayout``, per (request, row j in 0..K), one shard):
    AMAX_VAL, AMAX_ID          raw target argmax of the shard (NaN counts as -inf; ties: lowest id)
  sampling only (a temperature tensor):
    T_MAX, T_SUM, T_BAD        softmax statistics of target/T over the shard (BAD: a NaN or +inf scaled logit)
    T_AT                       target/T at the row's draft d_{j+1} (rows < K; written by the shard that owns it)
  with draft logits:
    Q_MAX, Q_SUM, Q_BAD, Q_AT  the same for draft/T (rows < K)
Residual plan (``PLAN_*``, decide -> residual pass, per (request, slot)): the row, whether it is needed, rho, the
    merged (global) softmax statistics of the target row and the draft row's normaliser (its merged statistics, or
    ``(l(d) - draft_logprob, 1, 0)`` where draft_logprobs give it).
Second exchange (``RES_*``, per (request, slot), one shard): the residual mass sum max(rho p - q, 0) over the
    shard, its exponential-race winner (score max(rho p - q, 0) / -log(u)) and the Gumbel race over p (key
    target/T - log(-log(u))) with the same uniforms u = uniform(request, row, RESIDUAL, global id); ties: lowest id.
Drafting (``DRAFT_*``, per (request, position), one shard): softmax statistics of logits/T over the shard, the shard
    winner's scaled logit and id (the log-probability of the drafted token is merged from these after the block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_VOCAB = 2 ** 24      # ids are exact in float32 slots below this
EMPTY_ID = MAX_VOCAB     # the id of an empty slot (larger than every token id, so it loses every tie)

AMAX_VAL, AMAX_ID = 0, 1
T_MAX, T_SUM, T_BAD, T_AT = 2, 3, 4, 5
Q_MAX, Q_SUM, Q_BAD, Q_AT = 6, 7, 8, 9

PLAN_ROW, PLAN_NEED, PLAN_RHO, PLAN_T_MAX, PLAN_T_SUM, PLAN_T_BAD, PLAN_Q_MAX, PLAN_Q_SUM, PLAN_Q_BAD = range(9)
PLAN_WIDTH = 9
RES_MASS, RES_SCORE, RES_ID, RES_GSCORE, RES_GID = range(5)
RES_WIDTH = 5
DRAFT_MAX, DRAFT_SUM, DRAFT_BAD, DRAFT_LWIN, DRAFT_ID = range(5)
DRAFT_WIDTH = 5


@dataclass(frozen=True)
class StatsLayout:
    """Slots of the first exchange for one call: ``sampled`` (a temperature tensor), ``draft`` (draft logits)."""

    sampled: bool
    draft: bool

    @property
    def width(self) -> int:
        if not self.sampled:
            return AMAX_ID + 1
        return Q_AT + 1 if self.draft else T_AT + 1


def plan_slots(sampled: bool, method: str, k_len: int) -> int:
    """Slots per request of the residual plan and of the second exchange: 0 greedy, 1 token (the emitting row),
    K+1 block (every row: S_i, and the emission at tau)."""
    return 0 if not sampled else (1 if method == "token" else k_len + 1)


def ids_to_slots(ids: torch.Tensor) -> torch.Tensor:
    """float32 slots holding ids in [0, 2^24] exactly."""
    return ids.to(torch.float32)


def slots_to_ids(slots: torch.Tensor) -> torch.Tensor:
    """int64 ids from float32 slots written by ``ids_to_slots``."""
    return slots.to(torch.int64)


def nan_to_neg_inf(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(x), float("-inf"), x)


def local_softmax_stats(scaled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum of exp(x - max), bad) over the last dim; NaN and +inf are left out of max and sum and set
    ``bad`` (1.0): torch.softmax turns such a row into NaN everywhere. An all -inf shard gives (-inf, 0, 0)."""
    bad = (torch.isnan(scaled) | (scaled == float("inf"))).any(-1)
    clean = torch.where(torch.isnan(scaled) | (scaled == float("inf")), float("-inf"), scaled)
    m = clean.amax(-1)
    s = torch.where(m > float("-inf"), torch.exp(clean - m.unsqueeze(-1)).sum(-1), 0.0)
    return m, s, bad.float()


def merge_softmax_stats(m: torch.Tensor, s: torch.Tensor, bad: torch.Tensor, dim: int = 0):
    """Merge per-shard statistics along ``dim``: (max, sum, bad) of the whole row. A row with no finite logit is
    bad (softmax of an all -inf row is NaN)."""
    top = m.amax(dim)
    scale = torch.where(m > float("-inf"), torch.exp(m - top.unsqueeze(dim)), 0.0)
    total = (s * scale).sum(dim)
    return top, total, (bad.amax(dim) > 0) | ~(top > float("-inf"))


def softmax_prob(scaled: torch.Tensor, m: torch.Tensor, s: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
    """softmax(row)[x] from a scaled logit and the row's merged statistics (NaN for a bad row); ``m``, ``s``,
    ``bad`` broadcast against ``scaled``."""
    return torch.where(bad, float("nan"), torch.exp(scaled - m) / s)


def argmax_lowest(values: torch.Tensor, ids: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(max, id) along ``dim`` with NaN as -inf and ties to the lowest id (the package's argmax rule, over ids that
    are not positions)."""
    values = nan_to_neg_inf(values)
    best = values.amax(dim)
    pick = torch.where(values == best.unsqueeze(dim), ids, torch.iinfo(torch.int64).max).amin(dim)
    return best, pick


def owner_of(tokens: torch.Tensor, shards: torch.Tensor) -> torch.Tensor:
    """int64 index of the shard (row of ``shards`` int64 [P, 2] = (vocab_start, size)) holding each token; 0 for a
    token no shard holds (only possible when the layout was not validated)."""
    t = tokens.unsqueeze(-1)
    inside = (t >= shards[:, 0]) & (t < shards[:, 0] + shards[:, 1])
    return inside.to(torch.int64).argmax(-1)
