"""Triton rng_uniform: out[n, k, v] = uniform(seed, offset, request=n, position=k, stream, token=v)."""

import torch
import triton
import triton.language as tl

from .rng import bits_to_uniform, key_args, load_key, random_block

_BLOCK_Q = 256  # counter blocks (4 tokens each) per program
_MAX_ROW_PROGRAMS = 2 ** 31 - 1  # a grid's first dimension: more rows loop


@triton.jit(do_not_specialize=["seed", "offset"])
def _rng_uniform_kernel(out_ptr, rng_key_ptr, seed, offset, KEY_IN_MEMORY: tl.constexpr, K, V, rows, quads_per_row, stream, BLOCK_Q: tl.constexpr):
    k0, k1, offset_lo = load_key(rng_key_ptr, seed, offset, KEY_IN_MEMORY)
    for r in range(tl.program_id(0), rows, tl.num_programs(0)):
        row = tl.zeros([], tl.int64) + r  # row = n * K + k, in 64 bits
        n = row // K
        k = row - n * K
        base = out_ptr + row * V
        for qb in range(tl.program_id(1), tl.cdiv(quads_per_row, BLOCK_Q), tl.num_programs(1)):
            quad = (tl.zeros([BLOCK_Q], tl.int64) + qb) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # 64-bit
            w0, w1, w2, w3 = random_block(k0, k1, offset_lo, n, k, stream, quad)
            # [BLOCK_Q, 2, 2] with [q, j, i] = word 2*j + i of block q: token 4*q + 2*j + i.
            u = tl.join(tl.join(bits_to_uniform(w0), bits_to_uniform(w2)),
                        tl.join(bits_to_uniform(w1), bits_to_uniform(w3)))
            j = tl.arange(0, 2)[None, :, None]
            i = tl.arange(0, 2)[None, None, :]
            token = quad[:, None, None] * 4 + j * 2 + i
            tl.store(base + token, u, mask=token < V)


def rng_uniform(out: torch.Tensor, rng_key: torch.Tensor, stream: int) -> None:
    """Fill the contiguous float32 ``out [N, K, V]`` (arguments checked by ``dk.rng_uniform``)."""
    n, k, v = out.shape
    if out.numel() == 0:
        return
    quads = triton.cdiv(v, 4)
    grid = (min(n * k, _MAX_ROW_PROGRAMS), min(triton.cdiv(quads, _BLOCK_Q), 65535))
    _rng_uniform_kernel[grid](out, *key_args(rng_key, out.device), k, v, n * k, quads, stream, BLOCK_Q=_BLOCK_Q)
