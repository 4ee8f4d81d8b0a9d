"""The counter-based random generator every backend shares.

One generator serves every random draw in the package: Philox4x32-10 (Salmon et al., 2011, the generator of
cuRAND, JAX and Triton's ``tl.philox``), keyed and counted as follows.

* key     = (seed_lo, seed_hi ^ offset_hi)          -- 2 x 32 bits
* counter = (token >> 2, position | stream << 24, request, offset_lo)
* the draw for ``token`` is output word ``token & 3`` of that counter's block, so the four tokens that share a
  counter (a float4 of logits in a kernel) cost one Philox evaluation.
* the 32-bit word ``x`` becomes ``u = ((x >> 8) | 1) * 2**-24``, a float32 in the open interval (0, 1): exact in
  float32 in every language, never 0 (so ``-log(u)`` is finite) and never 1 (so ``-log(-log(u))`` is too).

Ranges: position < 2**24, stream < 2**8, request < 2**32, token < 2**34; seed and offset are 64-bit.

Categorical sampling is the exponential race: ``argmax_v w_v / E_v`` with ``E_v = -log(u_v)`` draws ``v`` with
probability ``w_v / sum(w)`` for any non-negative weights, so no normalisation or prefix sum is needed. For logits
it is written in the log domain, ``argmax_v (l_v / T - log(E_v))`` (the Gumbel-max trick). Ties go to the lowest
index and NaN scores count as -inf.

The same algorithm is written in ``csrc/include/dspark/rng.cuh`` (CUDA and host C++) and in
``dspark_kernels/triton/rng.py``; ``python_tests/data/rng_vectors.json`` holds the vectors all must reproduce.
"""

from __future__ import annotations

import torch

__all__ = [
    "STREAM_DRAFT", "STREAM_ACCEPT", "STREAM_RESIDUAL", "STREAM_USER",
    "philox4x32", "random_bits", "uniform", "uniform_rows", "argmax_nan_low", "exponential_race", "gumbel_argmax",
    "make_rng_key",
]

# Streams separate independent uses of the same (request, position, token) cell.
STREAM_DRAFT = 0     # draft_block: sampling a draft token
STREAM_ACCEPT = 1    # verify_chain: the accept/reject uniform of a position (token 0)
STREAM_RESIDUAL = 2  # verify_chain: the correction or bonus sample
STREAM_USER = 16     # first stream free for callers of rng_uniform

_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF


def _mulhilo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product of uint32 values held in int64 tensors, without overflow."""
    x = (a >> 16) * b          # < 2**48
    y = (a & 0xFFFF) * b       # < 2**48
    hi = (x + (y >> 16)) >> 16
    lo = (((x & 0xFFFF) << 16) + y) & _MASK32
    return hi, lo


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = 10):
    """Philox4x32 on int64 tensors holding uint32 values (broadcasting); returns the four output words."""
    c0, c1, c2, c3, k0, k1 = (torch.as_tensor(t, dtype=torch.int64) & _MASK32 for t in (c0, c1, c2, c3, k0, k1))
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def random_bits(rng_key: torch.Tensor, request, position, stream, token) -> torch.Tensor:
    """The uint32 draw (in an int64 tensor) of each broadcast (request, position, stream, token) cell.

    ``rng_key`` is an int64 tensor ``[2]`` holding (seed, offset) (:func:`make_rng_key`); the other arguments are
    int64 tensors or ints, and the draws are computed on the device of the first tensor among them.
    """
    seed, offset = _key_parts(rng_key)
    dev = _cells_device(rng_key, request, position, stream, token)
    request, position, stream, token = (torch.as_tensor(t, dtype=torch.int64, device=dev)
                                        for t in (request, position, stream, token))
    k0 = seed & _MASK32
    k1 = ((seed >> 32) ^ (offset >> 32)) & _MASK32
    words = philox4x32(token >> 2, position | (stream << 24), request, offset & _MASK32, k0, k1)
    lane = token & 3
    out = torch.where(lane == 0, words[0], words[1])
    out = torch.where(lane == 2, words[2], out)
    return torch.where(lane == 3, words[3], out)


def uniform(rng_key: torch.Tensor, request, position, stream, token) -> torch.Tensor:
    """float32 uniforms in (0, 1) for each broadcast cell: ``((x >> 8) | 1) * 2**-24``."""
    bits = random_bits(rng_key, request, position, stream, token)
    return ((bits >> 8) | 1).to(torch.float32) * (2.0 ** -24)


def uniform_rows(rng_key: torch.Tensor, request: torch.Tensor, position, stream: int, vocab: int) -> torch.Tensor:
    """float32 ``[*request.shape, vocab]``: the uniforms of tokens ``0..vocab-1`` for each request (and position).

    Same values as ``uniform`` on a token grid, computed with one Philox evaluation per four tokens.
    """
    seed, offset = _key_parts(rng_key)
    dev = _cells_device(rng_key, request, position)
    request = torch.as_tensor(request, dtype=torch.int64, device=dev)
    position = torch.as_tensor(position, dtype=torch.int64, device=dev)
    block = torch.arange((vocab + 3) // 4, dtype=torch.int64, device=dev)
    words = philox4x32(block, (position | (stream << 24)).unsqueeze(-1), request.unsqueeze(-1), offset & _MASK32,
                       seed & _MASK32, ((seed >> 32) ^ (offset >> 32)) & _MASK32)
    bits = torch.stack(torch.broadcast_tensors(*words), dim=-1).flatten(-2)[..., :vocab]
    return ((bits >> 8) | 1).to(torch.float32) * (2.0 ** -24)


def argmax_nan_low(scores: torch.Tensor) -> torch.Tensor:
    """int64 argmax over the last dim: NaN counts as -inf (infinities stay), ties go to the lowest index."""
    return torch.where(torch.isnan(scores), float("-inf"), scores).argmax(dim=-1)


def exponential_race(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample index ``v`` with probability ``weights_v / sum(weights)``: ``argmax_v weights_v / -log(u_v)``."""
    return argmax_nan_low(weights / -torch.log(u))


