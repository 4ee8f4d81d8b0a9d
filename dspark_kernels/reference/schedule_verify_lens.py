"""Reference confidence scheduler: choose each request's verify length L_r to maximise Theta = tau * SPS(B).

Objective (DSpark): verifying ``L_r`` drafts of request r costs ``1 + L_r`` target tokens and is expected to yield
``1 + sum_{j<=L_r} a[r, j]`` tokens, where ``a[r, j]`` (the survival) estimates P(the first j drafts are all
accepted). For the whole batch, ``B = sum_r (1 + L_r)``, ``tau = sum_r (1 + sum_{j<=L_r} a[r, j])`` and the
expected accepted tokens per second are ``Theta = tau * SPS(B)`` (SPS from a cost table).

Admission order: the survival is made non-increasing along j (running minimum, so admissions are
prefix-consistent), clamped to [0, 1] with NaN -> 0; every request starts at ``L_r = min_len`` and the
candidates (r, j), ``min_len < j <= max_len``, are admitted in descending survival (ties: by r, then j; a stable
sort of the flattened ``[N, K]`` order). Admitting the first m candidates gives ``B_m = B_0 + m``,
``tau_m = tau_0 + (sum of their survivals)`` and ``Theta_m``.

Inactive requests (``active[r]`` false: finished, or padding of a fixed-size batch) are not scheduled: they verify
nothing (``L_r = 0`` and no rows, not even the anchor), count in neither B nor tau and hold no candidate; only the
active requests are "everything" in the fall-back below.

* "exact" (the paper's Algorithm 1): admit while each admission strictly raises Theta; stop at the first that
  does not. The early stop is what keeps the schedule independent of the drafted tokens' later confidences
  (lossless).
* "argmax" (production): admit the first ``m* = argmax_m Theta_m`` (first maximum). With ``budget_survival``
  (an earlier step's survival), ``m*`` is found on it and then applied to this step's order (clamped to the
  number of candidates). If the result's Theta is below ``(1 + min_gain)`` times the Theta of verifying
  everything (``L_r = max_len``), verify everything instead.

Sums are taken in float64 so the strict comparisons are stable.
"""

from typing import Optional, Tuple

import torch

from ..calibration import sps_from_table, survival_from_conf


def clean_survival(survival: torch.Tensor) -> torch.Tensor:
    """float64 ``[N, K]``: NaN -> 0, clamped to [0, 1], then the running minimum along K."""
    a = torch.nan_to_num(survival.to(torch.float64), nan=0.0).clamp(0.0, 1.0)
    if a.shape[1] > 0:
        a = torch.cummin(a, dim=1).values
    return a


