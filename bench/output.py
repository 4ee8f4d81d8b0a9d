"""Output formats of a bench run: the stdout tables, the CSV, the JSON record and the plots."""

from __future__ import annotations

import csv
import json
import os
import sys
from typing import Dict, List, Optional

from cases import CASE_KEYS, OPS, QWEN3_VOCAB

SCHEMA = "dspark-bench/2"


def fmt_time(ms) -> str:
    if ms is None:
        return "-"
    if ms < 1:
        return f"{ms * 1e3:.1f} us"
    if ms < 1000:
        return f"{ms:.3f} ms"
    return f"{ms / 1e3:.2f} s"


def fmt_bytes(b) -> str:
    if b is None:
        return "-"
    for unit, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= s:
            return f"{b / s:.1f} {unit}"
    return f"{b} B"


def case_str(r: dict) -> str:
    return " ".join(f"{k}={r[k]}" for k in CASE_KEYS if k in r and k not in ("r", "d"))


def _speedup(r: dict) -> str:
    return f"{r['speedup_vs_best_other']:.2f}x {r['best_other']}" if r.get("speedup_vs_best_other") else "-"


def _pct(r: dict) -> str:
    return f"{r['pct_of_copy_bw']:.3g}" if r.get("pct_of_copy_bw") is not None else "-"


# The measured columns of a row, in the order of the table and the CSV: (header, width, text of an "ok" row, the
# CSV keys it comes from).
COLUMNS = [
    ("median", 11, lambda r: fmt_time(r["median_ms"]), ["median_ms"]),
    ("IQR (p25..p75)", 24, lambda r: f"{fmt_time(r['p25_ms'])}..{fmt_time(r['p75_ms'])}",
     ["p25_ms", "p75_ms", "min_ms", "max_ms", "reps"]),
    ("floor", 10, lambda r: fmt_bytes(r["floor_bytes"]), ["floor_bytes"]),
    ("floor time", 12, lambda r: fmt_time(r.get("floor_ms")), ["floor_ms"]),
    ("GB/s", 10, lambda r: f"{r['achieved_gbps']:.3g}", ["achieved_gbps"]),
    ("% copy", 9, _pct, ["pct_of_copy_bw"]),
    ("  speed-up vs best other", 0, lambda r: "  " + _speedup(r), ["best_other", "speedup_vs_best_other"]),
]


def print_table(rows: List[dict], file=sys.stdout) -> None:
    hdr = f"{'op':<21}{'backend':<11}{'case':<44}" + "".join(f"{h:>{w}}" for h, w, _, _ in COLUMNS)
    print(hdr, file=file)
    print("-" * len(hdr), file=file)
    for r in rows:
        head = f"{r['op']:<21}{r['backend']:<11}{case_str(r):<44}"
        if r.get("status") != "ok":
            print(f"{head}  [{r.get('status')}] {r.get('note', '')}"[:len(hdr) + 40], file=file)
            continue
        print(head + "".join(f"{text(r):>{w}}" for _, w, text, _ in COLUMNS), file=file)


def print_structural(rows: List[dict], file=sys.stdout) -> None:
    print("\nstructural report (CUDA kernels without a GPU: SIMT harness counters, ptxas)", file=file)
    for r in rows:
        if r.get("simt") != "ok":
            print(f"  {r['op']:<21} SIMT: {r.get('simt_note', r.get('simt'))}", file=file)
        else:
            for m in r["cases"]:
                if "error" in m:
                    print(f"  {r['op']:<21} {m['shape']:<6} {case_str(m):<36} error: {m['error'][:90]}", file=file)
                else:
                    print(f"  {r['op']:<21} {m['shape']:<6} {case_str(m):<36} read {fmt_bytes(m['bytes_read'])} + "
                          f"written {fmt_bytes(m['bytes_written'])} vs floor {fmt_bytes(m['floor_bytes'])} "
                          f"({m['bytes_over_floor']:.2f}x; distinct {m['unique_over_floor']:.2f}x), CTAs {m['ctas']}, "
                          f"launches {m['launches']}", file=file)
                    if "sectors_over_ideal" in m:
                        print(f"  {'':<21} {'':<6} {'':<36} global sectors {m['sectors_over_ideal']:.2f}x ideal, "
                              f"shared wavefronts {m['wavefronts_over_ideal']:.2f}x ideal", file=file)
        for k in r.get("ptxas", []):
            print(f"  {r['op']:<21} ptxas {k['arch']}: {k['registers']} registers, {k['spill_bytes']} spill bytes  "
                  f"{str(k['kernel'])[:60]}", file=file)
        if r.get("ptxas_note"):
            print(f"  {r['op']:<21} ptxas: {r['ptxas_note']}", file=file)


def print_e2e(rows: List[dict], file=sys.stdout) -> None:
    print("\nend to end (decode loop against the target alone; the split is the speculative loop's phases; FORCED "
          "acceptance rows are bench/step.py's, whose drafts are the target's own continuation)", file=file)
    width = max([30] + [len(r["name"]) for r in rows])
    for r in rows:
        if "status" in r:
            print(f"  {r['name']:<{width}} {r['status']}", file=file)
            continue
        extra = ""
        if "split_s" in r:
            extra = "  split " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["split_s"].items())
        if "split_share" in r:
            extra = "  step " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in r["split_share"].items())
        if "same_tokens_as_target" in r:
            extra += f"  same tokens as target: {r['same_tokens_as_target']}"
        if "floor_ratio" in r:
            extra = f"  step {r['step_ms']:.2f} ms, {r['floor_ratio']:.2f}x its weights-read floor"
        print(f"  {r['name']:<{width}} {r['tokens_per_second']:>9.1f} tok/s  acceptance {r['acceptance_length']:.2f}  "
              f"x{r['speedup']:.2f} vs target alone{extra}", file=file)


