#!/usr/bin/env python
"""draft_block's warp instructions at the serving shapes, read by Nsight Compute on a lent GPU: the count that turns
on bench/model.py's issue term (``model_launch(..., warp_instructions=...)``). bench/gpu_check.sh runs both steps:

    ncu --clock-control none --kernel-name regex:draft_block_kernel --csv \\
        --section SchedulerStats --section WarpStateStats --section SpeedOfLight \\
        --metrics smsp__inst_executed.sum,gpu__time_duration.sum python bench/ncu_draft.py > ncu_draft.csv
    python bench/ncu_draft.py --report ncu_draft.csv --json ncu_draft.json

The first launches draft_block (vanilla, r = 256, bf16, greedy, V = 151936) once per shape of :data:`SHAPES`, in
that order, on the GPU (the last with bench/run.py's confidence head: its kernel time beside the bench row's, which
the kernel alone without the head was measured 1.8x under); the second pairs ncu's rows with the shapes and
writes, per shape, the warp instructions executed, the measured duration (under ncu, clocks left alone), the issue time those instructions need (the
model's term: at one warp instruction per scheduler per clock, a lower bound; with the sections' Warp Cycles Per
Issued Instruction and Active Warps Per Scheduler, at the rate those allow) and the floor model's time. The
modelled time with the issue term on: ``python bench/model_headline.py --draft N K --warp-instructions COUNT
--cycles-per-issue CPI`` (on the CPU).
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import re
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import floors  # noqa: E402
from model import GPUS, floor_model_us, issue_us  # noqa: E402
from model_headline import V, _draft_case, draft_floor_bytes, emit_rows  # noqa: E402

# (N, K, d): DESIGN's decode shapes and the serving batch of issue #35 without a confidence head (d = 0), then
# bench/run.py's draft_block row at N = 1 as it runs: with a confidence head over hidden states of d = 4096
SHAPES = ((1, 7, 0), (64, 7, 0), (256, 15, 0), (1, 7, 4096))
RANK = 256
# the sections' metrics a launch's row keeps, when ncu wrote them
SECTION_METRICS = {"Warp Cycles Per Issued Instruction": "cycles_per_issue",
                   "Active Warps Per Scheduler": "warps_per_scheduler", "SM Frequency": "sm_hz"}
_UNITS_US = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,  # ncu 2025.3 writes ns, us, ms, s
             "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def launch_shapes() -> None:
    import torch
    import dspark_kernels as dk
    for n, k, d in SHAPES:
        base, head, anchors = _draft_case(n, k, RANK)
        head = dk.MarkovHead("vanilla", w1=head.w1.cuda(), w2=head.w2.cuda())
        extra = {}
        if d:
            gen = torch.Generator().manual_seed(1)
            extra = dict(hidden=torch.randn(n, k, d, generator=gen).to(torch.bfloat16).cuda(),
                         confidence=dk.ConfidenceHead((torch.randn(d + RANK, generator=gen) * 0.02)
                                                      .to(torch.bfloat16).cuda(), 0.0))
        dk.draft_block(base.cuda(), anchors.cuda(), head, temperature=0.0, seed=1, backend="cuda", **extra)
        torch.cuda.synchronize()
        print(f"ncu_draft: launched N = {n}, K = {k}, d = {d}", flush=True)


def floor_bytes(n: int, k: int, d: int) -> int:
    """draft_floor_bytes, and with a confidence head (d > 0) what bench/floors.py adds for it: the hidden states once,
    its weight once and its two float32 outputs."""
    if not d:
        return draft_floor_bytes(n, k, RANK)
    head = floors.draft_block(n, k, V, RANK, d=d, confidence=True).total - floors.draft_block(n, k, V, RANK).total
    return draft_floor_bytes(n, k, RANK) + head


def parse_ncu_csv(text: str) -> List[Dict[str, object]]:
    """ncu's --csv details page -> one dict per profiled launch, in launch order: kernel, ctas,
    warp_instructions, measured_us, and the :data:`SECTION_METRICS` present. Lines before the header (the program's
    own output, ncu's notes) are skipped."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header (a line starting with \"ID\") in the input")
    launches: Dict[str, Dict[str, object]] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
        if not row.get("Metric Name"):
            continue
        rec = launches.setdefault(row["ID"], {"kernel": row["Kernel Name"],
                                              "ctas": _grid_ctas(row.get("Grid Size", ""))})
        name = row["Metric Name"]
        if name in SECTION_METRICS and row["Metric Value"] not in ("", "no data"):
            rec[SECTION_METRICS[name]] = float(row["Metric Value"].replace(",", ""))
            continue
        if name not in ("smsp__inst_executed.sum", "gpu__time_duration.sum"):
            continue  # a section's metric (gpu_check.sh asks for some to read beside these; "no data" among them)
        value = float(row["Metric Value"].replace(",", ""))
        if name == "smsp__inst_executed.sum":
            rec["warp_instructions"] = int(value)
        else:
            unit = row.get("Metric Unit", "usecond")
            if unit not in _UNITS_US:
                raise ValueError(f"gpu__time_duration.sum in an unknown unit {unit!r}")
            rec["measured_us"] = value * _UNITS_US[unit]
    return [launches[i] for i in sorted(launches, key=int)]


def _grid_ctas(grid: str) -> int:
    """ncu's "(x, y, z)" grid size -> CTAs; 0 when it names none."""
    dims = [int(x) for x in re.findall(r"\d+", grid)]
    return math.prod(dims) if dims else 0


def report(launches: List[Dict[str, object]], gpu: str = "h200") -> List[Dict[str, object]]:
    if len(launches) != len(SHAPES):
        raise ValueError(f"{len(launches)} profiled launches for {len(SHAPES)} shapes: profile only draft_block_kernel")
    rows = []
    for (n, k, d), ln in zip(SHAPES, launches):
        for key, metric in (("warp_instructions", "smsp__inst_executed.sum"),
                            ("measured_us", "gpu__time_duration.sum")):
            if key not in ln:
                raise ValueError(f"launch N = {n}, K = {k}, d = {d} has no {metric} in ncu's CSV")
        floor = floor_bytes(n, k, d)
        rows.append(dict(op="draft_block", N=n, K=k, V=V, r=RANK, d=d, kernel=ln["kernel"], ctas=ln["ctas"],
                         warp_instructions=ln["warp_instructions"], measured_us=ln["measured_us"],
                         issue_us=round(issue_us(ln["warp_instructions"], ln["ctas"], gpu,
                                                 ln.get("cycles_per_issue", 1.0),
                                                 ln.get("warps_per_scheduler", 1.0)), 2),
                         **{key: ln[key] for key in SECTION_METRICS.values() if key in ln},
                         floor_bytes=floor, floor_model_us=round(floor_model_us(floor, 1, gpu), 2),
                         note=f"measured under ncu on {gpu}; issue_us is bench/model.py's issue term (a model)"))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", metavar="CSV", help="pair ncu's CSV with the shapes instead of launching them")
    ap.add_argument("--json", help="with --report: write the rows here")
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    args = ap.parse_args(argv)
    if not args.report:
        launch_shapes()
        return 0
    with open(args.report) as f:
        emit_rows(report(parse_ncu_csv(f.read()), args.gpu), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
