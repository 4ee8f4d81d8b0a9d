"""``dk.schedule_verify_lens``: the confidence scheduler (the DSpark paper's Algorithm 1, and a production form)."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from .. import reference
from ..calibration import CostTable, survival_from_conf
from ._common import FLOAT_DTYPES, check_tensor, requested_backend, resolve_backend
from ._registry import CpuKernel, CudaKernel, TritonKernel, define_op

MODES = ("exact", "argmax")


class ScheduleOutput(NamedTuple):
    """Result of :func:`schedule_verify_lens` for N requests.

    Attributes:
        verify_lens: int32 ``[N]``, drafts to verify per request (``min_len <= L_r <= max_len``; 0 where not
            ``active``).
        cu_seqlens: int32 ``[N+1]``, exclusive prefix sum of each request's rows in the packed verify batch
            (``[anchor, d_1..d_L]``: ``1 + verify_lens``; none where not ``active``).
        theta: float32 ``[]``, predicted expected accepted tokens per second of this schedule.
    """

    verify_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    theta: torch.Tensor


def _fake(survival, conf_logits, sts_temperatures, token_counts, step_time_ms, fixed_overhead_ms, min_len, max_len,
          mode, budget_survival, min_gain, active):
    x = survival if survival is not None else conf_logits
    n = x.shape[0]
    new = x.new_empty
    return new((n,), dtype=torch.int32), new((n + 1,), dtype=torch.int32), new((), dtype=torch.float32)


def _on_survival(kernel):
    """``kernel`` on the reference's own float32 survival (bit-identical on the same device: the CUDA kernel's
    in-kernel conf_logits path, which the C ABI uses, may differ from torch's sigmoid in the last bit)."""
    def run(survival, conf_logits, sts_temperatures, token_counts, step_time_ms, fixed_overhead_ms, min_len, max_len,
            mode, budget_survival, min_gain, active):
        if survival is None:
            survival = survival_from_conf(conf_logits, sts_temperatures)
        return kernel(survival, None, None, token_counts, step_time_ms, fixed_overhead_ms, min_len, max_len, mode,
                      None if mode == "exact" else budget_survival, min_gain, active)
    return run


def _check_args(survival, conf_logits, sts_temperatures, token_counts, step_time_ms, fixed_overhead_ms, min_len,
                max_len, mode, budget_survival, min_gain, active):
    if (survival is None) == (conf_logits is None):
        raise ValueError("exactly one of survival and conf_logits must be given")
    x_name, x = ("survival", survival) if survival is not None else ("conf_logits", conf_logits)
    check_tensor(x_name, x, ndim=2, dtypes=FLOAT_DTYPES)
    k, dev = x.shape[1], x.device
    if sts_temperatures is not None and conf_logits is None:
        raise ValueError("sts_temperatures is only used with conf_logits (survival is already calibrated)")
    check_tensor("sts_temperatures", sts_temperatures, shape=(k,), dtypes=FLOAT_DTYPES, device=dev, optional=True)
    for name, t in (("token_counts", token_counts), ("step_time_ms", step_time_ms)):
        check_tensor(name, t, ndim=1, dtypes=(torch.float32,), device=dev)
        if t.shape[0] < 1 or t.shape != token_counts.shape:
            raise ValueError(f"{name} must have shape [P], P >= 1, as token_counts, got {tuple(t.shape)}")
    if not (isinstance(fixed_overhead_ms, float) and math.isfinite(fixed_overhead_ms) and fixed_overhead_ms >= 0):
        raise ValueError(f"fixed_overhead_ms must be a finite float >= 0, got {fixed_overhead_ms!r}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for name, v in (("min_len", min_len), ("max_len", max_len)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{name} must be an int, got {v!r}")
    if not 0 <= min_len <= max_len <= k:
        raise ValueError(f"need 0 <= min_len <= max_len <= K={k}, got min_len={min_len}, max_len={max_len}")
    check_tensor("budget_survival", budget_survival, ndim=2, dtypes=FLOAT_DTYPES, device=dev, optional=True)
    check_tensor("active", active, shape=(x.shape[0],), dtypes=(torch.bool,), device=dev, optional=True)
    if not (isinstance(min_gain, float) and math.isfinite(min_gain) and min_gain >= 0.0):
        raise ValueError(f"min_gain must be finite and >= 0, got {min_gain}")
    if mode == "exact" and (budget_survival is not None or min_gain != 0.0):
        raise ValueError("budget_survival and min_gain apply to mode='argmax' only")


SCHEDULE_VERIFY_LENS = define_op(
    "schedule_verify_lens",
    "(Tensor? survival, Tensor? conf_logits, Tensor? sts_temperatures, Tensor token_counts, Tensor step_time_ms, "
    "float fixed_overhead_ms, int min_len, int max_len, str mode, Tensor? budget_survival, float min_gain, "
    "Tensor? active) "
    "-> (Tensor, Tensor, Tensor)",
    _fake,
    {"reference": reference.schedule_verify_lens,
     "cpu": _on_survival(CpuKernel("schedule_verify_lens", reference.schedule_verify_lens)),
     "triton": TritonKernel("schedule_verify_lens", "schedule_verify_lens"),
     "cuda": _on_survival(CudaKernel("schedule_verify_lens"))},
    _check_args,
)


