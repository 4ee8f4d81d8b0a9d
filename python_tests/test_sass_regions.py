"""tools/sass_regions.py: line-annotated SASS parsed, source blocks found, and instructions charged by hand-counted
cases (no nvcc: the disassembly is written out here in nvdisasm -gi's form)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import sass_regions as sr  # noqa: E402

HEADER = """\
void kernel(int n) {
  for (int k = 0; k < n; ++k) {
    body(k);
    if (rare) {
      slow();
    }
  }
  finish();
}
int helper(int x) { return x + 1; }
void other() {
  if (a) {
    x();
  } else {  // the cold side
    y();
  }
  for (int i = 0; i < 4; ++i)
    z(i);
}
"""


def _sass(h):
    """A two-function listing: `kern` with a loop over lines 2-6 of `h` (a cold block at line 5 behind the test at
    line 4, an inlined helper at line 10 called from line 3, a shuffle retry loop at line 3 of a toolkit header; the
    exit at line 8), and `tail`."""
    return f"""\
.text._Z4kern:
	//## File "{h}", line 1
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
	//## File "{h}", line 3
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
	//## File "{h}", line 10 inlined at "{h}", line 3
	//## File "{h}", line 3
        /*0020*/                   IADD3 R3, R2, 0x1, RZ ;
.L_x_9:
	//## File "/cuda/include/sm_30_intrinsics.hpp", line 409 inlined at "{h}", line 3
	//## File "{h}", line 3
        /*0030*/                   SHFL.BFLY PT, R4, R3, 0x1, 0x1f ;
        /*0040*/               @P1 BRA `(.L_x_9) ;
	//## File "{h}", line 4
        /*0050*/              @!P2 BRA `(.L_x_2) ;
	//## File "{h}", line 5
        /*0060*/                   CALL.REL.NOINC `($_Z4kern$_Z4cold) ;
.L_x_2:
	//## File "{h}", line 2
        /*0070*/               @P0 BRA `(.L_x_1) ;
	//## File "{h}", line 8
        /*0080*/                   EXIT ;
$_Z4kern$_Z4cold:
	//## File "{h}", line 14
        /*0090*/                   MOV R5, RZ ;
	//## File "{h}", line 13
        /*00a0*/                   RET.REL.NODEC R20 ;
.text._Z4tail:
	//## File "{h}", line 13
        /*0000*/                   EXIT ;
