#!/usr/bin/env python
"""The open issues' goals judged on a GPU run: each goal's measured value beside its target, met or missed.

    python bench/goals.py BENCH.json [BENCH.json ...] [--step STEP.json] [--records DIR | --previous RECORD.json]
                          [--json OUT.json]

BENCH.json: records of ``bench/run.py`` (``--goals`` first: where two files time the same case, the first file that
has every row a goal compares decides it). A comparison never mixes files: the rows it compares come from one run,
with one copy bandwidth, and "the floor" is a row's own floor time at that run's copy bandwidth. STEP.json:
``bench/step.py``'s record. The previous record (#51: faster than the previous kernel) is the newest record in DIR
(default ``bench/records``) of the same GPU at another commit, or the one named. A goal the files cannot decide is
"not measured", with the reason (a row missing, or the row saying why its backend did not run).

The goals are the issues' (#51 verify_chain, #52 draft_block, #53 the decode step), at the headline shapes of
``cases.GOALS``: K = 7, V = 151936, bf16, r = 256 (and draft_block at N = 256, K = 15). This judges; it never
fails: exit status 0 unless a file cannot be read.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import sys
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
NS = (1, 8, 64, 256)
HEADLINE = dict(K=7, V=151936, dtype="bf16")


@dataclass
class Verdict:
    issue: int
    goal: str
    case: str
    value: Optional[float] = None   # the measured number (a time in us, or a ratio)
    shown: str = ""                 # how it reads: "12.3 us", "1.14x"
    ok: Optional[bool] = None       # None: not measured
    why: str = ""                   # what was missing, when not measured

    @property
    def result(self) -> str:
        return "-" if self.ok is None else "met" if self.ok else "MISSED"


def _norm(row: dict) -> dict:
    """A row with its case's defaults spelled out (the bench leaves them out of the row)."""
    r = dict(row)
    r.setdefault("w2", "same")
    r.setdefault("top_k", 0)
    if r.get("op") == "verify_chain":
        r.setdefault("form", "token" if r.get("mode") == "sampled" else None)
    if r.get("op") == "schedule_verify_lens":
        r.setdefault("active", 1.0)
    return r


class Runs:
    """The rows of one or more bench records, looked up per file (rows compared come from one file)."""

    def __init__(self, docs: List[dict]):
        self.files = [[_norm(r) for r in d.get("rows", [])] for d in docs]

    def _match(self, rows, op, backend, case) -> Optional[dict]:
        for r in rows:
            if r.get("op") == op and r.get("backend") == backend and all(r.get(k) == v for k, v in case.items()):
                return r
        return None

    def rows(self, op: str, wanted: List[Tuple[str, dict]]) -> Tuple[Optional[List[dict]], str]:
        """The ok rows of ``wanted`` [(backend, case)] from the first file that has all of them, or None and why
        not (the first file's non-ok row's note, or the row missing)."""
        why = ""
        for rows in self.files:
            found = [self._match(rows, op, b, c) for b, c in wanted]
            if all(r is not None and r.get("status") == "ok" for r in found):
                return found, ""
            for (b, _), r in zip(wanted, found):
                if not why and r is not None and r.get("status") != "ok":
                    why = f"{b} {r.get('status')}: {str(r.get('note', ''))[:90]}"
        if not why:
            why = "no " + " or ".join(dict.fromkeys(b for b, _ in wanted)) + " row"
        return None, why


# the case's keys as a row names them, and the values left unsaid (the headline's, and the defaults)
_SHOWN = ("N", "K", "mode", "form", "conf", "w2", "top_k", "sched", "active")
_UNSAID = dict(HEADLINE, w2="same", top_k=0, active=1.0)


def _case(c: dict) -> str:
    unsaid = dict(_UNSAID, mode="sampled") if c.get("form") else _UNSAID   # a form is a sampled case's
    return " ".join(f"{k}={c[k]}" for k in _SHOWN if k in c and unsaid.get(k, object()) != c[k])


def _us(row: dict) -> float:
    return row["median_ms"] * 1e3


def _floor_ratio(row: dict) -> float:
    return row["median_ms"] / row["floor_ms"] if row.get("floor_ms") else float("inf")


def _row_goal(runs: Runs, issue, goal, op, case, limit, of_floor: bool) -> Verdict:
    """The CUDA row's time in us (or, ``of_floor``, its time over its floor time) at most ``limit``."""
    found, why = runs.rows(op, [("cuda", case)])
    if found is None:
        return Verdict(issue, goal, _case(case), why=why)
    row = found[0]
    x = _floor_ratio(row) if of_floor else _us(row)
    shown = f"{x:.2f}x ({_us(row):.1f} us)" if of_floor else f"{x:.1f} us"
    return Verdict(issue, goal, _case(case), x, shown, x <= limit)


