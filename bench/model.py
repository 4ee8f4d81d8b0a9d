"""A modelled GPU time per kernel launch, from the SIMT harness's counters and the SASS facts. A MODEL, not a
measurement: every number it prints is labelled "modelled", and bench/gpu_check.sh records it beside the measured
time when a GPU is lent, so that the model can be checked and its constants corrected.

    from bench.model import model_launch, model_recording
    with simt.record(access=True) as rec: op(...)
    model_recording(rec.launches, "h200")  # -> {"modelled_us": ..., "launches": [per-launch breakdown]}

Per launch (``model_launch``), with the launch's counters (``simt.record(access=True)``) and optional SASS facts:
  t = launch + grid_barriers * grid_barrier + serial + max(t_dram, t_l2, t_smem, t_latency, t_tensor, t_issue)
where
  t_dram    = DRAM bytes / DRAM copy bandwidth: the harness's L2 estimate when the record has it (``dram_bytes_read``,
              csrc/simt/runtime.cpp's estimate_dram_reads: a re-read hits L2 when the CTA's own traffic since fits its
              share of L2, or another CTA touched the sector since the last grid barrier) plus the distinct bytes
              written; else the unique bytes (what a perfect cache moves) when they fit in L2, else every byte
              requested (a re-read working set larger than L2 misses it on every pass),
  t_l2      = global sectors * 32 bytes / L2 bandwidth (sectors from the access model; bytes requested without it),
  t_smem    = shared wavefronts / (SMs in use * one wavefront per clock),
  t_latency = DRAM bytes / (bytes in flight / DRAM latency): Little's law, bytes in flight = SMs in use * resident CTAs
              per SM * threads * (bytes per load, 16 for a 16-byte load) * loads in flight per thread,
  t_tensor  = tensor-core FLOPs (the launch's m16n8k16 MMAs x 4096, when the caller knows them: ``mma``) / the
              dense 16-bit tensor peak scaled to the SMs in use (a lower bound: mma.sync is not wgmma),
  t_issue   = warp instructions executed (``warp_instructions``: Nsight Compute's smsp__inst_executed.sum, which
              bench/ncu_draft.py reads on a lent GPU; 0 when not given) / (SMs in use * 4 schedulers * clock * rate):
              each of an SM's four sub-partitions issues at most one warp instruction per clock, and with w warps
              resident on it, each waiting ``cycles_per_issue`` clocks between two of its own instructions, at
              rate = min(1, w / cycles_per_issue) a clock. cycles_per_issue is the code's, measured: ncu's Warp
              Cycles Per Issued Instruction of a launch whose schedulers held one warp each (4.4-6.9 for draft_block
              on the H200, bench/records/h200_ncu_draft_sections.csv); 1 (the default) leaves the throughput bound.
              The rule assumes the warps' stalls overlap (latency, not a shared pipe: the H200's draft_block had its
              memory pipes 7-8 % busy), which holds while w <= cycles_per_issue.
and serial is latency on the launch's critical path that nothing overlaps, when the caller knows it (``serial_s``:
draft_block's per-position chain of dependent reads past its ring's fill, bench/model_headline.prologue_chain).
Waves = CTAs / (resident CTAs per SM * SMs), rounded up; the SMs in use are min(CTAs, SMs), each holding
min(resident, CTAs / SMs in use) CTAs at once.
What it leaves out (only a GPU shows it): instruction issue unless its count is given, L1
hits, DRAM page and channel effects, clock changes, overlap between launches, and any latency but DRAM's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional


@dataclass(frozen=True)
class Gpu:
    name: str
    sms: int
    dram_bytes_per_s: float   # achievable copy bandwidth (bytes read + written per second)
    l2_bytes_per_s: float
    clock_hz: float           # SM clock under load
    tensor_flops_per_s: float  # dense bf16 / fp16 tensor-core peak (FLOPs, multiply and add counted apart)
    dram_latency_s: float     # load-to-use latency of a DRAM access
    launch_s: float           # one kernel launch, back to back on a stream
    grid_barrier_s: float     # one cooperative-groups grid.sync() across a resident grid
    l2_capacity_bytes: int = 50 * 2**20
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32
    registers_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024
    schedulers_per_sm: int = 4  # warp schedulers (sub-partitions), one warp instruction per clock each


# Constants and where they come from (leads to be replaced by this repository's own measurements in
# bench/gpu_check.sh's records once a GPU is lent):
# - SMs: 132 on H100 SXM and H200 (NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022; the H200 is the same
#   GH100 die: /work/.library/device/H200.md).
# - H200 copy bandwidth 4.3 TB/s: a device-to-device copy through PyTorch on an H200 of this workplace, counting
#   bytes read and written (/work/.library/device/KINDS.md, seen 2026-10-28 and 2026-11-04); the datasheet says
#   4.8 TB/s. H100 SXM: the same 0.9 fraction of its 3.35 TB/s datasheet figure (H200.md quotes both datasheets),
#   3.0 TB/s, scaled, not measured here.
# - L2 bandwidth: 2.5x DRAM on both, an assumption of the order Chips and Cheese reported for an H100's L2 against
#   its DRAM ("Nvidia's H100: Funny L2, and Tons of Bandwidth", 2023); to be measured.
# - Clock: the H200's 1.81 GHz is the SM frequency Nsight Compute read while draft_block ran on this workplace's
#   H200 (1.796-1.823 GHz over its three launches, clocks not locked: bench/records/h200_ncu_draft_sections.csv);
#   nvidia-smi had read 1.98 GHz under another load (KINDS.md, 2026-10-28), which the H100 keeps.
# - DRAM latency 600 ns: the order of the load-to-use latency past L2 that the same article measured by pointer
#   chasing on an H100; to be measured.
# - Launch 2.5 us back to back: the order of the per-kernel launch cost of the NVIDIA developer blog "Getting
#   Started with CUDA Graphs" (2019) without graphs; not yet measured on Hopper here.
# - Grid barrier: 0.97 us on the H200, measured here (bench/grid_barrier.py, step 4 of bench/gpu_check.sh: 132 CTAs
#   of 128 threads, bench/records/h200_grid_barrier.json, 2026-12-04). The H100 keeps 1.3 us, the dead time of one
#   kernel boundary inside a CUDA graph that Hazy Research measured on an H100 (Spector, Juravsky et al., "Look Ma,
#   No Bubbles! Designing a Low-Latency Megakernel for Llama-1B", 2025-05-27): a boundary is the grid-wide wait plus
#   CTA retirement and launch, a grid.sync() the wait alone. bench/model_headline.py's rows keep the barrier term
#   apart (grid_barriers, barrier_us) so that a row holds at any other cost.
# - L2 capacity 50 MB on both (the H100 whitepaper's SXM5 figure; the H200 is the same die). A launch whose distinct
#   bytes exceed it and that re-reads them (draft_block's W2 once per position) misses L2 on every pass: DRAM moves
#   the bytes requested (LRU on a cyclic sweep keeps nothing), else the distinct bytes.
# - Four warp schedulers per SM, each dispatching one warp instruction per clock (the H100 whitepaper's SM diagram:
#   four processing blocks, each with its warp scheduler and dispatch unit, 32 threads per clock).
# - One shared-memory wavefront per SM clock (128 bytes per clock per SM: the whitepaper's shared-memory bandwidth).
# - Dense BF16 / FP16 tensor peak 989.4 TFLOPS on the H100 SXM5 (the whitepaper's table; the H200 datasheet gives
#   the same 989 TFLOPS): a bound that wgmma can approach; draft_block's mma.sync m16n8k16 has not been measured
#   here and may reach less.
GPUS = {
    "h200": Gpu("h200", sms=132, dram_bytes_per_s=4.3e12, l2_bytes_per_s=2.5 * 4.3e12, clock_hz=1.81e9,
                tensor_flops_per_s=989.4e12, dram_latency_s=600e-9, launch_s=2.5e-6, grid_barrier_s=0.97e-6),
    "h100": Gpu("h100", sms=132, dram_bytes_per_s=3.0e12, l2_bytes_per_s=2.5 * 3.0e12, clock_hz=1.98e9,
                tensor_flops_per_s=989.4e12, dram_latency_s=600e-9, launch_s=2.5e-6, grid_barrier_s=1.3e-6),
}


def resident_ctas(gpu: Gpu, threads: int, smem_bytes: int, registers: Optional[int] = None) -> int:
    """CTAs per SM by threads, blocks, shared memory (+1 KB reserved per block) and registers (when known)."""
    n = min(gpu.blocks_per_sm, gpu.threads_per_sm // max(threads, 1))
    n = min(n, gpu.smem_per_sm // (smem_bytes + 1024))
    if registers:
        per_warp = math.ceil(math.ceil(registers / 8) * 8 * 32 / 256) * 256
        n = min(n, gpu.registers_per_sm // (per_warp * math.ceil(threads / 32)))
    return max(n, 0)


def model_launch(rec: Dict[str, Any], gpu: str = "h200", *, registers: Optional[int] = None,
                 load_bytes: int = 16, loads_in_flight: int = 1, mma: Optional[int] = None,
                 warp_instructions: int = 0, cycles_per_issue: float = 1.0, grid_barrier_s: Optional[float] = None,
                 serial_s: float = 0.0) -> Dict[str, float]:
    """Modelled time of one launch record (a dict of ``simt.record().launches``), in microseconds, with its terms.

    registers: per thread, from the SASS report (None: not a limit); load_bytes: bytes per thread per load (16 for
    LDG.E.128); loads_in_flight: independent loads a thread has in flight (from the SASS of the innermost loop);
    mma: the launch's m16n8k16 tensor-core MMAs (None: the record's ``mma``, the harness's count; 0 when absent);
    warp_instructions: the launch's warp instructions executed, measured (0: the issue term is off);
    cycles_per_issue: clocks between two instructions of one warp alone on its scheduler, measured (1: none);
    grid_barrier_s: one grid barrier's cost (None: the GPU's constant; bench/grid_barrier.py measures it);
    serial_s: latency on the critical path that no other term overlaps, in seconds (added as it is)."""
    g = GPUS[gpu]
    threads, ctas = int(rec["threads"]), int(rec["ctas"])
    smem = int(rec.get("static_smem", 0)) + int(rec.get("dynamic_smem", 0))
    per_sm = resident_ctas(g, threads, smem, registers)
    if per_sm < 1:
        raise ValueError(f"{rec.get('kernel')}: {threads} threads and {smem} bytes of shared memory fit no SM")
    waves = math.ceil(ctas / (per_sm * g.sms))
    sms_used = min(g.sms, ctas)  # the CTAs spread over the SMs before any SM takes a second one
    unique = rec.get("unique_bytes_read", 0) + rec.get("unique_bytes_written", 0)
    requested = rec["bytes_read"] + rec["bytes_written"]
    if rec.get("dram_bytes_read") is not None:
        dram = rec["dram_bytes_read"] + rec.get("unique_bytes_written", 0)
    else:
        dram = unique if unique <= g.l2_capacity_bytes else max(unique, requested)
    sectors = rec.get("global_sectors")
    l2_bytes = 32 * sectors if sectors is not None else requested
    wavefronts = rec.get("shared_wavefronts") or 0
    resident = min(per_sm, math.ceil(ctas / sms_used))  # CTAs an SM in use holds at once
    in_flight = sms_used * resident * threads * load_bytes * loads_in_flight
    warps = resident * math.ceil(threads / 32) / g.schedulers_per_sm  # warps a scheduler holds
    t_dram = dram / g.dram_bytes_per_s
    t_l2 = l2_bytes / g.l2_bytes_per_s
    t_smem = wavefronts / (sms_used * g.clock_hz)
    t_latency = dram * g.dram_latency_s / in_flight if in_flight else 0.0
    mma = (rec.get("mma") or 0) if mma is None else mma
    t_tensor = mma * 4096 / (g.tensor_flops_per_s * sms_used / g.sms)
    t_issue = issue_us(warp_instructions, ctas, gpu, cycles_per_issue, warps) / 1e6
    body = max(t_dram, t_l2, t_smem, t_latency, t_tensor, t_issue)
    barriers = int(rec.get("grid_barriers", 0))
    grid = barriers * (g.grid_barrier_s if grid_barrier_s is None else grid_barrier_s)
    total = g.launch_s + body + grid + serial_s
    us = 1e6
    return dict(modelled_us=total * us, launch_us=g.launch_s * us, dram_us=t_dram * us, l2_us=t_l2 * us,
                smem_us=t_smem * us, latency_us=t_latency * us, tensor_us=t_tensor * us, issue_us=t_issue * us,
                grid_barrier_us=grid * us, grid_barriers=barriers, serial_us=serial_s * us,
                waves=waves, warps_per_scheduler=warps,
                ctas_per_sm=per_sm, sms_used=sms_used, bytes_in_flight=in_flight,
                bound=max(("dram", t_dram), ("l2", t_l2), ("smem", t_smem), ("latency", t_latency),
                          ("tensor", t_tensor), ("issue", t_issue), key=lambda kv: kv[1])[0])


def issue_us(warp_instructions: int, ctas: int, gpu: str = "h200", cycles_per_issue: float = 1.0,
             warps_per_scheduler: float = 1.0) -> float:
    """The issue term alone: ``warp_instructions`` over the SMs the launch's ``ctas`` occupy, each scheduler issuing
    min(1, warps_per_scheduler / cycles_per_issue) warp instructions a clock, in microseconds."""
    if warp_instructions < 0:
        raise ValueError(f"warp_instructions must be >= 0, got {warp_instructions}")
    if cycles_per_issue < 1.0 or warps_per_scheduler <= 0:
        raise ValueError(f"cycles_per_issue must be >= 1 and warps_per_scheduler > 0, got {cycles_per_issue}, "
                         f"{warps_per_scheduler}")
    g = GPUS[gpu]
    rate = min(1.0, warps_per_scheduler / cycles_per_issue)
    return 1e6 * warp_instructions / (min(g.sms, max(int(ctas), 1)) * g.schedulers_per_sm * g.clock_hz * rate)


def model_recording(launches: Iterable[Dict[str, Any]], gpu: str = "h200", **kw) -> Dict[str, Any]:
    """The modelled time of a sequence of launches (one op call): the sum of :func:`model_launch` (no overlap)."""
    per = [dict(kernel=r["kernel"], **model_launch(r, gpu, **kw)) for r in launches]
    return dict(gpu=gpu, modelled_us=sum(p["modelled_us"] for p in per), launches=per)


def floor_model_us(floor_bytes: float, launches: int = 1, gpu: str = "h200") -> float:
    """The model with only the bytes floor known (no harness counters): launches x launch cost + floor / copy
    bandwidth. What bench/gpu_check.sh sets beside each measured time."""
    g = GPUS[gpu]
    return (launches * g.launch_s + floor_bytes / g.dram_bytes_per_s) * 1e6


def compare(bench_rows: Iterable[Dict[str, Any]], gpu: str = "h200") -> list:
    """Rows of a bench record with a measured median: (op, params, measured_us, modelled_us, measured / model)."""
    out = []
    for r in bench_rows:
        if r.get("median_ms") is None or r.get("floor_bytes") is None:
            continue
        modelled = floor_model_us(r["floor_bytes"], gpu=gpu)
        measured = 1e3 * r["median_ms"]
        params = {k: v for k, v in r.items() if k in ("N", "K", "V", "dtype", "mode", "r", "method", "temperature")}
        out.append(dict(op=r.get("op"), backend=r.get("backend"), **params, measured_us=measured,
                        modelled_us=modelled, measured_over_model=measured / modelled))
    return out


def main(argv=None) -> int:
    import argparse
    import csv
    import glob
    import json
    import os

    ap = argparse.ArgumentParser(description="modelled (not measured) GPU times beside a bench record's measurements")
    ap.add_argument("bench_dir", help="the folder bench/run.py wrote its JSON record to")
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    ap.add_argument("--out", help="CSV to write (default: BENCH_DIR/model_vs_measured.csv)")
    args = ap.parse_args(argv)
    rows = []
    for path in sorted(glob.glob(os.path.join(args.bench_dir, "*.json"))):
        with open(path) as f:
            try:
                doc = json.load(f)
            except ValueError:
                continue
        if isinstance(doc, dict) and isinstance(doc.get("rows"), list):
            rows += compare(doc["rows"], args.gpu)
    out = args.out or os.path.join(args.bench_dir, "model_vs_measured.csv")
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("op", "backend"), k))
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f"model: {len(rows)} measured rows beside their modelled (floor-only) {args.gpu} time in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
