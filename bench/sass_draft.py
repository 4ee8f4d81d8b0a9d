#!/usr/bin/env python
"""draft_block's warp instructions at a shape, estimated from its sm_90a SASS (a MODEL, not a measurement): the
shipped kernel's line-annotated disassembly charged with how often each source block runs at that shape
(tools/sass_regions.py), for the case bench/model_headline.py models (vanilla head, bf16 U / W1 / W2, greedy, U
staged, no logits written, no confidence head). Nsight Compute measures the same count on a GPU
(bench/ncu_draft.py); this estimate stands in for it where none is lent, and feeds the model's issue term.

    python bench/sass_draft.py [--object OBJ] [--json PATH] [--model] N K [N K ...]

Without ``--object`` it compiles csrc/torch/draft_block.cu for sm_90a (about a minute; needs nvcc); an object given
must be built from this checkout's headers (its line info names their lines: a stale one mostly fails loudly, a
SASS loop at a line no block opens). ``--model`` also prints bench/model_headline.py's draft_block row with the
issue term on from this count.

Counts are per CTA, summed over its warps (4; 8 with the 64-request tile), for the busiest CTA (lane 0 and the
widest slice), times the CTAs: an upper bound for the path wherever a branch's two sides share a source block, for
finite logits (add_exp's NaN branch, taken only while every logit so far is -inf, not taken), and with the
greedy fold's rare branch (Part::add_greedy_seeded: a new running maximum) entered as often as logits in random
order make some lane of a warp meet one (record_pieces, a model of the data: about 45% of a warp's pieces at
N = 256, K = 15).
The ring's staging lambda is inlined twice (the prologue's kStages - 1 calls a group and the chunk loop's): its
blocks are named once for each copy, within that copy's SASS loop, each with its own count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_regions as sr  # noqa: E402
from model_headline import ROW_BATCH, V, WARPS, draft_sweep_plan, merge_rounds, warp_batches  # noqa: E402

HEADERS = os.path.join(ROOT, "csrc", "include", "dspark")
PROJECT = sorted(f for f in os.listdir(HEADERS) if f.endswith(".cuh"))  # the files whose lines regions name


def shape(n: int, k: int, vocab: int = V, rank: int = 256) -> dict:
    """The busiest CTA's trip counts at (N, K, V, r), from the launch plan (bench/model_headline.draft_sweep_plan)."""
    plan = draft_sweep_plan(n, vocab, rank)
    rpad, tpr = plan["rpad"], plan["tpr"]
    groups = -(-n // plan["group"])
    units = -(-vocab // 16)
    rows = 16 * -(-units // plan["slices"])  # the widest slice
    tiles = -(-rows // 128)
    nchunks = -(-rpad // 64)
    nb = min(n, plan["group"])
    nbp = -(-nb // 8) * 8
    return dict(plan, K=k, N=n, G=-(-groups // plan["lanes"]), rows=rows, rank=rank, tiles=tiles, nchunks=nchunks,
                chunks=tiles * nchunks, nb=nb, nbp=nbp, tpr=tpr, fold_warps=-(-nb * tpr // 32),
                pieces=max(1, 128 // (8 * tpr)))


TILE_LOOP = "for (int left = slice_rows, uslot = 0; left > 0;"
CHUNK_LOOP = "for (int ci = 0; ci < nchunks; ++ci, b += kblocks_chunk,"
FOLD_FIRST = "for (bias += i; i < rows && !(pt.stats.m > neg_inf()); i += step, bias += step) {"
FOLD_SEEDED = "for (; i < rows; i += step, bias += step) {"
PROLOGUE = "for (int s = 0; s < kStages - 1; ++s) stage();"


def record_pieces(pieces: int, lanes: int = 32) -> float:
    """Of a warp's `pieces` greedy fold calls in a group sweep, how many some lane enters Part::add_greedy's rare
    branch in (a new running maximum), for logits in random order (a MODEL of the data): a lane's j-th piece of 8
    holds the maximum of its first 8 j logits with probability 1 / j, independently across the warp's lanes."""
    return sum(1.0 - (1.0 - 1.0 / j) ** lanes for j in range(1, pieces + 1))


def regions(s: dict) -> list:
    """The source blocks of the path and their executions per CTA (summed over warps) at shape `s`."""
    db, rd, rng, part = (os.path.join(HEADERS, f) for f in ("draft_block.cuh", "reduce.cuh", "rng.cuh",
                                                             "draft_part.cuh"))
    K, G, W, nb = s["K"], s["G"], s["warps"], s["nb"]
    groups = K * G  # group sweeps per CTA
    chunks, tiles = groups * s["chunks"], groups * s["tiles"]
    fold = tiles * s["fold_warps"] * s["pieces"]
    first = groups * s["fold_warps"]  # the fold's pieces before a partial's maximum is above -inf
    records = first * (record_pieces(s["tiles"] * s["pieces"]) - 1)  # the seeded loop's rare branches
    merges = math.ceil(s["N"] / s["ctas"]) + (K - 1) * G * math.ceil(nb / s["slices"])
    merge = merge_rounds(nb, s["slices"], W)  # the prologue's merge of the slices' keys, summed over warps
    row_batches = warp_batches(s["nbp"], ROW_BATCH, W)["total"]  # and its batches of W1's rows
    table = [
        # the kernel: K positions, the last position's merges; the gated / rnn phases are off the path
        (db, "for (int64_t k = 0; k < p.K; ++k) {", K * W, "draft_block_kernel(DraftBlockParams p"),
        (db, "if (p.head != kVanilla) {", 0, "draft_block_kernel(DraftBlockParams p"),
        (db, "for (int64_t n = blockIdx.x; n < p.N; n += gridDim.x) {", math.ceil(s["N"] / s["ctas"]) * W,
         "draft_block_kernel(DraftBlockParams p"),
        (db, "for (int i = threadIdx.x; i < G; i += 2 * step) {", merges * W * math.ceil(s["slices"] / 256), None),
        (rd, "for (int w = 1; w < nwarps; ++w) r.merge(scratch[w]);  // warp 0's", merges * (W - 1), None),
        (rd, "for (int w = 1; w < nwarps; ++w) r.merge(scratch[w]);", 0, None),  # block_allreduce's: block_sum only
        # the phases are functions of their own on the GPU (their code's chains stop at them): the sweep runs once
        # a position, the gated / rnn phases not at all
        (db, "DSPARK_DRAFT_PHASE void phase_sweep_mma(", K * W, None),
        (db, "DSPARK_DRAFT_PHASE void phase_request(", 0, None),
        (db, "DSPARK_DRAFT_PHASE void phase_matvec(", 0, None),
        # the vanilla prologue, once per group sweep
        (db, "while (kl > 1 && kl * nw > 32) kl >>= 1;", groups * merge["halvings"], "int merge_lanes("),
        (db, "for (int s0 = sub; s0 < plan.slices; s0 += kl * kMergeLoads) {", groups * merge["rounds"],
         "void vanilla_prologue"),
        (db, "for (int o = 1; o < kl; o <<= 1) {", groups * merge["shuffles"], "void vanilla_prologue"),
        (db, "for (int j = first; j < nb; j += plan.slices) {", groups * math.ceil(nb / s["slices"]) * W,
         "void vanilla_prologue"),
        (db, "if (p.conf_w != nullptr) {", 0, "void vanilla_prologue"),
        # (and the functions only the confidence head and the gated / rnn phases call: the compiler's inline line
        # info does not always place their code inside the blocks that call them)
        (db, "DSPARK_DEVICE void gather_e(", 0, None),
        (db, "DSPARK_DEVICE void confidence(", 0, None),
        # the split of v into hi / lo rows
        (db, "for (int j0 = warp; j0 < nbp; j0 += kNW * kRowBatch) {  // W1's rows", groups * row_batches,
         "bool split_group"),
        (db, "for (int j = warp; j < nbp; j += kNW) {  // split rows", 0, "bool split_group"),
        (db, "DSPARK_DEVICE void copy_rows_w1(", groups * row_batches, None),  # the vanilla head's W1 rows
        (db, "for (int64_t c = 8 * lane; c < rpad; c += 8 * 32) {", groups * row_batches * math.ceil(s["rpad"] / 256),
         "void copy_rows_w1("),
        (db, "DSPARK_DEVICE bool split_row_elements(", 0, None),
        (db, "DSPARK_DEVICE float at(int64_t g0, int j, int64_t c) const {", 0, None),  # (only that path's)
        # the sweep: group loop, temperatures, the staging lambda (2 + chunks calls a group), the chunk loop
        (db, "for (int64_t g0 = int64_t(lane_id) * group; g0 < N;", groups * W, "void phase_sweep_mma"),
        (db, "for (int j = t; j < nb; j += kT) {", groups * math.ceil(nb / 32), "void phase_sweep_mma"),
        (db, PROLOGUE, 2 * groups * W, "void phase_sweep_mma"),
        (db, "DSPARK_DEVICE UStage(const DraftBlockParams& p", groups * W, "struct UStage"),
        (db, "for (int j = j0; j < nb; j += jstep, s += st) {", 0, "struct UStage"),  # fp32 U
        (db, "DSPARK_DEVICE void stage_w2_elements(", 0, None),  # (W2's rows 16-byte aligned: W2Copies)
        (db, TILE_LOOP, tiles * W, "void phase_sweep_mma"),
        (db, CHUNK_LOOP, chunks * W, "void phase_sweep_mma"),
        (db, "DSPARK_DEVICE void zero(float (&acc)", tiles * W, None),  # each tile's
        (db, "mma_chunk<TW, kFrags, true>", 0, "void phase_sweep_mma"),  # the vanilla head's v has no lo rows
        (db, "mma_chunk<TW, kFrags, false>", chunks * W, "void phase_sweep_mma"),
        (db, "for (int kk = 0; kk < width; kk += 16 * kSteps, brow += kSteps * kbs) {",
         chunks * W * 4 // k_steps(s), "void mma_chunk"),
        (db, "if (jf < nb) {", tiles * s["fold_warps"], "void phase_sweep_mma"),
        # the fold (greedy, U staged: fold_pieces_greedy), once a tile for each folding warp, a piece of 8 rows of U
        # an iteration: the first loop (Part::add_greedy) until the partial's maximum is above -inf, the first
        # piece of a group sweep for finite logits (add_exp's NaN branch not taken), the second (add_greedy_seeded)
        # the rest; its rare branch where some lane meets a new maximum. Off the path: the general fold_pieces and
        # what only it calls (U from global memory, fp32 U, an fp8 W2, logits written, flipped pieces, the sampled
        # race)
        (db, "DSPARK_DEVICE void fold_pieces_greedy(", tiles * s["fold_warps"], None),
        (db, FOLD_FIRST, first, "void fold_pieces_greedy("),
        (db, FOLD_SEEDED, fold - first, "void fold_pieces_greedy("),
        (part, "if (pm >= stats.m) {", first, "void add_greedy("),
        (part, "if (pm > stats.m) {", records, "void add_greedy_seeded("),
        (part, "DSPARK_DEVICE void add_exp(", first, None),
        (part, "else {", 0, "void add_exp("),
        (db, "DSPARK_DEVICE void fold_pieces(", 0, None),
        (db, "DSPARK_DEVICE void load_piece(", 0, None),
        (db, "DSPARK_DEVICE void unpack_piece(", 0, None),
        (db, "DSPARK_DEVICE void race_quad(", 0, None),
        (rd, "DSPARK_HOST_DEVICE_FN float gumbel_score(", 0, None),
        (rng, "DSPARK_HOST_DEVICE void mulhilo32(", 0, None),
        (rng, "DSPARK_HOST_DEVICE U32x4 philox4x32_10(", 0, None),
        (rng, "DSPARK_HOST_DEVICE float bits_to_uniform(", 0, None),
        (rng, "DSPARK_HOST_DEVICE U32x4 block(", 0, None),
        (rng, "DSPARK_HOST_DEVICE F32x4 uniform4(", 0, None),
        (db, "for (int o = 32 / tpr; o < 32; o <<= 1)", groups * W * int(math.log2(s["tpr"])), None),
    ]
    out = [sr.find_region(path, marker, count, after=after, name=marker) for path, marker, count, after in table]
    # the staging lambda is inlined twice: before the chunk loop (kStages - 1 = 2 calls a group, staging U's tile
    # when the call's chunk is a tile's last) and in it (a call a chunk); each copy takes its own count
    loops = {r.name: r for r in out}
    pro_u = groups * sum(1 for c in range(2) if c < s["chunks"] and c % s["nchunks"] == s["nchunks"] - 1)
    # a group's chunk c (tile c // nchunks, columns 64 (c % nchunks) on) is whole (W2Copies::issue_whole) when its
    # tile has 128 rows and its columns reach 64 past its first; the prologue stages c = 0, 1, the loop the rest
    whole = [c // s["nchunks"] < s["rows"] // 128 and c % s["nchunks"] < s["rank"] // 64 for c in range(s["chunks"])]
    whole_calls = {CHUNK_LOOP: groups * sum(whole[2:]), PROLOGUE: groups * sum(whole[:2])}
    edge_calls = {CHUNK_LOOP: groups * (len(whole[2:]) - sum(whole[2:])),
                  PROLOGUE: groups * (len(whole[:2]) - sum(whole[:2]))}
    for loop, calls, u_tiles in ((CHUNK_LOOP, chunks, tiles - pro_u), (PROLOGUE, 2 * groups, pro_u)):
        # (and the helpers it inlines, each a region of its own: their inline info can name a wrong caller, the
        # fold or the element copies off the path)
        for marker, count, after in (("auto stage = [&]() {", calls * W, "void phase_sweep_mma"),
                                     ("DSPARK_DEVICE void next(int nchunks, int uslots) {", calls * W,
                                      "struct ChunkCursor"),
                                     ("DSPARK_DEVICE void issue(TW* slot, int rows, int cols", calls * W,
                                      "struct W2Copies"),
                                     ("DSPARK_DEVICE void issue_whole(TW* d)", whole_calls[loop] * W,
                                      "struct W2Copies"),
                                     ("DSPARK_DEVICE void issue_edge(TW* d", edge_calls[loop] * W, "struct W2Copies"),
                                     ("DSPARK_DEVICE void next(bool tile_end)", calls * W, "struct W2Copies"),
                                     ("ust.tile(slice_rows - at.rows_left", u_tiles * W, "void phase_sweep_mma"),
                                     ("DSPARK_DEVICE void tile(int64_t off", u_tiles * W, "struct UStage")):
            name = f"{marker} ({'chunk loop' if loop == CHUNK_LOOP else 'prologue'})"
            out.append(sr.find_region(db, marker, count, after=after, name=name, within=loops[loop]))
    # the helpers both fold loops inline (the sum of a piece's exp2 terms; the tie mask in the rare branches), a
    # count for each copy
    for loop, exps, ties in ((FOLD_FIRST, first, first),
                             (FOLD_SEEDED, fold - first, records)):
        for marker, count in (("DSPARK_DEVICE void add_exp_at(", exps), ("DSPARK_DEVICE static int first_at(", ties)):
            out.append(sr.find_region(part, marker, count, name=f"{marker} ({loop})", within=loops[loop]))
    return out


def tile(group: int) -> int:
    """The tensor-core sweep's register tile (launch_w2): the group rounded up to 8, 16, 32 or 64 requests."""
    return next(t for t in (8, 16, 32, 64) if group <= t)


def warp_blocks(s: dict) -> int:
    """A warp's 8-request blocks of the register tile (mma_chunk's kFrags): the 64-request tile's halves with 8 warps."""
    return tile(s["group"]) // 8 // (s["warps"] // WARPS)


def k_steps(s: dict) -> int:
    """mma_chunk's k-steps a SASS iteration (kSteps, no lo products): a 64-column chunk's 4 for up to 4 blocks a
    warp, else 1."""
    return 1 if warp_blocks(s) > 4 else 4


def kernel_name(s: dict) -> str:
    return f"draft_block_kernelI13__nv_bfloat16Li{tile(s['group'])}ELb1E"


def compile_object(tmp: str) -> str:
    """csrc/torch/draft_block.cu compiled for sm_90a with the extension's flags (tools/check_cuda.py --keep)."""
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "check_cuda.py"), "--archs", "9.0a", "--keep", tmp,
                    os.path.join(ROOT, "csrc", "torch", "draft_block.cu")], check=True, capture_output=True)
    return os.path.join(tmp, "csrc_torch_draft_block.cu.o")


def estimate(funcs: dict, n: int, k: int) -> dict:
    """The launch's estimated warp instructions at (n, k) and the busiest CTA's share by source block."""
    s = shape(n, k)
    name = next((f for f in funcs if kernel_name(s) in f), None)
    if name is None:
        raise SystemExit(f"sass_draft: no {kernel_name(s)} in the object's sm_90a SASS")
    frags = warp_blocks(s)
    # mma_chunk's instance with the lo products is off the path (the vanilla head's v rows have no lo part): its
    # loop takes 2 k-steps an iteration (1 at 8 blocks a warp), each 2 A loads, a B load a block and 4 HMMA a block
    lo_steps = 1 if frags > 4 else 2
    lo_loop = lambda body: (sum(" HMMA." in f" {i.text}" for i in body) == 4 * lo_steps * frags and  # noqa: E731
                            sum(" LDSM." in f" {i.text}" for i in body) == lo_steps * (2 + frags))
    per_cta = sr.estimate(funcs[name], regions(s), PROJECT, off_path=lo_loop)
    top = sorted(per_cta["by_region"].items(), key=lambda kv: -kv[1])[:8]
    return dict(N=n, K=k, V=V, r=256, ctas=s["ctas"], kernel=name,
                warp_instructions=int(round(per_cta["warp_instructions"] * s["ctas"])),
                per_cta=int(round(per_cta["warp_instructions"])), per_cta_by_block={b: int(c) for b, c in top},
                note="estimated from the sm_90a SASS (bench/sass_draft.py), not measured")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shapes", type=int, nargs="+", help="N K pairs")
    ap.add_argument("--object", help="an object or library holding draft_block's sm_90a SASS (-lineinfo)")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--model", action="store_true", help="also model each shape with the issue term on")
    ap.add_argument("--wide-warps", type=int, choices=(4, 8), default=None,
                    help="the object's kWideWarps when it was built with another value than this checkout's (an A/B "
                         "variant: the 64-request tile's CTA of 4 or 8 warps)")
    ap.add_argument("--cycles-per-issue", type=float, default=1.0, metavar="CPI",
                    help="with --model: a warp's clocks between two of its instructions alone on its scheduler "
                         "(ncu's, bench/records/h200_ncu_draft_two_ctas.json; 1: the throughput bound)")
    args = ap.parse_args()
    if len(args.shapes) % 2:
        ap.error("shapes come in N K pairs")
    if args.wide_warps is not None:
        if args.model:
            ap.error("--model runs this checkout's build: its kWideWarps only")
        import model_headline
        model_headline.WIDE_WARPS = args.wide_warps
    import sass
    home = os.environ.get("CUDA_HOME")
    cuobjdump, nvdisasm = sass.toolkit_tool("cuobjdump", home), sass.toolkit_tool("nvdisasm", home)
    if not cuobjdump or not nvdisasm:
        print("sass_draft: needs cuobjdump and nvdisasm (the CUDA toolkit or the Triton wheel)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        funcs = sr.lined_functions(args.object or compile_object(tmp), cuobjdump, nvdisasm)
    rows = []
    for n, k in zip(args.shapes[::2], args.shapes[1::2]):
        row = estimate(funcs, n, k)
        if args.model:
            from model_headline import draft_rows
            os.environ.setdefault("DSPARK_SIMT", "1")
            (m,) = draft_rows("h200", n, k, run_k=1, warp_instructions=row["warp_instructions"],
                              issue_source="SASS estimate", cycles_per_issue=args.cycles_per_issue)
            row["model"] = m
        rows.append(row)
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