def gumbel_argmax(scaled_logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample from ``softmax(scaled_logits)``: ``argmax_v scaled_logits_v - log(-log(u_v))``."""
    return argmax_nan_low(scaled_logits - torch.log(-torch.log(u)))


def make_rng_key(seed, offset, device) -> torch.Tensor:
    """int64 ``[2]`` (seed, offset) for a kernel on ``device``, built without a launch or a synchronisation.

    ``seed`` and ``offset`` are Python ints or int64 / int32 tensors with one element. Two ints give a CPU tensor:
    no launch builds it, and the kernels take its values by value. A tensor (on any device; a CUDA-graph replay can
    bump an offset tensor in place) gives a key on ``device`` that the kernels read there: ``torch.cat`` of the two
    (an int is written with ``torch.full``), a launch or two and no copy to the host. Two int64 tensors on
    ``device`` that are consecutive elements of one array (``key[0:1]`` and ``key[1:2]`` of an int64 ``[2]`` key,
    as a CUDA-graph step keeps it) give that ``[2]`` view itself: no launch at all.
    """
    if _adjacent_on(seed, offset, device):
        return seed.as_strided((2,), (1,))
    ints = []
    for name, value in (("seed", seed), ("offset", offset)):
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"{name} must be an int or a one-element int32/int64 tensor, got "
                                 f"{tuple(value.shape)} {value.dtype}")
            ints.append(None)
        elif isinstance(value, int) and not isinstance(value, bool):
            if not -(2 ** 63) <= value < 2 ** 64:
                raise ValueError(f"{name} must fit in 64 bits, got {value}")
            ints.append(value - 2 ** 64 if value >= 2 ** 63 else value)
        else:
            raise TypeError(f"{name} must be an int or a tensor, got {type(value).__name__}")
    if None not in ints:
        return torch.tensor(ints, dtype=torch.int64)
    parts = [torch.full((1,), i, dtype=torch.int64, device=device) if i is not None
             else v.reshape(1).to(device=device, dtype=torch.int64, non_blocking=True)
             for i, v in zip(ints, (seed, offset))]
    return torch.cat(parts)


def _adjacent_on(seed, offset, device) -> bool:
    """Whether seed and offset are one-element int64 tensors on ``device``, offset the element right after seed
    (never while torch.compile traces: it has no storage addresses, and the concatenation is its own)."""
    if not (isinstance(seed, torch.Tensor) and isinstance(offset, torch.Tensor)) or torch.compiler.is_compiling():
        return False
    if seed.numel() != 1 or offset.numel() != 1 or seed.dtype != torch.int64 or offset.dtype != torch.int64:
        return False
    dev = torch.device(device)
    if seed.device.type != dev.type or (dev.index is not None and seed.device != dev) or offset.device != seed.device:
        return False
    same = seed.untyped_storage().data_ptr() == offset.untyped_storage().data_ptr()
    return same and offset.data_ptr() == seed.data_ptr() + 8


def _key_parts(rng_key: torch.Tensor):
    """(seed, offset) of a key: Python ints for a CPU key (no copy), else int64 scalars on its device."""
    if rng_key.device.type == "cpu":
        seed, offset = rng_key.tolist()
        return seed, offset
    return rng_key[0].to(torch.int64), rng_key[1].to(torch.int64)


def _cells_device(rng_key: torch.Tensor, *args) -> torch.device:
    """Where the draws are computed: the device of the first tensor argument, else the key's."""
    return next((a.device for a in args if isinstance(a, torch.Tensor)), rng_key.device)