def time_goal(runs: Runs, issue, goal, op, case, limit_us) -> Verdict:
    return _row_goal(runs, issue, goal, op, case, limit_us, of_floor=False)


def floor_goal(runs: Runs, issue, goal, op, case, limit) -> Verdict:
    return _row_goal(runs, issue, goal, op, case, limit, of_floor=True)


def ratio_goal(runs: Runs, issue, goal, op, num: Tuple[str, dict], den: Tuple[str, dict], limit) -> Verdict:
    """``num``'s time over ``den``'s, both (backend, case) rows of one file, at most ``limit``."""
    found, why = runs.rows(op, [num, den])
    case = _case(num[1])
    if found is None:
        return Verdict(issue, goal, case, why=why)
    x = found[0]["median_ms"] / found[1]["median_ms"]
    return Verdict(issue, goal, case, x, f"{x:.2f}x ({_us(found[0]):.1f} / {_us(found[1]):.1f} us)", x <= limit)


def verify_goals(runs: Runs, previous: Optional[Runs]) -> Iterator[Verdict]:
    """#51: verify_chain at the headline shape."""
    greedy, token = dict(HEADLINE, mode="greedy"), dict(HEADLINE, mode="sampled", form="token")
    rows = dict(token, form="token-rows")
    for n, us in ((1, 8), (8, 10)):
        yield time_goal(runs, 51, f"greedy <= {us} us", "verify_chain", dict(greedy, N=n), us)
    for n in (64, 256):
        yield floor_goal(runs, 51, "greedy <= 1.2x the floor", "verify_chain", dict(greedy, N=n), 1.2)
    for n, us in ((1, 15), (8, 20)):
        yield time_goal(runs, 51, f"token sampling <= {us} us", "verify_chain", dict(token, N=n), us)
    for n in (64, 256):
        yield floor_goal(runs, 51, "token sampling <= 1.3x the floor", "verify_chain", dict(token, N=n), 1.3)
        yield floor_goal(runs, 51, "token sampling, every draft row read, <= 1.3x its floor", "verify_chain",
                         dict(rows, N=n), 1.3)
    pairs = [("block", "token", 1.5, "block verification <= 1.5x token sampling"),
             ("block-rows", "token-rows", 1.5, "block verification <= 1.5x token sampling"),
             ("token-reduced", "token", 1.0, "reduced draft rows no slower than dense"),
             ("token-reduced-rows", "token-rows", 1.0, "reduced draft rows no slower than dense"),
             ("token-topk", "token", 1.0, "top-k draft rows no slower than dense"),
             ("token-topk-rows", "token-rows", 1.0, "top-k draft rows no slower than dense")]
    for form, base, limit, goal in pairs:
        for n in NS:
            yield ratio_goal(runs, 51, goal, "verify_chain", ("cuda", dict(token, N=n, form=form)),
                             ("cuda", dict(token, N=n, form=base)), limit)
    for n in (8, 64, 256):
        yield ratio_goal(runs, 51, "faster than FlashInfer (softmax included)", "verify_chain",
                         ("cuda", dict(token, N=n)), ("flashinfer", dict(token, N=n)), 1.0)
    for n in (8, 64, 256):
        yield _triton_goal(runs, 51, "verify_chain", dict(greedy, N=n))
        for form in ("token", "token-rows", "block"):
            yield _triton_goal(runs, 51, "verify_chain", dict(token, N=n, form=form))
    yield from _previous_goals(runs, previous, greedy, token)


def _triton_goal(runs: Runs, issue: int, op: str, case: dict) -> Verdict:
    return ratio_goal(runs, issue, "the Triton twin within 1.6x of the CUDA kernel", op, ("triton", case),
                     ("cuda", case), 1.6)


def _previous_goals(runs: Runs, previous: Optional[Runs], greedy: dict, token: dict) -> Iterator[Verdict]:
    goal = "faster than the previous kernel (last record of this GPU)"
    for n in (1, 8, 64, 256):
        for case in (dict(greedy, N=n), dict(token, N=n)):
            now, why = runs.rows("verify_chain", [("cuda", case)])
            before, why_before = (previous.rows("verify_chain", [("cuda", case)]) if previous is not None else
                                  (None, "no earlier record of this GPU"))
            if now is None or before is None:
                yield Verdict(51, goal, _case(case), why=why or why_before)
                continue
            x = now[0]["median_ms"] / before[0]["median_ms"]
            yield Verdict(51, goal, _case(case), x, f"{x:.2f}x ({_us(now[0]):.1f} / {_us(before[0]):.1f} us)", x < 1)


