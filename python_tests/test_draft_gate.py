"""The decode loop's drafting gate: measured gains over a window of drafting steps, plain runs, probes."""

import pytest

import dspark_kernels as dk
from dspark_kernels.decode.draft_gate import DraftGate

TARGET = dk.CostTable([1, 16], [10.0, 20.0])
DRAFT = dk.CostTable([1, 8], [2.0, 2.0])
D, p = True, False


def gate(plain_steps=4, window=16, margin=0.05):
    return DraftGate(TARGET, DRAFT, plain_steps=plain_steps, window=window, margin=margin)


def run(g, tokens, n=8, rows=16, steps=21):
    """Drive the gate as the loop does: step i commits ``tokens(i)`` if it drafts, ``n`` if not."""
    pattern, generated = [], 0
    for i in range(steps):
        drafted = g.drafts_next()
        g.observe(generated, drafted, rows if drafted else n, n)
        pattern.append(drafted)
        generated += tokens(i) if drafted else n
    return pattern


def test_plain_equivalent_by_hand():
    t8 = 10.0 + 7 / 15 * 10.0  # T(8), interpolated
    assert gate().plain_equivalent(16, 8) == pytest.approx(8 * (20.0 + 2.0) / t8)  # = 12 tokens
    fixed = DraftGate(dk.CostTable([1, 16], [10.0, 20.0], fixed_overhead_ms=1.0), DRAFT, 4, 16, 0.0)
    assert fixed.plain_equivalent(16, 8) == pytest.approx(8 * 23.0 / (t8 + 1.0))


def test_plain_equivalent_counts_the_drafting_tables_fixed_overhead():
    """A drafting pass costs D(N) = time_ms(N) + fixed_overhead_ms, as any CostTable step does: a draft table that
    puts its 2 ms in the overhead prices a drafting step as the same table with the 2 ms in its points."""
    overhead = DraftGate(TARGET, dk.CostTable([1, 8], [1e-9, 1e-9], fixed_overhead_ms=2.0), 4, 16, 0.05)
    assert overhead.plain_equivalent(16, 8) == pytest.approx(gate().plain_equivalent(16, 8))


def test_losing_drafts_run_plain_between_probes():
    """8 requests, a window of 16 request-steps: two drafting steps fill it, the third has drafted before the
    verdict is read (the lag), then 4 plain steps; each probe starts with an empty window, and each losing probe
    doubles the next plain run, up to 8 x 4 steps."""
    g = gate()
    pattern = run(g, lambda i: 8, steps=3 * 5 + 4 + 8 + 16 + 32 + 32)  # 8 tokens where the target alone makes 12
    assert pattern == sum(([D, D, D] + [p] * n for n in (4, 8, 16, 32, 32)), [])
    one = gate(window=1)
    assert run(one, lambda i: 8, steps=14) == [D, D] + [p] * 4 + [D, D] + [p] * 6


def test_winning_drafts_run_every_step():
    assert run(gate(), lambda i: 24) == [D] * 21  # 24 tokens where the target alone makes 12
    edge = gate(margin=0.5)  # 17 tokens over 12: a gain of 1.42, under 1.5
    assert run(edge, lambda i: 17, steps=7) == [D, D, D, p, p, p, p]


def test_drafting_stops_when_the_window_turns_and_resumes_when_a_probe_wins():
    turn = run(gate(), lambda i: 24 if i < 6 else 4)
    # the read of step 8 sees steps 6 and 7 (4 + 4 tokens of 24): plain from step 9; the read of step 7 saw steps 5
    # and 6 (28 of 24): on
    assert turn[:13] == [D] * 9 + [p] * 4 and turn[13:16] == [D, D, D]
    resume = run(gate(), lambda i: 4 if i < 10 else 48, steps=40)
    assert resume[:18] == [D, D, D] + [p] * 4 + [D, D, D] + [p] * 8 and all(resume[18:])
    # and the winning window resets the plain run: a later loss runs 4 plain steps again
    again = run(gate(), lambda i: 4 if i < 10 or i >= 30 else 48, steps=40)
    assert again[:30] == resume[:30] and again[30:40] == [D, D, D] + [p] * 4 + [D, D, D]
