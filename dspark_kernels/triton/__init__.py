"""Triton kernels of dspark_kernels (GPU, or CPU tensors under ``TRITON_INTERPRET=1``).

Each op has one module here with the same flat arguments as its reference (``dspark_kernels.reference``);
``rng`` holds the generator as ``@triton.jit`` helpers shared by the kernels; ``_compat`` keeps them working on
the oldest supported Triton (3.6).
"""

from ._compat import patch_interpreter

patch_interpreter()

from .rng_uniform import rng_uniform  # noqa: E402

__all__ = ["rng_uniform"]