"""


def _listing(func, h, rows):
    """nvdisasm -gi text of function `func` from rows: a label name, or (chain, instruction) with the chain's lines
    of `h` innermost first, each inlined at the next."""
    out = [f".text.{func}:"]
    for row in rows:
        if isinstance(row, str):
            out.append(f"{row}:")
            continue
        chain, text = row
        out += [f'\t//## File "{h}", line {a} inlined at "{h}", line {b}' for a, b in zip(chain, chain[1:])]
        out += [f'\t//## File "{h}", line {chain[-1]}', f"        /*{16 * len(out):04x}*/   {text} ;"]
    return "\n".join(out) + "\n"


@pytest.fixture
def header(tmp_path):
    p = tmp_path / "k.cuh"
    p.write_text(HEADER)
    return str(p)


def test_parse_lined_keeps_chains_labels_and_targets(header):
    funcs = sr.parse_lined(_sass(header))
    assert sorted(funcs) == ["_Z4kern", "_Z4tail"]
    kern = funcs["_Z4kern"]
    assert kern[0].text == "MOV R1, c[0x0][0x28]" and kern[4].text == "@P1 BRA `(.L_x_9)"
    assert len(kern) == 11 and len(funcs["_Z4tail"]) == 1
    assert kern[0].chain == (("k.cuh", 1),)
    assert kern[2].chain == (("k.cuh", 10), ("k.cuh", 3))  # innermost frame first
    assert kern[3].chain[0] == ("sm_30_intrinsics.hpp", 409)
    assert kern[4].target == 3 and kern[5].target == 7 and kern[7].target == 1  # labels -> instruction indices
    assert kern[1].target is None and kern[6].target is None  # a call is not a branch
    # the subroutine: line info afresh from its symbol; its instructions carry its first one's chain as the entry
    assert kern[9].chain == (("k.cuh", 14),) and kern[10].chain == (("k.cuh", 13),)
    assert kern[10].entry == kern[9].entry == (("k.cuh", 14),) and kern[8].entry == ()


def test_find_region_blocks_statements_and_else(header):
    r = sr.find_region(header, "for (int k = 0; k < n; ++k) {", 7)
    assert (r.file, r.first, r.last, r.count) == ("k.cuh", 2, 7, 7)
    assert (sr.find_region(header, "if (rare) {", 0).first, sr.find_region(header, "if (rare) {", 0).last) == (4, 6)
    els = sr.find_region(header, "else {  // the cold side", 0)
    assert (els.first, els.last) == (14, 16)  # the "}" before the marker closes nothing
    stmt = sr.find_region(header, "for (int i = 0; i < 4; ++i)", 4)
    assert (stmt.first, stmt.last) == (17, 18)  # a braceless loop: through its statement's ";"
    assert sr.find_region(header, "x();", 1, after="void other").first == 13
    with pytest.raises(ValueError, match="nope"):
        sr.find_region(header, "nope", 1)
    with pytest.raises(ValueError, match="void kernel"):
        sr.find_region(header, "x();", 1, after="void kernel(int n) {\n")


def test_estimate_by_hand(header):
    """The loop runs 7 times: its 5 body instructions that no branch skips (two at line 3, the shuffle and its retry
    branch, the inlined helper's at line 10, the rare block's test at line 4) and the loop branch at line 2 are
    charged 7 each, the cold call behind the test 0, the 2 outside once: 6 * 7 + 2 = 44; the subroutine's two
    instructions are off the path (the second through its entry). The retry branch closes inside a toolkit header:
    no region of its own."""
    kern = sr.parse_lined(_sass(header))["_Z4kern"]
    regions = [sr.find_region(header, "for (int k = 0; k < n; ++k) {", 7),
               sr.find_region(header, "if (rare) {", 0),
               sr.find_region(header, "else {  // the cold side", 0)]  # the subroutine's body, its line 13 too
    est = sr.estimate(kern, regions, ["k.cuh"])
    loop = "for (int k = 0; k < n; ++k) {"
    assert est["warp_instructions"] == 44
    assert est["by_region"] == {"(once)": 2, f"loop {loop}": 42, "if (rare) {": 0,
                                "else {  // the cold side": 0, "(entry) else {  // the cold side": 0}
    # what no branch skips runs every iteration, whatever its line's region says (line 3 alone given 2, the rare
    # block 3: only the call behind the test takes the block's count)
    inner = [regions[0], sr.find_region(header, "body(k);", 2), sr.find_region(header, "if (rare) {", 3), regions[2]]
    assert sr.estimate(kern, inner, ["k.cuh"])["warp_instructions"] == 6 * 7 + 3 + 2


def test_a_branch_out_of_the_loop_skips_nothing(header):
    """A branch that leaves the loop (to an exit after it) skips no body instruction: the IADD3 after it, whose line
    info names the rare block (count 2), still takes the loop's 7 (it runs every iteration but the last); behind a
    branch to a later body instruction instead (the back edge) it takes the block's 2."""
    def rows(to):
        return [".L_x_1", ((3,), "IADD3 R2, R2, 0x1, RZ"), ((4,), f"@P2 BRA `({to})"), ((5,), "IADD3 R3, R3, 0x1, RZ"),
                ".L_x_6", ((2,), "@P0 BRA `(.L_x_1)"), ((8,), "EXIT"), ".L_x_5", ((8,), "EXIT")]
    regions = [sr.find_region(header, "for (int k = 0; k < n; ++k) {", 7), sr.find_region(header, "if (rare) {", 2)]
    out = sr.parse_lined(_listing("_Z1r", header, rows(".L_x_5")))["_Z1r"]
    assert out[1].target == 5
    assert [n for n, _ in sr.charges(out, regions, ["k.cuh"])] == [7, 7, 7, 7, 1, 1]
    over = sr.parse_lined(_listing("_Z1r", header, rows(".L_x_6")))["_Z1r"]
    assert over[1].target == 3
    assert [n for n, _ in sr.charges(over, regions, ["k.cuh"])] == [7, 7, 2, 7, 1, 1]


def test_a_loop_count_holds_only_inside_its_sass_loop(header):
    """An instruction whose line lies in a loop's region but which sits outside the SASS loop closing at that line
    (the loop's setup, an unrolled copy, or line info naming the loop wrongly) takes the next region's count: the
    function's 1 here, not the loop's 7: 1 + 7 + 7."""
    sass = f""".text._Z1f:
	//## File "{header}", line 2
        /*0000*/                   MOV R2, RZ ;
.L_x_1:
	//## File "{header}", line 3
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
	//## File "{header}", line 2
        /*0020*/               @P0 BRA `(.L_x_1) ;
"""
    f = sr.parse_lined(sass)["_Z1f"]
    regions = [sr.find_region(header, "void kernel(int n) {", 1),
               sr.find_region(header, "for (int k = 0; k < n; ++k) {", 7)]
    assert regions[1].loop and not regions[0].loop
    assert [n for n, _ in sr.charges(f, regions, ["k.cuh"])] == [1, 7, 7]


