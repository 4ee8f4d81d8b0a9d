"""Reference rng_uniform: the generator of ``dspark_kernels.rng`` evaluated on a dense grid."""

import torch

from ..rng import uniform_rows


def rng_uniform(out: torch.Tensor, rng_key: torch.Tensor, stream: int) -> None:
    """Fill ``out`` (float32 ``[N, K, V]``) with ``uniform(seed, offset, request=n, position=k, stream, token=v)``."""
    n, k, v = out.shape
    if out.numel() == 0:
        return
    request = torch.arange(n, device=out.device).view(n, 1)
    position = torch.arange(k, device=out.device).view(1, k)
    out.copy_(uniform_rows(rng_key, request, position, stream, v))
