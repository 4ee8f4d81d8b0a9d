"""bench/goals.py: the issues' goals judged on hand-made records, on the H200 record, and against the cases that
``bench/run.py --goals`` times (every goal it judges is a row that plan measures)."""

import json
import os
import subprocess
import sys

import pytest

from bench_modules import load_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
H200 = os.path.join(BENCH, "records", "nvidia-h200-16c-0a7c9cdf_full.json")
HEAD = dict(K=7, V=151936, dtype="bf16")


goals = load_bench("goals.py")


def _row(op, backend, us, floor_us=1.0, status="ok", **case):
    return dict(op=op, backend=backend, status=status, median_ms=us / 1e3, floor_ms=floor_us / 1e3, **case)


def _doc(*rows, device="NVIDIA H200", commit="c1", date="2026-12-06"):
    return dict(machine=dict(device=device, git_commit=commit, date=date), rows=list(rows))


def _find(verdicts, goal, case):
    found = [v for v in verdicts if goal in v.goal and v.case == case]
    assert len(found) == 1, (goal, case, [(v.goal, v.case) for v in verdicts if goal in v.goal])
    return found[0]


def test_times_and_floor_ratios_by_hand():
    greedy = dict(HEAD, mode="greedy")
    doc = _doc(_row("verify_chain", "cuda", 7.9, N=1, **greedy), _row("verify_chain", "cuda", 10.5, N=8, **greedy),
               _row("verify_chain", "cuda", 60.0, floor_us=50.0, N=64, **greedy),
               _row("verify_chain", "cuda", 61.0, floor_us=50.0, N=256, **greedy))
    v = goals.judge([doc])
    assert _find(v, "greedy <= 8 us", "N=1 mode=greedy").ok is True
    assert _find(v, "greedy <= 10 us", "N=8 mode=greedy").ok is False
    at64 = _find(v, "greedy <= 1.2x the floor", "N=64 mode=greedy")
    assert at64.ok is True and at64.value == pytest.approx(1.2)
    assert _find(v, "greedy <= 1.2x the floor", "N=256 mode=greedy").ok is False
    # a goal with no row is not measured, and says so
    missing = _find(v, "token sampling <= 15 us", "N=1 form=token")
    assert missing.ok is None and missing.result == "-" and "no cuda row" in missing.why


def test_a_comparison_takes_both_rows_from_one_run():
    """FlashInfer is timed only in the second file: the CUDA time compared is that file's, not the first's."""
    token = dict(HEAD, mode="sampled")
    first = _doc(_row("verify_chain", "cuda", 10.0, N=8, **token),
                 _row("verify_chain", "flashinfer", 0.0, status="missing", note="flashinfer not importable", N=8,
                      **token))
    second = _doc(_row("verify_chain", "cuda", 30.0, N=8, **token), _row("verify_chain", "flashinfer", 20.0, N=8,
                                                                         **token))
    fi = _find(goals.judge([first, second]), "FlashInfer", "N=8 form=token")
    assert fi.value == pytest.approx(1.5) and fi.ok is False
    # with only the first file, the goal is not measured, with the row's own reason
    alone = _find(goals.judge([first]), "FlashInfer", "N=8 form=token")
    assert alone.ok is None and "flashinfer not importable" in alone.why
    # the first file's time decides a goal of that row alone
    assert _find(goals.judge([first, second]), "token sampling <= 20 us", "N=8 form=token").value == 10.0


def test_draft_block_ratios_by_hand():
    g = dict(HEAD, mode="greedy", conf=0, r=256, d=0)
    sampled = dict(g, mode="sampled")
    rows = [_row("draft_block", "cuda", 100.0, N=1, **g), _row("draft_block", "cuda", 116.0, N=1, **sampled),
            _row("draft_block", "cuda", 64.0, N=1, w2="fp8", **g),
            _row("draft_block", "cuda", 39.0, N=1, top_k=64, **g),
            _row("draft_block", "cublas", 131.0, N=1, **g), _row("draft_block", "triton", 161.0, N=1, **g)]
    v = goals.judge([_doc(*rows)])
    assert _find(v, "sampled <= 1.15x greedy", "N=1 mode=sampled conf=0").ok is False   # 1.16
    assert _find(v, "fp8 W2 <= 0.65x", "N=1 mode=greedy conf=0 w2=fp8").ok is True       # 0.64
    assert _find(v, "top-k 64 <= 40 us", "N=1 mode=greedy conf=0 top_k=64").ok is True
    assert _find(v, "cuBLAS", "N=1 mode=greedy conf=0").ok is True                       # 1.31x faster
    assert _find(v, "Triton", "N=1 mode=greedy conf=0").ok is False                      # 1.61x
    # the rows with the confidence head are other cases: not measured here
    assert _find(v, "sampled <= 1.15x greedy", "N=1 mode=sampled conf=1").ok is None


