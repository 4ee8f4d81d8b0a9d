"""The structural report: what the CUDA kernels do without a GPU, counted by the SIMT harness at small shapes (bytes
against the floor, CTAs, launches, global sectors and shared-memory wavefronts against their ideal), and their ptxas
registers and spills (``tools/check_cuda.py --json``). Counts, not times."""

from __future__ import annotations

import json
import os
import subprocess
from typing import List, Optional

import torch

from cases import cases_for


def _load_ptxas(path: Optional[str]) -> tuple:
    if not path:
        return None, "no ptxas table given (run: python tools/check_cuda.py --json PATH, then --ptxas-json PATH)"
    try:
        with open(path) as f:
            data = json.load(f)
        return (data["kernels"] if isinstance(data, dict) else data), None
    except (OSError, ValueError, KeyError) as e:
        return None, f"ptxas table {path} unreadable: {e}"


def _demangle(names: List[str]) -> List[str]:
    """C++ kernel names as written (c++filt where it exists, else as given)."""
    if not names:
        return names
    try:
        p = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, timeout=10)
        out = p.stdout.splitlines()
        return out if p.returncode == 0 and len(out) == len(names) else names
    except (OSError, subprocess.SubprocessError):
        return names


def _access(launches: List[dict]) -> dict:
    """The warp access model's counts summed over the launches, against their ideal (global sectors, shared-memory
    wavefronts); empty where the harness has no access model (the sanitized build)."""
    if not launches or any(ln.get("global_sectors") is None for ln in launches):
        return {}
    total = {k: sum(int(ln[k]) for ln in launches) for k in
             ("global_sectors", "global_sectors_ideal", "shared_wavefronts", "shared_wavefronts_ideal")}
    def ratio(got, ideal):  # 1.0 where a launch makes no such access at all
        return round(total[got] / total[ideal], 3) if total[ideal] else (1.0 if not total[got] else float("inf"))
    return dict(sectors_over_ideal=ratio("global_sectors", "global_sectors_ideal"),
                wavefronts_over_ideal=ratio("shared_wavefronts", "shared_wavefronts_ideal"))


def structural_report(ops: List[str], ptxas_path: Optional[str]) -> List[dict]:
    """Per op: the CUDA kernels run on the CPU through the SIMT harness (bytes against the floor at a small shape,
    CTAs at N = 1) and the ptxas registers / spills of the op's translation unit."""
    ptxas, ptxas_note = _load_ptxas(ptxas_path)
    if not torch.cuda.is_available():
        os.environ.setdefault("DSPARK_SIMT", "1")  # without a GPU the harness is what shows the CUDA kernels' structure
    try:
        from dspark_kernels import simt
        simt_ok = bool(simt.available())
        simt_note = None if simt_ok else "SIMT harness not available (needs DSPARK_SIMT=1 and its CPU build)"
    except Exception as e:  # noqa: BLE001
        simt, simt_ok = None, False
        simt_note = f"SIMT harness not available ({type(e).__name__}: {str(e)[:80]})"
    small = dict(N=[4], K=[7], V=[1000], dtype=["fp32"], mode=["greedy", "sampled"], top_k=[0, 64])
    n1 = dict(small, N=[1])
    out = []
    cpu = torch.device("cpu")
    for op in ops:
        row: dict = dict(op=op)
        if not simt_ok:
            row.update(simt="unavailable", simt_note=simt_note)
        else:
            measured = []
            for grid, tag in ((small, "small"), (n1, "N=1")):
                for case in cases_for(op, cpu, grid, "quick"):
                    try:
                        x = case.inputs()
                        with simt.record(access=True) as rec:
                            case.run("cuda", x)
                        moved = int(rec.bytes_read) + int(rec.bytes_written)
                        measured.append(dict(shape=tag, **case.params, bytes_read=int(rec.bytes_read),
                                             bytes_written=int(rec.bytes_written), floor_bytes=case.floor.total,
                                             bytes_over_floor=round(moved / max(case.floor.total, 1), 3),
                                             unique_bytes=int(rec.unique_bytes),
                                             unique_over_floor=round(rec.unique_bytes / max(case.floor.total, 1),
                                                                     3),
                                             ctas=int(rec.ctas), launches=len(rec.launches),
                                             kernels=sorted({str(ln.get("kernel")) for ln in rec.launches}),
                                             **_access(rec.launches)))
                    except Exception as e:  # noqa: BLE001 - a harness fault or a failing kernel: one row says so
                        measured.append(dict(shape=tag, **case.params, error=f"{type(e).__name__}: {e}"[:200]))
            row.update(simt="ok" if any("error" not in m for m in measured) else "failed", cases=measured)
            if row["simt"] == "failed":
                row["simt_note"] = measured[0].get("error") if measured else "no cases"
        if ptxas is None:
            row["ptxas_note"] = ptxas_note
        else:
            mine = [k for k in ptxas if os.path.basename(str(k.get("unit", ""))).split(".")[0] == op]
            names = _demangle([str(k.get("kernel")) for k in mine])
            row["ptxas"] = [dict(arch=k.get("arch"), kernel=name, registers=k.get("registers"),
                                 spill_bytes=k.get("spill_bytes"), stack_bytes=k.get("stack_bytes"))
                            for k, name in zip(mine, names)]
            if not mine:
                row["ptxas_note"] = f"no kernel of csrc/torch/{op}.cu in the ptxas table"
        out.append(row)
    return out

