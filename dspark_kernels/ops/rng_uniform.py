"""``dk.rng_uniform``: the package's random numbers, for engines that want the same noise as the kernels."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from .. import reference
from ..rng import make_rng_key
from ._common import check_rng_key, check_tensor, resolve_backend
from ._registry import CpuKernel, CudaKernel, TritonKernel, define_op


def _fake(out, rng_key, stream):
    return None


def _check_args(out, rng_key, stream):
    check_tensor("out", out, ndim=3, dtypes=(torch.float32,))
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if not (isinstance(stream, int) and 0 <= stream < 256):
        raise ValueError(f"stream must be an int in [0, 256), got {stream!r}")
    n, k_len, vocab = out.shape  # the counter's words: request 32 bits, position 24, token 34
    if n > 2 ** 32:
        raise ValueError(f"requests must be <= 2**32, got N={n}")
    if k_len >= 2 ** 24:
        raise ValueError(f"positions must be < 2**24, got K={k_len}")
    if vocab > 2 ** 34:
        raise ValueError(f"tokens must be <= 2**34, got V={vocab}")
    check_rng_key(rng_key, out.device)


RNG_UNIFORM = define_op(
    "rng_uniform_",
    "(Tensor(a!) out, Tensor rng_key, int stream) -> ()",
    _fake,
    {"reference": reference.rng_uniform, "cpu": CpuKernel("rng_uniform_", reference.rng_uniform),
     "triton": TritonKernel("rng_uniform", "rng_uniform"),
     "cuda": CudaKernel("rng_uniform_")},
    _check_args,
)


def rng_uniform(shape_or_out: Union[Sequence[int], torch.Tensor], seed=0, offset=0, stream: int = 0, *,
                device: Optional[Union[str, torch.device]] = None, backend: Optional[str] = "auto") -> torch.Tensor:
    """Uniforms in (0, 1) from the package's counter-based generator (see ``dspark_kernels.rng``).

    Args:
        shape_or_out: ``(N, K, V)``, or a float32 tensor ``[N, K, V]`` to fill in place (contiguous).
        seed, offset: Python ints or one-element int32/int64 tensors (device tensors allowed: no sync).
        stream: 0 <= stream < 256; streams 0-15 are the ones the ops use (``rng.STREAM_*``).
        device: where to allocate when a shape is given (default: the CPU).
        backend: "auto" | "cpu" | "cuda" | "triton" | "reference" ("auto": CUDA or Triton on a GPU, the CPU
            kernel on CPU tensors where it builds, else the reference).

    Returns:
        float32 ``[N, K, V]``: ``out[n, k, v] = uniform(seed, offset, request=n, position=k, stream, token=v)``,
        bit-identical on every backend.
    """
    if isinstance(shape_or_out, torch.Tensor):
        out = shape_or_out
    else:
        shape = tuple(int(s) for s in shape_or_out)
        if len(shape) != 3 or min(shape, default=0) < 0:
            raise ValueError(f"shape_or_out must be (N, K, V) with non-negative sizes, got {shape}")
        out = torch.empty(shape, dtype=torch.float32, device=device)
    check_tensor("out", out, ndim=3)  # a tensor, whose device the key is made for
    rng_key = make_rng_key(seed, offset, out.device)
    _check_args(out, rng_key, stream)
    RNG_UNIFORM(out, rng_key, stream, backend=resolve_backend(backend, out.device, RNG_UNIFORM.name))
    return out