def test_an_inlined_frame_counts_only_before_the_chain_reaches_the_loop(header):
    """Code inlined into the SASS loop closing at line 2 takes the count of the first region its chain meets before
    the loop's own source: the helper (line 10) called from a cold block (line 15) that was inlined at the loop's
    line 3 is off the path (0); called from the rare branch (line 5, count 2), 2; called at line 3 with a chain that
    then names the cold block as where the loop's own code was inlined (line info naming the wrong call site: the
    loop is on the path, so that frame cannot take it off), the loop's 7; the loop's two branches 7. Without the
    forward branch (a straight-line body) every instruction would take the loop's 7."""
    sass = _listing("_Z1g", header, [".L_x_1", ((2,), "@P2 BRA `(.L_x_3)"),
                                     ((10, 15, 3), "IADD3 R2, R2, 0x1, RZ"), ((10, 5), "IADD3 R4, R4, 0x1, RZ"),
                                     ((10, 3, 15), "IADD3 R3, R3, 0x1, RZ"), ".L_x_3", ((2,), "@P0 BRA `(.L_x_1)")])
    f = sr.parse_lined(sass)["_Z1g"]
    assert f[1].chain == (("k.cuh", 10), ("k.cuh", 15), ("k.cuh", 3))
    regions = [sr.find_region(header, "for (int k = 0; k < n; ++k) {", 7),
               sr.find_region(header, "if (rare) {", 2),
               sr.find_region(header, "else {  // the cold side", 0)]
    assert [n for n, _ in sr.charges(f, regions, ["k.cuh"])] == [7, 0, 2, 7, 7]
    straight = sass.replace("@P2 BRA `(.L_x_3)", "NOP")
    assert [n for n, _ in sr.charges(sr.parse_lined(straight)["_Z1g"], regions, ["k.cuh"])] == [7] * 5


def test_an_inlined_frame_that_would_run_more_often_than_its_loop_is_a_misnamed_call_site(header):
    """The same listing with the rare block given 9 runs, more than the loop's 7 around the helper's copy: no
    block inside a loop runs more often than the loop, so the frame names the wrong call site and the copy takes the
    loop's 7 (the cold block's 0 still holds: a block off the path may hold a loop's copy)."""
    sass = _listing("_Z1g", header, [".L_x_1", ((2,), "@P2 BRA `(.L_x_3)"),
                                     ((10, 15, 3), "IADD3 R2, R2, 0x1, RZ"), ((10, 5), "IADD3 R4, R4, 0x1, RZ"),
                                     ".L_x_3", ((2,), "@P0 BRA `(.L_x_1)")])
    f = sr.parse_lined(sass)["_Z1g"]
    regions = [sr.find_region(header, "for (int k = 0; k < n; ++k) {", 7),
               sr.find_region(header, "if (rare) {", 9),
               sr.find_region(header, "else {  // the cold side", 0)]
    assert [n for n, _ in sr.charges(f, regions, ["k.cuh"])] == [7, 0, 7, 7]
    regions[1] = sr.find_region(header, "if (rare) {", 2)
    assert [n for n, _ in sr.charges(f, regions, ["k.cuh"])] == [7, 0, 2, 7]


def test_a_region_within_a_loop_counts_only_its_own_copy(header):
    """The helper's block (line 10) inlined twice: a copy inside the SASS loop closing at line 2 (the loop's body
    runs 7 times) and a copy inside the one closing at line 17 (4 times). Named once for each loop with `within`,
    each copy takes its own count: 7 and 4 (without `within`, one count for both); the loops' own instructions 7
    and 4 (each body has a forward branch, so the straight-loop rule does not decide)."""
    sass = _listing("_Z1h", header, [".L_x_1", ((2,), "@P2 BRA `(.L_x_3)"), ((10, 3), "IADD3 R2, R2, 0x1, RZ"),
                                     ".L_x_3", ((2,), "@P0 BRA `(.L_x_1)"),
                                     ".L_x_2", ((17,), "@P2 BRA `(.L_x_4)"), ((10, 18), "IADD3 R3, R3, 0x1, RZ"),
                                     ".L_x_4", ((17,), "@P1 BRA `(.L_x_2)")])
    f = sr.parse_lined(sass)["_Z1h"]
    loop_k = sr.find_region(header, "for (int k = 0; k < n; ++k) {", 7)
    loop_i = sr.find_region(header, "for (int i = 0; i < 4; ++i)", 4)
    helper = "int helper(int x)"
    regions = [loop_k, loop_i, sr.find_region(header, helper, 7, within=loop_k),
               sr.find_region(header, helper, 4, within=loop_i)]
    assert regions[2].within == ("k.cuh", 2) and regions[3].within == ("k.cuh", 17)
    assert [n for n, _ in sr.charges(f, regions, ["k.cuh"])] == [7, 7, 7, 4, 4, 4]
    one = [loop_k, loop_i, sr.find_region(header, helper, 5)]
    assert [n for n, _ in sr.charges(f, one, ["k.cuh"])] == [7, 5, 7, 4, 5, 4]


