#!/usr/bin/env python
"""The cost of one cooperative-groups grid barrier on the GPU at hand, measured (bench/model.py's ``grid_barrier_s``).

    python bench/grid_barrier.py [--ctas N] [--threads T] [--rounds R] [--json PATH]

A cooperative launch of ``--ctas`` CTAs (default: one per SM, draft_block's grid) of ``--threads`` threads (128,
draft_block's CTA) runs ``cooperative_groups::this_grid().sync()`` R times in a loop with no other work; the same
launch with no barrier is timed beside it, and a barrier's cost is the difference over R (the median of several
launches of each, timed with CUDA events). That is the barrier's cost when every CTA arrives together; a kernel whose
CTAs arrive apart waits for the last one as well, which the model's body term already holds (it charges the slowest
SM's work).

The kernel is compiled at run time by CuPy (NVRTC), which the GPU machine's image carries; without CuPy or a GPU the
script says so and exits 2. ``bench/gpu_check.sh`` runs it and keeps ``grid_barrier.json``; its ``barrier_us``
replaces bench/model.py's constant through ``bench/model_headline.py --grid-barrier-us``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from typing import Callable, Dict, Optional, Sequence

SOURCE = r"""
#include <cooperative_groups.h>
extern "C" __global__ void grid_barriers(int rounds, int* sink) {
  cooperative_groups::grid_group grid = cooperative_groups::this_grid();
  for (int i = 0; i < rounds; ++i) grid.sync();
  if (blockIdx.x == 0 && threadIdx.x == 0) sink[0] = rounds;  // keeps the loop
}
"""


def per_barrier_us(time_launch: Callable[[int], float], rounds: int, repeats: int = 7) -> Dict[str, float]:
    """The cost of one barrier from ``time_launch(r)`` (the time in microseconds of one launch running ``r``
    barriers): (median time at ``rounds`` - median time at 0) / ``rounds``, with both medians and their spreads."""
    if rounds < 1 or repeats < 1:
        raise ValueError(f"rounds and repeats must be >= 1, got {rounds} and {repeats}")
    time_launch(rounds)  # warm-up: module load, first launch
    base = [time_launch(0) for _ in range(repeats)]
    full = [time_launch(rounds) for _ in range(repeats)]
    m0, m1 = statistics.median(base), statistics.median(full)
    return dict(barrier_us=(m1 - m0) / rounds, empty_launch_us=m0, launch_us=m1, rounds=rounds, repeats=repeats,
                spread_us=max(max(base) - min(base), max(full) - min(full)))


def cupy_launcher(ctas: int, threads: int) -> Callable[[int], float]:
    """A ``time_launch(rounds)`` running the barrier kernel as one cooperative launch through CuPy, timed with CUDA
    events (microseconds)."""
    import cupy as cp
    kernel = cp.RawKernel(SOURCE, "grid_barriers", enable_cooperative_groups=True)
    sink = cp.zeros(1, dtype=cp.int32)
    start, stop = cp.cuda.Event(), cp.cuda.Event()

    def time_launch(rounds: int) -> float:
        start.record()
        kernel((ctas,), (threads,), (cp.int32(rounds), sink))
        stop.record()
        stop.synchronize()
        return 1e3 * cp.cuda.get_elapsed_time(start, stop)

    return time_launch


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctas", type=int, default=0, help="CTAs (default: the GPU's SM count)")
    ap.add_argument("--threads", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    try:
        import cupy as cp
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    except Exception as e:  # no CuPy, or no GPU
        print(f"grid_barrier: needs CuPy and a GPU ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    ctas = args.ctas or int(props["multiProcessorCount"])
    result = per_barrier_us(cupy_launcher(ctas, args.threads), args.rounds)
    result.update(gpu=props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
                  ctas=ctas, threads=args.threads, note="measured: CUDA events around cooperative launches")
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        pathlib.Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
