"""Timing: the timer (CUDA events with an L2 flush and the host ahead on a GPU, perf_counter until stable on the
CPU), the copy bandwidth of the machine, one case's row per backend, and the comparisons between a case's rows."""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Dict, List

import torch

from cases import CASE_KEYS, Case


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
    """GPU: CUDA events with an L2 flush before each repeat, the GPU held by a spin kernel while the host enqueues
    the repeat, so that the events time the GPU's work and not a gap where it waits for the host (nvbench's blocking
    kernel): an op's host time, which an engine's CUDA graph removes, is its own number, ``host_ms`` (the time to
    enqueue a call; a call that synchronises with the device reaches the hold's length). CPU: perf_counter until
    the median is stable."""

    def __init__(self, dev, min_reps, max_reps, min_time, max_time):
        self.dev, self.min_reps, self.max_reps = dev, min_reps, max_reps
        self.min_time, self.max_time = min_time, max_time
        self.flush = None
        if dev.type == "cuda":
            self.flush = torch.empty(512 * 2 ** 20 // 4, dtype=torch.float32, device=dev)  # > H200's 60 MB L2
            self.spin_hz = self._spin_rate()

    @staticmethod
    def _spin_rate() -> float:
        """torch.cuda._sleep's cycles a second on this GPU (its clock, as the spin kernel counts it)."""
        cycles = 10 ** 7
        torch.cuda._sleep(cycles)  # (the first launch loads the kernel)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) * 1e-3)

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
        hold = self._hold(fn, one)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        host = []
        for i in range(reps):
            self.flush.zero_()
            torch.cuda._sleep(hold)
            h0 = time.perf_counter()
            starts[i].record()
            fn()
            ends[i].record()
            host.append((time.perf_counter() - h0) * 1e3)
        torch.cuda.synchronize()
        return dict(_summary([s.elapsed_time(e) for s, e in zip(starts, ends)]), host_ms=statistics.median(host),
                    hold_ms=hold / self.spin_hz * 1e3)

    def _hold(self, fn, one: float) -> int:
        """The spin kernel's cycles for `fn`: twice the host's time to enqueue a call (timed while the GPU spins for
        as long as a whole synchronous call, `one` seconds) and 0.1 ms, at most 50 ms."""
        torch.cuda._sleep(int(self.spin_hz * min(one, 0.05)))
        h0 = time.perf_counter()
        fn()
        enqueue = time.perf_counter() - h0
        torch.cuda.synchronize()
        return int(self.spin_hz * min(2.0 * enqueue + 1e-4, 0.05))

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
        elif b in case.peer_notes:  # a peer the case builds on its own inputs (cases.py)
            if b not in case.peers:
                rows.append(dict(row, status="missing", note=case.peer_notes[b]))
                continue
            row["note"] = case.peer_notes[b]
            call = (lambda fn=case.peers[b], x=x: fn(x))
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
        except ValueError as e:   # a backend that cannot run this case
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
    """% of copy bandwidth per row, the floor's time at the copy bandwidth; speed-up against the best other backend /
    peer of the same case."""
    key = lambda r: (r["op"],) + tuple((k, r[k]) for k in CASE_KEYS if k in r)  # noqa: E731
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault(key(r), []).append(r)
    for rs in groups.values():
        ok = [r for r in rs if r.get("status") == "ok"]
        for r in ok:
            r["pct_of_copy_bw"] = _sig(100.0 * r["achieved_gbps"] / copy_gbps) if copy_gbps else None
            r["floor_ms"] = _sig(r["floor_bytes"] / (copy_gbps * 1e9) * 1e3) if copy_gbps else None
            others = [o for o in ok if o is not r]
            if others:
                best = min(others, key=lambda o: o["median_ms"])
                r["best_other"] = best["backend"]
                r["speedup_vs_best_other"] = round(best["median_ms"] / r["median_ms"], 3)
            else:
                r["best_other"], r["speedup_vs_best_other"] = None, None


