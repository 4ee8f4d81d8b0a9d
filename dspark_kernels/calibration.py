"""Calibration tools: cost tables (target steps per second vs batch tokens) and sequential temperature scaling.

* :class:`CostTable` - the target model's measured step time as a function of the number of tokens B in a
  forward pass; ``sps(B) = 1000 / (time_ms(B) + fixed_overhead_ms)`` is the SPS(B) of the scheduler's objective
  ``Theta = tau * SPS(B)``.
* :func:`survival_from_conf` - ``a_k = prod_{i<=k} sigmoid(z_i / T_i)`` (what ``dk.schedule_verify_lens`` does
  with ``conf_logits``).
* :func:`fit_sts` - fits the per-position temperatures ``T_1..T_K`` from logged confidences and accepted lengths.
* :func:`expected_calibration_error` - the equal-width-bin ECE used by :func:`fit_sts`.

:func:`fit_sts` and :func:`expected_calibration_error` are host-side tools (they may synchronise); the rest never
synchronise and are what the ops use. This module imports nothing else from the package, so the references can
import it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import operator
import os
from typing import Dict, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "CostTable", "interp_step_time_ms", "sps_from_table", "survival_from_conf", "fit_sts",
    "expected_calibration_error",
]


# ----------------------------------------------------------------------------------------------------------------
# Cost table
# ----------------------------------------------------------------------------------------------------------------

def interp_step_time_ms(tokens: torch.Tensor, token_counts: torch.Tensor, step_time_ms: torch.Tensor) -> torch.Tensor:
    """Step time (ms) at ``tokens`` by piecewise-linear interpolation of a cost table. Never synchronises.

    Args:
        tokens: float tensor of any shape, the batch sizes B (in tokens) to evaluate.
        token_counts: float ``[P]``, P >= 1, strictly ascending.
        step_time_ms: float ``[P]``, positive.

    Returns:
        ``tokens``' shape, dtype of ``tokens``: ``step_time_ms[0]`` for B <= token_counts[0]; linear between
        neighbouring points; above the last point, linear extrapolation along the last segment, with the slope
        clamped at >= 0 (a table whose last segment falls would otherwise predict times <= 0 for large B).
        A single point gives a constant.
    """
    c = token_counts.to(tokens.dtype)
    t = step_time_ms.to(tokens.dtype)
    p = c.shape[0]
    if p == 1:
        return t[0].expand(tokens.shape).clone()
    # segment i covers [c[i], c[i+1]]; below c[0] -> segment 0 (then clamped), above c[-1] -> last segment
    seg = (torch.searchsorted(c, tokens.contiguous(), right=True) - 1).clamp(0, p - 2)
    c0, c1, t0, t1 = c[seg], c[seg + 1], t[seg], t[seg + 1]
    slope = (t1 - t0) / (c1 - c0)
    x = torch.maximum(tokens, c[0])  # clamped below the first point
    inside = t0 + (x - c0) * slope
    above = t[-1] + (x - c[-1]) * slope.clamp(min=0.0)  # seg is the last segment there
    return torch.where(x > c[-1], above, inside)


def sps_from_table(tokens: torch.Tensor, token_counts: torch.Tensor, step_time_ms: torch.Tensor,
                   fixed_overhead_ms: float) -> torch.Tensor:
    """Steps per second ``1000 / (interp_step_time_ms(tokens) + fixed_overhead_ms)``; shape and dtype of ``tokens``."""
    return 1000.0 / (interp_step_time_ms(tokens, token_counts, step_time_ms) + fixed_overhead_ms)


@dataclasses.dataclass(frozen=True)
class CostTable:
    """The target model's step time against the number of tokens in its forward pass.

    Attributes:
        token_counts: strictly ascending token counts B (ints >= 0), at least one point.
        step_time_ms: measured step time in milliseconds at each count (positive, finite).
        fixed_overhead_ms: per-step time added to every step (sampling, scheduling, ...), >= 0.

    ``time_ms(B)`` interpolates linearly between points, is constant below the first point, and extrapolates
    the last segment above the last point (slope clamped at >= 0); ``sps(B) = 1000 / (time_ms(B) +
    fixed_overhead_ms)``. The JSON form uses TensorRT-LLM's field names: ``{"token_counts": [...],
    "step_time_ms": [...], "fixed_overhead_ms": x}``. Device copies of the table are cached per device, so the
    scheduler does no host-to-device copy per call.
    """

    token_counts: Tuple[int, ...]
    step_time_ms: Tuple[float, ...]
    fixed_overhead_ms: float = 0.0
    _cache: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self):
        counts = _as_number_list("token_counts", self.token_counts)
        times = _as_number_list("step_time_ms", self.step_time_ms)
        if len(counts) == 0:
            raise ValueError("token_counts must have at least one point")
        if len(counts) != len(times):
            raise ValueError(f"token_counts and step_time_ms must have the same length, got {len(counts)} and "
                             f"{len(times)}")
        if any(not math.isfinite(c) or float(c) != int(c) or c < 0 for c in counts):
            raise ValueError(f"token_counts must be non-negative integers, got {counts}")
        counts = [int(c) for c in counts]
        if any(b <= a for a, b in zip(counts, counts[1:])):
            raise ValueError(f"token_counts must be strictly ascending, got {counts}")
        times = [float(t) for t in times]
        if any(not (math.isfinite(t) and t > 0.0) for t in times):
            raise ValueError(f"step_time_ms must be positive and finite, got {times}")
        if isinstance(self.fixed_overhead_ms, bool) or not isinstance(self.fixed_overhead_ms, numbers.Real):
            raise ValueError(f"fixed_overhead_ms must be a number, got {self.fixed_overhead_ms!r}")
        overhead = float(self.fixed_overhead_ms)
        if not (math.isfinite(overhead) and overhead >= 0.0):
            raise ValueError(f"fixed_overhead_ms must be finite and >= 0, got {overhead}")
        object.__setattr__(self, "token_counts", tuple(counts))
        object.__setattr__(self, "step_time_ms", tuple(times))
        object.__setattr__(self, "fixed_overhead_ms", overhead)

    # -- evaluation ------------------------------------------------------------------------------------------
    def tensors(self, device: Union[str, torch.device, None] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """(token_counts float32 ``[P]``, step_time_ms float32 ``[P]``) on ``device``, created once per device."""
        device = torch.device("cpu" if device is None else device)
        key = str(device)
        hit = self._cache.get(key)
        if hit is None:
            hit = (torch.tensor(self.token_counts, dtype=torch.float32, device=device),
                   torch.tensor(self.step_time_ms, dtype=torch.float32, device=device))
            self._cache[key] = hit
        return hit

    def time_ms(self, tokens):
        """Interpolated step time (without ``fixed_overhead_ms``): a float for a number, float64 for a tensor."""
        return self._eval(tokens, lambda b, c, t: interp_step_time_ms(b, c, t))

    def sps(self, tokens):
        """Steps per second at ``tokens``; a float for a number, a float64 tensor for a tensor (on its device)."""
        return self._eval(tokens, lambda b, c, t: sps_from_table(b, c, t, self.fixed_overhead_ms))

    def _eval(self, tokens, fn):
        if isinstance(tokens, torch.Tensor):
            c, t = self.tensors(tokens.device)
            return fn(tokens.to(torch.float64), c, t)
        c, t = self.tensors("cpu")
        return float(fn(torch.tensor(float(tokens), dtype=torch.float64), c, t))

    # -- serialisation ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"token_counts": list(self.token_counts), "step_time_ms": list(self.step_time_ms),
                "fixed_overhead_ms": self.fixed_overhead_ms}

    @classmethod
    def from_dict(cls, d: dict) -> "CostTable":
        if not isinstance(d, dict):
            raise ValueError(f"a cost table must be a JSON object, got {type(d).__name__}")
        for name in ("token_counts", "step_time_ms"):
            if name not in d:
                raise ValueError(f"cost table is missing the field {name!r}")
        unknown = set(d) - {"token_counts", "step_time_ms", "fixed_overhead_ms"}
        if unknown:
            raise ValueError(f"cost table has unknown fields {sorted(unknown)}")
        return cls(d["token_counts"], d["step_time_ms"], d.get("fixed_overhead_ms", 0.0))

    def to_json(self, path: Union[str, os.PathLike]) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    @classmethod
    def from_json(cls, path: Union[str, os.PathLike]) -> "CostTable":
        with open(path) as f:
            return cls.from_dict(json.load(f))


def _as_number_list(name: str, xs) -> list:
    """``xs`` (a sequence or tensor of real numbers) as a list; a string, a bool or anything else is refused."""
    if isinstance(xs, torch.Tensor):
        if xs.dtype == torch.bool or xs.is_complex():
            raise ValueError(f"{name} must contain real numbers, got a {xs.dtype} tensor")
        xs = xs.detach().cpu().flatten().tolist()
    if isinstance(xs, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of numbers, got {type(xs).__name__}")
    try:
        xs = list(xs)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of numbers, got {type(xs).__name__}") from None
    for x in xs:
        if isinstance(x, bool) or not isinstance(x, numbers.Real):
            raise ValueError(f"{name} must contain numbers, got {x!r}")
    return xs


# ----------------------------------------------------------------------------------------------------------------
# Sequential temperature scaling
# ----------------------------------------------------------------------------------------------------------------

def survival_from_conf(conf_logits: torch.Tensor, sts_temperatures: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Survival ``a[:, k] = prod_{i<=k} sigmoid(conf_logits[:, i] / T_i)``. Never synchronises.

    Args:
        conf_logits: float ``[N, K]`` confidence logits ``z``.
        sts_temperatures: float ``[K]`` per-position temperatures (default all 1). Non-positive or NaN
            temperatures are not checked (that would need a sync); they give NaN or 0/1 confidences.

    Returns:
        float32 ``[N, K]``, non-increasing along K.
    """
    z = conf_logits.to(torch.float32)
    if sts_temperatures is not None:
        z = z / sts_temperatures.to(device=z.device, dtype=torch.float32)
    return torch.cumprod(torch.sigmoid(z), dim=-1)