def test_sass_draft_table_matches_the_plan_and_the_source():
    """bench/sass_draft.py's trip counts at N = 256, K = 15, V = 151936, r = 256 by hand (33 slices x 4 lanes of
    64 requests; the widest slice 16 * ceil(9496 / 33) = 4608 rows: 36 tiles of 4 chunks; a CTA of 8 warps, 4
    threads a request, so 8 warps fold 4 pieces a tile), and every block its table names still found in the headers
    at N = 1, 64, 256."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import sass_draft as sd
    s = sd.shape(256, 15)
    assert (s["slices"], s["lanes"], s["group"], s["G"]) == (33, 4, 64, 1)
    assert (s["tiles"], s["nchunks"], s["chunks"], s["tpr"], s["fold_warps"], s["pieces"]) == (36, 4, 144, 4, 8, 4)
    assert s["warps"] == 8
    regions = {r.name: r for r in sd.regions(s)}
    kstep = "for (int kk = 0; kk < width; kk += 16 * kSteps, brow += kSteps * kbs) {"
    assert regions[kstep].count == 15 * 144 * 8  # K x chunks x warps x iterations (a chunk's four k-steps each)
    assert sd.k_steps(dict(s, warps=4)) == 1  # (8 blocks a warp: one k-step an iteration)
    # the fold: a group sweep's first piece through add_greedy (its maximum then above -inf), the rest seeded
    assert regions[sd.FOLD_FIRST].count == regions["if (pm >= stats.m) {"].count == 15 * 8
    assert regions[sd.FOLD_SEEDED].count == 15 * 36 * 8 * 4 - 15 * 8
    assert regions[kstep].loop and regions[sd.FOLD_FIRST].loop and regions[sd.FOLD_SEEDED].loop
    # the greedy fold's rare branch: a warp enters it at a piece where some lane meets a new maximum (logits in
    # random order: lane probability 1 / j at its j-th piece); 2 lanes over 2 pieces: 1 + (1 - 1/4); the first
    # piece's is the first loop's
    assert sd.record_pieces(2, lanes=2) == 1.75
    assert regions["if (pm > stats.m) {"].count == 15 * 8 * (sd.record_pieces(36 * 4) - 1)
    exps = "DSPARK_DEVICE void add_exp_at( ({})"
    assert regions[exps.format(sd.FOLD_FIRST)].count == 15 * 8
    assert regions[exps.format(sd.FOLD_SEEDED)].count == regions[sd.FOLD_SEEDED].count
    # W2's copies: 4608 rows are 36 whole tiles and r = 256 four whole chunks, so every chunk takes issue_whole
    # (the prologue's 2 a group, the loop's other 142); N = 1's widest slice, 16 * ceil(9496 / 264) = 576 rows,
    # ends in a 64-row tile whose 4 chunks take issue_edge (4 warps, 7 positions)
    whole, edge = "DSPARK_DEVICE void issue_whole(TW* d) ({})", "DSPARK_DEVICE void issue_edge(TW* d ({})"
    assert regions[whole.format("chunk loop")].count == 15 * 142 * 8
    assert regions[whole.format("prologue")].count == 15 * 2 * 8
    assert regions[edge.format("chunk loop")].count == regions[edge.format("prologue")].count == 0
    assert regions["DSPARK_DEVICE void stage_w2_elements("].count == 0  # (W2's rows 16-byte aligned: W2Copies)
    one = {r.name: r for r in sd.regions(sd.shape(1, 7))}
    assert sd.shape(1, 7)["rows"] == 576 and sd.shape(1, 7)["tiles"] == 5
    assert (one[whole.format("chunk loop")].count, one[edge.format("chunk loop")].count) == (7 * 14 * 4, 7 * 4 * 4)
    assert (one[whole.format("prologue")].count, one[edge.format("prologue")].count) == (7 * 2 * 4, 0)
    for n, k in ((1, 7), (64, 7)):
        assert all(r.count >= 0 and r.first <= r.last for r in sd.regions(sd.shape(n, k)))
    assert sd.shape(1, 7)["tpr"] == 32 and sd.shape(1, 7)["slices"] == 264  # two CTAs an SM at N = 1
    assert sd.shape(64, 7)["slices"] == 132  # a 64-request group fits once
