"""Triton kernels of dspark_kernels (GPU, or CPU tensors under ``TRITON_INTERPRET=1``).

Each op has one module here with the same flat arguments as its reference (``dspark_kernels.reference``);
``rng`` holds the generator as ``@triton.jit`` helpers shared by the kernels.
"""

from .rng_uniform import rng_uniform

__all__ = ["rng_uniform"]