def draft_goals(runs: Runs) -> Iterator[Verdict]:
    """#52: draft_block (r = 256), with the confidence head (conf 1) and the kernel alone (conf 0)."""
    for conf in (1, 0):
        greedy = dict(HEADLINE, mode="greedy", conf=conf, w2="same", top_k=0)
        for n, limit in ((1, 1.25), (8, 1.25), (64, 1.25), (256, 1.3)):
            yield floor_goal(runs, 52, f"greedy <= {limit}x the floor", "draft_block", dict(greedy, N=n), limit)
        yield floor_goal(runs, 52, "greedy <= 1.3x the floor", "draft_block", dict(greedy, N=256, K=15), 1.3)
        for n in NS:
            yield ratio_goal(runs, 52, "sampled <= 1.15x greedy", "draft_block",
                             ("cuda", dict(greedy, N=n, mode="sampled")), ("cuda", dict(greedy, N=n)), 1.15)
        yield ratio_goal(runs, 52, "fp8 W2 <= 0.65x a bf16 W2", "draft_block", ("cuda", dict(greedy, N=1, w2="fp8")),
                         ("cuda", dict(greedy, N=1)), 0.65)
        yield time_goal(runs, 52, "top-k 64 <= 40 us", "draft_block", dict(greedy, N=1, top_k=64), 40)
    alone = dict(HEADLINE, mode="greedy", conf=0, w2="same", top_k=0)
    for case in [dict(alone, N=n) for n in NS] + [dict(alone, N=256, K=15)]:
        yield ratio_goal(runs, 52, ">= 1.3x faster than cuBLAS (K products in a CUDA graph)", "draft_block",
                         ("cuda", case), ("cublas", case), 1 / 1.3)
    for n in NS:
        for mode in ("greedy", "sampled"):
            for conf in (1, 0):
                yield _triton_goal(runs, 52, "draft_block", dict(HEADLINE, N=n, mode=mode, conf=conf, w2="same",
                                                                 top_k=0))
    for n in NS:
        for mode in ("greedy", "sampled"):
            yield floor_goal(runs, 52, "dist_draft_step <= 1.2x its shard's floor", "dist_draft_step",
                             dict(N=n, V=151936, dtype="bf16", mode=mode), 1.2)


def small_op_goals(runs: Runs) -> Iterator[Verdict]:
    """#53's small ops: the scheduler and the scan at N <= 256."""
    for n in NS:
        for sched, active in itertools.product(("exact", "argmax"), (1.0, 0.75)):
            yield time_goal(runs, 53, "schedule_verify_lens <= 8 us", "schedule_verify_lens",
                            dict(N=n, K=7, sched=sched, active=active), 8)
        yield time_goal(runs, 53, "accept_prefix_scan <= 5 us", "accept_prefix_scan", dict(N=n, K=7), 5)


# (batch, tau, goal, the run's key, limit, at least: the limit is a minimum)
STEP_GOALS = [
    (1, None, "the target alone within 1.2x of reading its weights", "target_floor_ratio", 1.2, False),
    (1, None, "the package's ops <= 4% of a speculative step", "ops_share", 0.04, False),
    (64, None, "the package's ops <= 8% of a speculative step", "ops_share", 0.08, False),
    (1, 3.6, "speedup >= 2.6x", "speedup", 2.6, True),
    (8, 3.6, "speedup >= 2.3x", "speedup", 2.3, True),
    (64, 3.6, "speedup >= 1.2x", "speedup", 1.2, True),
    (1, 1.0, "speedup >= 0.9x (drafting gate on)", "speedup", 0.9, True),
]