def expected_calibration_error(pred, label, n_bins: int = 15) -> float:
    """Expected calibration error with ``n_bins`` equal-width bins on [0, 1] (host-side; synchronises).

    Args:
        pred: float ``[M]`` predicted probabilities (clamped to [0, 1]; NaN counts as 0).
        label: ``[M]`` outcomes (bool, or numbers in [0, 1]).
        n_bins: number of bins (>= 1); bin b holds ``b/n_bins <= pred < (b+1)/n_bins``, the last bin includes 1.

    Returns:
        ``sum_b (count_b / M) * |mean(pred in b) - mean(label in b)|`` as a Python float; 0.0 when M == 0.
    """
    pred = torch.as_tensor(pred).detach().flatten().to(torch.float64)
    label = torch.as_tensor(label).detach().flatten().to(device=pred.device, dtype=torch.float64)
    if pred.shape != label.shape:
        raise ValueError(f"pred and label must have the same number of elements, got {pred.numel()} and "
                         f"{label.numel()}")
    try:
        n_bins = operator.index(n_bins)
    except TypeError:
        raise ValueError(f"n_bins must be an int >= 1, got {n_bins!r}") from None
    if n_bins < 1:
        raise ValueError(f"n_bins must be an int >= 1, got {n_bins}")
    m = pred.numel()
    if m == 0:
        return 0.0
    pred = torch.nan_to_num(pred, nan=0.0).clamp(0.0, 1.0)
    bins = (pred * n_bins).floor().long().clamp(0, n_bins - 1)
    count = torch.zeros(n_bins, dtype=torch.float64, device=pred.device).index_add_(0, bins, torch.ones_like(pred))
    sum_pred = torch.zeros_like(count).index_add_(0, bins, pred)
    sum_label = torch.zeros_like(count).index_add_(0, bins, label)
    # count_b/M * |sum_pred_b/count_b - sum_label_b/count_b| = |sum_pred_b - sum_label_b| / M
    return float((sum_pred - sum_label).abs().sum() / m)


