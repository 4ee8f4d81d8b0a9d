#!/usr/bin/env python
"""Compile every Triton kernel for sm_90, and for sm_80 too where its lowering differs by architecture (:data:`ARCHS`),
without a GPU (CI runs this; the interpreter misses errors the real compiler catches, such as non-constexpr globals
or type mismatches between branches), with the num_warps its launcher uses and the alignment a real launch
specialises for, and report each kernel's registers and spill bytes from ptxas (spills depend on that
specialisation, so they are reported, not failed on; the CUDA kernels' spills fail tools/check_cuda.py).

    python tools/check_triton.py
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Optional

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from dspark_kernels.distributed import triton_decide, triton_draft, triton_stats, triton_verify
from dspark_kernels.distributed.triton_decide import _decide_kernel
from dspark_kernels.distributed.triton_draft import _draft_step_kernel
from dspark_kernels.distributed.triton_stats import _stats_kernel
from dspark_kernels.distributed.triton_verify import _residual_kernel
from dspark_kernels.triton.accept_prefix_scan import _accept_prefix_scan_kernel
from dspark_kernels.triton.draft_block import (_conf_kernel, _draft_block_kernel, _head_kernel, _merge_kernel,
                                               _sweep_kernel, _topk_kernel)
from dspark_kernels.triton.rng_uniform import _rng_uniform_kernel
from dspark_kernels.triton.schedule_verify_lens import _schedule_verify_lens_kernel
from dspark_kernels.triton.verify_chain import _mass_kernel, _rows_kernel, _sample_kernel


def _draft_signature(w2: str) -> dict:
    """draft_block's kernel with a W2 of Triton type ``w2`` (bf16 inputs otherwise)."""
    return dict(base_ptr="*bf16", anchor_ptr="*i64", w1_ptr="*bf16", w2_ptr=f"*{w2}", w2s_ptr="*fp32", d2t_ptr="*i64",
                wg_ptr="*bf16", bg_ptr="*bf16", wj_ptr="*bf16", bj_ptr="*bf16", hidden_ptr="*bf16", cw_ptr="*fp32",
                cb_ptr="*fp32", sts_ptr="*fp32", cand_ptr="*i64", temp_ptr="*fp32", rng_key_ptr="*i64", seed="i64",
                offset="i64", KEY_IN_MEMORY="constexpr", scratch_ptr="*fp32", tokens_ptr="*i64", logits_ptr="*fp32", conf_ptr="*fp32", surv_ptr="*fp32",
                logprob_ptr="*fp32", K="i32", V="i32", W="i32", VT="i32", R="i32", D="i32", HEAD="constexpr",
                W2_FP8="constexpr", HAS_SCALE="constexpr", HAS_MAP="constexpr", HAS_CONF="constexpr",
                HAS_STS="constexpr", TOPK="constexpr", RETURN_LOGITS="constexpr", BLOCK_V="constexpr",
                BLOCK_R="constexpr", BLOCK_C="constexpr")


# verify_chain's three kernels: pass A, block verification's mass pass, pass B
_ROWS_SIGNATURE = dict(
    target_ptr="*bf16", cu_ptr="*i32", drafts_ptr="*i64", dl_ptr="*fp32", inv_ptr="*i32", cand_ptr="*i64",
    lp_ptr="*fp32", lens_ptr="*i32", surv_ptr="*fp32", thr_ptr="*fp32", temp_ptr="*fp32", key_ptr="*i64", seed="i64",
    offset="i64", KEY_IN_MEMORY="constexpr", stops_ptr="*i64", n_stops="i32", tokens_ptr="*i64", num_acc_ptr="*i32",
    mask_ptr="*u8", amax_v="*fp32", amax_i="*i64", tpart="*fp32", dpart="*fp32", at_t="*fp32", atq_l="*fp32",
    atq_c="*i64", rho_ptr="*fp32", rowt="*fp32", rowq="*fp32", si_ptr="*i64", sf_ptr="*fp32", tickets="*i32",
    total_rows="i32", K="i32", V="i32", W="i32", chunk="i32", chunks="i32", dchunk="i32", dchunks="i32",
    PACKED="constexpr", HAS_LENS="constexpr", HAS_THR="constexpr", SAMPLING="constexpr", HAS_LOGPROBS="constexpr",
    DRAFT_STATS="constexpr", QKIND="constexpr", BLOCK_METHOD="constexpr", BLOCK_V="constexpr", BLOCK_K="constexpr",
    BLOCK_C="constexpr", BLOCK_W="constexpr")