def step_goals(step: Optional[dict]) -> Iterator[Verdict]:
    """#53's end-to-end goals from bench/step.py's record (acceptance forced)."""
    runs = step.get("runs", []) if step else []
    cut = " (the step's run was cut short)" if step and not step.get("machine", {}).get("complete") else ""
    for batch, tau, goal, key, limit, at_least in STEP_GOALS:
        chosen = [r for r in runs if r.get("batch") == batch and (tau is None or abs(r.get("tau", -1) - tau) < 1e-6)]
        if key == "target_floor_ratio":
            chosen = chosen[:1]   # the target alone is timed once per batch
        if not chosen or any(r.get(key) is None for r in chosen):
            where = f"batch {batch}" + (f", tau {tau}" if tau is not None else "")
            yield Verdict(53, goal, f"batch={batch}" + (f" tau={tau}" if tau else ""),
                          why=("no step record" if step is None else f"no run at {where}") + cut)
            continue
        for r in chosen:
            x = r[key]
            shown = f"{100 * x:.1f}%" if key == "ops_share" else f"{x:.2f}x"
            yield Verdict(53, goal, f"batch={batch} tau={r.get('tau')}", x, shown, x >= limit if at_least else
                          x <= limit)
    if runs:
        equal = [bool(r.get("greedy_equal")) for r in runs]
        yield Verdict(53, "greedy output equal to the target's", "every run", sum(equal), f"{sum(equal)}/{len(runs)}",
                      all(equal))


def judge(docs: List[dict], step: Optional[dict] = None, previous: Optional[dict] = None) -> List[Verdict]:
    runs = Runs(docs)
    prev = Runs([previous]) if previous is not None else None
    return (list(verify_goals(runs, prev)) + list(draft_goals(runs)) + list(small_op_goals(runs))
            + list(step_goals(step)))


def previous_record(records_dir: str, docs: List[dict], exclude: List[str], op: str = "verify_chain"
                    ) -> Tuple[Optional[dict], str]:
    """The newest bench record in ``records_dir`` of the first doc's GPU at another commit with CUDA rows of
    ``op``: (record, its path), or (None, "")."""
    if not docs:
        return None, ""
    device, commit = docs[0]["machine"].get("device"), docs[0]["machine"].get("git_commit")
    best, best_path = None, ""
    skip = {os.path.realpath(p) for p in exclude}
    for path in sorted(glob.glob(os.path.join(records_dir, "*.json"))):
        if os.path.realpath(path) in skip:
            continue
        try:
            doc = json.load(open(path))
        except (OSError, ValueError):
            continue
        if not isinstance(doc, dict) or not any(r.get("op") == op and r.get("backend") == "cuda" and
                                                r.get("status") == "ok" for r in doc.get("rows", [])):
            continue
        m = doc.get("machine", {})
        if m.get("device") != device or m.get("git_commit") == commit:
            continue
        if best is None or m.get("date", "") > best["machine"].get("date", ""):
            best, best_path = doc, path
    return best, best_path


def report(verdicts: List[Verdict], out=sys.stdout) -> Dict[int, Dict[str, int]]:
    """The table, issue by issue, and the counts per issue: {issue: {"met", "MISSED", "-"}}."""
    counts: Dict[int, Dict[str, int]] = {}
    issue = None
    for v in verdicts:
        if v.issue != issue:
            issue = v.issue
            print(f"\n#{issue}", file=out)
        print(f"  {v.result:<7}{v.goal:<58}{v.case:<30} {v.shown or 'not measured: ' + v.why}", file=out)
        c = counts.setdefault(v.issue, {"met": 0, "MISSED": 0, "-": 0})
        c[v.result] += 1
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", nargs="*", help="bench/run.py records (JSON), the --goals one first")
    ap.add_argument("--step", default=None, help="bench/step.py's record (JSON)")
    ap.add_argument("--records", default=os.path.join(HERE, "records"), help="where to find the previous record")
    ap.add_argument("--previous", default=None, help="the previous record (default: the newest of this GPU there)")
    ap.add_argument("--json", default=None, help="also write the verdicts here")
    args = ap.parse_args(argv)
    docs = [json.load(open(p)) for p in args.bench]
    step = json.load(open(args.step)) if args.step else None
    if args.previous:
        previous, prev_path = json.load(open(args.previous)), args.previous
    else:
        previous, prev_path = previous_record(args.records, docs, args.bench)
    verdicts = judge(docs, step, previous)
    cut = [p for p, d in zip(args.bench, docs) if d.get("settings", {}).get("complete") is False]
    print(f"goals judged on {', '.join(args.bench) or 'no bench record'}"
          + (f" (cut short, the rows timed before the stop: {', '.join(cut)})" if cut else "")
          + (f"; step {args.step}" if args.step else "") + (f"; previous {prev_path}" if prev_path else ""))
    counts = report(verdicts)
    print()
    for issue, c in counts.items():
        print(f"goals #{issue}: {c['met']} met, {c['MISSED']} missed, {c['-']} not measured")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(bench=args.bench, step=args.step, previous=prev_path,
                           verdicts=[dict(asdict(v), result=v.result) for v in verdicts]), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
