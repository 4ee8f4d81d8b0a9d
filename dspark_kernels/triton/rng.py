"""The package's generator (``dspark_kernels.rng``, the spec) as ``@triton.jit`` helpers for the Triton kernels.

Philox4x32-10 with key = (seed_lo, seed_hi ^ offset_hi), counter = (token >> 2, position | stream << 24,
request, offset_lo); the draw of ``token`` is word ``token & 3``; ``u = ((x >> 8) | 1) * 2**-24``.
The rounds are written out here (same arithmetic as ``tl.philox``'s 32-bit path, which keys by one 64-bit seed
(lo, hi) and would need the key packed as ``seed ^ (offset_hi << 32)``), so the key and counter layout stay visible.
"""

import triton
import triton.language as tl

PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
STREAM_DRAFT = tl.constexpr(0)
STREAM_ACCEPT = tl.constexpr(1)
STREAM_RESIDUAL = tl.constexpr(2)
STREAM_USER = tl.constexpr(16)


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 blocks (counters c0..c3, key k0, k1); returns the four output words."""
    for _ in tl.static_range(10):
        _c0 = c0
        _c2 = c2
        c0 = tl.umulhi(_c2, PHILOX_M1) ^ c1 ^ k0
        c2 = tl.umulhi(_c0, PHILOX_M0) ^ c3 ^ k1
        c1 = tl.mul(_c2, PHILOX_M1, sanitize_overflow=False)
        c3 = tl.mul(_c0, PHILOX_M0, sanitize_overflow=False)
        k0 = tl.add(k0, PHILOX_W0, sanitize_overflow=False)
        k1 = tl.add(k1, PHILOX_W1, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def _u32(x):
    """The low 32 bits of an integer (Python int, int32/int64/uint32 scalar or tensor) as uint32."""
    return tl.cast(x, tl.int64).to(tl.uint32)   # tl.cast takes Python ints too (no tl.to_tensor in triton 3.6)


@triton.jit
def make_key(seed, offset):
    """(k0, k1, offset_lo) as uint32 from 64-bit seed and offset (ints, scalars or tensors)."""
    seed = tl.cast(seed, tl.int64)
    offset = tl.cast(offset, tl.int64)
    k0 = seed.to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32) ^ (offset >> 32).to(tl.uint32)
    offset_lo = offset.to(tl.uint32)
    return k0, k1, offset_lo


@triton.jit
def load_key(rng_key_ptr):
    """(k0, k1, offset_lo) as uint32 scalars from the device int64 [2] (seed, offset)."""
    return make_key(tl.load(rng_key_ptr), tl.load(rng_key_ptr + 1))


@triton.jit
def random_block(k0, k1, offset_lo, request, position, stream, quad):
    """The four uint32 words of counter block ``quad`` (tokens 4*quad .. 4*quad+3); integer args broadcast."""
    c0 = _u32(quad)
    c1 = _u32(position) | (_u32(stream) << 24)
    c2 = _u32(request)
    zero = tl.zeros_like(c0) + tl.zeros_like(c1) + tl.zeros_like(c2)  # the broadcast shape of the cell
    return philox4x32_10(c0 + zero, c1 + zero, c2 + zero, offset_lo + zero, k0 + zero, k1 + zero)


@triton.jit
def bits_to_uniform(x):
    """uint32 -> float32 in (0, 1): ((x >> 8) | 1) * 2**-24 (exact)."""
    return ((x >> 8) | 1).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def random_bits(k0, k1, offset_lo, request, position, stream, token):
    """The uint32 draw of each (request, position, stream, token) cell (one Philox per cell)."""
    w0, w1, w2, w3 = random_block(k0, k1, offset_lo, request, position, stream, token >> 2)
    lane = token & 3
    out = tl.where(lane == 0, w0, w1)
    out = tl.where(lane == 2, w2, out)
    return tl.where(lane == 3, w3, out)


@triton.jit
def uniform(k0, k1, offset_lo, request, position, stream, token):
    """float32 uniforms in (0, 1) of each (request, position, stream, token) cell."""
    return bits_to_uniform(random_bits(k0, k1, offset_lo, request, position, stream, token))


@triton.jit
def gumbel_score(scaled_logit, u):
    """Gumbel-max score ``l - log(-log(u))`` with NaN mapped to -inf (argmax: ties to the lowest index)."""
    s = scaled_logit - tl.log(-tl.log(u))
    return tl.where(s != s, float("-inf"), s)


@triton.jit
def race_score(weight, u):
    """Exponential-race score ``w / -log(u)`` with NaN mapped to -inf."""
    s = weight / -tl.log(u)
    return tl.where(s != s, float("-inf"), s)


@triton.jit
def argmax_update(best, best_i, score, cols):
    """One chunk of a running per-lane argmax (strictly greater wins, so earlier columns keep ties)."""
    better = score > best
    return tl.where(better, score, best), tl.where(better, cols, best_i)


@triton.jit
def argmax_finish(best, best_i, none):
    """The argmax over the lanes of a running argmax: the lowest column among the maxima (``none`` bounds them)."""
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, best_i, none), axis=0)
