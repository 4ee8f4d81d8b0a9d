"""dspark_kernels/_build.py's stale-lock removal: with torch's existence-style lock (torch < 2.14), a lock a killed
build left is removed, a fresh one stays, and processes that find the same stale lock at once (pytest -n workers)
all go on; torch's flock-style lock (torch >= 2.14) is never touched."""

import os
import subprocess
import sys
import time

import torch

from dspark_kernels import _build

# each child imports, says it is ready, then waits for the go file, so that all of them look at the lock at once
_CLEAR = """
import os, sys, time
from dspark_kernels import _build
open(sys.argv[2], "w").close()
while not os.path.exists(sys.argv[3]):
    time.sleep(0.001)
_build.clear_stale_lock(sys.argv[1], by_existence=True)
"""


def _lock(tmp_path, age_s):
    lock = tmp_path / "lock"
    lock.write_text("")
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_a_stale_lock_is_removed_and_a_fresh_one_stays(tmp_path, capsys):
    lock = _lock(tmp_path, 3600)
    _build.clear_stale_lock(str(tmp_path), by_existence=True)
    assert not lock.exists()
    assert "removed a stale build lock" in capsys.readouterr().err
    lock = _lock(tmp_path, 5)
    _build.clear_stale_lock(str(tmp_path), by_existence=True)
    assert lock.exists()
    _build.clear_stale_lock(str(tmp_path / "absent"), by_existence=True)  # no folder, no lock: nothing to do


def test_an_flock_style_lock_is_left_alone(tmp_path, capsys):
    """torch >= 2.14 keeps the lock file and flocks it: an old file is no sign of a killed build."""
    lock = _lock(tmp_path, 3600)
    _build.clear_stale_lock(str(tmp_path), by_existence=False)
    assert lock.exists() and "removed" not in capsys.readouterr().err


def test_the_lock_style_follows_torch():
    """torch 2.14 replaced the existence-style FileBaton with an flock (torch/utils/cpp_extension.py)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert _build.torch_locks_by_existence() == ((major, minor) < (2, 14))


def test_processes_clearing_one_stale_lock_at_once_all_go_on(tmp_path):
    lock = _lock(tmp_path, 3600)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ready = [tmp_path / f"ready{i}" for i in range(4)]
    procs = [subprocess.Popen([sys.executable, "-c", _CLEAR, str(tmp_path), str(r), str(tmp_path / "go")], env=env,
                              stderr=subprocess.PIPE, text=True) for r in ready]
    deadline = time.time() + 120
    while not all(r.exists() for r in ready) and time.time() < deadline:
        time.sleep(0.01)
    (tmp_path / "go").write_text("")
    results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]
    assert all(rc == 0 for rc, _ in results), results
    assert sum("removed a stale build lock" in err for _, err in results) == 1, results
    assert not lock.exists()
