#!/usr/bin/env python
"""Bytes one rank receives per call of the vocabulary-parallel ops, against all-gathering the logits.

    python bench/distributed_bytes.py                     # N {1, 64, 256}, K = 7, V = 151936, P {2, 4, 8}
    python bench/distributed_bytes.py --N 64 --P 8 --dtype-bytes 4
    python bench/distributed_bytes.py --certificates     # how often token sampling needs its exact residual pass

The counts come from ``dspark_kernels.distributed.traffic`` (the collectives each op issues; the tests check the
model against the bytes counted on the real collectives). Convention: an all-gather of B bytes per rank delivers
(P - 1) B to each rank; a ring all-reduce of B bytes moves 2 (P - 1) / P B per rank. Baselines: verification
all-gathers the target rows [N, K+1, V] (+ the draft rows [N, K, V] when sampling from draft logits); drafting
all-gathers each position's logits [N, V] (K times). A count, not a time: latency per collective is not modelled
(verify issues 2 collectives greedy, 3 sampling; draft_block K + 2).
"""

from __future__ import annotations

import argparse

import torch

from dspark_kernels.distributed import exchange_bytes, logits_gather_bytes, layout, ops
from dspark_kernels.distributed.testing import even_sizes, shard_spans
from dspark_kernels.rng import make_rng_key

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


def certificate_failures(n: int, k: int, vocab: int, world: int, offsets: int = 3) -> tuple[int, int]:
    """(requests whose residual race was not certified, requests) for token sampling on random logits (target
    randn * 2, draft = target + randn * 2, drafts sampled from the draft; draft rows and one-hot drafts), the shards
    evaluated in one process with the reference pieces (no collectives needed to count)."""
    g = torch.Generator().manual_seed(0)
    target = torch.randn(n, k + 1, vocab, generator=g) * 2
    draft = target[:, :k] + torch.randn(n, k, vocab, generator=g) * 2
    drafts = torch.softmax(draft, -1).view(-1, vocab).multinomial(1, generator=g).view(n, k)
    temps, spans = torch.ones(n), shard_spans(even_sizes(vocab, world))
    need = total = 0
    for off in range(offsets):
        key = make_rng_key(1, off, "cpu")
        for d in (draft, None):
            stats = torch.stack([ops.verify_stats(target[..., a:a + b], None, drafts,
                                                  None if d is None else d[..., a:a + b], temps, key, a, vocab, 8,
                                                  "reference") for a, b in spans])
            plan = ops.verify_decide(stats, torch.tensor(spans), None, None, 0, drafts, None, None, None, None,
                                     temps, key, None, "token", d is not None, 8, vocab, "reference")[3]
            need, total = need + int(plan[..., layout.PLAN_NEED].sum()), total + n
    return need, total


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--N", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--K", type=int, default=7)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--P", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--dtype-bytes", type=int, default=2, help="bytes per logit of the baseline (bf16: 2)")
    ap.add_argument("--certificates", action="store_true",
                    help="count uncertified residual races instead (N 16, K 7, V 32000, P 8; about a CPU minute)")
    args = ap.parse_args(argv)
    if args.certificates:
        need, total = certificate_failures(16, 7, 32000, 8)
        print(f"token sampling, M = 8 candidates per shard, N 16, K 7, V 32000, P 8: {need} of {total} requests "
              "needed the exact residual pass")
        return
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