def admission_curve(a: torch.Tensor, min_len: int, max_len: int, token_counts: torch.Tensor,
                    step_time_ms: torch.Tensor, fixed_overhead_ms: float, active: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The admission order and the Theta after each number of admissions.

    Args:
        a: float64 ``[N, K]`` cleaned survival (see :func:`clean_survival`), ``0 <= min_len <= max_len <= K``.
        active: bool ``[N]`` or None (every request active).

    Returns:
        order: int64 ``[N * W]``, ``W = max_len - min_len``: candidate indices into the flattened ``[N, W]``
            candidate grid (request r, draft ``j = min_len + 1 + c``), best first; the first M are the active
            requests' candidates.
        theta: float64 ``[N * W + 1]``, ``theta[m]`` = Theta after admitting the first m candidates (m <= M;
            -inf beyond).
        m: int64 ``[]``, ``M = (active requests) * W``.
    """
    n, w = a.shape[0], max_len - min_len
    act = torch.ones(n, dtype=torch.bool, device=a.device) if active is None else active
    a = torch.where(act.view(-1, 1), a, 0.0)
    cand = torch.where(act.view(-1, 1), a[:, min_len:max_len], -1.0).reshape(-1)  # (r, j) r-major; inactive last
    sorted_a, order = torch.sort(cand, descending=True, stable=True)
    n_act = act.sum().to(torch.float64)
    b0 = n_act * (1 + min_len)
    tau0 = n_act + a[:, :min_len].sum()
    m = act.sum() * w
    steps = torch.arange(n * w + 1, device=a.device)
    tau = tau0 + torch.cat([torch.zeros(1, dtype=torch.float64, device=a.device), torch.cumsum(sorted_a, dim=0)])
    theta = tau * sps_from_table(b0 + steps.to(torch.float64), token_counts, step_time_ms, fixed_overhead_ms)
    return order, torch.where(steps <= m, theta, float("-inf")), m


def _at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for a 0-d index tensor, as a 0-d tensor, without the host sync of ``x[tensor]``."""
    return x.index_select(0, index.reshape(1)).reshape(())


def schedule_verify_lens(survival: Optional[torch.Tensor], conf_logits: Optional[torch.Tensor],
                         sts_temperatures: Optional[torch.Tensor], token_counts: torch.Tensor,
                         step_time_ms: torch.Tensor, fixed_overhead_ms: float, min_len: int, max_len: int, mode: str,
                         budget_survival: Optional[torch.Tensor], min_gain: float,
                         active: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Choose verify lengths (the flat arguments of ``torch.ops.dspark.schedule_verify_lens``).

    Args:
        survival: float ``[N, K]`` or None; else ``survival_from_conf(conf_logits, sts_temperatures)``.
        conf_logits: float ``[N, K]`` or None; sts_temperatures: float ``[K]`` or None.
        token_counts, step_time_ms: float32 ``[P]`` cost table; fixed_overhead_ms: float.
        min_len, max_len: ``0 <= min_len <= max_len <= K``.
        mode: "exact" or "argmax".
        budget_survival: float ``[N', K']`` or None (argmax only).
        min_gain: float >= 0 (argmax only).
        active: bool ``[N]`` or None (every request active).

    Returns:
        verify_lens: int32 ``[N]``, ``min_len + admitted drafts of r`` (0 where inactive).
        cu_seqlens: int32 ``[N+1]``, exclusive prefix sum of the rows, ``1 + verify_lens`` (0 where inactive).
        theta: float32 ``[]``, predicted Theta of the returned schedule.
    """
    if survival is None:
        survival = survival_from_conf(conf_logits, sts_temperatures)
    n = survival.shape[0]
    dev = survival.device
    a = clean_survival(survival)
    order, theta, m_total = admission_curve(a, min_len, max_len, token_counts, step_time_ms, fixed_overhead_ms,
                                            active)

    if mode == "exact":
        # number of leading admissions that each strictly raise Theta
        improves = theta[1:] > theta[:-1]
        m_star = torch.cumprod(improves.to(torch.int64), dim=0).sum()
    else:
        if budget_survival is None:
            m_star = torch.argmax(theta)  # first maximum
        else:
            ab = clean_survival(budget_survival)
            budget_max = min(max_len, ab.shape[1])
            _, theta_b, _ = admission_curve(ab, min(min_len, budget_max), budget_max, token_counts, step_time_ms,
                                            fixed_overhead_ms)
            m_star = torch.minimum(torch.argmax(theta_b), m_total)
        # fall back to verifying everything unless the schedule beats it by min_gain
        m_star = torch.where(_at(theta, m_star) < (1.0 + min_gain) * _at(theta, m_total), m_total, m_star)

    # rank[c] = position of candidate c in the admission order; the first m_star are admitted
    rank = torch.empty(order.shape[0], dtype=torch.int64, device=dev)
    rank[order] = torch.arange(order.shape[0], device=dev)
    admitted = (rank < m_star).view(n, max_len - min_len)
    per_request = admitted.sum(dim=1)
    act = torch.ones(n, dtype=torch.bool, device=dev) if active is None else active
    verify_lens = torch.where(act, min_len + per_request, 0)
    cu_seqlens = torch.zeros(n + 1, dtype=torch.int64, device=dev)
    cu_seqlens[1:] = torch.cumsum(torch.where(act, 1 + verify_lens, 0), dim=0)
    return verify_lens.to(torch.int32), cu_seqlens.to(torch.int32), _at(theta, m_star).to(torch.float32)
