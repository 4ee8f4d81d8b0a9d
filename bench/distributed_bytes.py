#!/usr/bin/env python
"""Bytes one rank receives per call of the vocabulary-parallel ops, against all-gathering the logits.

    python bench/distributed_bytes.py                     # N {1, 64, 256}, K = 7, V = 151936, P {2, 4, 8}
    python bench/distributed_bytes.py --N 64 --P 8 --dtype-bytes 4

The counts come from ``dspark_kernels.distributed.traffic`` (the collectives each op issues; the tests check the
model against the bytes counted on the real collectives). Convention: an all-gather of B bytes per rank delivers
(P - 1) B to each rank; a ring all-reduce of B bytes moves 2 (P - 1) / P B per rank. Baselines: verification
all-gathers the target rows [N, K+1, V] (+ the draft rows [N, K, V] when sampling from draft logits); drafting
all-gathers each position's logits [N, V] (K times). A count, not a time: latency per collective is not modelled
(verify issues 2 collectives greedy, 3 sampling; draft_block K + 2).
"""

from __future__ import annotations

import argparse

from dspark_kernels.distributed import exchange_bytes, logits_gather_bytes

CASES = [  # (name, op, mode of the exchange, draft logits gathered by the baseline)
    ("verify greedy", "verify_chain", dict(sampled=False, draft_logits=False), False),
    ("verify token, draft logits", "verify_chain", dict(sampled=True, draft_logits=True), True),
    ("verify token, one-hot", "verify_chain", dict(sampled=True, draft_logits=False), False),
    ("verify block, draft logits", "verify_chain", dict(sampled=True, draft_logits=True, method="block"), True),
    ("draft_block", "draft_block", dict(), False),
]


def fmt(nbytes: float) -> str:
    for unit, scale in (("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--N", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--K", type=int, default=7)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--P", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--dtype-bytes", type=int, default=2, help="bytes per logit of the baseline (bf16: 2)")
    args = ap.parse_args(argv)
    print(f"K = {args.K}, V = {args.V}, baseline logits {args.dtype_bytes} bytes each; bytes received per rank")
    print("| case | N | P | exchanged | all-gather logits | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, op, mode, draft in CASES:
        for n in args.N:
            for p in args.P:
                ours = exchange_bytes(op, n, args.K, p, **mode)
                # draft_block's baseline gathers the float32 logits it computes
                width = 4 if op == "draft_block" else args.dtype_bytes
                theirs = logits_gather_bytes(op, n, args.K, args.V, p, draft_logits=draft, dtype_bytes=width)
                print(f"| {name} | {n} | {p} | {fmt(ours)} | {fmt(theirs)} | {theirs / ours:,.0f}x |")


if __name__ == "__main__":
    main()
