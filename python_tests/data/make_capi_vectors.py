#!/usr/bin/env python
"""Write python_tests/data/capi_vectors.json: inputs and the reference's outputs of accept_prefix_scan and
schedule_verify_lens, which csrc/capi/test_capi_vectors.cpp (ctest) feeds to the C ABI running on the CPU through
the SIMT harness. python_tests/test_capi_vectors.py regenerates them and requires the checked-in file to be
identical, so the two cannot drift.

Usage: python python_tests/data/make_capi_vectors.py [out.json]

Format: {"scan": [case...], "schedule": [case...]}. Integer arrays are lists of ints with a dtype "i32" / "i64";
float arrays are lists of floats (float32 values, NaN / Infinity as Python's json writes them) with a dtype "f32",
or lists of raw 16-bit patterns with "bf16" / "f16". A missing optional input is null. "expect" holds the
reference's outputs (theta as a float).
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from dspark_kernels import reference  # noqa: E402
from dspark_kernels.calibration import CostTable  # noqa: E402

OUT = os.path.join(HERE, "capi_vectors.json")


def _ints(t):
    if t is None:
        return None
    return {"dtype": "i64" if t.dtype == torch.int64 else "i32", "data": [int(x) for x in t.flatten().tolist()]}


def _floats(t):
    if t is None:
        return None
    if t.dtype == torch.float32:
        return {"dtype": "f32", "data": [float(x) for x in t.flatten().tolist()]}
    name = "bf16" if t.dtype == torch.bfloat16 else "f16"
    return {"dtype": name, "data": [int(x) & 0xFFFF for x in t.flatten().view(torch.int16).tolist()]}


def _scan_case(tokens, seq_lens, num_accepted=None, accept_mask=None, verify_cu_seqlens=None, block_table=None,
               block_size=1, max_seq_lens=None, stop_token_ids=None):
    out = reference.accept_prefix_scan(tokens, seq_lens, num_accepted, accept_mask, verify_cu_seqlens, block_table,
                                       block_size, max_seq_lens, stop_token_ids)
    cu, toks, new, anchor, rows, slots, fin = out
    n, kp1 = tokens.shape
    return {
        "N": n, "K": kp1 - 1, "tokens": _ints(tokens), "seq_lens": _ints(seq_lens),
        "num_accepted": _ints(num_accepted),
        "accept_mask": None if accept_mask is None else [int(x) for x in accept_mask.flatten().tolist()],
        "verify_cu_seqlens": _ints(verify_cu_seqlens), "block_table": _ints(block_table),
        "max_blocks": 0 if block_table is None else block_table.shape[1], "block_size": block_size,
        "max_seq_lens": _ints(max_seq_lens), "stop_token_ids": _ints(stop_token_ids),
        "expect": {"cu_out": cu.tolist(), "out_tokens": toks.tolist(), "new_seq_lens": new.tolist(),
                   "next_anchor": anchor.tolist(), "hidden_rows": rows.tolist(),
                   "kv_slots": slots.tolist() if block_table is not None else None,
                   "finished": [int(x) for x in fin.tolist()]},
    }


def _sched_case(table, mode, survival=None, conf_logits=None, sts_temperatures=None, min_len=0, max_len=None,
                budget_survival=None, min_gain=0.0):
    x = survival if survival is not None else conf_logits
    n, k = x.shape
    max_len = k if max_len is None else max_len
    c, s = table.tensors("cpu")
    lens, cu, theta = reference.schedule_verify_lens(survival, conf_logits, sts_temperatures, c, s,
                                                     table.fixed_overhead_ms, min_len, max_len, mode,
                                                     budget_survival, min_gain)
    return {
        "N": n, "K": k, "survival": _floats(survival), "conf_logits": _floats(conf_logits),
        "sts_temperatures": _floats(sts_temperatures), "token_counts": [float(v) for v in table.token_counts],
        "step_time_ms": list(table.step_time_ms), "fixed_overhead_ms": table.fixed_overhead_ms,
        "min_len": min_len, "max_len": max_len, "mode": mode, "budget_survival": _floats(budget_survival),
        "NB": 0 if budget_survival is None else budget_survival.shape[0],
        "KB": 0 if budget_survival is None else budget_survival.shape[1], "min_gain": min_gain,
        "expect": {"verify_lens": lens.tolist(), "cu_seqlens": cu.tolist(), "theta": float(theta)},
    }


def make_vectors() -> dict:
    g = torch.Generator().manual_seed(2024)
    t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt)  # noqa: E731
    i32 = torch.int32

    scan = []
    tokens = t([[11, 12, 13, 14], [21, 22, 13, -1], [31, -1, -1, -1], [41, 42, -1, -1]])
    seq = t([10, 5, 1, 7], i32)
    table4 = t([[2, 0, 5], [1, 4, 3], [3, 1, 0], [5, 2, 4]], i32)
    mask = torch.tensor([[True, True, True], [True, False, True], [False, True, True], [True, True, False]])
    scan.append(_scan_case(tokens, seq, num_accepted=t([3, 1, 0, 2])))
    scan.append(_scan_case(tokens.to(i32), seq.long(), accept_mask=mask, verify_cu_seqlens=t([0, 4, 6, 7, 10], i32)))
    scan.append(_scan_case(tokens, seq, num_accepted=t([3, 1, 0, 2], i32), verify_cu_seqlens=t([0, 2, 4, 5, 8]),
                           block_table=table4, block_size=4, max_seq_lens=t([12, 100, 1, 8]),
                           stop_token_ids=t([42, 13], i32)))
    scan.append(_scan_case(t([[5, 6], [7, 8], [9, 10]]), t([0, 2, 1000]), num_accepted=t([1, 1, 1]),
                           block_table=t([[1, 0], [-1, 0], [0, 1]], i32), block_size=2))
    scan.append(_scan_case(t([[1, 2, 3, 4], [5, 6, 7, 8]]), t([0, 0]), num_accepted=t([7, -2], i32)))
    scan.append(_scan_case(torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, dtype=i32),
                           accept_mask=torch.zeros(0, 3, dtype=torch.bool)))
    scan.append(_scan_case(t([[3], [-1], [5]]), t([1, 2, 0]), num_accepted=t([0, 2, -1]), block_table=t([[0], [1], [2]]),
                           block_size=2))
    for case in range(8):
        n = int(torch.randint(1, 9, (1,), generator=g))
        k = int(torch.randint(0, 7, (1,), generator=g))
        bs = int(torch.randint(1, 5, (1,), generator=g))
        toks = torch.randint(0, 30, (n, k + 1), generator=g)
        n_acc = torch.randint(-1, k + 2, (n,), generator=g)
        toks[torch.arange(n), n_acc.clamp(0, k)] = torch.where(torch.rand(n, generator=g) < 0.3, -1,
                                                                toks[torch.arange(n), n_acc.clamp(0, k)])
        s = torch.randint(-1, 20, (n,), generator=g)
        mb = int(torch.randint(0, 8, (1,), generator=g))
        kw = dict(num_accepted=n_acc) if case % 2 else dict(accept_mask=torch.rand(n, k, generator=g) < 0.7)
        dt = i32 if case % 3 == 0 else torch.int64
        scan.append(_scan_case(toks.to(dt), s.to(dt), block_table=torch.randint(-1, 40, (n, mb), generator=g).to(dt),
                               block_size=bs, max_seq_lens=(s + torch.randint(-2, k + 3, (n,), generator=g)).to(dt),
                               stop_token_ids=t([3, 7]).to(dt), **kw))

    sched = []
    appendix = CostTable([1, 2, 3], [1000.0, 2000.0, 1000.0 / 0.45])
    linear = CostTable([1, 100], [10.0, 109.0])
    flat = CostTable([1], [10.0])
    tables = [CostTable([1, 8, 32, 128], [10.0, 10.5, 14.0, 40.0]),
              CostTable([1, 4, 16], [5.0, 9.0, 30.0], fixed_overhead_ms=3.0), linear, flat,
              CostTable([2, 30, 40], [5.0, 30.0, 6.0])]
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    current = f([[0.5, 0.4], [0.9, 0.1], [0.3, 0.2]])
    sched.append(_sched_case(appendix, "exact", f([[0.8, 0.72]])))
    sched.append(_sched_case(appendix, "argmax", f([[0.8, 0.72]])))
    sched.append(_sched_case(appendix, "argmax", f([[0.8, 0.72]]), budget_survival=f([[0.8, 0.0]])))
    sched.append(_sched_case(linear, "argmax", current, budget_survival=f([[0.9, 0.8], [0.5, 0.05]])))
    sched.append(_sched_case(linear, "argmax", current, min_gain=0.1))
    sched.append(_sched_case(flat, "exact", f([[0.9, 0.0]])))
    sched.append(_sched_case(linear, "argmax", f([[float("inf"), float("-inf")], [-0.0, 2.0], [float("nan"), 0.5]])))
    sched.append(_sched_case(flat, "argmax", f([[0.9, 0.8, 0.7], [0.0, 0.0, 0.0]]), min_len=1, max_len=2))
    sched.append(_sched_case(linear, "exact", torch.zeros(0, 4)))
    sched.append(_sched_case(linear, "argmax", torch.zeros(3, 0), budget_survival=f([[0.5, 0.2]]), min_gain=0.2))
    for case in range(10):
        n = int(torch.randint(1, 12, (1,), generator=g))
        k = int(torch.randint(1, 9, (1,), generator=g))
        if case % 3 == 0:
            surv = torch.cumprod(torch.rand(n, k, generator=g) * 0.8 + 0.2, dim=1)
        elif case % 3 == 1:
            surv = (torch.rand(n, k, generator=g) * 4).round() / 4
        else:
            surv = torch.rand(n, k, generator=g) * 1.4 - 0.2
            surv[torch.rand(n, k, generator=g) < 0.15] = float("nan")
        mn = int(torch.randint(0, k + 1, (1,), generator=g))
        mx = int(torch.randint(mn, k + 1, (1,), generator=g))
        mode = "exact" if case % 2 == 0 else "argmax"
        kw = {}
        if mode == "argmax" and case % 4 == 1:
            kw = dict(budget_survival=torch.rand(n + 1, k, generator=g).cumprod(1).to(torch.bfloat16), min_gain=0.03)
        if case in (4, 7):
            surv = surv.to(torch.float16 if case == 4 else torch.bfloat16)
        sched.append(_sched_case(tables[case % len(tables)], mode, surv, min_len=mn, max_len=mx, **kw))
    # conf_logits (the kernel's own sigmoid path): logits far from the decision boundaries
    z = f([[2.0, 1.0, -1.0], [3.0, 3.0, 0.5]])
    sched.append(_sched_case(tables[0], "argmax", conf_logits=z, sts_temperatures=f([1.0, 2.0, 0.5])))
    sched.append(_sched_case(linear, "exact", conf_logits=z))
    return {"scan": scan, "schedule": sched}


def dumps(vectors: dict) -> str:
    return json.dumps(vectors, indent=None, separators=(",", ":")).replace('{"N"', '\n{"N"') + "\n"


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else OUT
    with open(path, "w") as fh:
        fh.write(dumps(make_vectors()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
