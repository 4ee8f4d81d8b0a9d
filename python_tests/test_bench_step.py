"""bench/step.py: the end-to-end GPU benchmark's pipeline at its tiny shape on the CPU, and its JSON."""

import json
import os
import subprocess
import sys

import pytest
import torch

from bench_modules import load_bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_KEYS = {"batch", "tau", "target_tokens_per_s", "spec_tokens_per_s", "speedup", "ops_share", "target_floor_ratio",
            "greedy_equal"}


def test_tiny_run_writes_the_record(tmp_path):
    """Forced acceptance at tau = 6.2 on a tiny random pair: the record has the machine (commit included) and one
    run per (batch, tau) with the fields the README's table reads; the greedy outputs are the target's."""
    cmd = [sys.executable, os.path.join(ROOT, "bench", "step.py"), "--tiny", "--batch", "2", "--tau", "6.2",
           "--prompt-len", "6", "--new-tokens", "8", "--out-dir", str(tmp_path), "--name", "t", "--device", "cpu"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "t_step.json") as f:
        rec = json.load(f)
    assert {"git_commit", "git_dirty", "device"} <= set(rec["machine"]) and rec["machine"]["forced_acceptance"]
    assert rec["machine"]["complete"] is True
    (run,) = rec["runs"]
    assert RUN_KEYS <= set(run) and (run["batch"], run["tau"]) == (2, 6.2)
    assert run["greedy_equal"] is True
    assert run["speedup"] == pytest.approx(run["spec_tokens_per_s"] / run["target_tokens_per_s"], rel=1e-2)
    assert 0.0 <= run["ops_share"] <= 1.0 and run["target_floor_ratio"] > 0
    assert run["drafted_tokens_per_step"] > 1.0  # the forced drafts are accepted where every step drafts
    assert run["measured_tokens_per_step"] >= 1.0  # the timed run's gate may run the target alone (timing-dependent)
    assert run["measured_tokens_per_step"] == 1.0 or run["drafting_steps"] > 0
    assert set(run["spec_step_split_ms"]) == {"drafter", "draft_block", "schedule_verify_lens", "target",
                                              "verify_chain", "accept_prefix_scan", "rest"}


def test_a_run_cut_short_keeps_the_runs_it_measured(tmp_path, monkeypatch):
    """The record is written after every run: when the second batch dies (as a time limit would stop it), the file
    holds the first batch's runs, marked incomplete."""
    step = load_bench("step.py")
    real = step.run_batch

    def run_batch(target, drafter, s, n, *args):
        if n == 2:
            raise KeyboardInterrupt  # what a timeout's signal leaves: nothing after this point runs
        yield from real(target, drafter, s, n, *args)
    monkeypatch.setattr(step, "run_batch", run_batch)
    argv = ["--tiny", "--batch", "1", "2", "--tau", "1", "6.2", "--prompt-len", "6", "--new-tokens", "8",
            "--out-dir", str(tmp_path), "--name", "t", "--device", "cpu"]
    with pytest.raises(KeyboardInterrupt):
        step.main(argv)
    with open(tmp_path / "t_step.json") as f:
        rec = json.load(f)
    assert rec["machine"]["complete"] is False
    assert [(r["batch"], r["tau"]) for r in rec["runs"]] == [(1, 1.0), (1, 6.2)]
    assert all(r["greedy_equal"] for r in rec["runs"])
    assert not list(tmp_path.glob("*.tmp"))


def test_cpu_cost_table_is_flat_at_the_median(monkeypatch):
    """On the CPU the verify forwards' table is flat at the median of the measured times, so that one spike (here
    planted at the second bucket) cannot make the scheduler verify no draft; its counts are the buckets n (1 + L)."""
    step = load_bench("step.py")
    times = iter([1.0, 50.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    monkeypatch.setattr(step, "_time_ms", lambda fn, dev, reps=5: next(times))
    dev = torch.device("cpu")
    target, _ = step.build_models(step.TINY, dev, torch.float32)
    table = step.cost_table(target, 2, 4, 4 + step.K + 2, dev)
    assert list(table.token_counts) == [2 * (1 + length) for length in range(step.K + 1)]
    assert list(table.step_time_ms) == [4.5] * (step.K + 1)
