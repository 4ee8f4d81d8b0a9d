"""The package's generator (``dspark_kernels.rng``, the spec) as ``@triton.jit`` helpers for the Triton kernels.

Philox4x32-10 with key = (seed_lo, seed_hi ^ offset_hi), counter = (token >> 2, position | stream << 24,
request, offset_lo); the draw of ``token`` is word ``token & 3``; ``u = ((x >> 8) | 1) * 2**-24``.
The rounds are written out here (same arithmetic as ``tl.philox``'s 32-bit path, which keys by one 64-bit seed
(lo, hi) and would need the key packed as ``seed ^ (offset_hi << 32)``), so the key and counter layout stay visible.
"""

import torch
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
def load_key(key_ptr, seed, offset, KEY_IN_MEMORY: tl.constexpr):
    """(k0, k1, offset_lo) as uint32 scalars: from the int64 [2] (seed, offset) at ``key_ptr`` where
    ``KEY_IN_MEMORY``, else from ``seed`` and ``offset`` (the four arguments :func:`key_args` gives)."""
    if KEY_IN_MEMORY:
        seed = tl.load(key_ptr)
        offset = tl.load(key_ptr + 1)
    return make_key(seed, offset)


def key_args(rng_key, device) -> tuple:
    """A kernel's four key arguments ``(key_ptr, seed, offset, KEY_IN_MEMORY)`` for ``rng_key`` int64 [2]: a key on
    the kernel's device is read by the kernel (a CUDA graph replays with what it holds then); a CPU key beside
    device tensors is passed by value (read here: CPU memory, no synchronisation)."""
    if rng_key.device == torch.device(device):
        return rng_key, 0, 0, True
    seed, offset = rng_key.tolist()
    return _placeholder(device), seed, offset, False


_PLACEHOLDERS: dict = {}


def _placeholder(device):
    """A one-element device tensor for ``key_ptr`` where the kernel reads the key from its scalars (never loaded)."""
    key = torch.device(device)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(2, dtype=torch.int64, device=key)
    return _PLACEHOLDERS[key]


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
