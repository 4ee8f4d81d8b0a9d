#!/usr/bin/env python
"""Nsight Compute's measured counters for the CUDA kernels of each op at the headline shapes, on a lent GPU.

    python bench/ncu.py --ncu /path/to/ncu --json ncu.json [--op draft_block verify_chain] [--N 1 64]

Runs ncu once per case (``bench/cases.py``'s full grid cut to K = 7, V = 151936, bf16, the N asked for, greedy and
sampled), each time profiling the CUDA backend's launches of one call of that case (after a warm-up call that ncu
skips), with clocks left alone. Per case it writes the kernels launched and, per launch and in total: duration,
DRAM bytes read and written, the SM and DRAM throughput as a percentage of peak, achieved occupancy and warp
instructions executed, beside the case's bytes floor (``bench/floors.py``). Measured counters only; ncu's durations
are serialised launches with its own overhead, so ``bench/run.py``'s CUDA-event times stay the timings of record.

``--launch OP INDEX`` (what each ncu run executes) makes the warm-up call and the profiled call of one case.
``--report CSV`` turns one of ncu's ``--csv`` outputs into the per-launch rows (for a CSV made by hand).
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import os
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("DSPARK_USE_INSTALLED") != "1":  # bench/gpu_check.sh sets it to run an installed wheel
    sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

METRICS = {  # ncu metric -> row key
    "gpu__time_duration.sum": "duration_us",
    "dram__bytes_read.sum": "dram_read_bytes",
    "dram__bytes_write.sum": "dram_write_bytes",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "smsp__inst_executed.sum": "warp_instructions",
}
_SCALE = {  # ncu's units -> microseconds / bytes
    "nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6, "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6,
    "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9,
}
DEFAULT_OPS = ["draft_block", "verify_chain", "accept_prefix_scan", "schedule_verify_lens"]
MARK = "bench/ncu.py: profiled call"


def headline_grid(ns: List[int]) -> dict:
    from cases import GRIDS
    return dict(GRIDS["full"], N=ns, K=[7], V=[151936], dtype=["bf16"], w2=["same"], top_k=[0])


def case_list(op: str, ns: List[int], dev="cuda"):
    from cases import cases_for
    return list(cases_for(op, dev, headline_grid(ns), "full"))


def launch(op: str, index: int, ns: List[int]) -> None:
    """One warm-up call (builds, caches; not profiled: ncu's --launch-skip counts it) and the profiled call."""
    import torch
    case = case_list(op, ns)[index]
    x = case.inputs()
    case.run("cuda", x)
    torch.cuda.synchronize()
    print(MARK, op, case.params, flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    case.run("cuda", x)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def parse_ncu_csv(text: str) -> List[Dict[str, object]]:
    """ncu's ``--csv --page details`` output -> one dict per profiled launch, in launch order: kernel, grid and the
    :data:`METRICS` it holds (times in microseconds, bytes in bytes). Lines before the header are skipped."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError('no ncu CSV header (a line starting with "ID") in the input')
    launches: Dict[str, Dict[str, object]] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        rec = launches.setdefault(row["ID"], {"kernel": row.get("Kernel Name", ""), "grid": row.get("Grid Size", "")})
        key = METRICS.get(row.get("Metric Name", ""))
        value = row.get("Metric Value", "").replace(",", "")
        if key is None or value in ("", "n/a", "no data"):
            continue
        unit = row.get("Metric Unit", "")
        scale = 1.0 if unit in ("", "%", "inst", "warp") else _SCALE.get(unit)
        if scale is None:
            raise ValueError(f"{row['Metric Name']} in an unknown unit {unit!r}")
        rec[key] = float(value) * scale
    return [launches[i] for i in sorted(launches, key=int)]


def case_row(op: str, params: dict, floor_bytes: int, launches: List[Dict[str, object]]) -> dict:
    total = {k: sum(float(ln.get(k, 0.0)) for ln in launches)
             for k in ("duration_us", "dram_read_bytes", "dram_write_bytes", "warp_instructions")}
    dram = total["dram_read_bytes"] + total["dram_write_bytes"]
    return dict(op=op, **params, launches=len(launches), floor_bytes=floor_bytes, **total,
                dram_over_floor=round(dram / max(floor_bytes, 1), 3), kernels=launches)


def interleaved(ops: List[str], ns: List[int]) -> List[tuple]:
    """(op, index, case) of every op's cases, the ops taking turns (each op's cases in their order), so that a time
    budget that ends the list early leaves every op some profiled cases."""
    lists = [[(op, i, c) for i, c in enumerate(case_list(op, ns, dev="meta"))] for op in ops]
    return [entry for turn in itertools.zip_longest(*lists) for entry in turn if entry is not None]


def profile(ncu: str, ops: List[str], ns: List[int], timeout: float, time_budget: Optional[float] = None,
            on_row: Optional[Callable[[List[dict]], None]] = None) -> List[dict]:
    """One ncu run per case (``interleaved``), at most ``timeout`` seconds each; no case starts after
    ``time_budget`` seconds, and none runs past it (each is a row saying so). ``on_row(rows so far)`` after each
    case, so that a run stopped from outside keeps the cases it profiled."""
    metrics = ",".join(METRICS)
    rows: List[dict] = []
    cases = interleaved(ops, ns)
    t0 = time.perf_counter()
    for op, i, case in cases:
        left = timeout if time_budget is None else min(timeout, time_budget - (time.perf_counter() - t0))
        if left < 1:
            rows.append(dict(op=op, **case.params, skipped="the time budget was spent"))
            continue
        cmd = [ncu, "--csv", "--page", "details", "--clock-control", "none", "--profile-from-start", "off",
               "--metrics", metrics, sys.executable, os.path.abspath(__file__), "--launch", op, str(i), "--N",
               *map(str, ns)]
        try:
            rows.append(case_row(op, case.params, case.floor.total, parse_ncu_csv(_run_group(cmd, left))))
        except subprocess.TimeoutExpired as e:
            if left < timeout:  # the budget's end, not the case's own limit
                rows.append(dict(op=op, **case.params, skipped=f"the time budget ended it after {left:.0f} s"))
            else:
                rows.append(dict(op=op, **case.params, error=f"{type(e).__name__}: {e}"[:300]))
        except (subprocess.SubprocessError, ValueError, OSError) as e:
            rows.append(dict(op=op, **case.params, error=f"{type(e).__name__}: {e}"[:300]))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "kernels"}), flush=True)
        if on_row is not None:
            on_row(rows)
    return rows


def _run_group(cmd: List[str], timeout: float) -> str:
    """stdout of ``cmd``, run in a process group of its own: past ``timeout`` the whole group is killed (ncu and the
    program it profiles: killing ncu alone would leave that program on the GPU beside the timed steps)."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, 9)
        except OSError:
            pass
        p.communicate()
        raise
    return out


def _write(path: Optional[str], rows: List[dict]) -> None:
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ncu", help="the ncu executable: profile every case and write --json")
    ap.add_argument("--json", help="where the rows go (with --ncu or --report)")
    ap.add_argument("--op", nargs="+", default=DEFAULT_OPS)
    ap.add_argument("--N", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per case")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for every case together: none starts or runs past it (the rest are rows saying "
                         "so; the exit status counts them as no failure)")
    ap.add_argument("--launch", nargs=2, metavar=("OP", "INDEX"), help="run one case (what ncu profiles)")
    ap.add_argument("--report", metavar="CSV", help="parse one ncu --csv output into per-launch rows")
    args = ap.parse_args(argv)
    if args.launch:
        launch(args.launch[0], int(args.launch[1]), args.N)
        return 0
    if args.report:
        with open(args.report) as f:
            rows = parse_ncu_csv(f.read())
    elif args.ncu:
        rows = profile(args.ncu, args.op, args.N, args.timeout, args.time_budget,
                       on_row=lambda rows: _write(args.json, rows))
    else:
        ap.error("give --ncu, --report or --launch")
    _write(args.json, rows)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
