"""The collectives of the vocabulary-parallel ops, their byte counter, and the shard-layout check.

Everything goes through ``torch.distributed`` (gloo on CPU tensors, NCCL on CUDA tensors) on the caller's group.
``all_gather`` stacks every rank's tensor in rank order; ``all_reduce_max`` is an integer MAX in place. Neither
reads a value on the host. ``count_traffic`` records each collective's payload so tests and the bench can check
the bytes a call moves.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist


@dataclass
class Traffic:
    """Collectives issued while counting: (kind, bytes one rank contributes, world size) each."""

    calls: list = field(default_factory=list)

    def received_per_rank(self) -> int:
        """Bytes each rank receives: (P - 1) x its contribution for an all-gather, 2 (P - 1) / P x the buffer for
        a ring all-reduce."""
        total = 0.0
        for kind, nbytes, world in self.calls:
            total += (world - 1) * nbytes if kind == "all_gather" else 2 * (world - 1) / world * nbytes
        return int(round(total))


_counters: list = []


@contextlib.contextmanager
def count_traffic():
    """Record the collectives issued inside the block: ``with count_traffic() as t: ...; t.calls``."""
    t = Traffic()
    _counters.append(t)
    try:
        yield t
    finally:
        _counters.remove(t)


def _record(kind: str, t: torch.Tensor, world: int) -> None:
    for c in _counters:
        c.calls.append((kind, t.numel() * t.element_size(), world))


def all_gather(t: torch.Tensor, group) -> torch.Tensor:
    """``[P, *t.shape]``: every rank's ``t`` in rank order."""
    world = dist.get_world_size(group)
    t = t.contiguous()
    _record("all_gather", t, world)
    out = t.new_empty((world,) + tuple(t.shape))
    if t.is_cuda:
        dist.all_gather_into_tensor(out, t, group=group)
    else:
        dist.all_gather(list(out.unbind(0)), t, group=group)
    return out


def all_reduce_max(t: torch.Tensor, group) -> torch.Tensor:
    """In-place elementwise MAX over the ranks (integer tensors: exact)."""
    _record("all_reduce", t, dist.get_world_size(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


class ShardLayoutError(ValueError):
    """The shards of a vocabulary-parallel call do not fit together; raised on every rank."""


def shard_table(group, device: torch.device, *, vocab_start: int, local_size: int, vocab_size: int,
                signature: Sequence[tuple], validate: bool, local_error: Optional[BaseException]) -> torch.Tensor:
    """int64 ``[P, 2]`` (vocab_start, size) of every rank's shard, on ``device``, from one all-gather of each rank's
    metadata (64 bytes or so).

    ``signature`` lists (name, value) integers that must agree across ranks (shapes, modes). With ``validate`` the
    gathered table is read on the host (a synchronisation with a GPU group) and every rank raises the same
    ``ShardLayoutError`` when the shards do not tile [0, vocab_size) or a signature entry differs; a rank whose own
    arguments failed their checks (``local_error``) raises that error after the exchange, the others a
    ``ShardLayoutError`` naming it, so no rank is left waiting in a later collective. Without ``validate`` nothing
    is read back and the layout is trusted (a local error is raised at once).
    """
    if local_error is not None and not validate:
        raise local_error
    values = [vocab_start, local_size, vocab_size, int(local_error is not None)] + [int(v) for _, v in signature]
    meta = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":  # a pinned staging buffer: the copy is enqueued without waiting for the stream
        meta = meta.pin_memory().to(device, non_blocking=True)
    table = all_gather(meta, group)
    if validate:
        _check_table(table.cpu().tolist(), [name for name, _ in signature], local_error)
    return table[:, :2].contiguous()


def _check_table(rows: list, names: list, local_error: Optional[BaseException]) -> None:
    if local_error is not None:
        raise local_error
    failed = [r for r, row in enumerate(rows) if row[3]]
    if failed:
        raise ShardLayoutError(f"rank(s) {failed} rejected their arguments (see the error raised there)")
    for i, name in enumerate(["vocab_size"] + names):
        col = 2 if i == 0 else 3 + i
        values = [row[col] for row in rows]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ShardLayoutError(f"{name} differs across ranks ({per_rank})")
    vocab = rows[0][2]
    spans = sorted((row[0], row[1], r) for r, row in enumerate(rows))
    expect = 0
    for start, size, r in spans:
        if size < 1:
            raise ShardLayoutError(f"rank {r} holds an empty vocabulary shard (local V = {size})")
        if start != expect:
            what = "overlaps the previous shard" if start < expect else f"leaves [{expect}, {start}) to no rank"
            raise ShardLayoutError(f"vocabulary shards do not tile [0, {vocab}): rank {r} starts at {start}, which "
                                   f"{what}")
        expect = start + size
    if expect != vocab:
        raise ShardLayoutError(f"vocabulary shards do not tile [0, {vocab}): they end at {expect}")