def default_sts_grid() -> torch.Tensor:
    """float64 ``[62]``: ``logspace(-1.5, 1.5, 61)`` (0.03 .. 31.6) plus 1.0, ascending, without duplicates."""
    grid = torch.cat([torch.logspace(-1.5, 1.5, 61, dtype=torch.float64), torch.ones(1, dtype=torch.float64)])
    return torch.unique(grid)


def fit_sts(conf_logits: torch.Tensor, accepted_lens: torch.Tensor, *, verify_lens: Optional[torch.Tensor] = None,
            grid: Optional[Union[torch.Tensor, Sequence[float]]] = None, n_bins: int = 15) -> torch.Tensor:
    """Fit sequential temperature scaling ``T_1..T_K`` from logged steps (host-side; synchronises).

    Position k (1-based) is fitted after ``T_1..T_{k-1}``: among the rows that verified at least k drafts
    (all rows when ``verify_lens`` is None), the label is ``accepted_lens >= k`` and the prediction is the
    cumulative survival ``prod_{i<=k} sigmoid(z_i / T_i)``; ``T_k`` is the grid value with the smallest
    :func:`expected_calibration_error`, ties (within 1e-12) going to the value closest to 1.0. A position with
    no eligible rows gets ``T_k = 1``.

    Args:
        conf_logits: float ``[M, K]`` confidence logits of the drafts.
        accepted_lens: int ``[M]`` number of drafts accepted in each row.
        verify_lens: int ``[M]`` number of drafts verified in each row (optional).
        grid: candidate temperatures (positive); default ``logspace(-1.5, 1.5, 61)`` plus 1.0.
        n_bins: ECE bins.

    Returns:
        float32 ``[K]`` temperatures, on ``conf_logits``' device.
    """
    if not isinstance(conf_logits, torch.Tensor) or conf_logits.dim() != 2 or not conf_logits.is_floating_point():
        raise ValueError(f"conf_logits must be a float tensor [M, K], got "
                         f"{tuple(conf_logits.shape) if isinstance(conf_logits, torch.Tensor) else type(conf_logits)}")
    m, k_total = conf_logits.shape
    device = conf_logits.device
    if not isinstance(accepted_lens, torch.Tensor) or accepted_lens.shape != (m,):
        raise ValueError(f"accepted_lens must be a tensor [{m}], got "
                         f"{getattr(accepted_lens, 'shape', type(accepted_lens))}")
    if verify_lens is not None and (not isinstance(verify_lens, torch.Tensor) or verify_lens.shape != (m,)):
        raise ValueError(f"verify_lens must be a tensor [{m}], got "
                         f"{tuple(verify_lens.shape) if isinstance(verify_lens, torch.Tensor) else type(verify_lens)}")
    grid = default_sts_grid() if grid is None else torch.as_tensor(grid, dtype=torch.float64).flatten()
    if grid.numel() == 0 or not bool(torch.all(torch.isfinite(grid) & (grid > 0))):
        raise ValueError("grid must be a non-empty list of positive, finite temperatures")
    grid = grid.cpu()

    z = conf_logits.detach().to(device="cpu", dtype=torch.float64)
    acc = accepted_lens.detach().cpu().long()
    ver = None if verify_lens is None else verify_lens.detach().cpu().long()
    temps = torch.ones(k_total, dtype=torch.float64)
    prefix = torch.ones(m, dtype=torch.float64)  # prod_{i<k} sigmoid(z_i / T_i) with the fitted T's
    closeness = (grid - 1.0).abs()
    for k in range(k_total):
        rows = torch.ones(m, dtype=torch.bool) if ver is None else ver >= k + 1
        label = (acc >= k + 1)[rows]
        if label.numel() > 0:
            eces = torch.tensor([expected_calibration_error(prefix[rows] * torch.sigmoid(z[rows, k] / t), label,
                                                            n_bins) for t in grid.tolist()], dtype=torch.float64)
            best = eces.min()
            tied = eces <= best + 1e-12
            temps[k] = grid[torch.where(tied, closeness, torch.full_like(closeness, math.inf)).argmin()]
        prefix = prefix * torch.sigmoid(z[:, k] / temps[k])
    return temps.to(device=device, dtype=torch.float32)
