"""Chi-square goodness of fit with the project's pass rule (shared by the sampling tests)."""

from __future__ import annotations

import math

import torch


def chi_square(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom, after merging bins with expected count < 5.

    Bins whose expectation is below 5 are pooled into one bin; if the pool itself is below 5 it joins the
    smallest remaining bin. ``observed`` and ``expected`` are float ``[B]`` with equal sums.
    """
    observed, expected = observed.double(), expected.double()
    assert abs(observed.sum().item() - expected.sum().item()) < 1e-6 * max(1.0, expected.sum().item())
    small = expected < 5
    obs = observed[~small].tolist()
    exp = expected[~small].tolist()
    pool_o, pool_e = observed[small].sum().item(), expected[small].sum().item()
    if pool_e > 0 or pool_o > 0:
        if pool_e >= 5 or not exp:
            obs.append(pool_o)
            exp.append(pool_e)
        else:
            i = min(range(len(exp)), key=exp.__getitem__)
            obs[i] += pool_o
            exp[i] += pool_e
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    if any(e == 0 and o > 0 for o, e in zip(obs, exp)):
        stat = math.inf  # an outcome the null says is impossible
    return stat, len(exp) - 1


def passes(observed: torch.Tensor, expected: torch.Tensor) -> bool:
    """The pass rule: chi2 < df + 10 sqrt(2 df) (a ~7-sigma bound, so failures mean a real bias)."""
    stat, df = chi_square(observed, expected)
    return stat < df + 10 * math.sqrt(2 * max(df, 1))


def counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.flatten().long(), minlength=vocab).double()
