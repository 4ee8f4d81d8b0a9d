"""Chi-square goodness of fit with the project's pass rule (shared by the sampling tests)."""

from __future__ import annotations

import torch

from dspark_kernels.decode.testing import chi_square, passes  # noqa: F401  (they live in the package now)


def counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.flatten().long(), minlength=vocab).double()