def test_step_goals_by_hand():
    runs = [dict(batch=1, tau=3.6, speedup=2.7, ops_share=0.03, target_floor_ratio=1.1, greedy_equal=True),
            dict(batch=1, tau=1.0, speedup=0.85, ops_share=0.05, target_floor_ratio=1.1, greedy_equal=True),
            dict(batch=8, tau=3.6, speedup=2.2, ops_share=0.02, target_floor_ratio=1.3, greedy_equal=False)]
    v = list(goals.step_goals(dict(machine=dict(complete=False), runs=runs)))
    assert _find(v, "speedup >= 2.6x", "batch=1 tau=3.6").ok is True
    assert _find(v, "speedup >= 2.3x", "batch=8 tau=3.6").ok is False
    assert _find(v, "speedup >= 0.9x", "batch=1 tau=1.0").ok is False
    assert _find(v, "within 1.2x of reading its weights", "batch=1 tau=3.6").ok is True
    share = [x for x in v if x.goal.endswith("<= 4% of a speculative step")]
    assert [x.ok for x in share] == [True, False]                    # every tau at batch 1
    cut = _find(v, "speedup >= 1.2x", "batch=64 tau=3.6")
    assert cut.ok is None and "cut short" in cut.why
    equal = _find(v, "greedy output equal", "every run")
    assert equal.ok is False and equal.shown == "2/3"
    assert all(x.ok is None for x in goals.step_goals(None))


def test_previous_record_is_the_newest_of_the_same_gpu_at_another_commit(tmp_path):
    """... that has CUDA rows of verify_chain (a draft_block-only rerun, a step record and an ncu list do not)."""
    verify = _row("verify_chain", "cuda", 20.0, N=1, mode="greedy", **HEAD)
    records = {"old.json": _doc(verify, commit="a", date="2026-12-01"),
               "newer.json": _doc(verify, commit="b", date="2026-12-04"),
               "draft_only.json": _doc(_row("draft_block", "cuda", 300.0, N=1, mode="greedy", **HEAD), commit="b",
                                       date="2026-12-04T13"),
               "same_commit.json": _doc(verify, commit="c1", date="2026-12-05"),
               "h100.json": _doc(verify, device="NVIDIA H100 80GB HBM3", commit="d", date="2026-12-05"),
               "x_step.json": dict(machine=dict(device="NVIDIA H200", git_commit="e", date="2026-12-05"), runs=[]),
               "ncu.json": [dict(op="verify_chain")]}
    for name, doc in records.items():
        (tmp_path / name).write_text(json.dumps(doc))
    doc, path = goals.previous_record(str(tmp_path), [_doc()], [])
    assert os.path.basename(path) == "newer.json"
    _, path = goals.previous_record(str(tmp_path), [_doc()], [str(tmp_path / "newer.json")])
    assert os.path.basename(path) == "old.json"
    assert goals.previous_record(str(tmp_path), [_doc(device="NVIDIA A100")], []) == (None, "")
    # the one H200 record in bench/records is the previous of an H200 run at another commit
    doc, path = goals.previous_record(os.path.join(BENCH, "records"), [_doc(commit="new")], [])
    assert os.path.basename(path) == os.path.basename(H200)


