"""Whether a decode step drafts: drafting's measured gain over the target alone (``Scheduler.draft_cost``).

A drafting step costs the target's forward over its verify rows plus one drafting pass; a plain step costs the
target over one row per request. The gate prices each drafting step with the two cost tables, T (the target's)
and D (the drafting pass's, by request count): in its time ``T(rows) + D(N)`` the target alone would have committed
``N (T(rows) + D(N)) / T(N)`` tokens for its N running requests. Drafting's gain over a window of drafting steps
is the tokens they really committed over that sum. The committed tokens, not the confidence head's forecast,
decide: on SmolLM2 at batch 8 the forecast saw a 5% gain where the loop lost 20%. The loop's one host read per step
already carries the tokens generated so far, so the read of step s tells the tokens of step s - 1 (a one-step
lag); the gate needs no synchronisation of its own.

The window is the latest drafting steps holding at least ``window`` request-steps (the default 32: 32 steps at
batch 1, where a step commits 1 to K + 1 tokens and single steps say little, 4 at batch 8). When its gain is below
``1 + margin``, the next ``plain_steps`` steps run the target alone; then drafting starts again with an empty
window (a probe) and is judged once the window is full again. Each probe that loses again doubles the plain run (up
to 8 ``plain_steps``), so a batch where drafting never pays spends few steps on probes; a window that wins resets
it. ``margin`` covers what the tables leave out (the verify pass's ops over the extra rows).
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Tuple

from ..calibration import CostTable


class DraftGate:
    """Per ``generate`` call: ``drafts_next()`` before each step, ``observe(...)`` at its host read."""

    def __init__(self, cost_table: CostTable, draft_cost: CostTable, plain_steps: int, window: int, margin: float):
        self.cost_table, self.draft_cost = cost_table, draft_cost
        self.plain_steps, self.window, self.threshold = int(plain_steps), int(window), 1.0 + float(margin)
        self.plain_left = 0                  # steps still to run without drafting
        self.plain_run = self.plain_steps    # the next plain run's length (doubles while probes lose)
        self.steps: deque = deque()          # the window: (tokens, plain-equivalent tokens, requests) per step
        self._last: Optional[Tuple[int, int, int]] = None  # the last step, if it drafted: generated, rows, N

    def drafts_next(self) -> bool:
        return self.plain_left == 0

    def observe(self, generated: int, drafted: bool, rows: int, active: int) -> None:
        """The step just read: ``generated`` tokens before it (all requests), whether it ``drafted``, its verify
        ``rows`` and ``active`` requests."""
        if self._last is not None and self.plain_left == 0:
            g0, rows0, n0 = self._last
            self.steps.append((generated - g0, self.plain_equivalent(rows0, n0), n0))
            while sum(s[2] for s in self.steps) - self.steps[0][2] >= self.window:
                self.steps.popleft()
            if sum(s[2] for s in self.steps) >= self.window:
                if self.gain() >= self.threshold:
                    self.plain_run = self.plain_steps
                else:
                    self.plain_left = self.plain_run
                    self.plain_run = min(2 * self.plain_run, 8 * self.plain_steps)
                    self.steps.clear()
        if not drafted and self.plain_left > 0:
            self.plain_left -= 1
        self._last = (generated, rows, active) if drafted and self.plain_left == 0 else None

    def gain(self) -> float:
        """Tokens the window's drafting steps committed over what the target alone would have in their time."""
        return sum(s[0] for s in self.steps) / sum(s[1] for s in self.steps)

    def plain_equivalent(self, rows: int, requests: int) -> float:
        """Tokens the target alone commits for ``requests`` requests in a drafting step's time."""
        t, fixed = self.cost_table.time_ms, self.cost_table.fixed_overhead_ms
        draft = self.draft_cost.time_ms(requests) + self.draft_cost.fixed_overhead_ms  # a drafting pass, D(N)
        return requests * (t(rows) + draft + fixed) / (t(requests) + fixed)
