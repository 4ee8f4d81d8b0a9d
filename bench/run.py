#!/usr/bin/env python
"""Microbenchmarks of every dspark_kernels op and backend, side by side with peers, against each op's bytes floor.

    python bench/run.py --quick                        # CPU-sized grid (reference ops), about a minute
    python bench/run.py --full                         # N {1,8,64,256} x K {3,7,15} x V {32000,151936} x bf16/fp32
                                                       #   x greedy/sampled, every backend and peer that runs here
    python bench/run.py --full --op verify_chain --backend cuda triton flashinfer --K 7 --V 151936
    python bench/run.py --full --out-dir /tmp/out --record    # also keep the record under bench/records/
    python bench/run.py --goals                        # the rows the open issues' goals are judged on, first
                                                       #   (cases.GOALS; bench/goals.py judges them)

Rows are op x backend x shape. Time: on a GPU, CUDA events around each call with the L2 cache flushed (a 512 MiB
write) before every repeat; on the CPU, perf_counter after warm-up, repeated until the median is stable (at least
``--min-reps`` calls and ``--min-time`` seconds). Each row reports the median, the spread (IQR = 25th..75th
percentile, and the minimum), the op's bytes floor (``bench/floors.py``: inputs read once, outputs written once),
the achieved bandwidth against that floor, that bandwidth as a percentage of this machine's copy bandwidth
(measured in the same run with a large tensor copy), the floor's time at that copy bandwidth, and the speed-up
against the best other backend or peer of the same case. Peers: the reference ops on the same device (what a
PyTorch engine would write), the CPU kernels (on the CPU), the Triton twins, FlashInfer's
``chain_speculative_sampling`` for verify_chain, and for draft_block ``cublas`` (per position torch.addmm of the
previous tokens' W1 rows by W2^T plus U[:, k], then argmax, the K positions in one CUDA graph; greedy rows without
the confidence head); a peer that is missing is a row saying so.

Also: a structural report (per op, bytes moved by the CUDA kernels under the SIMT harness against the floor, CTAs
at N = 1, registers and spills from ptxas via ``tools/check_cuda.py --json``) and end-to-end rows (the decode
loop's tokens/s, acceptance length and time split against the target decoding alone on the same prompts; and the
CUDA-graphed decode step of ``bench/step.py`` with acceptance FORCED, at batch 1 and 8 and 64 new tokens on a GPU,
its tiny shape on the CPU).

Modules: ``cases.py`` (shapes, inputs, calls, peers), ``timing.py`` (the timer, copy bandwidth, a case's rows),
``machine.py`` (machine facts), ``structural.py`` (the SIMT / ptxas report), ``e2e.py`` (the decode loop),
``output.py`` (tables, CSV, JSON, plots), ``floors.py`` (the bytes floors); this file is the command line.

Output: a table on stdout; ``<out-dir>/<machine>_<preset>.json`` (machine: device, CPU, cores, versions, commit,
date; the name carries the device and a host id, so machines never overwrite each other's records), ``.csv`` and
two PNG plots (time vs N per backend; % of copy bandwidth vs N) when matplotlib is installed
(``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("DSPARK_USE_INSTALLED") != "1":  # bench/gpu_check.sh sets it to run an installed wheel
    sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from cases import BACKENDS, DTYPES, GOALS, GRIDS, OPS, backends_for, cases_for, flashinfer_runner  # noqa: E402
from e2e import decode_step_rows, end_to_end, smollm2_rows  # noqa: E402
from machine import machine_id, machine_info  # noqa: E402
from output import SCHEMA, case_str, fmt_bytes, fmt_time, print_e2e, print_structural, print_table  # noqa: E402
from output import write_outputs  # noqa: E402
from structural import structural_report  # noqa: E402
from timing import Timer, add_comparisons, copy_bandwidth, run_case  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    preset = ap.add_mutually_exclusive_group(required=True)
    preset.add_argument("--quick", action="store_true", help=f"small grid for a CPU: {GRIDS['quick']}")
    preset.add_argument("--full", action="store_true", help=f"the full grid: {GRIDS['full']}")
    preset.add_argument("--goals", action="store_true",
                        help="the cases the open issues' goals name, in priority order, with the backends they compare "
                             "(cases.GOALS; the grid restrictions below do not apply; --op and --backend narrow them)")
    ap.add_argument("--op", nargs="+", choices=OPS, help="ops to run (default: all)")
    ap.add_argument("--backend", nargs="+", choices=BACKENDS,
                    help="backends and peers (default: on a GPU all of them, on the CPU the CPU kernels and the "
                         "reference)")
    ap.add_argument("--N", nargs="+", type=int, help="restrict the grid's N values")
    ap.add_argument("--K", nargs="+", type=int, help="restrict the grid's K values")
    ap.add_argument("--V", nargs="+", type=int, help="restrict the grid's V values")
    ap.add_argument("--dtype", nargs="+", choices=list(DTYPES), help="restrict the grid's dtypes")
    ap.add_argument("--mode", nargs="+", choices=["greedy", "sampled"], help="restrict greedy / sampled")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--min-reps", type=int, default=None, help="at least this many timed calls (GPU 20, CPU 7)")
    ap.add_argument("--max-reps", type=int, default=None, help="at most this many (GPU 200, CPU 100)")
    ap.add_argument("--min-time", type=float, default=None, help="time at least this many seconds per row")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="stop starting new cases after this many seconds (rows left out are listed)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"), help="where JSON / CSV / PNG go")
    ap.add_argument("--name", default=None,
                    help="file stem (default: {machine}_{preset}; {machine} is replaced by the machine id)")
    ap.add_argument("--record", action="store_true", help="also copy the JSON, CSV and plots into bench/records/")
    ap.add_argument("--ptxas-json", default=None, help="tools/check_cuda.py --json output for the registers")
    ap.add_argument("--no-structural", action="store_true")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--no-plot", action="store_true")
    return ap.parse_args(argv)


def make_timer(args, gpu: bool) -> Timer:
    return Timer(torch.device(args.device), args.min_reps or (20 if gpu else 7), args.max_reps or (200 if gpu else 100),
                 args.min_time if args.min_time is not None else (0.05 if gpu else 0.3),
                 max(args.min_time or 0.0, 0.5 if gpu else (3.0 if args.full else 0.6)))


def time_grid(plan, preset, dev, timer, copy_gbps, fi, time_budget, t_start, on_case=None) -> tuple:
    """Every case of every op on every backend of each (ops, grid, backends) of ``plan``, in order: the rows, and
    the cases the time budget left out. ``on_case(rows so far)`` is called after each case, so that a run stopped
    from outside (bench/gpu_check.sh's timeout) keeps what it measured."""
    rows: List[dict] = []
    left_out: List[str] = []
    with torch.no_grad():
        for ops, grid, backends in plan:
            for op in ops:
                for case in cases_for(op, dev, grid, preset):
                    if time_budget is not None and time.perf_counter() - t_start > time_budget:
                        left_out.append(f"{op} {' '.join(f'{k}={v}' for k, v in case.params.items())}")
                        continue
                    new = run_case(case, backends_for(op, backends), dev, timer, fi)
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()   # the case's inputs are gone: give their memory back
                    add_comparisons(new, copy_gbps)
                    rows.extend(new)
                    if on_case is not None:
                        on_case(rows)
                    print(f"  {op:<21} {case_str(new[0]):<44} " + "  ".join(
                        f"{r['backend']} {fmt_time(r.get('median_ms')) if r['status'] == 'ok' else r['status']}"
                        for r in new), flush=True)
    add_comparisons(rows, copy_gbps)
    return rows, left_out


def make_plan(args, preset: str, gpu: bool) -> list:
    """[(ops, grid, backends)]: the goals' cases (cases.GOALS, narrowed to the ops of --op and the backends of
    --backend), or the preset's grid restricted by the command line."""
    if preset == "goals":
        plan = [([op for op in ops if op in (args.op or OPS)], grid,
                 [b for b in backends if b in (args.backend or BACKENDS)]) for ops, grid, backends in GOALS]
        return [entry for entry in plan if entry[0] and entry[2]]
    grid = dict(GRIDS[preset], **{k: getattr(args, k) for k in ("N", "K", "V", "dtype", "mode") if getattr(args, k)})
    return [(args.op or OPS, grid, args.backend or (BACKENDS if gpu else ["cpu", "reference"]))]


def run_e2e(dev, preset: str, copy_gbps: float) -> List[dict]:
    """The end-to-end rows: tiny models, SmolLM2 on the CPU, and the decode step (``e2e.decode_step_rows``); a part
    that fails is a row saying so."""
    parts = [("end to end", lambda: end_to_end(dev, preset))]
    if dev.type == "cpu":
        parts.append(("SmolLM2-135M bf16", lambda: smollm2_rows(preset)))
    parts.append(("decode step", lambda: decode_step_rows(dev, copy_gbps)))
    rows = []
    for name, make in parts:
        try:
            rows += make()
        except Exception as e:  # noqa: BLE001 - the record keeps the failure
            rows.append(dict(name=name, error=f"{type(e).__name__}: {e}"[:300]))
            print(f"\n{name}: failed: {rows[-1]['error']}")
    print_e2e([r for r in rows if "error" not in r])
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    preset, dev = ("full" if args.full else "goals" if args.goals else "quick"), torch.device(args.device)
    gpu = dev.type == "cuda"
    if args.threads:
        torch.set_num_threads(args.threads)
    plan = make_plan(args, preset, gpu)
    ops = list(dict.fromkeys(op for op_list, _, _ in plan for op in op_list))
    backends = list(dict.fromkeys(b for _, _, bs in plan for b in bs))
    timer, info = make_timer(args, gpu), machine_info(dev)
    timing = ("CUDA events, L2 flushed (512 MiB write) before each repeat" if gpu else
              "perf_counter, 2 warm-up calls, repeats until the IQR is within 10% of the median")
    print(f"bench: preset --{preset}  grid {plan[0][1] if len(plan) == 1 else 'cases.GOALS'}")
    print(f"bench: ops {ops}  backends {backends}  device {info['device']} ({info['cpu_model']}, "
          f"{info['cpu_cores']} cores)  torch {info['torch']}  triton {info['triton']}  CUDA {info['cuda']}  "
          f"commit {info['git_commit'][:12]}  load {info['load_avg_1m']}")
    print(f"bench: timing: {timing}; min reps {timer.min_reps}, max reps {timer.max_reps}, "
          f"min time {timer.min_time} s per row")
    t_start = time.perf_counter()
    cb = copy_bandwidth(dev, timer)
    print(f"bench: copy bandwidth {cb['gbps']:.1f} GB/s (median; best {cb['best_gbps']:.1f}) "
          f"over {fmt_bytes(cb['bytes'])} read + written")
    fi = flashinfer_runner() if "flashinfer" in backends else (None, "not asked for")
    mid = machine_id(info)
    stem = (args.name or "{machine}_{preset}").format(machine=mid, preset=preset)
    grid = plan[0][1] if len(plan) == 1 else [dict(ops=o, grid=g, backends=b) for o, g, b in plan]

    def record(rows, left_out, structural, e2e, complete) -> dict:
        settings = dict(preset=preset, grid=grid, ops=ops, backends=backends, timing=timing,
                        min_reps=timer.min_reps, max_reps=timer.max_reps, min_time_s=timer.min_time,
                        time_budget_s=args.time_budget, left_out=left_out,
                        argv=sys.argv[1:] if argv is None else argv, floors="bench/floors.py",
                        wall_s=round(time.perf_counter() - t_start, 1), complete=complete)
        return dict(schema=SCHEMA, machine_id=mid, machine=info, settings=settings, copy_bandwidth=cb, rows=rows,
                    structural=structural, e2e=e2e)

    def partial(rows) -> None:
        """The record as it stands (JSON and CSV, no plots; settings.complete false), written after every case and
        replaced by the whole record at the end."""
        write_outputs(record(rows, [], [], [], False), os.path.join(args.out_dir, stem), plots=False,
                      record_dir=None)

    rows, left_out = time_grid(plan, preset, dev, timer, cb["gbps"], fi, args.time_budget, t_start, partial)
    print()
    print_table(rows)
    if left_out:
        print(f"\nbench: time budget of {args.time_budget} s reached; {len(left_out)} cases left out, first: "
              f"{left_out[:3]}")
    structural = [] if args.no_structural else structural_report(ops, args.ptxas_json)
    if structural:
        print_structural(structural)
    e2e = [] if args.no_e2e else run_e2e(dev, preset, cb["gbps"])
    doc = record(rows, left_out, structural, e2e, True)
    written = write_outputs(doc, os.path.join(args.out_dir, stem), plots=not args.no_plot,
                            record_dir=os.path.join(HERE, "records") if args.record else None)
    print(f"bench: {len(rows)} rows in {doc['settings']['wall_s']} s; wrote " + ", ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
