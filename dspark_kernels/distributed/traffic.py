"""Bytes the vocabulary-parallel ops exchange per call, against all-gathering the logits (a model of the calls
the ops issue, checked against ``comm.count_traffic`` in the tests)."""

from __future__ import annotations

from .comm import Traffic
from .layout import DRAFT_WIDTH, RES_WIDTH, StatsLayout, plan_slots

_META_FIXED = 4          # vocab_start, local size, vocab_size, error flag
_VERIFY_SIGNATURE = 10   # entries of verify_chain's signature
_DRAFT_SIGNATURE = 6


def verify_calls(n: int, k: int, world: int, *, sampled: bool, draft_logits: bool, method: str = "token") -> Traffic:
    """The collectives of one ``distributed.verify_chain`` call."""
    width = StatsLayout(sampled, draft_logits).width
    calls = [("all_gather", 8 * (_META_FIXED + _VERIFY_SIGNATURE), world),
             ("all_gather", 4 * n * (k + 1) * width, world)]
    if sampled:
        calls.append(("all_gather", 4 * n * plan_slots(True, method, k) * RES_WIDTH, world))
    return Traffic(calls)


def draft_calls(n: int, k: int, world: int) -> Traffic:
    """The collectives of one ``distributed.draft_block`` call."""
    calls = [("all_gather", 8 * (_META_FIXED + _DRAFT_SIGNATURE), world)]
    calls += [("all_reduce", 8 * n, world)] * k
    calls.append(("all_gather", 4 * n * k * DRAFT_WIDTH, world))
    return Traffic(calls)


def exchange_bytes(op: str, n: int, k: int, world: int, **mode) -> int:
    """Bytes each rank receives in one call of ``op`` ("verify_chain" with ``sampled``, ``draft_logits``,
    ``method``; or "draft_block")."""
    traffic = verify_calls(n, k, world, **mode) if op == "verify_chain" else draft_calls(n, k, world)
    return traffic.received_per_rank()


def logits_gather_bytes(op: str, n: int, k: int, vocab: int, world: int, *, draft_logits: bool = False,
                        dtype_bytes: int = 2) -> int:
    """Bytes each rank receives when the logits are all-gathered instead: verify, the target rows [N, K+1, V]
    (+ the draft rows [N, K, V]); draft_block, each position's logits [N, V] (K all-gathers)."""
    rows = n * (k + 1) + (n * k if draft_logits else 0) if op == "verify_chain" else n * k
    return (world - 1) * (rows * vocab * dtype_bytes) // world
