#!/usr/bin/env python
"""Compile every Triton kernel for sm_80 and sm_90 without a GPU (CI runs this; the interpreter misses errors the
real compiler catches, such as non-constexpr globals or type mismatches between branches).

    python tools/check_triton.py
"""

from __future__ import annotations

import itertools
import sys
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dspark_kernels.triton.draft_block import _draft_block_kernel
from dspark_kernels.triton.rng_uniform import _rng_uniform_kernel
from dspark_kernels.triton.verify_chain import _verify_chain_kernel

# kernel -> (signature, {constexpr name: values to try})
KERNELS = {
    _rng_uniform_kernel: (
        dict(out_ptr="*fp32", rng_key_ptr="*i64", K="i32", V="i32", quads_per_row="i32", stream="i32",
             BLOCK_Q="constexpr"),
        dict(BLOCK_Q=[256]),
    ),
    _verify_chain_kernel: (
        dict(target_ptr="*bf16", cu_ptr="*i32", drafts_ptr="*i64", draft_logits_ptr="*fp32", verify_lens_ptr="*i32",
             survival_ptr="*fp32", thresholds_ptr="*fp32", temp_ptr="*fp32", rng_key_ptr="*i64", stops_ptr="*i64",
             tokens_ptr="*i64", num_acc_ptr="*i32", mask_ptr="*u8", total_rows="i32", K="i32", V="i32",
             n_stops="i32", PACKED="constexpr", HAS_DRAFT_LOGITS="constexpr", HAS_VERIFY_LENS="constexpr",
             HAS_THRESHOLDS="constexpr", BLOCK_METHOD="constexpr", BLOCK_V="constexpr", BLOCK_K="constexpr"),
        dict(PACKED=[False, True], HAS_DRAFT_LOGITS=[False, True], HAS_VERIFY_LENS=[True], HAS_THRESHOLDS=[True],
             BLOCK_METHOD=[False, True], BLOCK_V=[1024], BLOCK_K=[8]),
    ),
    _draft_block_kernel: (
        dict(base_ptr="*bf16", anchor_ptr="*i64", w1_ptr="*bf16", w2_ptr="*bf16", wg_ptr="*bf16", bg_ptr="*bf16",
             wj_ptr="*bf16", bj_ptr="*bf16", hidden_ptr="*bf16", cw_ptr="*fp32", cb_ptr="*fp32", sts_ptr="*fp32",
             temp_ptr="*fp32", rng_key_ptr="*i64", scratch_ptr="*fp32", tokens_ptr="*i64", logits_ptr="*fp32",
             conf_ptr="*fp32", surv_ptr="*fp32", K="i32", V="i32", R="i32", D="i32",
             HEAD="constexpr", HAS_CONF="constexpr", HAS_STS="constexpr", RETURN_LOGITS="constexpr",
             BLOCK_V="constexpr", BLOCK_R="constexpr", BLOCK_C="constexpr"),
        dict(HEAD=[0, 1, 2], HAS_CONF=[True], HAS_STS=[True], RETURN_LOGITS=[False, True], BLOCK_V=[128],
             BLOCK_R=[64], BLOCK_C=[128]),
    ),
}
ARCHS = (80, 90)


def main() -> int:
    failures = 0
    for kernel, (signature, grid) in KERNELS.items():
        for values in itertools.product(*grid.values()):
            consts = dict(zip(grid, values))
            for arch in ARCHS:
                t0 = time.time()
                try:
                    triton.compile(ASTSource(kernel, signature, consts), target=GPUTarget("cuda", arch, 32))
                    status = "ok"
                except Exception as e:  # report every failure, then fail
                    failures += 1
                    status = f"FAILED: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                print(f"{kernel.fn.__name__} sm_{arch} {consts}: {status} ({time.time() - t0:.1f} s)", flush=True)
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