def write_csv(rows: List[dict], path: str) -> None:
    cols = ["op", "backend"] + CASE_KEYS + ["status"] + [k for *_, keys in COLUMNS for k in keys] + ["note"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def _slice(rows: List[dict], op: str) -> tuple:
    """The rows of one op at one (K, V, dtype, mode, sched) slice, preferring the headline K=7, V=151936, bf16."""
    mine = [r for r in rows if r["op"] == op and r.get("status") == "ok"]
    if not mine:
        return {}, []
    prefs = dict(K=[7], V=[QWEN3_VOCAB], dtype=["bf16"], mode=["greedy"], sched=["exact"])
    fixed = {}
    for k, pref in prefs.items():
        vals = sorted({r[k] for r in mine if k in r}, key=str)
        if vals:
            fixed[k] = next((p for p in pref if p in vals), vals[-1] if k == "V" else vals[0])
    sel = [r for r in mine if all(r.get(k) == v for k, v in fixed.items())]
    return fixed, sel


def series(sel: List[dict]) -> Dict[str, List[dict]]:
    """The rows of one panel as lines, one per configuration: the backend and every case parameter but N that takes
    more than one value among the rows (fp8 W2, top-k, ...), so no line joins two configurations at the same N.
    Each line's rows are in N order; its label names the backend and those parameters."""
    varying = [k for k in CASE_KEYS if k != "N" and len({str(r.get(k)) for r in sel}) > 1]
    lines: Dict[str, List[dict]] = {}
    for r in sorted(sel, key=lambda r: (r["backend"], [str(r.get(k)) for k in varying], r["N"])):
        label = " ".join([r["backend"]] + [f"{k}={r.get(k)}" for k in varying])
        lines.setdefault(label, []).append(r)
    return lines


def plot(rows: List[dict], copy_gbps: float, time_path: str, floor_path: str, title: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker  # noqa: F401
    except ImportError:
        return "matplotlib is not installed: no plots (pip install -e \".[bench]\")"
    ops = [op for op in OPS if any(r["op"] == op and r.get("status") == "ok" for r in rows)]
    if not ops:
        return "no timed rows to plot"
    for path, metric, ylabel in ((time_path, "median_ms", "median time (ms)"),
                                 (floor_path, "pct_of_copy_bw", "floor bytes / time, % of copy bandwidth")):
        cols = min(3, len(ops))
        nrows = -(-len(ops) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.6 * nrows), squeeze=False)
        for ax in axes.flat[len(ops):]:
            ax.set_visible(False)
        for ax, op in zip(axes.flat, ops):
            fixed, sel = _slice(rows, op)
            for label, line in series(sel).items():
                pts = [(r["N"], r[metric]) for r in line if r.get(metric) is not None]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
                    if metric == "median_ms":
                        ax.fill_between([r["N"] for r in line], [r["p25_ms"] for r in line],
                                        [r["p75_ms"] for r in line], alpha=0.2)
            ax.set_xscale("log", base=2)
            ns = sorted({r["N"] for r in sel})
            ax.set_xticks(ns)
            ax.set_xticklabels([str(x) for x in ns])
            ys = [r[metric] for r in sel if r.get(metric)]
            if metric == "median_ms" and ys and max(ys) > 10 * min(ys):   # log only where it spans a decade
                ax.set_yscale("log")
                ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:g}"))
                ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_title(f"{op}\n" + " ".join(f"{k}={v}" for k, v in fixed.items()), fontsize=8)
            ax.set_xlabel("N (requests)")
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        sub = f" (copy bandwidth {copy_gbps:.0f} GB/s)" if metric != "median_ms" else ""
        fig.suptitle(title + sub, fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return None



def write_outputs(doc: dict, base: str, *, plots: bool, record_dir: Optional[str]) -> List[str]:
    """``<base>.json`` (the record), ``<base>.csv``, the two plots unless ``plots`` is False (or matplotlib is
    missing: said on stdout); copies of all of them in ``record_dir`` when given. Returns the paths written."""
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=1, default=str)
    write_csv(doc["rows"], base + ".csv")
    written = [base + ".json", base + ".csv"]
    if plots:
        info = doc["machine"]
        why = plot(doc["rows"], doc["copy_bandwidth"]["gbps"], base + "_time.png", base + "_floor.png",
                   f"dspark_kernels on {info['device']} ({doc['settings']['preset']}, {info['date'][:10]})")
        if why:
            print(f"bench: {why}")
        else:
            written += [base + "_time.png", base + "_floor.png"]
    if record_dir:
        os.makedirs(record_dir, exist_ok=True)
        for path in list(written):
            dst = os.path.join(record_dir, os.path.basename(path))
            if os.path.abspath(dst) != os.path.abspath(path):
                with open(path, "rb") as src, open(dst, "wb") as out:
                    out.write(src.read())
                written.append(dst)
    return written