def test_the_h200_record_is_judged_by_its_own_numbers(tmp_path):
    """The one full GPU record: verify_chain greedy took 22.2 us at N = 1 (the issue's table), a goal missed."""
    out = tmp_path / "goals.json"
    done = subprocess.run([sys.executable, os.path.join(BENCH, "goals.py"), H200, "--records", str(tmp_path),
                           "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    verdicts = json.loads(out.read_text())["verdicts"]
    greedy = [v for v in verdicts if v["goal"] == "greedy <= 8 us"]
    assert len(greedy) == 1 and greedy[0]["value"] == pytest.approx(22.176) and greedy[0]["result"] == "MISSED"
    assert "goals #51:" in done.stdout and "goals #53:" in done.stdout


def _plan_rows(cases, plan):
    """A row for every case and backend of ``plan`` (ok, except the peers a case has not)."""
    rows = []
    for ops, grid, backends in plan:
        for op in ops:
            for case in cases.cases_for(op, "cpu", grid, "goals"):
                for b in cases.backends_for(op, backends):
                    fi_ok = case.params.get("mode") == "sampled" and "form" not in case.params
                    ok = (b not in cases.PEERS or b in case.peers) if b != "flashinfer" else fi_ok
                    rows.append(dict(op=op, backend=b, status="ok" if ok else "missing", median_ms=1.0,
                                     floor_ms=1.0, **case.params))
    return rows


def test_every_goal_is_a_case_the_goals_plan_times():
    """With rows for every case of ``run.py --goals``, every goal but the previous-record and the decode-step ones
    is measured; with the plan's last entry left out, some are not."""
    cases = load_bench("cases.py")

    def unmeasured(plan):   # the goals of bench rows (not the decode step's, nor the previous record's)
        return [(x.goal, x.case) for x in goals.judge([_doc(*_plan_rows(cases, plan))])
                if x.ok is None and x.case.startswith("N=") and "previous" not in x.goal]

    assert unmeasured(cases.GOALS) == []
    assert any("dist_draft_step" in goal for goal, _ in unmeasured(cases.GOALS[:-1]))


def test_run_goals_times_the_plan_in_order_into_one_record(tmp_path):
    """``run.py --goals`` with --op and --backend: the plan's entries of those ops, in the plan's order, with only
    the asked-for backends that the entry compares (reference is in none); the file named after the machine
    ({machine}) and the preset."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, os.path.join(BENCH, "run.py"), "--goals", "--device", "cpu",
                        "--op", "accept_prefix_scan", "schedule_verify_lens", "--backend", "triton", "reference",
                        "--min-reps", "2", "--max-reps", "3", "--min-time", "0", "--no-structural", "--no-e2e",
                        "--no-plot", "--out-dir", str(tmp_path), "--name", "{machine}_x_{preset}"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (path,) = tmp_path.glob("*_x_goals.json")
    doc = json.loads(path.read_text())
    assert path.name == doc["machine_id"] + "_x_goals.json" and doc["settings"]["preset"] == "goals"
    cases = [(r["op"], r["N"], r.get("sched"), r.get("active")) for r in doc["rows"]]
    # the plan's order: the scheduler (unmasked, then a quarter inactive) before the scan (cases.GOALS), every N of
    # the headline grid
    assert cases == [("schedule_verify_lens", n, s, a) for n in (1, 8, 64, 256) for a in (None, 0.75)
                     for s in ("exact", "argmax")] + [("accept_prefix_scan", n, None, None) for n in (1, 8, 64, 256)]
    assert {r["backend"] for r in doc["rows"]} == {"triton"} and all(r["status"] == "ok" for r in doc["rows"])


def test_backend_narrows_each_goal_entry():
    """``--backend`` keeps, in each entry of the goals plan, the backends it names (gpu_check leaves FlashInfer out
    this way when its build failed): no entry gains a backend, and an entry left with none is dropped."""
    run = load_bench("run.py")
    cases = load_bench("cases.py")
    plan = run.make_plan(run.parse_args(["--goals", "--backend", "cuda", "triton", "cublas"]), "goals", True)
    assert len(plan) == len(cases.GOALS)
    for (ops, _, backends), (_, _, compared) in zip(plan, cases.GOALS):
        assert "flashinfer" not in backends and backends == [b for b in compared if b != "flashinfer"], ops
    assert [b for _, grid, b in plan if grid.get("w2") == ["fp8"]] == [["cuda"]]
    only = run.make_plan(run.parse_args(["--goals", "--backend", "flashinfer"]), "goals", True)
    assert [(ops, b) for ops, _, b in only] == [(["verify_chain"], ["flashinfer"])]


def test_the_goals_plan_times_only_what_a_goal_reads(monkeypatch):
    """Every case ``run.py --goals`` times is one some goal looks up (the rest of the grid is ``--full``'s)."""
    cases = load_bench("cases.py")
    read = []
    real = goals.Runs.rows

    def rows(self, op, wanted):
        read.extend((op, case) for _, case in wanted)
        return real(self, op, wanted)
    monkeypatch.setattr(goals.Runs, "rows", rows)
    timed = [goals._norm(r) for r in _plan_rows(cases, cases.GOALS) if r["backend"] == "cuda"]
    goals.judge([_doc(*timed)])
    unread = [r for r in timed if not any(op == r["op"] and all(r.get(k) == v for k, v in case.items())
                                          for op, case in read)]
    assert unread == []
    assert len(timed) == 86   # the plan's cases (one CUDA row each)
