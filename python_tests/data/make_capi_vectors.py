#!/usr/bin/env python
"""Write python_tests/data/capi_vectors.json: inputs and the reference's outputs of accept_prefix_scan,
schedule_verify_lens, draft_block and verify_chain, which csrc/capi/test_capi_vectors.cpp (ctest) feeds to the C ABI running on the CPU through
the SIMT harness. python_tests/test_capi_vectors.py regenerates them and requires the checked-in file to agree (integers exactly,
floats within the C ABI test's tolerance, since float bits differ between CPUs), so the two cannot drift.

Usage: python python_tests/data/make_capi_vectors.py [out.json]

Format: {"scan": [case...], "schedule": [case...], "draft": [case...], "verify": [case...]}. Integer arrays are lists of ints with a dtype "i32" / "i64";
float arrays are lists of floats (float32 values, NaN / Infinity as Python's json writes them) with a dtype "f32",
or lists of raw 16-bit patterns with "bf16" / "f16". A missing optional input is null. "expect" holds the
reference's outputs (theta as a float; draft_block's float outputs as f32 arrays). Float inputs of draft_block and
verify_chain are small multiples of 1/16 (short to write, exact in every dtype). rng_key is [seed, offset].
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from dspark_kernels import reference  # noqa: E402
from dspark_kernels.ops import target_to_draft_map  # noqa: E402
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
    if t.dtype == torch.float8_e4m3fn:
        return {"dtype": "f8e4m3", "data": [int(x) for x in t.flatten().view(torch.uint8).tolist()]}
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
                budget_survival=None, min_gain=0.0, active=None):
    x = survival if survival is not None else conf_logits
    n, k = x.shape
    max_len = k if max_len is None else max_len
    c, s = table.tensors("cpu")
    lens, cu, theta = reference.schedule_verify_lens(survival, conf_logits, sts_temperatures, c, s,
                                                     table.fixed_overhead_ms, min_len, max_len, mode,
                                                     budget_survival, min_gain, active)
    return {
        "N": n, "K": k, "survival": _floats(survival), "conf_logits": _floats(conf_logits),
        "sts_temperatures": _floats(sts_temperatures), "token_counts": [float(v) for v in table.token_counts],
        "step_time_ms": list(table.step_time_ms), "fixed_overhead_ms": table.fixed_overhead_ms,
        "min_len": min_len, "max_len": max_len, "mode": mode, "budget_survival": _floats(budget_survival),
        "NB": 0 if budget_survival is None else budget_survival.shape[0],
        "KB": 0 if budget_survival is None else budget_survival.shape[1], "min_gain": min_gain,
        "active": None if active is None else [int(x) for x in active.tolist()],
        "expect": {"verify_lens": lens.tolist(), "cu_seqlens": cu.tolist(), "theta": float(theta)},
    }


def _q(shape, g, scale=16, lo=-48, hi=48):
    """float32 multiples of 1/scale in [lo, hi) / scale: short JSON, exact in bf16/fp16, exact small products."""
    return torch.randint(lo, hi, shape, generator=g).float() / scale


def _draft_case(base, anchors, kind, w1, w2, wg=None, bg=None, wj=None, bj=None, hidden=None, conf_weight=None,
                conf_bias=None, sts=None, temperature=None, key=(0, 0), return_logits=False, w2_scale=None, top_k=0):
    rng_key = torch.tensor(list(key), dtype=torch.int64)
    tokens, logits, conf, surv, logprobs, candidates = reference.draft_block(
        base, anchors, kind, w1, w2, w2_scale, None, wg, bg, wj, bj, hidden, conf_weight, conf_bias, sts,
        temperature, rng_key, return_logits, top_k)
    n, k, v = base.shape
    has_conf = conf_weight is not None
    return {
        "N": n, "K": k, "V": v, "R": w1.shape[1], "D": 0 if hidden is None else hidden.shape[2], "head": kind,
        "base_logits": _floats(base), "anchor_tokens": _ints(anchors), "w1": _floats(w1), "w2": _floats(w2),
        "w2_scale": _floats(w2_scale),
        "wg": _floats(wg), "bg": _floats(bg), "wj": _floats(wj), "bj": _floats(bj), "hidden": _floats(hidden),
        "conf_weight": _floats(conf_weight), "conf_bias": _floats(conf_bias), "sts_temperatures": _floats(sts),
        "temperature": _floats(temperature), "rng_key": list(key), "return_logits": bool(return_logits),
        "top_k": top_k,
        "expect": {"tokens": tokens.flatten().tolist(), "draft_logprobs": _floats(logprobs),
                   "logits": _floats(logits) if return_logits else None,
                   "candidates": candidates.flatten().tolist() if return_logits and top_k else None,
                   "conf_logits": _floats(conf) if has_conf else None,
                   "survival": _floats(surv) if has_conf else None},
    }


def _verify_case(target, draft_tokens, cu_seqlens=None, draft_logits=None, draft_logprobs=None, verify_lens=None,
                 survival=None, thresholds=None, temperature=None, key=(0, 0), stop_token_ids=None, method="token",
                 target_to_draft=None, draft_candidates=None):
    rng_key = torch.tensor(list(key), dtype=torch.int64)
    tokens, n_acc, mask = reference.verify_chain(target, cu_seqlens, draft_tokens, draft_logits, target_to_draft,
                                                 draft_candidates, draft_logprobs, verify_lens, survival, thresholds,
                                                 temperature, rng_key, stop_token_ids, method)
    n, k = draft_tokens.shape
    return {
        "N": n, "K": k, "V": target.shape[-1], "target_logits": _floats(target), "cu_seqlens": _ints(cu_seqlens),
        "total_rows": target.shape[0] if cu_seqlens is not None else 0, "draft_tokens": _ints(draft_tokens),
        "draft_logits": _floats(draft_logits), "draft_logprobs": _floats(draft_logprobs),
        "draft_width": draft_logits.shape[-1] if draft_logits is not None else 0,
        "target_to_draft": _ints(target_to_draft), "draft_candidates": _ints(draft_candidates),
        "verify_lens": _ints(verify_lens), "survival": _floats(survival), "thresholds": _floats(thresholds),
        "temperature": _floats(temperature), "rng_key": list(key), "stop_token_ids": _ints(stop_token_ids),
        "method": method,
        "expect": {"tokens": tokens.flatten().tolist(), "num_accepted": n_acc.tolist(),
                   "accept_mask": [int(x) for x in mask.flatten().tolist()]},
    }


def _draft_vectors(g):
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    draft = []
    n, k, v, r, d = 3, 4, 24, 8, 4

    def head(kind):
        w = dict(w1=_q((v, r), g), w2=_q((v, r), g))
        if kind == "gated":
            w.update(wg=_q((r, d + r), g), bg=_q((r,), g))
        elif kind == "rnn":
            w.update(wj=_q((3 * r, 2 * r + d), g), bj=_q((3 * r,), g))
        return w

    def conf():
        return dict(conf_weight=_q((d + r,), g, lo=-8, hi=8), conf_bias=f([0.25]), sts=f([1.0, 2.0, 0.5, 1.5]))

    anchors = torch.tensor([3, 17, v + 5], dtype=torch.int64)  # the last one is outside [0, V): a zero embedding
    # vanilla, greedy, no hidden, with the logits
    draft.append(_draft_case(_q((n, k, v), g), anchors, "vanilla", **head("vanilla"), return_logits=True))
    # vanilla, sampled (mixed temperatures: 0 and negative are greedy), confidence + STS, int32 anchors
    draft.append(_draft_case(_q((n, k, v), g), anchors.to(torch.int32), "vanilla", **head("vanilla"),
                             hidden=_q((n, k, d), g), **conf(), temperature=f([0.7, 0.0, 1.3]), key=(1234, 5)))
    # gated, greedy, confidence (no STS)
    c = conf()
    c.pop("sts")
    draft.append(_draft_case(_q((n, k, v), g), anchors, "gated", **head("gated"), hidden=_q((n, k, d), g), **c))
    # gated, sampled
    draft.append(_draft_case(_q((n, k, v), g), anchors, "gated", **head("gated"), hidden=_q((n, k, d), g),
                             temperature=f([1.0, 0.5, -1.0]), key=(7, 2 ** 33 + 1)))
    # vanilla, an fp8 W2 with per-row scales, mixed temperatures, with the logits: k / 16 for |k| <= 8 (exact in
    # e4m3) times powers of two, so the products stay exact as in the other cases
    q = _q((v, r), g, lo=-8, hi=9).to(torch.float8_e4m3fn)
    scale = torch.pow(2.0, torch.randint(-1, 3, (v,), generator=g).float())
    draft.append(_draft_case(_q((n, k, v), g), anchors, "vanilla", _q((v, r), g), q, w2_scale=scale,
                             temperature=f([0.0, 0.9, 1.1]), key=(99, 3), return_logits=True))
    # rnn, greedy, confidence + STS
    draft.append(_draft_case(_q((n, k, v), g), anchors, "rnn", **head("rnn"), hidden=_q((n, k, d), g), **conf()))
    # rnn, sampled, confidence + STS, bf16 base logits
    draft.append(_draft_case(_q((n, k, v), g).to(torch.bfloat16), anchors, "rnn", **head("rnn"),
                             hidden=_q((n, k, d), g), **conf(), temperature=f([0.9, 1.1, 2.0]), key=(99, 0)))
    # gated, top-5 proposals (U on a coarse grid: ties at the cut), mixed temperatures, with the sparse logits
    draft.append(_draft_case(_q((n, k, v), g, scale=2, lo=-4, hi=4), anchors, "gated", **head("gated"),
                             hidden=_q((n, k, d), g), temperature=f([0.8, 0.0, 1.2]), key=(5, 9), return_logits=True,
                             top_k=5))
    return draft


def _verify_vectors(g):
    f = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    t = lambda x, dt=torch.int64: torch.tensor(x, dtype=dt)  # noqa: E731
    verify = []
    n, k, v = 3, 4, 20

    def near_argmax(target, agree):
        """drafts equal to the target's argmax on the leading `agree[r]` rows, then a different token."""
        am = target[:, :k].argmax(-1)
        d = am.clone()
        for r, a in enumerate(agree):
            if a < k:
                d[r, a] = (am[r, a] + 1) % v
        return d

    target = _q((n, k + 1, v), g)
    # greedy, dense, one-hot drafts, a draft outside [0, V)
    drafts = near_argmax(target, [4, 1, 2])
    drafts[2, 3] = v + 3
    verify.append(_verify_case(target, drafts))
    # greedy with verify_lens and stop tokens, int32 drafts
    target = _q((n, k + 1, v), g)
    drafts = near_argmax(target, [4, 4, 3])
    verify.append(_verify_case(target, drafts.to(torch.int32), verify_lens=t([2, 9, -1], torch.int32),
                               stop_token_ids=t([int(drafts[1, 1]), v + 100])))
    # token, sampled, drafts from the draft model's logits (draft_block at T) with draft_logprobs
    dlog = _q((n, k, v), g)
    temps = f([0.8, 1.0, 1.5])
    target = dlog.new_zeros(n, k + 1, v)
    target[:, :k] = dlog + _q((n, k, v), g, lo=-8, hi=8)  # a target close to the draft: long acceptances
    target[:, k] = _q((n, v), g)
    q = torch.softmax(dlog / temps.view(n, 1, 1), -1)
    drafts = torch.multinomial(q.view(-1, v), 1, generator=g).view(n, k)
    logprobs = torch.log_softmax(dlog / temps.view(n, 1, 1), -1).gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    verify.append(_verify_case(target, drafts, draft_logits=dlog, draft_logprobs=logprobs, temperature=temps,
                               key=(42, 7)))
    # token, sampled, draft logits without draft_logprobs, one greedy request
    verify.append(_verify_case(target, drafts, draft_logits=dlog, temperature=f([0.8, 0.0, 1.5]), key=(42, 8)))
    # block, sampled, draft logits
    verify.append(_verify_case(target, drafts, draft_logits=dlog, temperature=temps, key=(5, 1), method="block"))
    # block, sampled, draft_logprobs, stop tokens
    verify.append(_verify_case(target, drafts, draft_logits=dlog, draft_logprobs=logprobs, temperature=temps,
                               key=(5, 2), method="block", stop_token_ids=t([int(drafts[0, 1])], torch.int32)))
    # packed rows with cu_seqlens (verify lengths 4, 1, 0, 2; the last request runs past the rows), greedy
    n4 = 4
    cu = t([0, 5, 7, 8, 11], torch.int32)
    packed = _q((10, v), g)
    drafts = torch.randint(0, v, (n4, k), generator=g)
    drafts[0, :2] = packed[0:2].argmax(-1)
    drafts[1, 0] = packed[5].argmax(-1)
    verify.append(_verify_case(packed, drafts, cu_seqlens=cu))
    # packed, sampled token method with survival thresholds and verify_lens, one-hot drafts
    verify.append(_verify_case(packed, drafts, cu_seqlens=cu.long(), verify_lens=t([3, 4, 4, 1]),
                               survival=f([[0.9, 0.8, 0.7, 0.2], [0.9, 0.9, 0.9, 0.9], [0.1, 0.0, 0.0, 0.0],
                                           [0.95, 0.9, 0.5, 0.4]]), thresholds=f([0.5, 0.5, 0.6, 0.3]),
                               temperature=f([1.0, 0.6, 1.0, 2.0]), key=(11, 3)))
    # packed, block method, draft logits (bf16 target), stop tokens
    dl4 = _q((n4, k, v), g)
    verify.append(_verify_case(packed.to(torch.bfloat16), drafts, cu_seqlens=cu, draft_logits=dl4,
                               temperature=f([1.0, 1.0, 0.5, 1.2]), key=(3, 3), method="block",
                               stop_token_ids=t([int(drafts[0, 0]), int(drafts[3, 1])])))
    # dense, one-hot drafts sampled with the block method, K = 1
    target1 = _q((n, 2, v), g)
    verify.append(_verify_case(target1, target1[:, 0].argmax(-1, keepdim=True), temperature=f([1.0, 0.3, 3.0]),
                               key=(8, 8), method="block"))
    # reduced draft rows (Vd = 6 of V = 20, an entry outside [0, V), an id named twice), token with draft_logprobs
    d2t = t([4, 11, v + 2, 17, 0, 11])
    inv = target_to_draft_map(d2t, v)
    rows = _q((n, k, 6), g)
    cols = torch.multinomial(torch.softmax(rows, -1).view(-1, 6), 1, generator=g).view(n, k)
    lp = torch.log_softmax(rows, -1).gather(-1, cols.unsqueeze(-1)).squeeze(-1)
    target = _q((n, k + 1, v), g)
    verify.append(_verify_case(target, d2t[cols], draft_logits=rows, target_to_draft=inv, draft_logprobs=lp,
                               temperature=f([1.0, 1.0, 0.7]), key=(21, 4)))
    # top-k draft rows (k = 4 candidates a row, int32 ids, one outside [0, V)), block, without draft_logprobs
    cands = torch.stack([torch.randperm(v, generator=g)[:4] for _ in range(n * k)]).view(n, k, 4).to(torch.int32)
    cands[1, 0, 2] = -5
    rows = _q((n, k, 4), g)
    drafts = cands[..., 0].long()
    verify.append(_verify_case(target, drafts, draft_logits=rows, draft_candidates=cands,
                               temperature=f([0.9, 1.0, 1.2]), key=(21, 5), method="block"))
    return verify


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
    # inactive requests (finished, or padding): no candidates, no rows, not counted in B or tau
    on = torch.tensor([True, False, True])
    sched.append(_sched_case(tables[0], "exact", f([[0.9, 0.8, 0.5], [0.9, 0.9, 0.9], [0.7, 0.6, 0.1]]), active=on))
    sched.append(_sched_case(linear, "argmax", current, active=~on, min_gain=0.05, min_len=1))
    sched.append(_sched_case(flat, "argmax", current, active=torch.zeros(3, dtype=torch.bool),
                             budget_survival=f([[0.5, 0.2]])))
    return {"scan": scan, "schedule": sched, "draft": _draft_vectors(g), "verify": _verify_vectors(g)}


def dumps(vectors: dict) -> str:
    return json.dumps(vectors, indent=None, separators=(",", ":")).replace('{"N"', '\n{"N"') + "\n"


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else OUT
    with open(path, "w") as fh:
        fh.write(dumps(make_vectors()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
