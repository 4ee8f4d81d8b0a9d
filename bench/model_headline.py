#!/usr/bin/env python
"""bench/model.py's modelled H100 / H200 time of the CUDA kernels at the headline vocabulary, from the SIMT harness's
counters at N = 1 (a MODEL, not a measurement): verify_chain (greedy; token sampling with draft logits and
draft_logprobs) at K in {7, 15}, V = 151936 bf16, and draft_block (vanilla, r = 256, bf16 W2) at K = 7.

    python bench/model_headline.py [--gpu h200] [--json PATH] [--batch N] [--draft N K]

verify_chain runs with the warp access model (sectors and wavefronts feed the model's L2 and shared-memory terms);
draft_block without it (its harness run with the model costs an hour here), so its L2 term is the bytes requested
and its shared-memory term is absent: said in each row; its DRAM term is the harness's L2 estimate
(``dram_bytes_read``), its tensor term the MMAs the harness counted. ``--draft N K`` models draft_block at a batch:
the harness runs one position (the others repeat its work) and the counters are scaled to K. Loads in flight per thread come from the kernels' designs
(:data:`LOADS_IN_FLIGHT`; the SASS tests hold the kernels to them); registers limit occupancy when the harness has
them (``DSPARK_SIMT_REGISTERS=build/check_cuda.json``: each launch's ``registers``), else not. Prints the
model's time for the bytes floor in as many launches beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import GPUS, floor_model_us, model_launch, resident_ctas  # noqa: E402

# 16-byte loads each thread has in flight, by kernel, from the kernels' designs (DESIGN.md) and their SASS tests:
# verify_chain's stats and qstats sweeps issue four LDG.E.128 per iteration (test_verify_chain's SASS tests);
# draft_block's tensor-core sweep keeps two 16 KB stages of its cp.async ring in flight per CTA (16 a thread of a
# 128-thread CTA, 8 of a 256-thread one: RING_IN_FLIGHT / (16 x threads)).
LOADS_IN_FLIGHT = {"verify_chain_stats": 4, "verify_chain_qstats": 4}
RING_IN_FLIGHT = 2 * 128 * 64 * 2
# draft_block.cuh's vanilla prologue: the slices' keys a lane loads a round (kMergeLoads), W1's rows a warp loads a
# batch (kRowBatch), a W2 chunk's elements and the ring stages the sweep fills before it (kThreads x kRKm, kStages)
MERGE_LOADS, ROW_BATCH, CHUNK_ELEMENTS, STAGES = 10, 4, 128 * 64, 3
WARPS = 4  # a 128-thread CTA's
WIDE_WARPS = 8  # draft_block.cuh's kWideWarps: the 64-request register tile's CTA


def draft_warps(group: int) -> int:
    """draft_block's warps a CTA (cta_threads / 32) for the tensor-core sweep at a request group: WIDE_WARPS when
    the group takes the 64-request register tile (more than 32 requests), else 4."""
    return WIDE_WARPS if group > 32 else WARPS


def loads_in_flight(rec: dict) -> int:
    """16-byte loads a thread of launch `rec` has in flight (its kernel's design)."""
    if rec["kernel"] == "draft_block_kernel[mma]":
        return RING_IN_FLIGHT // (16 * int(rec["threads"]))
    return LOADS_IN_FLIGHT.get(rec["kernel"], 1)

V = 151936


def _verify_case(n: int, k: int, mode: str):
    """`n` requests verifying all K drafts (target randn * 2; greedy drafts: the argmax with one mismatch in the
    middle; token: drafts sampled from draft = target + randn * 2, with draft_logprobs) -> (args, kwargs)."""
    gen = torch.Generator().manual_seed(0)
    target = (torch.randn(n, k + 1, V, generator=gen) * 2).to(torch.bfloat16)
    kwargs = dict(verify_lens=torch.full((n,), k))
    if mode == "greedy":
        drafts = target[:, :k].float().argmax(-1)
        drafts[:, k // 2] = (drafts[:, k // 2] + 1) % V
        return (target, drafts), kwargs
    draft_logits = (target[:, :k].float() + torch.randn(n, k, V, generator=gen) * 2).to(torch.bfloat16)
    probs = torch.softmax(draft_logits.float().view(-1, V), -1)
    drafts = torch.multinomial(probs, 1, generator=gen).view(n, k)
    logprobs = torch.log_softmax(draft_logits.float(), -1).gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    kwargs.update(draft_logits=draft_logits, draft_logprobs=logprobs, temperature=torch.ones(n), seed=2)
    return (target, drafts), kwargs


def verify_rows(gpu: str, n: int = 1, ks=(7, 15), access: bool = True):
    import dspark_kernels as dk
    from dspark_kernels import simt
    rows = []
    for k in ks:
        for mode in ("greedy", "token"):
            args, kwargs = _verify_case(n, k, mode)
            with simt.record(access=access, dram=True) as rec:
                out = dk.verify_chain(*args, backend="cuda", **kwargs)
            rejected = int((out.num_accepted < kwargs["verify_lens"]).sum())
            floor = n * (k + 1) * V * 2 + (rejected * V * 2 if mode == "token" else 0)
            rows.append(_row("verify_chain", dict(N=n, K=k, V=V, mode=mode), rec.launches, floor, gpu, access))
    return rows


# draft_block.cuh's launch constants: CTAs an SM at most (kMaxCtasPerSm) and its static shared memory (the
# harness's record and the SASS report: 1676 bytes)
MAX_CTAS_PER_SM, STATIC_SMEM = 2, 1676
EXTRA_SHARE = 1  # kExtraShare: a stacked CTA's reads besides its W2 slice (v rows, the slices' keys) within it


def draft_group(n: int, rank: int) -> int:
    """make_plan's request group for the tensor-core sweep: min(N, 64, 16384 // rpad rounded down to 8)."""
    return min(n, max(1, min(64, 16384 // (-(-rank // 32) * 32)) // 8 * 8))


def draft_smem_bytes(n: int, rank: int, fp8: bool = False, staged: bool = True) -> int:
    """draft_block's dynamic shared memory for the vanilla head's tensor-core sweep with a bf16 U, as make_plan sizes
    it (the tests hold it to the harness's launches): the v tile's hi + lo k-blocks (or the prologue's scratch), the
    cp.async ring (an fp8 W2: raw chunks and the widened one), the bias tile, temperatures and scales, 32 bytes of
    alignment, and U's slots where U is ``staged`` (make_plan stages it when V is a multiple of 8)."""
    ru = lambda a, b: -(-a // b) * b  # noqa: E731
    rpad = ru(rank, 32)
    group = draft_group(n, rank)
    vrows = ru(group, 8)
    lo_off = rpad // 16 * (16 * vrows + 16)
    vfloats = (2 * lo_off + 16 * max(0, 64 - vrows)) // 2
    area = max(vfloats, rank, 32 * 65 + 64 * 64)
    ring = 3 * 128 * 64 + 128 * 72 * 2 if fp8 else 3 * 128 * 72 * 2
    off_u = ru(area, 8) + ru(ring // 4, 8) + vrows * 132 + 2 * ru(group, 4)
    uslots = 2 // -(-rpad // 64) + 1
    return off_u * 4 + 32 + (uslots * group * 128 * 2 if staged else 0)


def draft_ctas_per_sm(n: int, rank: int, fp8: bool = False, registers: int = 255, gpu: str = "h200",
                      staged: bool = True) -> int:
    """draft_block's resident CTAs an SM on a GPU: bench/model.py's occupancy rule (shared memory, registers: 255 a
    thread, what its launch bounds allow, unless a SASS report says otherwise) capped at MAX_CTAS_PER_SM."""
    smem = draft_smem_bytes(n, rank, fp8, staged) + STATIC_SMEM
    warps = draft_warps(draft_group(n, rank))
    return max(1, min(MAX_CTAS_PER_SM, resident_ctas(GPUS[gpu], 32 * warps, smem, registers)))


def draft_sweep_plan(n: int, vocab: int, rank: int, sms: int = 132, per_sm: int = 0, fp8: bool = False) -> dict:
    """draft_block's tensor-core sweep as make_plan and slice_bounds size it (csrc/include/dspark/draft_block.cuh; the
    tests hold the harness's launches to it): request groups of min(N, 64, 16384 // rpad rounded down to 8), one lane
    of CTAs per group, as many vocabulary slices of >= 128 rows as the resident CTAs (``per_sm`` an SM, 0: a GPU's,
    draft_ctas_per_sm; more than one only while a CTA's reads of its group's bf16 v rows and of the slices' 8-byte
    keys stay within 1 / EXTRA_SHARE of its W2 slice: bf16, or fp8 with a 4-byte scale a row) leave each lane; and
    the m16n8k16 MMAs of one position: per slice tile of 128 rows and group, 4 row warps x rpad / 16 steps x 2 row
    blocks x the register tile's request blocks (the group rounded up to 8, 16, 32 or 64 requests, over 8: the
    k-step multiplies them all; with 8 warps each row warp's two warps take half the blocks each) (twice that when v
    needs its lo rows: ``mma_lo``); rpad, the CTA's ``warps`` (draft_warps), and tpr: the fold's threads per request
    (32 halved while tpr x group > 32 x warps)."""
    rpad = -(-rank // 32) * 32
    group = draft_group(n, rank)
    groups = -(-n // group)

    def grid(resident):
        lanes = min(groups, resident)
        slices = min(max(1, vocab // 128), max(1, resident // lanes))
        return slices, min(groups, max(1, resident // slices))

    per_sm = min(per_sm or draft_ctas_per_sm(n, rank, fp8, staged=vocab % 8 == 0), MAX_CTAS_PER_SM)
    slices, lanes = grid(sms * per_sm)
    w2_row = rank + 4 if fp8 else 2 * rank
    if per_sm > 1 and EXTRA_SHARE * group * (2 * rank + 8 * slices) * slices > vocab * w2_row:
        per_sm = 1
        slices, lanes = grid(sms)
    units = -(-vocab // 16)
    tiles = sum(-(-(min(16 * ((b + 1) * units // slices), vocab) - 16 * (b * units // slices)) // 128)
                for b in range(slices))
    per_tile = groups * 4 * (rpad // 16) * 2 * (next(t for t in (8, 16, 32, 64) if group <= t) // 8)
    warps = draft_warps(group)
    tpr = 32
    while tpr > 1 and tpr * group > 32 * warps:
        tpr //= 2
    return dict(slices=slices, lanes=lanes, group=group, ctas=slices * lanes, per_sm=per_sm, mma=tiles * per_tile,
                mma_lo=2 * tiles * per_tile, rpad=rpad, tpr=tpr, warps=warps)


def warp_batches(rows: int, batch: int, warps: int = WARPS) -> dict:
    """A group's rows dealt to the CTA's `warps` (row j to warp j % warps), `batch` a warp at a time: the batches
    summed over the warps (``total``) and the most any warp runs (``most``)."""
    per = [-(-len(range(w, rows, warps)) // batch) for w in range(warps)]
    return dict(total=sum(per), most=max(per))


def merge_rounds(nb: int, slices: int, warps: int = WARPS) -> dict:
    """vanilla_prologue's merge of a group's keys (the max over the slices, per request): warp w of `warps` takes the
    consecutive requests [w per, (w + 1) per) below nb (per = ceil(nb / warps); nw of them) with kl = merge_lanes(nw)
    lanes each (the largest power of two <= 32 / nw), each lane MERGE_LOADS loads a round. Summed over warps:
    merge_lanes' halvings, the rounds and the shuffles; and the most rounds any warp runs (``most_rounds``: the warps
    run side by side)."""
    out = dict(halvings=0, rounds=0, shuffles=0, most_rounds=0)
    per = -(-nb // warps)
    for w in range(warps):
        nw = max(0, min(nb - w * per, per))
        if nw == 0:
            continue
        kl = 32
        while kl > 1 and kl * nw > 32:
            kl //= 2
        rounds = -(-slices // (kl * MERGE_LOADS))
        out["halvings"] += 5 - int(math.log2(kl))
        out["rounds"] += rounds
        out["shuffles"] += int(math.log2(kl))
        out["most_rounds"] = max(out["most_rounds"], rounds)
    return out


def prologue_chain(n: int, k: int, rank: int = 256, gpu: str = "h200", fp8: bool = False) -> dict:
    """draft_block's per-position chain of dependent reads (the vanilla head, the busiest CTA), a MODEL: after the
    grid barrier each group sweep issues its ring's first STAGES - 1 W2 chunks, then merges the slices' keys (the
    most rounds a warp runs), merges the Part of each request it reports (one round each) and copies W1's rows of
    the tokens (the most batches a warp runs, a round each per 256 columns); the ring's fill (a DRAM round trip
    plus the chunks of every CTA at the copy bandwidth) overlaps that chain, and what is left of it nothing
    overlaps: the SM issues nothing and DRAM serves it nothing. A round costs the model's DRAM latency; the keys and
    Parts come from L2, whose hit latency (not found to cite for Hopper) is below it, so that part is an upper
    bound. Position 0 has no merge (its tokens are the anchors). An fp8 W2's chunks are a byte an element (its raw
    ring), so its fill is shorter. Times in microseconds; ``serial_us``: the launch's."""
    g = GPUS[gpu]
    plan = draft_sweep_plan(n, V, rank, fp8=fp8)
    nb = min(n, plan["group"])
    nbp = -(-nb // 8) * 8
    groups = -(-n // plan["group"])
    groups_per_cta = -(-groups // plan["lanes"])
    keys = merge_rounds(nb, plan["slices"], plan["warps"])["most_rounds"]
    report = -(-nb // plan["slices"]) * -(-plan["slices"] // 256)  # merge_parts: 2 x 128 slices a round
    rows = warp_batches(nbp, ROW_BATCH, plan["warps"])["most"] * -(-plan["rpad"] // 256)
    lam = g.dram_latency_s
    chunk_bytes = CHUNK_ELEMENTS * (1 if fp8 else 2)
    fill = lam + (STAGES - 1) * chunk_bytes * plan["ctas"] / g.dram_bytes_per_s
    chain, first = (keys + report + rows) * lam, rows * lam
    serial = groups_per_cta * (max(0.0, first - fill) + (k - 1) * max(0.0, chain - fill))
    return dict(chain_rounds=keys + report + rows, chain_us=chain * 1e6, fill_us=fill * 1e6,
                serial_us=serial * 1e6)


def _draft_case(n: int, k: int, r: int = 256, fp8: bool = False, vocab: int = V):
    gen = torch.Generator().manual_seed(0)
    import dspark_kernels as dk
    base = (torch.randn(n, k, vocab, generator=gen) * 2).to(torch.bfloat16)
    w1 = (torch.randn(vocab, r, generator=gen) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(vocab, r, generator=gen) * 0.05).to(torch.bfloat16)
    if fp8:
        q, scale = dk.quantize_w2(w2)
        head = dk.MarkovHead("vanilla", w1=w1, w2=q, w2_scale=scale)
    else:
        head = dk.MarkovHead("vanilla", w1=w1, w2=w2)
    anchors = torch.randint(0, vocab, (n,), generator=gen)
    return base, head, anchors


def draft_floor_bytes(n: int, k: int, r: int = 256, fp8: bool = False, out_bytes: int = 12) -> int:
    """draft_block's bytes floor at V: U once, W2 once per position (an fp8 W2: a byte an element and a float32
    scale a row), the W1 rows gathered, and ``out_bytes`` per request and position (an int64 token and a float32
    log-probability)."""
    w2_bytes = V * (r + 4) if fp8 else V * r * 2
    return n * k * V * 2 + k * w2_bytes + n * k * r * 2 + n * k * out_bytes


def draft_rows(gpu: str, n: int = 1, k: int = 7, run_k: int = 0, fp8: bool = False, warp_instructions: int = 0,
               issue_source: str = "measured", grid_barrier_us=None, cycles_per_issue: float = 1.0):
    """draft_block (vanilla, r = 256, bf16 U / W1 / W2, or an fp8 W2 with its row scales, greedy) at N = `n`,
    K = `k`. With ``run_k`` < k the harness
    runs ``run_k`` positions and the launch's per-position counters (bytes, DRAM estimate, MMAs, grid barriers) are
    scaled to k positions (every position does the same work), said in the row. ``warp_instructions``: the whole
    launch's count, measured on a GPU (bench/ncu_draft.py) or estimated from the SASS (bench/sass_draft.py: say so
    in ``issue_source``), which turns the model's issue term on (0: off); ``cycles_per_issue``: a warp's clocks
    between two of its instructions, alone on its scheduler (ncu's Warp Cycles Per Issued Instruction at one warp a
    scheduler; 1: the throughput bound). ``grid_barrier_us``: one grid barrier's cost (None: bench/model.py's
    constant; bench/grid_barrier.py measures it on a GPU)."""
    import dspark_kernels as dk
    from dspark_kernels import simt
    r, run_k = 256, run_k or k
    base, head, anchors = _draft_case(n, run_k, r, fp8)
    with simt.record(dram=True) as rec:
        out = dk.draft_block(base, anchors, head, temperature=0.0, seed=1, backend="cuda")
    (ln,) = rec.launches
    ln = dict(ln, warp_instructions=int(warp_instructions), issue_source=issue_source,
              cycles_per_issue=float(cycles_per_issue))
    if run_k != k:
        scale = k / run_k
        ln = dict(ln, **{key: int(round(ln[key] * scale)) for key in
                         ("bytes_read", "bytes_written", "unique_bytes_read", "unique_bytes_written",
                          "dram_bytes_read", "mma", "grid_barriers")})
    floor = draft_floor_bytes(n, k, r, fp8, out.tokens.element_size() + out.draft_logprobs.element_size())
    plan = draft_sweep_plan(n, V, r, fp8=fp8)
    chain = prologue_chain(n, k, r, gpu, fp8)
    ln["serial_s"] = chain["serial_us"] * 1e-6
    params = dict(N=n, K=k, V=V, r=r, mode="greedy", w2="fp8" if fp8 else "bf16", ctas=ln["ctas"],
                  lanes=plan["lanes"], chain_rounds=chain["chain_rounds"], chain_us=round(chain["chain_us"], 3),
                  fill_us=round(chain["fill_us"], 3))
    row = _row("draft_block", params, [ln], floor, gpu, False, grid_barrier_us)
    if run_k != k:
        row["note"] += f"; the harness ran {run_k} of the {k} positions, its counters scaled to {k}"
    return [row]


def _row(op, params, launches, floor, gpu, access, grid_barrier_us=None):
    """One op's modelled row. Its grid barriers are counted and their term kept apart (``barrier_us``, at
    ``grid_barrier_us`` each: bench/model.py's constant unless given), so that the time at any other barrier cost is
    ``modelled_us - barrier_us + grid_barriers * cost``."""
    each = GPUS[gpu].grid_barrier_s if grid_barrier_us is None else grid_barrier_us * 1e-6
    per = [model_launch(ln, gpu, registers=ln.get("registers"), loads_in_flight=loads_in_flight(ln),
                        warp_instructions=ln.get("warp_instructions", 0),
                        cycles_per_issue=ln.get("cycles_per_issue", 1.0), grid_barrier_s=each,
                        serial_s=ln.get("serial_s", 0.0)) for ln in launches]
    issue = sum(ln.get("warp_instructions", 0) for ln in launches)
    barriers = sum(p["grid_barriers"] for p in per)
    return dict(op=op, **params, launches=len(launches), access_model=access, floor_bytes=floor,
                issue_term=(f"on ({issue} warp instructions, {launches[0].get('issue_source', 'measured')}; "
                            f"{launches[0].get('cycles_per_issue', 1.0):g} cycles a warp's issue)" if issue else "off"),
                warps_per_scheduler=[p["warps_per_scheduler"] for p in per],
                modelled_us=round(sum(p["modelled_us"] for p in per), 2),
                grid_barriers=barriers, barrier_us=round(sum(p["grid_barrier_us"] for p in per), 2),
                grid_barrier_us_each=round(each * 1e6, 3), serial_us=round(sum(p["serial_us"] for p in per), 2),
                floor_model_us=round(floor_model_us(floor, len(launches), gpu), 2),
                per_launch_us={ln["kernel"]: round(p["modelled_us"], 2) for ln, p in zip(launches, per)},
                bound=[p["bound"] for p in per], note="modelled (bench/model.py), not measured")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", default="h200", choices=("h200", "h100"))
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--batch", type=int, default=1, help="verify_chain only, at this N and K = 7")
    ap.add_argument("--draft", type=int, nargs=2, metavar=("N", "K"),
                    help="draft_block only, at this N and K (the harness runs one position, scaled to K)")
    ap.add_argument("--w2", default="bf16", choices=("bf16", "fp8"), help="with --draft: W2's dtype")
    ap.add_argument("--warp-instructions", type=int, default=0, metavar="COUNT",
                    help="with --draft: the launch's warp instructions from bench/ncu_draft.py (turns the issue "
                         "term on)")
    ap.add_argument("--cycles-per-issue", type=float, default=1.0, metavar="CPI",
                    help="with --warp-instructions: a warp's clocks between two of its instructions alone on its "
                         "scheduler (ncu's Warp Cycles Per Issued Instruction at one warp a scheduler)")
    ap.add_argument("--grid-barrier-us", type=float, metavar="US",
                    help="with --draft: one grid barrier's cost (default: bench/model.py's constant; "
                         "bench/grid_barrier.py measures it on a GPU)")
    ap.add_argument("--no-access", action="store_true",
                    help="with --batch: without the access model (its shared-memory term is then absent and its L2 "
                         "term the bytes requested)")
    args = ap.parse_args()
    os.environ.setdefault("DSPARK_SIMT", "1")
    if args.draft:
        rows = draft_rows(args.gpu, args.draft[0], args.draft[1], run_k=1, fp8=args.w2 == "fp8",
                          warp_instructions=args.warp_instructions, grid_barrier_us=args.grid_barrier_us,
                          cycles_per_issue=args.cycles_per_issue)
    elif args.batch == 1:
        rows = verify_rows(args.gpu) + draft_rows(args.gpu)
    else:
        rows = verify_rows(args.gpu, args.batch, ks=(7,), access=not args.no_access)
    emit_rows(rows, args.json)
    return 0


def emit_rows(rows, json_path=None) -> None:
    """Print each row as a JSON line; also write them all to ``json_path`` when given."""
    for r in rows:
        print(json.dumps(r))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