def schedule_verify_lens(survival: Optional[torch.Tensor] = None, *, conf_logits: Optional[torch.Tensor] = None,
                         sts_temperatures: Optional[torch.Tensor] = None, cost_table: CostTable,
                         min_len: int = 0, max_len: Optional[int] = None, mode: str = "exact",
                         budget_survival: Optional[torch.Tensor] = None, min_gain: float = 0.0,
                         active: Optional[torch.Tensor] = None, backend: Optional[str] = "auto") -> ScheduleOutput:
    """Choose each request's verify length ``L_r`` to maximise ``Theta = tau * SPS(B)``. Never synchronises.

    ``B = sum_r (1 + L_r)`` target tokens, ``tau = sum_r (1 + sum_{j<=L_r} a'[r, j])`` expected tokens, with
    ``a'`` the survival made non-increasing along K (running minimum), clamped to [0, 1], NaN -> 0. Requests
    start at ``L_r = min_len``; candidates (r, j), ``min_len < j <= max_len``, are admitted in descending
    ``a'`` (ties by r, then j).

    * ``mode="exact"``: the paper's Algorithm 1, admit while each admission strictly raises Theta (early stop).
    * ``mode="argmax"``: admit the first ``argmax_m Theta_m`` candidates. ``budget_survival`` (an earlier step's
      survival, any ``[N', K']``) sets that count instead (found by the same argmax with ``max_len`` clamped to
      K'), applied to this step's order. Then, unless the schedule's Theta is at least ``(1 + min_gain)`` times
      the Theta of verifying everything (``L_r = max_len``), verify everything.

    ``active`` (bool ``[N]``) leaves requests out: an inactive request (finished, or a padding row of a fixed-size
    batch) gets ``L_r = 0`` and no rows in ``cu_seqlens`` (not even its anchor), and counts in neither B nor tau;
    "everything" is every active request at ``max_len``. ``budget_survival`` describes its own batch and is
    counted whole.

    Args:
        survival: float ``[N, K]`` (fp32/bf16/fp16), ``a[r, j-1]`` = P(first j drafts accepted); or
        conf_logits: float ``[N, K]`` confidence logits, with survival ``= dk.survival_from_conf(conf_logits,
            sts_temperatures)``. Exactly one of the two.
        sts_temperatures: float ``[K]`` STS temperatures (only with ``conf_logits``; default 1).
        cost_table: :class:`dk.CostTable`, the target's step time vs tokens (its device tensors are cached).
        min_len, max_len: ints, ``0 <= min_len <= max_len <= K`` (``max_len`` defaults to K).
        mode: "exact" or "argmax".
        budget_survival: float ``[N', K']`` (argmax mode only).
        min_gain: float >= 0 (argmax mode only).
        active: bool ``[N]`` on the survival's device, or None (every request active).
        backend: "auto" | "cpu" | "cuda" | "triton" | "reference". "auto" on CPU tensors: the CPU kernel where it
            builds (equal to the reference bit for bit), else the reference. "auto" on a GPU: CUDA where the
            extension builds (any N*K), else Triton up to its one-program size (N*K <= 16384), else the reference.

    Returns:
        :class:`ScheduleOutput`: ``verify_lens`` int32 ``[N]``, ``cu_seqlens`` int32 ``[N+1]``,
        ``theta`` float32 ``[]`` (predicted Theta of the returned schedule).
    """
    x = survival if survival is not None else conf_logits
    if isinstance(x, torch.Tensor) and x.dim() == 2 and max_len is None:
        max_len = x.shape[1]
    if not isinstance(cost_table, CostTable):
        raise TypeError(f"cost_table must be a dk.CostTable, got {type(cost_table).__name__}")
    try:
        min_gain = float(min_gain)
    except (TypeError, ValueError):
        raise ValueError(f"min_gain must be a number, got {min_gain!r}") from None
    dev = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
    token_counts, step_time_ms = cost_table.tensors(dev)
    fixed_overhead_ms = float(cost_table.fixed_overhead_ms)
    _check_args(survival, conf_logits, sts_temperatures, token_counts, step_time_ms, fixed_overhead_ms, min_len,
                max_len, mode, budget_survival, min_gain, active)
    chosen = resolve_backend(backend, dev, SCHEDULE_VERIFY_LENS.name)
    if chosen == "triton" and requested_backend(backend) == "auto":
        # "auto" never picks a backend that cannot take the batch: the Triton twin sorts in one program (N*K <=
        # MAX_ELEMENTS); the CUDA kernel (picked first where the extension exists) and the reference have no cap
        from ..triton.schedule_verify_lens import MAX_ELEMENTS
        if x.numel() > MAX_ELEMENTS or (budget_survival is not None and budget_survival.numel() > MAX_ELEMENTS):
            chosen = "reference"
    verify_lens, cu_seqlens, theta = SCHEDULE_VERIFY_LENS(
        survival, conf_logits, sts_temperatures, token_counts, step_time_ms, fixed_overhead_ms, min_len, max_len,
        mode, budget_survival, min_gain, active, backend=chosen)
    return ScheduleOutput(verify_lens, cu_seqlens, theta)
