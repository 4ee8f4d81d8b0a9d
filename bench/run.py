#!/usr/bin/env python
"""Microbenchmarks of every dspark_kernels op and backend: time and achieved GB/s against the bytes each op must move.

    python bench/run.py                      # every op, every backend that runs here, default shapes
    python bench/run.py --ops verify_chain --backends reference --quick
    python bench/run.py --out bench/results/h200.json

Each row is data: op, backend, device, case parameters, median milliseconds, bytes (the floor: inputs read once,
outputs written once) and GB/s = bytes / time. Rows go to stdout as a table and to a JSON file (default
bench/results/<device>.json). On a GPU, times come from CUDA events around each call after warm-up (median of
``--reps``); on the CPU, from perf_counter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dspark_kernels as dk  # noqa: E402

QWEN3_VOCAB = 151936


@dataclass
class Case:
    op: str
    params: dict
    bytes: int                      # the floor: every input read once, every output written once
    run: Callable[[str], object]    # backend -> result


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def rng_uniform_cases(dev, quick):
    for n, k, v in ([(8, 7, 32000)] if quick else [(8, 7, 32000), (64, 8, QWEN3_VOCAB)]):
        out = torch.empty(n, k, v, device=dev)
        yield Case("rng_uniform", dict(N=n, K=k, V=v), nbytes(out),
                   lambda b, out=out: dk.rng_uniform(out, seed=1, offset=2, backend=b))


def draft_block_cases(dev, quick, dtype):
    shapes = [(8, 7, 32000, 256, 1024)] if quick else [(1, 7, QWEN3_VOCAB, 256, 4096), (16, 7, QWEN3_VOCAB, 256, 4096),
                                                        (64, 7, QWEN3_VOCAB, 256, 4096)]
    for n, k, v, r, d in shapes:
        for kind in ("vanilla", "gated", "rnn"):
            g = torch.Generator(device="cpu").manual_seed(0)
            mk = lambda *s: torch.randn(*s, generator=g).to(dev, dtype)  # noqa: E731
            head = dk.MarkovHead(kind, mk(v, r), mk(v, r))
            if kind == "gated":
                head.wg, head.bg = mk(r, d + r), mk(r)
            if kind == "rnn":
                head.wj, head.bj = mk(3 * r, 2 * r + d), mk(3 * r)
            base, hidden = mk(n, k, v), mk(n, k, d)
            anchors = torch.randint(0, v, (n,), device=dev)
            conf = dk.ConfidenceHead(mk(d + r), 0.0)
            tokens = torch.empty(n, k, dtype=torch.int64)
            logits = torch.empty(n, k, v, dtype=torch.float32)
            floor = (nbytes(base, anchors, hidden, head.w2, head.wg, head.wj, conf.weight, tokens, logits)
                     + n * k * r * head.w1.element_size() + 2 * n * k * 4)
            yield Case("draft_block", dict(N=n, K=k, V=v, r=r, d=d, head=kind, dtype=str(dtype)[6:]), floor,
                       lambda b, a=(base, anchors, head, hidden, conf): dk.draft_block(
                           a[0], a[1], a[2], hidden=a[3], confidence=a[4], temperature=1.0, return_logits=True,
                           backend=b))


def verify_chain_cases(dev, quick, dtype):
    shapes = [(8, 7, 32000)] if quick else [(1, 7, QWEN3_VOCAB), (16, 7, QWEN3_VOCAB), (64, 7, QWEN3_VOCAB)]
    for n, k, v in shapes:
        target = torch.randn(n, k + 1, v, device=dev).to(dtype)
        draft_logits = torch.randn(n, k, v, device=dev)
        drafts = torch.randint(0, v, (n, k), device=dev)
        out = torch.empty(n, k + 1, dtype=torch.int64)
        for method, dl, t in (("greedy", None, 0.0), ("token", draft_logits, 1.0), ("block", draft_logits, 1.0)):
            floor = nbytes(target, dl, drafts, out) + n * 4 + n * k
            yield Case("verify_chain", dict(N=n, K=k, V=v, method=method, dtype=str(dtype)[6:]), floor,
                       lambda b, dl=dl, t=t, m=method: dk.verify_chain(
                           target, drafts, draft_logits=dl, temperature=t, method="token" if m == "greedy" else m,
                           backend=b))


def accept_prefix_scan_cases(dev, quick):
    for n, k in ([(64, 7)] if quick else [(64, 7), (1024, 7), (65536, 16)]):
        tokens = torch.randint(0, 1000, (n, k + 1), device=dev)
        n_acc = torch.randint(0, k + 1, (n,), device=dev, dtype=torch.int32)
        seq_lens = torch.randint(1, 4000, (n,), device=dev, dtype=torch.int32)
        block_table = torch.arange(n * 256, device=dev, dtype=torch.int32).view(n, 256)
        outs = n * (k + 1) * (8 + 4 + 8) + n * (4 + 8 + 1) + (n + 1) * 4
        yield Case("accept_prefix_scan", dict(N=n, K=k), nbytes(tokens, n_acc, seq_lens) + n * (k + 1) * 4 + outs,
                   lambda b: dk.accept_prefix_scan(tokens, seq_lens, num_accepted=n_acc, block_table=block_table,
                                                   block_size=16, backend=b))


def schedule_verify_lens_cases(dev, quick):
    table = dk.CostTable([1, 64, 256, 1024], [10.0, 11.0, 14.0, 30.0])
    for n, k in ([(64, 7)] if quick else [(64, 7), (256, 7), (512, 7), (16384, 16)]):
        survival = torch.rand(n, k, device=dev).cumprod(-1)
        for mode in ("exact", "argmax"):
            yield Case("schedule_verify_lens", dict(N=n, K=k, mode=mode), nbytes(survival) + n * 4 + (n + 1) * 4,
                       lambda b, m=mode: dk.schedule_verify_lens(survival, cost_table=table, mode=m, backend=b))


def time_ms(fn, dev, warmup, reps) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def backends_here(dev) -> list[str]:
    if dev.type != "cuda":
        return ["reference"]
    from dspark_kernels import _ext
    return ["reference", "triton"] + (["cuda"] if _ext.is_available() else [])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="*", default=None, help="ops to run (default: all)")
    ap.add_argument("--backends", nargs="*", default=None, help="backends (default: all that run here)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--quick", action="store_true", help="small shapes (the default on the CPU)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON file for the rows (default bench/results/<device>.json)")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    quick = args.quick or dev.type != "cuda"
    warmup = args.warmup if args.warmup is not None else (10 if dev.type == "cuda" else 1)
    reps = args.reps if args.reps is not None else (50 if dev.type == "cuda" else 3)
    dtype = getattr(torch, args.dtype)
    generators = {
        "rng_uniform": lambda: rng_uniform_cases(dev, quick),
        "draft_block": lambda: draft_block_cases(dev, quick, dtype),
        "verify_chain": lambda: verify_chain_cases(dev, quick, dtype),
        "accept_prefix_scan": lambda: accept_prefix_scan_cases(dev, quick),
        "schedule_verify_lens": lambda: schedule_verify_lens_cases(dev, quick),
    }
    ops = args.ops or list(generators)
    unknown = set(ops) - set(generators)
    if unknown:
        ap.error(f"unknown ops {sorted(unknown)}; choose from {list(generators)}")
    backends = args.backends or backends_here(dev)

    rows = []
    print(f"{'op':<22}{'backend':<11}{'case':<58}{'ms':>10}{'GB/s':>10}")
    for op in ops:
        for case in generators[op]():
            for backend in backends:
                try:
                    ms = time_ms(lambda: case.run(backend), dev, warmup, reps)
                except ValueError as e:  # a backend this op does not have (yet)
                    print(f"{op:<22}{backend:<11}({str(e)[:70]})")
                    continue
                gbps = case.bytes / (ms * 1e-3) / 1e9
                params = " ".join(f"{k}={v}" for k, v in case.params.items())
                print(f"{op:<22}{backend:<11}{params:<58}{ms:>10.3f}{gbps:>10.2f}")
                rows.append(dict(op=op, backend=backend, **case.params, ms=round(ms, 5), bytes=case.bytes,
                                 gbps=round(gbps, 3)))

    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"{dev.type}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(device=device_name, torch=torch.__version__, dspark_kernels=dk.__version__,
                       time=time.strftime("%Y-%m-%dT%H:%M:%S"), rows=rows), f, indent=1)
    print(f"wrote {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
