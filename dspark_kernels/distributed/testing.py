"""Run a function in P spawned processes joined by a gloo group (tests and examples of the distributed ops)."""

from __future__ import annotations

import datetime
import faulthandler
import sys
from typing import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn(world: int, fn, *args, timeout_s: float = 180.0) -> None:
    """``fn(rank, world, *args)`` on ``world`` processes with the default group initialised (gloo, CPU); an
    exception on any rank is raised here. ``fn`` must be importable (a module-level function). Collectives give up
    after ``timeout_s``, so a rank left waiting fails instead of hanging. The rendezvous is a TCP store this process
    serves on a port the kernel picks (no file store: its rendezvous races, and a rank then aborts inside gloo).

    A rank killed by SIGABRT (``std::terminate`` with no exception: seen once in CI, not reproduced in 70 runs
    here) prints every thread's Python stack (faulthandler) and the group runs once more, said on stderr; a second
    abort, any other signal and any Python exception fail at once."""
    for attempt in (1, 2):
        store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        try:
            mp.spawn(_entry, args=(world, store.port, fn, args, timeout_s), nprocs=world, join=True)
            return
        except mp.ProcessExitedException as e:
            if e.signal_name != "SIGABRT" or attempt == 2:
                raise
            print(f"spawn: rank {e.error_index} of {fn.__name__} aborted (SIGABRT); the group runs once more",
                  file=sys.stderr)


def _entry(rank, world, port, fn, args, timeout_s):
    faulthandler.enable(all_threads=True)  # a rank killed by a signal prints where each of its threads was
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        fn(rank, world, *args)
        dist.barrier()  # no rank tears its pairs down while a peer is still inside a collective with it
    finally:
        dist.destroy_process_group()


def shard_spans(sizes: Sequence[int], order: Sequence[int] = None) -> list:
    """(vocab_start, size) of each rank: shards of the given sizes tile the vocabulary in ``order`` (rank ids in
    vocabulary order; default rank order)."""
    order = list(order) if order is not None else list(range(len(sizes)))
    spans = [None] * len(sizes)
    start = 0
    for rank in order:
        spans[rank] = (start, sizes[rank])
        start += sizes[rank]
    return spans


def even_sizes(vocab: int, world: int) -> list:
    """Sizes of ``world`` shards as even as possible (the first ones one larger)."""
    return [vocab // world + (r < vocab % world) for r in range(world)]