_ROWS_BLOCKS = dict(HAS_LENS=[True], HAS_THR=[True], BLOCK_V=[1024], BLOCK_K=[8], BLOCK_C=[64], BLOCK_W=[16])
_MASS_SIGNATURE = dict(
    target_ptr="*bf16", drafts_ptr="*i64", dl_ptr="*fp32", inv_ptr="*i32", cand_ptr="*i64", key_ptr="*i64",
    seed="i64", offset="i64", KEY_IN_MEMORY="constexpr", stops_ptr="*i64", n_stops="i32", tokens_ptr="*i64",
    num_acc_ptr="*i32", mask_ptr="*u8", rho_ptr="*fp32", rowt="*fp32", rowq="*fp32", si_ptr="*i64", sf_ptr="*fp32",
    masspart="*fp32", tickets="*i32", N="i32", K="i32", V="i32", W="i32", chunk="i32", chunks="i32",
    QKIND="constexpr", BLOCK_V="constexpr", BLOCK_K="constexpr", BLOCK_C="constexpr", BLOCK_W="constexpr")
_SAMPLE_SIGNATURE = dict(
    target_ptr="*bf16", dl_ptr="*fp32", inv_ptr="*i32", cand_ptr="*i64", key_ptr="*i64", seed="i64", offset="i64",
    KEY_IN_MEMORY="constexpr", tokens_ptr="*i64", si_ptr="*i64", sf_ptr="*fp32", res_v="*fp32", res_i="*i64",
    gum_v="*fp32", gum_i="*i64", mass_ptr="*fp32", tickets="*i32", N="i32", K="i32", V="i32", W="i32", chunk="i32",
    chunks="i32", QKIND="constexpr", BLOCK_V="constexpr", BLOCK_C="constexpr", BLOCK_W="constexpr")


