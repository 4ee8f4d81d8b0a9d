#!/usr/bin/env python
"""Microbenchmarks of every dspark_kernels op and backend, side by side with peers, against each op's bytes floor.

    python bench/run.py --quick                        # CPU-sized grid (reference ops), about a minute
    python bench/run.py --full                         # N {1,8,64,256} x K {3,7,15} x V {32000,151936} x bf16/fp32
                                                       #   x greedy/sampled, every backend and peer that runs here
    python bench/run.py --full --op verify_chain --backend cuda triton flashinfer --K 7 --V 151936
    python bench/run.py --full --out-dir /tmp/out --record    # also keep the record under bench/records/

Rows are op x backend x shape. Time: on a GPU, CUDA events around each call with the L2 cache flushed (a 512 MiB
write) before every repeat; on the CPU, perf_counter after warm-up, repeated until the median is stable (at least
``--min-reps`` calls and ``--min-time`` seconds). Each row reports the median, the spread (IQR = 25th..75th
percentile, and the minimum), the op's bytes floor (``bench/floors.py``: inputs read once, outputs written once),
the achieved bandwidth against that floor, that bandwidth as a percentage of this machine's copy bandwidth
(measured in the same run with a large tensor copy), and the speed-up against the best other backend or peer of
the same case. Peers: the reference ops on the same device (what a PyTorch engine would write), the Triton twins,
FlashInfer's ``chain_speculative_sampling`` for verify_chain; a peer that is missing is a row saying so.

Also: a structural report (per op, bytes moved by the CUDA kernels under the SIMT harness against the floor, CTAs
at N = 1, registers and spills from ptxas via ``tools/check_cuda.py --json``) and an end-to-end row (the decode
loop's tokens/s, acceptance length and time split against the target decoding alone on the same prompts).

Output: a table on stdout; ``<out-dir>/<machine>_<preset>.json`` (machine: device, CPU, cores, versions, commit,
date; the name carries the device and a host id, so machines never overwrite each other's records), ``.csv`` and
two PNG plots (time vs N per backend; % of copy bandwidth vs N) when matplotlib is installed
(``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import inspect
import itertools
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import dspark_kernels as dk  # noqa: E402
import floors  # noqa: E402

SCHEMA = "dspark-bench/2"
OPS = ["rng_uniform", "draft_block", "verify_chain", "accept_prefix_scan", "schedule_verify_lens"]
BACKENDS = ["cuda", "triton", "reference", "flashinfer"]
PEERS = {"flashinfer": ["verify_chain"]}   # external peers and the ops they have
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GRIDS = {
    # the grid; ops use the dimensions they have (scan: N, K; schedule: N, K; rng_uniform: N, K, V)
    "full": dict(N=[1, 8, 64, 256], K=[3, 7, 15], V=[32000, 151936], dtype=["bf16", "fp32"],
                 mode=["greedy", "sampled"]),
    "quick": dict(N=[1, 8, 64], K=[7], V=[32000], dtype=["fp32"], mode=["greedy", "sampled"]),
}
RANK, HIDDEN = 256, {"full": 4096, "quick": 256}
QWEN3_VOCAB = 151936


# ------------------------------------------------------------------------------------------------ cases

@dataclass
class Case:
    op: str
    params: Dict[str, object]
    floor: floors.Floor
    inputs: Callable[[], dict]                  # builds the tensors (lazily, per case)
    run: Callable[[str, dict], object]          # (backend, inputs) -> result


def _gen(seed: int = 0, dev="cpu") -> torch.Generator:
    return torch.Generator(device=dev).manual_seed(seed)


def _randn(shape, dev, dtype, g):
    """Random inputs made where they are used (the generator ``g`` lives on ``dev``): fast for GPU-sized cases."""
    return torch.randn(*shape, generator=g, device=dev).to(dtype)


def rng_uniform_cases(dev, grid):
    for n, k, v in itertools.product(grid["N"], grid["K"], grid["V"]):
        def inputs(n=n, k=k, v=v):
            return dict(out=torch.empty(n, k, v, device=dev))
        yield Case("rng_uniform", dict(N=n, K=k, V=v), floors.rng_uniform(n, k, v), inputs,
                   lambda b, x: dk.rng_uniform(x["out"], seed=1, offset=2, backend=b))


def draft_block_cases(dev, grid, d):
    for n, k, v, dt, mode in itertools.product(grid["N"], grid["K"], grid["V"], grid["dtype"], grid["mode"]):
        dtype, sampled = DTYPES[dt], mode == "sampled"
        esize = torch.empty(0, dtype=dtype).element_size()
        fl = floors.draft_block(n, k, v, RANK, d=d, u_bytes=esize, w_bytes=esize, confidence=True,
                                return_logits=sampled)

        def inputs(n=n, k=k, v=v, dtype=dtype):
            g = _gen(0, dev)
            head = dk.MarkovHead("vanilla", _randn((v, RANK), dev, dtype, g) * 0.05,
                                 _randn((v, RANK), dev, dtype, g) * 0.05)
            return dict(base=_randn((n, k, v), dev, dtype, g),
                        anchors=torch.randint(0, v, (n,), generator=g, device=dev), head=head,
                        hidden=_randn((n, k, d), dev, dtype, g),
                        conf=dk.ConfidenceHead(_randn((d + RANK,), dev, dtype, g) * 0.02, 0.0))

        yield Case("draft_block", dict(N=n, K=k, V=v, dtype=dt, mode=mode, r=RANK, d=d), fl, inputs,
                   lambda b, x, t=1.0 if sampled else 0.0, s=sampled: dk.draft_block(
                       x["base"], x["anchors"], x["head"], hidden=x["hidden"], confidence=x["conf"], temperature=t,
                       seed=1, offset=0, return_logits=s, backend=b))


_VERIFY_HAS_LOGPROBS = "draft_logprobs" in inspect.signature(dk.verify_chain).parameters


def verify_chain_cases(dev, grid):
    for n, k, v, dt, mode in itertools.product(grid["N"], grid["K"], grid["V"], grid["dtype"], grid["mode"]):
        dtype, sampled = DTYPES[dt], mode == "sampled"
        esize = torch.empty(0, dtype=dtype).element_size()
        # the draft logits come from draft_block: float32
        fl = floors.verify_chain_dense(n, k, v, target_bytes=esize, sampled=sampled,
                                       draft_logits_bytes=4 if sampled else None,
                                       draft_logprobs=sampled and _VERIFY_HAS_LOGPROBS)

        def inputs(n=n, k=k, v=v, dtype=dtype, sampled=sampled):
            g = _gen(1, dev)
            target = _randn((n, k + 1, v), dev, dtype, g)
            drafts = torch.randint(0, v, (n, k), generator=g, device=dev)
            # make most drafts the target's argmax, so chains run a few positions deep
            keep = torch.rand(n, k, generator=g, device=dev) < 0.7
            drafts = torch.where(keep, target[:, :k].argmax(-1), drafts)
            x = dict(target=target, drafts=drafts, draft_logits=None)
            if sampled:
                x["draft_logits"] = (target[:, :k].float() + 0.5 * _randn((n, k, v), dev, torch.float32, g))
                if _VERIFY_HAS_LOGPROBS:
                    lp = torch.log_softmax(x["draft_logits"], -1)
                    x["draft_logprobs"] = lp.gather(-1, drafts[..., None])[..., 0]
            return x

        def run(b, x, t=1.0 if sampled else 0.0):
            kw = dict(draft_logprobs=x["draft_logprobs"]) if "draft_logprobs" in x else {}
            return dk.verify_chain(x["target"], x["drafts"], draft_logits=x["draft_logits"], temperature=t, seed=1,
                                   offset=0, method="token", backend=b, **kw)

        yield Case("verify_chain", dict(N=n, K=k, V=v, dtype=dt, mode=mode), fl, inputs, run)


def accept_prefix_scan_cases(dev, grid):
    for n, k in itertools.product(grid["N"], grid["K"]):
        def inputs(n=n, k=k):
            g = _gen(2)
            n_acc = torch.randint(0, k + 1, (n,), generator=g, dtype=torch.int32)
            tokens = torch.randint(0, 1000, (n, k + 1), generator=g)
            tokens[torch.arange(k + 1)[None, :] > n_acc[:, None].long()] = -1
            seq_lens = torch.randint(1, 4000, (n,), generator=g, dtype=torch.int32)
            cu = torch.nn.functional.pad((n_acc.long() * 0 + k + 1).cumsum(0), (1, 0)).int()
            table = torch.randperm(n * 256, generator=g).int().view(n, 256)
            return {key: t.to(dev) for key, t in dict(tokens=tokens, n_acc=n_acc, seq_lens=seq_lens, cu=cu,
                                                      table=table).items()}

        yield Case("accept_prefix_scan", dict(N=n, K=k), floors.accept_prefix_scan(n, k, block_size=16), inputs,
                   lambda b, x: dk.accept_prefix_scan(x["tokens"], x["seq_lens"], num_accepted=x["n_acc"],
                                                      verify_cu_seqlens=x["cu"], block_table=x["table"],
                                                      block_size=16, backend=b))


def schedule_verify_lens_cases(dev, grid):
    table = dk.CostTable([1, 64, 256, 1024], [10.0, 11.0, 14.0, 30.0])
    for n, k, mode in itertools.product(grid["N"], grid["K"], ["exact", "argmax"]):
        def inputs(n=n, k=k):
            return dict(survival=torch.rand(n, k, generator=_gen(3)).cumprod(-1).to(dev))
        yield Case("schedule_verify_lens", dict(N=n, K=k, sched=mode), floors.schedule_verify_lens(n, k), inputs,
                   lambda b, x, m=mode: dk.schedule_verify_lens(x["survival"], cost_table=table, mode=m, backend=b))


def cases_for(op, dev, grid, preset):
    return {"rng_uniform": lambda: rng_uniform_cases(dev, grid),
            "draft_block": lambda: draft_block_cases(dev, grid, HIDDEN[preset]),
            "verify_chain": lambda: verify_chain_cases(dev, grid),
            "accept_prefix_scan": lambda: accept_prefix_scan_cases(dev, grid),
            "schedule_verify_lens": lambda: schedule_verify_lens_cases(dev, grid)}[op]()


# ------------------------------------------------------------------------------------------------ peers

def flashinfer_runner():
    """A verify_chain runner with FlashInfer's chain_speculative_sampling (softmax of the logits included, as an
    engine holding logits would do), or the reason it is missing."""
    try:
        import flashinfer
        from flashinfer.sampling import chain_speculative_sampling
    except Exception as e:  # noqa: BLE001
        return None, f"flashinfer not importable ({type(e).__name__}: {str(e)[:80]})"

    def run(x):   # sampled cases only: FlashInfer takes probabilities, so the softmax is part of its time
        draft_probs = torch.softmax(x["draft_logits"].float(), -1)
        target_probs = torch.softmax(x["target"].float(), -1)
        return chain_speculative_sampling(draft_probs, x["drafts"].int(), target_probs)

    return run, f"flashinfer {getattr(flashinfer, '__version__', '?')}"


# ------------------------------------------------------------------------------------------------ timing

def _percentile(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _summary(samples_ms: List[float]) -> dict:
    med = statistics.median(samples_ms)
    return dict(median_ms=med, p25_ms=_percentile(samples_ms, 0.25), p75_ms=_percentile(samples_ms, 0.75),
                min_ms=min(samples_ms), max_ms=max(samples_ms), reps=len(samples_ms))


class Timer:
    """GPU: CUDA events with an L2 flush before each repeat. CPU: perf_counter until the median is stable."""

    def __init__(self, dev, min_reps, max_reps, min_time, max_time):
        self.dev, self.min_reps, self.max_reps = dev, min_reps, max_reps
        self.min_time, self.max_time = min_time, max_time
        self.flush = None
        if dev.type == "cuda":
            self.flush = torch.empty(512 * 2 ** 20 // 4, dtype=torch.float32, device=dev)  # > H200's 60 MB L2

    def __call__(self, fn) -> dict:
        if self.dev.type == "cuda":
            return self._gpu(fn)
        return self._cpu(fn)

    def _gpu(self, fn):
        fn()  # compile / build / allocate
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        one = max(time.perf_counter() - t0, 1e-6)
        reps = int(min(self.max_reps, max(self.min_reps, self.min_time / one)))
        reps = max(3, min(reps, int(self.max_time / one)))   # slow calls (the reference at N = 256): fewer repeats
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return _summary([s.elapsed_time(e) for s, e in zip(starts, ends)])

    def _cpu(self, fn):
        t_start = time.perf_counter()
        for _ in range(2):   # warm-up: first-call costs (allocator, caches, lazy imports)
            fn()
        samples: List[float] = []
        while True:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
            spent = time.perf_counter() - t_start
            if len(samples) >= self.max_reps or spent >= (self.max_time if len(samples) >= 3 else 3 * self.max_time):
                break   # at least 3 samples (a spread) unless even that takes 3x the time cap
            if len(samples) >= self.min_reps and sum(samples) >= self.min_time * 1e3:
                s = _summary(samples)
                if (s["p75_ms"] - s["p25_ms"]) <= 0.1 * s["median_ms"] or len(samples) >= 4 * self.min_reps:
                    break
        return _summary(samples)


def copy_bandwidth(dev, timer: Timer) -> dict:
    """Device-to-device copy of a large buffer: bytes read + written per second."""
    nbytes = (1 << 30) if dev.type == "cuda" else (128 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    s = timer(lambda: dst.copy_(src))
    moved = 2 * nbytes
    return dict(bytes=moved, median_ms=s["median_ms"], gbps=moved / (s["median_ms"] * 1e-3) / 1e9,
                best_gbps=moved / (s["min_ms"] * 1e-3) / 1e9, reps=s["reps"])


# ------------------------------------------------------------------------------------------------ machine

def _run(cmd, cwd=ROOT, timeout=10) -> Optional[str]:
    try:
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        return p.stdout.strip() if p.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", s.lower()).strip("-")[:40] or "unknown"


def machine_info(dev) -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001
        triton_version = None
    try:
        cores_usable = len(os.sched_getaffinity(0))
    except AttributeError:
        cores_usable = os.cpu_count()
    commit = _run(["git", "rev-parse", "HEAD"])
    dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    info = dict(
        device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        device_type=dev.type,
        cpu_model=_cpu_model(), cpu_cores=os.cpu_count(), cpu_cores_usable=cores_usable,
        torch_threads=torch.get_num_threads(),
        load_avg_1m=round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        hostname=socket.gethostname(), os=platform.platform(), python=platform.python_version(),
        torch=torch.__version__, triton=triton_version, cuda=torch.version.cuda,
        numpy=_version("numpy"), flashinfer=_version("flashinfer"), dspark_kernels=dk.__version__,
        git_commit=commit or "unknown", git_dirty=bool(dirty) if commit else None,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(gpu_sms=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                    gpu_capability=f"{props.major}.{props.minor}",
                    driver=_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]))
    return info


def _version(mod: str) -> Optional[str]:
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:  # noqa: BLE001
        return None


def machine_id(info: dict) -> str:
    """``<device>-<cores>c-<host id>``: the device (GPU name, or CPU model), and a short hash of the host name and
    /etc/machine-id, so two machines never share a file name."""
    dev = info["device"] if info["device_type"] == "cuda" else info["cpu_model"]
    mid = ""
    try:
        with open("/etc/machine-id") as f:
            mid = f.read().strip()
    except OSError:
        pass
    host = hashlib.sha1((info["hostname"] + mid).encode()).hexdigest()[:8]
    return f"{_slug(dev)}-{info['cpu_cores']}c-{host}"


# ------------------------------------------------------------------------------------------------ the run

def backends_for(op: str, dev, wanted: List[str]) -> List[str]:
    out = []
    for b in wanted:
        if b in PEERS and op not in PEERS[b]:
            continue
        out.append(b)
    return out


def run_case(case: Case, backends, dev, timer, fi) -> List[dict]:
    rows = []
    try:
        x = case.inputs()
    except Exception as e:  # noqa: BLE001 - e.g. out of memory
        return [dict(op=case.op, backend=b, **case.params, status="error", note=f"inputs: {e}"[:160])
                for b in backends]
    for b in backends:
        row = dict(op=case.op, backend=b, **case.params, floor_bytes=case.floor.total)
        if b == "flashinfer":
            fn, why = fi
            if fn is None:
                rows.append(dict(row, status="missing", note=why))
                continue
            if x.get("draft_logits") is None:
                rows.append(dict(row, status="missing", note="FlashInfer has no greedy chain verification"))
                continue
            row["note"] = "softmax of target and draft logits included (FlashInfer takes probabilities)"
            call = (lambda fn=fn, x=x: fn(x))
        elif b == "cuda" and dev.type != "cuda":
            rows.append(dict(row, status="skipped", note="timing needs a GPU (see the structural report)"))
            continue
        elif b == "triton" and dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            rows.append(dict(row, status="skipped", note="Triton needs a GPU (or TRITON_INTERPRET=1, untimed)"))
            continue
        else:
            call = (lambda b=b, x=x: case.run(b, x))
        try:
            s = timer(call)
        except ValueError as e:   # a backend this op does not have (yet)
            rows.append(dict(row, status="unsupported", note=str(e)[:160]))
            continue
        except Exception as e:  # noqa: BLE001 - keep going: one broken backend is one row
            rows.append(dict(row, status="error", note=f"{type(e).__name__}: {e}"[:200]))
            if dev.type == "cuda":
                torch.cuda.synchronize()
            continue
        gbps = case.floor.total / (s["median_ms"] * 1e-3) / 1e9
        rows.append(dict(row, status="ok", **{k: round(v, 6) if isinstance(v, float) else v for k, v in s.items()},
                         achieved_gbps=_sig(gbps)))
    return rows


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def add_comparisons(rows: List[dict], copy_gbps: float) -> None:
    """% of copy bandwidth per row; speed-up against the best other backend / peer of the same case."""
    key = lambda r: (r["op"],) + tuple((k, r[k]) for k in CASE_KEYS if k in r)  # noqa: E731
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    for rs in groups.values():
        ok = [r for r in rs if r.get("status") == "ok"]
        for r in ok:
            r["pct_of_copy_bw"] = _sig(100.0 * r["achieved_gbps"] / copy_gbps) if copy_gbps else None
            others = [o for o in ok if o is not r]
            if others:
                best = min(others, key=lambda o: o["median_ms"])
                r["best_other"] = best["backend"]
                r["speedup_vs_best_other"] = round(best["median_ms"] / r["median_ms"], 3)
            else:
                r["best_other"], r["speedup_vs_best_other"] = None, None


CASE_KEYS = ["N", "K", "V", "dtype", "mode", "sched", "r", "d"]


# ------------------------------------------------------------------------------------------------ structural

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
    small = dict(N=[4], K=[7], V=[1000], dtype=["fp32"], mode=["greedy", "sampled"])
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
                        with simt.record() as rec:
                            case.run("cuda", x)
                        moved = int(rec.bytes_read) + int(rec.bytes_written)
                        measured.append(dict(shape=tag, **case.params, bytes_read=int(rec.bytes_read),
                                             bytes_written=int(rec.bytes_written), floor_bytes=case.floor.total,
                                             bytes_over_floor=round(moved / max(case.floor.total, 1), 3),
                                             unique_bytes=int(rec.unique_bytes),
                                             unique_over_floor=round(rec.unique_bytes / max(case.floor.total, 1),
                                                                     3),
                                             ctas=int(rec.ctas), launches=len(rec.launches),
                                             kernels=sorted({str(ln.get("kernel")) for ln in rec.launches})))
                    except Exception as e:  # noqa: BLE001 - no CUDA kernel yet, or a harness fault
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


# ------------------------------------------------------------------------------------------------ end to end

def _target_alone(target, prompts, max_new, dev):
    """Plain batched greedy decoding with the target: one token per request per step (equal-length prompts)."""
    n, p = len(prompts), len(prompts[0])
    target.alloc_cache(n, p + max_new + 1)
    seq = torch.tensor(prompts, device=dev)
    out = []
    # prefill every prompt token; the last row's logits give the first new token
    toks = seq.reshape(-1)
    pos = torch.arange(p, device=dev).repeat(n)
    cu = torch.arange(0, n * p + 1, p, device=dev, dtype=torch.int32)
    logits = target(toks, pos, cu, p, p, logit_rows=cu[1:].long() - 1).logits
    nxt = logits.argmax(-1)
    for step in range(max_new):
        out.append(nxt)
        if step == max_new - 1:
            break
        pos = torch.full((n,), p + step, device=dev)
        cu = torch.arange(n + 1, device=dev, dtype=torch.int32)
        nxt = target(nxt, pos, cu, 1, p + step + 1).logits.argmax(-1)
    return torch.stack(out, 1).tolist()


def end_to_end(dev, preset: str) -> List[dict]:
    from dspark_kernels.decode import Scheduler, SpeculativeDecoder
    from dspark_kernels.decode.testing import oracle_drafter, tiny_drafter, tiny_target

    threads = torch.get_num_threads()
    if dev.type != "cuda":
        torch.set_num_threads(1)   # tiny models: one intra-op thread is faster, and steadier on a shared CPU
    try:
        vocab, layers = (512, 4) if preset == "quick" else (4096, 8)
        n, plen, max_new, k = (4, 8, 32, 4) if preset == "quick" else (8, 16, 64, 7)
        target = tiny_target(0, vocab=vocab, layers=layers).to(dev)
        g = _gen(5)
        prompts = torch.randint(0, vocab - 1, (n, plen), generator=g).tolist()
        with torch.no_grad():
            _target_alone(target, prompts, 4, dev)      # warm-up
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            ref = _target_alone(target, prompts, max_new, dev)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            base_s = time.perf_counter() - t0
        rows = [dict(name="target alone (greedy)", tokens=n * max_new, time_s=round(base_s, 4),
                     tokens_per_second=round(n * max_new / base_s, 1), acceptance_length=1.0, speedup=1.0)]
        for name, make in (("speculative, oracle drafter", lambda: oracle_drafter(target, block_size=k)),
                           ("speculative, random drafter", lambda: tiny_drafter(target, block_size=k))):
            drafter = make().to(dev)
            if hasattr(drafter, "set_reference"):
                drafter.set_reference([p + r for p, r in zip(prompts, ref)], device=dev)
            dec = SpeculativeDecoder(target, drafter)
            dec.generate(prompts, max_new_tokens=4, temperature=0.0, scheduler=Scheduler())  # warm-up
            res = dec.generate(prompts, max_new_tokens=max_new, temperature=0.0, scheduler=Scheduler())
            st = res.stats
            # the whole call's rate, like the target-alone row (both calls come after a warm-up call of their own)
            tps = st.tokens_per_second_with_warmup
            rows.append(dict(name=name, tokens=st.generated_tokens, time_s=round(st.time_s.get("total", 0.0), 4),
                             tokens_per_second=round(tps, 1),
                             acceptance_length=round(st.acceptance_length, 3), steps=st.steps,
                             split_s={k_: round(v, 4) for k_, v in st.time_s.items()},
                             speedup=round(tps / rows[0]["tokens_per_second"], 3),
                             same_tokens_as_target=res.tokens == ref))
        for r in rows:
            r.update(device=str(dev), models=f"tiny random qwen3 target (vocab {vocab}, {layers} layers, hidden 32)",
                     requests=n, prompt_len=plen, max_new_tokens=max_new, block_size=k)
        return rows
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------ output

def _fmt_time(ms) -> str:
    if ms is None:
        return "-"
    if ms < 1:
        return f"{ms * 1e3:.1f} us"
    if ms < 1000:
        return f"{ms:.3f} ms"
    return f"{ms / 1e3:.2f} s"


def _fmt_bytes(b) -> str:
    if b is None:
        return "-"
    for unit, s in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= s:
            return f"{b / s:.1f} {unit}"
    return f"{b} B"


def case_str(r: dict) -> str:
    return " ".join(f"{k}={r[k]}" for k in CASE_KEYS if k in r and k not in ("r", "d"))


def print_table(rows: List[dict], file=sys.stdout) -> None:
    hdr = (f"{'op':<21}{'backend':<11}{'case':<44}{'median':>11}{'IQR (p25..p75)':>24} {'floor':>9} {'GB/s':>9} "
           f"{'% copy':>8}  {'speed-up vs best other'}")
    print(hdr, file=file)
    print("-" * len(hdr), file=file)
    for r in rows:
        head = f"{r['op']:<21}{r['backend']:<11}{case_str(r):<44}"
        if r.get("status") != "ok":
            print(f"{head}  [{r.get('status')}] {r.get('note', '')}"[:len(hdr) + 40], file=file)
            continue
        iqr = f"{_fmt_time(r['p25_ms'])}..{_fmt_time(r['p75_ms'])}"
        sp = (f"{r['speedup_vs_best_other']:.2f}x {r['best_other']}" if r.get("speedup_vs_best_other") else "-")
        pct = f"{r['pct_of_copy_bw']:.3g}" if r.get("pct_of_copy_bw") is not None else "-"
        print(f"{head}{_fmt_time(r['median_ms']):>11}{iqr:>24} {_fmt_bytes(r['floor_bytes']):>9} "
              f"{r['achieved_gbps']:>9.3g} {pct:>8}  {sp}", file=file)


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
                    print(f"  {r['op']:<21} {m['shape']:<6} {case_str(m):<36} read {_fmt_bytes(m['bytes_read'])} + "
                          f"written {_fmt_bytes(m['bytes_written'])} vs floor {_fmt_bytes(m['floor_bytes'])} "
                          f"({m['bytes_over_floor']:.2f}x; distinct {m['unique_over_floor']:.2f}x), CTAs {m['ctas']}, "
                          f"launches {m['launches']}", file=file)
        for k in r.get("ptxas", []):
            print(f"  {r['op']:<21} ptxas {k['arch']}: {k['registers']} registers, {k['spill_bytes']} spill bytes  "
                  f"{str(k['kernel'])[:60]}", file=file)
        if r.get("ptxas_note"):
            print(f"  {r['op']:<21} ptxas: {r['ptxas_note']}", file=file)


def print_e2e(rows: List[dict], file=sys.stdout) -> None:
    print("\nend to end (decode loop on tiny random models; the split is the speculative loop's phases)", file=file)
    for r in rows:
        extra = ""
        if "split_s" in r:
            extra = "  split " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in r["split_s"].items())
            extra += f"  same tokens as target: {r['same_tokens_as_target']}"
        print(f"  {r['name']:<30} {r['tokens_per_second']:>9.1f} tok/s  acceptance {r['acceptance_length']:.2f}  "
              f"x{r['speedup']:.2f} vs target alone{extra}", file=file)


def write_csv(rows: List[dict], path: str) -> None:
    cols = ["op", "backend"] + CASE_KEYS + ["status", "median_ms", "p25_ms", "p75_ms", "min_ms", "max_ms", "reps",
                                            "floor_bytes", "achieved_gbps", "pct_of_copy_bw", "best_other",
                                            "speedup_vs_best_other", "note"]
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
            for b in sorted({r["backend"] for r in sel}):
                pts = sorted((r["N"], r[metric]) for r in sel if r["backend"] == b and r.get(metric) is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=b)
                    if metric == "median_ms":
                        lo = [r["p25_ms"] for r in sorted(sel, key=lambda r: r["N"]) if r["backend"] == b]
                        hi = [r["p75_ms"] for r in sorted(sel, key=lambda r: r["N"]) if r["backend"] == b]
                        ax.fill_between([p[0] for p in pts], lo, hi, alpha=0.2)
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


# ------------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    preset = ap.add_mutually_exclusive_group(required=True)
    preset.add_argument("--quick", action="store_true", help=f"small grid for a CPU: {GRIDS['quick']}")
    preset.add_argument("--full", action="store_true", help=f"the full grid: {GRIDS['full']}")
    ap.add_argument("--op", nargs="+", choices=OPS, help="ops to run (default: all)")
    ap.add_argument("--backend", nargs="+", choices=BACKENDS,
                    help="backends and peers (default: on a GPU all of them, on the CPU the reference)")
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
    ap.add_argument("--name", default=None, help="file stem (default: <machine id>_<quick|full>)")
    ap.add_argument("--record", action="store_true", help="also copy the JSON, CSV and plots into bench/records/")
    ap.add_argument("--ptxas-json", default=None, help="tools/check_cuda.py --json output for the registers")
    ap.add_argument("--no-structural", action="store_true")
    ap.add_argument("--no-e2e", action="store_true")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)

    preset_name = "full" if args.full else "quick"
    dev = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    grid = dict(GRIDS[preset_name])
    for k in ("N", "K", "V", "dtype", "mode"):
        if getattr(args, k):
            grid[k] = getattr(args, k)
    ops = args.op or OPS
    backends = args.backend or (BACKENDS if dev.type == "cuda" else ["reference"])
    gpu = dev.type == "cuda"
    timer = Timer(dev, args.min_reps or (20 if gpu else 7), args.max_reps or (200 if gpu else 100),
                  args.min_time if args.min_time is not None else (0.05 if gpu else 0.3),
                  max(args.min_time or 0.0, 0.5 if gpu else (3.0 if args.full else 0.6)))
    info = machine_info(dev)
    mid = machine_id(info)
    stem = args.name or f"{mid}_{preset_name}"
    print(f"bench: preset --{preset_name}  grid {grid}")
    print(f"bench: ops {ops}  backends {backends}  device {info['device']} ({info['cpu_model']}, "
          f"{info['cpu_cores']} cores)  torch {info['torch']}  triton {info['triton']}  CUDA {info['cuda']}  "
          f"commit {info['git_commit'][:12]}  load {info['load_avg_1m']}")
    timing = ("CUDA events, L2 flushed (512 MiB write) before each repeat" if gpu else
              "perf_counter, 2 warm-up calls, repeats until the IQR is within 10% of the median")
    print(f"bench: timing: {timing}; min reps {timer.min_reps}, max reps {timer.max_reps}, "
          f"min time {timer.min_time} s per row")

    t_start = time.perf_counter()
    cb = copy_bandwidth(dev, timer)
    print(f"bench: copy bandwidth {cb['gbps']:.1f} GB/s (median; best {cb['best_gbps']:.1f}) "
          f"over {_fmt_bytes(cb['bytes'])} read + written")
    fi = flashinfer_runner() if "flashinfer" in backends else (None, "not asked for")

    rows: List[dict] = []
    left_out = []
    with torch.no_grad():
        for op in ops:
            bks = backends_for(op, dev, backends)
            for case in cases_for(op, dev, grid, preset_name):
                if args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
                    left_out.append(f"{op} {' '.join(f'{k}={v}' for k, v in case.params.items())}")
                    continue
                new = run_case(case, bks, dev, timer, fi)
                if gpu:
                    torch.cuda.empty_cache()   # the case's inputs are gone: give their memory back
                add_comparisons(new, cb["gbps"])
                rows.extend(new)
                print(f"  {op:<21} {case_str(new[0]):<44} " + "  ".join(
                    f"{r['backend']} {_fmt_time(r.get('median_ms')) if r['status'] == 'ok' else r['status']}"
                    for r in new), flush=True)
    add_comparisons(rows, cb["gbps"])
    print()
    print_table(rows)
    if left_out:
        print(f"\nbench: time budget of {args.time_budget} s reached; {len(left_out)} cases left out, first: "
              f"{left_out[:3]}")

    structural = [] if args.no_structural else structural_report(ops, args.ptxas_json)
    if structural:
        print_structural(structural)
    e2e: List[dict] = []
    if not args.no_e2e:
        try:
            e2e = end_to_end(dev, preset_name)
            print_e2e(e2e)
        except Exception as e:  # noqa: BLE001
            e2e = [dict(name="end to end", error=f"{type(e).__name__}: {e}"[:300])]
            print(f"\nend to end: failed: {e2e[0]['error']}")

    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, stem)
    settings = dict(preset=preset_name, grid=grid, ops=ops, backends=backends, timing=timing,
                    min_reps=timer.min_reps, max_reps=timer.max_reps, min_time_s=timer.min_time,
                    time_budget_s=args.time_budget, left_out=left_out, argv=sys.argv[1:] if argv is None else argv,
                    floors="bench/floors.py", wall_s=round(time.perf_counter() - t_start, 1))
    doc = dict(schema=SCHEMA, machine_id=mid, machine=info, settings=settings, copy_bandwidth=cb, rows=rows,
               structural=structural, e2e=e2e)
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=1, default=str)
    write_csv(rows, base + ".csv")
    written = [base + ".json", base + ".csv"]
    if not args.no_plot:
        why = plot(rows, cb["gbps"], base + "_time.png", base + "_floor.png",
                   f"dspark_kernels on {info['device']} ({preset_name}, {info['date'][:10]})")
        if why:
            print(f"bench: {why}")
        else:
            written += [base + "_time.png", base + "_floor.png"]
    if args.record:
        rec_dir = os.path.join(HERE, "records")
        os.makedirs(rec_dir, exist_ok=True)
        for p in list(written):
            dst = os.path.join(rec_dir, os.path.basename(p))
            if os.path.abspath(dst) != os.path.abspath(p):
                with open(p, "rb") as fi_, open(dst, "wb") as fo:
                    fo.write(fi_.read())
                written.append(dst)
    print(f"bench: {len(rows)} rows in {settings['wall_s']} s; wrote " + ", ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
