"""Triton kernels that expose a ``@triton.jit`` helper of the package to a test (kept out of the test modules, whose
source pytest rewrites: the Triton interpreter re-reads a kernel's source)."""

import triton
import triton.language as tl

from dspark_kernels.triton.draft_block import _e4m3_to_f32


@triton.jit
def decode_e4m3(src, dst):
    """dst[i] = the float32 value of the 256 float8 e4m3 codes in src (uint8)."""
    o = tl.arange(0, 256)
    tl.store(dst + o, _e4m3_to_f32(tl.load(src + o).to(tl.int32)))