# kernel -> (signature, {constexpr name: values to try}), or a list of them; NUM_WARPS: what the launchers use
# (default 4)
KERNELS = {
    _rng_uniform_kernel: (
        dict(out_ptr="*fp32", rng_key_ptr="*i64", seed="i64", offset="i64", KEY_IN_MEMORY="constexpr", K="i32",
             V="i32", rows="i32", quads_per_row="i32", stream="i32", BLOCK_Q="constexpr"),
        dict(KEY_IN_MEMORY=[True, False], BLOCK_Q=[256]),
    ),
    _rows_kernel: [(_ROWS_SIGNATURE, variant) for variant in (
        # greedy; token / block sampling with draft_logprobs (q: one-hot, dense, reduced, top-k); without them
        dict(KEY_IN_MEMORY=[True], PACKED=[False, True], SAMPLING=[False], HAS_LOGPROBS=[False],
             DRAFT_STATS=[False], QKIND=[1], BLOCK_METHOD=[False], **_ROWS_BLOCKS),
        dict(KEY_IN_MEMORY=[True], PACKED=[True], SAMPLING=[True], HAS_LOGPROBS=[True], DRAFT_STATS=[False],
             QKIND=[1, 2, 3, 4], BLOCK_METHOD=[False, True], **_ROWS_BLOCKS),
        dict(KEY_IN_MEMORY=[False], PACKED=[False], SAMPLING=[True], HAS_LOGPROBS=[False], DRAFT_STATS=[True],
             QKIND=[2, 3, 4], BLOCK_METHOD=[False, True], **_ROWS_BLOCKS))],
    _mass_kernel: [(_MASS_SIGNATURE, grid) for grid in (
        dict(KEY_IN_MEMORY=[True], QKIND=[1, 2, 3], BLOCK_V=[512], BLOCK_K=[8], BLOCK_C=[64], BLOCK_W=[16]),
        dict(KEY_IN_MEMORY=[True], QKIND=[4], BLOCK_V=[256], BLOCK_K=[8], BLOCK_C=[64], BLOCK_W=[16]))],
    _sample_kernel: [(_SAMPLE_SIGNATURE, grid) for grid in (
        dict(KEY_IN_MEMORY=[True, False], QKIND=[1, 2, 3], BLOCK_V=[512], BLOCK_C=[256], BLOCK_W=[16]),
        dict(KEY_IN_MEMORY=[True], QKIND=[4], BLOCK_V=[256], BLOCK_C=[256], BLOCK_W=[16]))],
    # the top-k proposals' kernel (the walk over each row's candidates; the full proposal is _sweep_kernel's)
    _draft_block_kernel: [(_draft_signature("bf16"),
                           dict(KEY_IN_MEMORY=[True], HEAD=[0, 1, 2], W2_FP8=[False], HAS_SCALE=[False],
                                HAS_MAP=[False, True], HAS_CONF=[True], HAS_STS=[True], TOPK=[True],
                                RETURN_LOGITS=[False, True], BLOCK_V=[64], BLOCK_R=[64], BLOCK_C=[64])),
                          (_draft_signature("u8"),  # an fp8 W2 (its bytes) with its row scales
                           dict(KEY_IN_MEMORY=[True], HEAD=[0, 2], W2_FP8=[True], HAS_SCALE=[True], HAS_MAP=[False],
                                HAS_CONF=[True], HAS_STS=[True], TOPK=[True], RETURN_LOGITS=[True], BLOCK_V=[64],
                                BLOCK_R=[64], BLOCK_C=[64]))],
    _topk_kernel: (dict(base_ptr="*bf16", cand_ptr="*i64", V="i32", TOP="i32", BLOCK_V="constexpr"),
                   dict(BLOCK_V=[1024])),
    # the full proposal, a position at a time: the sweep (bf16 W2 with W1's rows, v split into hi + lo, an fp32 W2;
    # an fp8 W2's bytes), the merge, the gate / rnn head, the confidence head
    _sweep_kernel: [(dict(base_ptr="*bf16", tokens_ptr="*i64", anchor_ptr="*i64", w1_ptr="*bf16", scratch_ptr="*fp32",
                          w2_ptr=f"*{w2}", w2s_ptr="*fp32", temp_ptr="*fp32", key_ptr="*i64", seed="i64",
                          offset="i64", KEY_IN_MEMORY="constexpr", logits_ptr="*fp32", part_ptr="*fp32",
                          ids_ptr="*i32", k="i32", N="i32", K="i32", V="i32", VT="i32", R="i32", V_W1="constexpr",
                          W2_FP8="constexpr", HAS_SCALE="constexpr", HAS_TEMP="constexpr",
                          RETURN_LOGITS="constexpr", DOT="constexpr", F32="constexpr", BLOCK_N="constexpr",
                          BLOCK_V="constexpr", BLOCK_R="constexpr"),
                     dict(KEY_IN_MEMORY=[True], V_W1=[v_w1], W2_FP8=[fp8], HAS_SCALE=[fp8], HAS_TEMP=[True],
                          RETURN_LOGITS=[False, True], DOT=[dot], F32=[False], BLOCK_N=[block_n],
                          BLOCK_V=[tile // block_n], BLOCK_R=[64]))
                    for w2, v_w1, fp8, dot, tile in (("bf16", True, False, 2, 4096), ("bf16", False, False, 1, 4096),
                                                     ("fp32", True, False, 0, 2048), ("u8", False, True, 1, 4096))
                    for block_n in (32, 64)],  # the launcher's BLOCK_N x BLOCK_V on a GPU (and 16 x 128)
    _merge_kernel: (dict(part_ptr="*fp32", ids_ptr="*i32", d2t_ptr="*i64", tokens_ptr="*i64", logprob_ptr="*fp32",
                         k="i32", K="i32", blocks="i32", none="i32", HAS_MAP="constexpr", BLOCK_B="constexpr"),
                    dict(HAS_MAP=[False, True], BLOCK_B=[1024])),
    _head_kernel: (dict(tokens_ptr="*i64", anchor_ptr="*i64", w1_ptr="*bf16", wg_ptr="*bf16", bg_ptr="*bf16",
                        wj_ptr="*bf16", bj_ptr="*bf16", hidden_ptr="*bf16", scratch_ptr="*fp32", k="i32", K="i32",
                        VT="i32", R="i32", D="i32", HEAD="constexpr", BLOCK_R="constexpr", BLOCK_C="constexpr"),
                   dict(HEAD=[1, 2], BLOCK_R=[64], BLOCK_C=[64])),
    _conf_kernel: (dict(tokens_ptr="*i64", anchor_ptr="*i64", w1_ptr="*bf16", hidden_ptr="*bf16", cw_ptr="*fp32",
                        cb_ptr="*fp32", sts_ptr="*fp32", conf_ptr="*fp32", surv_ptr="*fp32", K="i32", VT="i32",
                        R="i32", D="i32", HAS_STS="constexpr", BLOCK_C="constexpr"),
                   dict(HAS_STS=[True], BLOCK_C=[128])),
    _accept_prefix_scan_kernel: (
        dict(tokens_ptr="*i64", seq_ptr="*i32", nacc_ptr="*i32", mask_ptr="*u8", vcu_ptr="*i32", table_ptr="*i32",
             maxlen_ptr="*i64", stops_ptr="*i64", cu_ptr="*i32", out_ptr="*i64", newseq_ptr="*i32",
             anchor_ptr="*i64", rows_ptr="*i32", slots_ptr="*i64", fin_ptr="*u8", N="i32", K="i32",
             max_blocks="i32", block_size="i32", n_stops="i32", HAS_NUM_ACCEPTED="constexpr",
             HAS_VERIFY_CU="constexpr", HAS_TABLE="constexpr", HAS_MAX_LEN="constexpr", BLOCK_N="constexpr",
             BLOCK_K="constexpr", BLOCK_T="constexpr"),
        dict(HAS_NUM_ACCEPTED=[False, True], HAS_VERIFY_CU=[True], HAS_TABLE=[True], HAS_MAX_LEN=[True],
             BLOCK_N=[128], BLOCK_K=[8], BLOCK_T=[1024]),
    ),
    _schedule_verify_lens_kernel: (
        dict(surv_ptr="*fp32", budget_ptr="*fp16", active_ptr="*i1", counts_ptr="*fp32", times_ptr="*fp32", lens_ptr="*i32",
             cu_ptr="*i32", theta_ptr="*fp32", N="i32", K="i32", NB="i32", KB="i32", P="i32", min_len="i32",
             max_len="i32", overhead_bits="i64", gain_bits="i64", EXACT="constexpr", HAS_BUDGET="constexpr",
             BLOCK="constexpr", SHIFT="constexpr", BLOCK_B="constexpr", SHIFT_B="constexpr", BLOCK_R="constexpr",
             BLOCK_K="constexpr", BLOCK_KB="constexpr", HAS_ACTIVE="constexpr"),
        dict(EXACT=[True, False], HAS_BUDGET=[True], BLOCK=[256], SHIFT=[54], BLOCK_B=[64], SHIFT_B=[56],
             BLOCK_R=[256], BLOCK_K=[16], BLOCK_KB=[8], HAS_ACTIVE=[False, True]),
    ),
    # the vocabulary-parallel pieces (dspark_kernels/distributed): a shard's draft step, verify statistics and
    # residual pass, and the per-request decision over every shard's statistics
    _draft_step_kernel: (
        dict(u_ptr="*bf16", stride_un="i32", v_ptr="*fp32", w2_ptr="*bf16", temp_ptr="*fp32", key_ptr="*i64",
             seed="i64", offset="i64", KEY_IN_MEMORY="constexpr", part_ptr="*fp32", logits_ptr="*fp32", local="i32",
             rank="i32", position="i32", vocab_start="i32", HAS_TEMP="constexpr", RETURN_LOGITS="constexpr",
             BLOCK_V="constexpr", BLOCK_R="constexpr", NONE="constexpr"),
        dict(KEY_IN_MEMORY=[True], HAS_TEMP=[False, True], RETURN_LOGITS=[False, True],
             BLOCK_V=[triton_draft._BLOCK_V], BLOCK_R=[triton_draft._BLOCK_R], NONE=[triton_draft._NONE]),
    ),
    _stats_kernel: (
        dict(t_ptr="*bf16", stride_t="i32", t_row_ptr="*i64", d_ptr="*fp32", stride_d="i32", at_ptr="*i32",
             temp_ptr="*fp32", out_ptr="*fp32", local="i32", k_len="i32", vocab_start="i32", width="i32",
             SAMPLED="constexpr", HAS_DRAFT="constexpr", BLOCK_V="constexpr"),
        dict(SAMPLED=[False, True], HAS_DRAFT=[False, True], BLOCK_V=[triton_stats._BLOCK_V]),
    ),
    _residual_kernel: (
        dict(t_ptr="*bf16", t_row_ptr="*i64", d_ptr="*fp32", d_row_ptr="*i64", dtok_ptr="*i64", plan_ptr="*fp32",
             temp_ptr="*fp32", key_ptr="*i64", seed="i64", offset="i64", KEY_IN_MEMORY="constexpr", part_ptr="*fp32",
             local="i32", vocab_start="i32", HAS_DRAFT="constexpr", BLOCK_V="constexpr", NONE="constexpr"),
        dict(KEY_IN_MEMORY=[True], HAS_DRAFT=[False, True], BLOCK_V=[triton_verify._BLOCK_V],
             NONE=[triton_verify._NONE]),
    ),
    _decide_kernel: [(
        dict(stats_ptr="*fp32", shards_ptr="*i64", res_ptr="*fp32", cu_ptr="*i32", drafts_ptr="*i64", lp_ptr="*fp32",
             vlens_ptr="*i32", surv_ptr="*fp32", thr_ptr="*fp32", temp_ptr="*fp32", key_ptr="*i64", seed="i64",
             offset="i64", KEY_IN_MEMORY="constexpr", stops_ptr="*i64", tokens_ptr="*i64", num_ptr="*i32",
             mask_ptr="*u8", plan_ptr="*fp32", n_req="i32", k_len="i32", P="i32", F="i32", num_rows="i32",
             n_stops="i32", vocab_size="i32", res_slots="i32", SAMPLED="constexpr", BLOCK_METHOD="constexpr",
             HAS_DRAFT="constexpr", HAS_LOGPROBS="constexpr", HAS_RES="constexpr", PACKED="constexpr",
             HAS_VLENS="constexpr", HAS_SURV="constexpr", BLOCK_K="constexpr", EPS="constexpr"),
        dict(KEY_IN_MEMORY=[True], SAMPLED=[sampled], BLOCK_METHOD=block, HAS_DRAFT=draft, HAS_LOGPROBS=logprobs,
             HAS_RES=[sampled], PACKED=packed, HAS_VLENS=[True], HAS_SURV=[True], BLOCK_K=[8],
             EPS=[triton_decide.RESIDUAL_EPS]))
        for sampled, block, draft, logprobs, packed in ((False, [False], [False], [False], [False, True]),
                                                        (True, [False, True], [False, True], [False], [True]),
                                                        (True, [False, True], [False], [True], [False]))],
}
NUM_WARPS = {_draft_block_kernel: 8, _sweep_kernel: 8, _merge_kernel: 8, _head_kernel: 8, _conf_kernel: 8}
# Integer arguments compiled as multiples of 16 (as Triton specialises a launch whose sizes are: vocabularies, hidden
# sizes and ranks of real models are); every pointer is compiled as 16-byte aligned (torch's allocations are).
DIVISIBLE_BY_16 = {_draft_block_kernel: ("V", "R", "D"), _sweep_kernel: ("V", "R"), _rows_kernel: ("V",),
                   _mass_kernel: ("V",), _sample_kernel: ("V",)}
# sm_90 (the H100 / H200 the benchmarks run on) for every kernel. The errors the interpreter misses come from
# Triton's front end and the lowering every architecture shares, so sm_80 adds a compile only where the lowering
# differs: tl.dot (mma.sync on sm_80, wgmma on sm_90), in the sweep alone (the fp8 decode is integer arithmetic).
ARCHS = {_sweep_kernel: (80, 90)}
DEFAULT_ARCHS = (90,)


def ptxas_usage(log: str) -> Optional[str]:
    """Registers and spill bytes from a ptxas -v log, or None when the log has no usage line."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None:
        return None
    return f"{regs.group(1)} regs, {spill.group(1) if spill else '?'} B spill stores"


def rerun_ptxas(ptx: str, arch: int) -> str:
    """ptxas -v run again on a kernel's PTX (a compile the Triton cache answered ran no ptxas to log)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        res = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={sm}", path, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    return res.stderr


def compile_with_ptxas_log(src: ASTSource, arch: int, num_warps: int):
    """``triton.compile`` with the log of its own ptxas run (``-v``: registers and spills of the cubin it made, with
    the options it passes), captured from what ``knobs.nvidia.dump_ptxas_log`` (triton >= 3.6) prints; "" when it ran
    no ptxas (a Triton cache hit)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), triton.knobs.nvidia.scope():
        triton.knobs.nvidia.dump_ptxas_log = True
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps))
    return compiled, out.getvalue()


def main() -> int:
    failures = 0
    variants = [(kernel, v) for kernel, vs in KERNELS.items() for v in (vs if isinstance(vs, list) else [vs])]
    for kernel, (signature, grid) in variants:
        for values in itertools.product(*grid.values()):
            consts = dict(zip(grid, values))
            for arch in ARCHS.get(kernel, DEFAULT_ARCHS):
                t0 = time.time()
                try:
                    aligned = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(signature.items())
                               if ty.startswith("*") or name in DIVISIBLE_BY_16.get(kernel, ())}
                    compiled, log = compile_with_ptxas_log(ASTSource(kernel, signature, consts, aligned), arch,
                                                           NUM_WARPS.get(kernel, 4))
                    usage = ptxas_usage(log) or ptxas_usage(rerun_ptxas(compiled.asm["ptx"], arch)) or "? regs"
                    status = "ok, " + usage
                except Exception as e:  # report every failure, then fail
                    failures += 1
                    status = f"FAILED: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                print(f"{kernel.fn.__name__} sm_{arch} {consts}: {status} ({time.time() - t0:.1f} s)", flush=True)
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
