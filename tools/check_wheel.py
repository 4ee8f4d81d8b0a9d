#!/usr/bin/env python
"""Install a wheel into a fresh venv without a CUDA toolkit and check that its prebuilt CUDA extension is what loads.

Usage: ``python tools/check_wheel.py WHEEL [--venv DIR] [--archs A] [--extract PATH]``

The venv (default build/wheel-venv, made anew) gets the wheel with ``pip install --no-deps``; its torch and numpy
are this interpreter's, reached through a ``.pth`` file (the same torch the wheel was built against, without a
second 4 GB install). The checks run in that venv from an empty folder, with no toolkit: PATH holds no folder with
an ``nvcc``, CUDA_HOME / CUDA_PATH are unset, ``DSPARK_NO_JIT=1``, an empty TORCH_EXTENSIONS_DIR, and stand-ins for
nvcc, the C/C++ compilers and ninja first on PATH that record any call (a call fails the check). They require:

* ``dspark_kernels`` imports from the venv, and ``_ext.load()`` loads the wheel's prebuilt library;
* every op the sources register a CUDA kernel for (``m.impl`` in csrc/torch) has its CUDA kernel registered;
* ``dk.build_info()`` lists the architectures of ``--archs`` (default ``DSPARK_CUDA_ARCHS``, else the wheel's
  default), and the library's own (cuobjdump's listing of it) are the same;
* with its build record changed to another torch release, the loader refuses it with a message naming both
  versions.

``--extract PATH`` copies the wheel's library to PATH (CI: build/dspark_C.so, which test_gpu_build.py loads and
tools/check_cuda.py disassembles for the SASS report). Needs no GPU. Exit status 1 on any failed check.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRIPWIRES = ("nvcc", "cc", "c++", "gcc", "g++", "clang", "clang++", "ninja")

_CHECK = """
import json, os, sys, warnings
import torch
import dspark_kernels as dk
from dspark_kernels import _ext
warnings.simplefilter("always")
out = dict(package=dk.__file__, error=None)
try:
    _ext.load()
except RuntimeError as e:
    out["error"] = str(e)
out["loaded_from"] = _ext._loaded_from
def has_cuda_kernel(op):
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"dspark_C::{op}", "CUDA")
    except RuntimeError:  # no such op
        return False
out["missing"] = [op for op in json.loads(sys.argv[1]) if not has_cuda_kernel(op)]
out["info"] = dk.build_info()
print(json.dumps(out))
"""


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_dspark_{name}", os.path.join(ROOT, "dspark_kernels", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_venv(venv: str, wheel: str) -> str:
    """A new venv at `venv` with `wheel` installed and this interpreter's site-packages behind its own; returns its
    site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", venv], check=True)
    py = os.path.join(venv, "bin", "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    import torch
    with open(os.path.join(site, "zz_torch_of_the_build.pth"), "w") as f:
        f.write(os.path.dirname(os.path.dirname(torch.__file__)) + "\n")
    subprocess.run([py, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel], check=True)
    return site


def clean_env(venv: str, tripwire_dir: str, log: str) -> dict:
    """The environment of a machine without a CUDA toolkit, with compiler stand-ins that log to `log`."""
    os.makedirs(tripwire_dir, exist_ok=True)
    for name in TRIPWIRES:
        path = os.path.join(tripwire_dir, name)
        with open(path, "w") as f:
            f.write(f'#!/bin/sh\necho "{name} $*" >> "{log}"\nexit 1\n')
        os.chmod(path, 0o755)
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not os.path.exists(os.path.join(d, "nvcc")) and "/cuda" not in d]
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_HOME", "CUDA_PATH", "PYTHONPATH", "TORCH_CUDA_ARCH_LIST", "DSPARK_BACKEND", "CXX")}
    env.update(PATH=os.pathsep.join([tripwire_dir, os.path.join(venv, "bin")] + keep), DSPARK_NO_JIT="1",
               TORCH_EXTENSIONS_DIR=os.path.join(os.path.dirname(log), "torch_extensions"))
    return env


def run_check(venv: str, env: dict, cwd: str, ops) -> dict:
    p = subprocess.run([os.path.join(venv, "bin", "python"), "-c", _CHECK, json.dumps(ops)], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0 or not p.stdout.strip():
        raise SystemExit(f"check_wheel: the check failed in the venv (exit {p.returncode}):\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["stderr"] = p.stderr
    return out


def library(site: str) -> str:
    found = glob.glob(os.path.join(site, "dspark_kernels", "_C.*.so"))
    if not found:
        raise SystemExit(f"check_wheel: the wheel installed no dspark_kernels/_C library into {site}")
    return found[0]


def check_loaded(out: dict, site: str, ops, archs) -> list:
    """The failures of the check run with the wheel's own record."""
    bad = []
    if not out["package"].startswith(site):
        bad.append(f"dspark_kernels imported from {out['package']}, not from the venv {site}")
    if out["error"] or not (out["loaded_from"] or "").startswith("prebuilt "):
        bad.append(f"the prebuilt extension did not load: {out['error'] or out['loaded_from']}")
    if out["missing"]:
        bad.append(f"ops without a CUDA kernel in the loaded library: {out['missing']} (expected all of {ops})")
    pre = out["info"].get("prebuilt") or {}
    if (pre.get("sass"), pre.get("ptx")) != archs:
        bad.append(f"build_info() lists SASS {pre.get('sass')} and PTX {pre.get('ptx')}; expected {archs}")
    return bad


def binary_archs(so: str):
    """(SASS, PTX) architectures cuobjdump lists in the library; None without a cuobjdump."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import sass

    tool = sass.cuobjdump(_load("_build").cuda_home())
    if tool is None:
        return None
    found = sass.binary_archs(so, tool)
    return found["sass"], found["ptx"]


def check_refusal(venv: str, env: dict, cwd: str, so: str, ops) -> list:
    """Rewrites the installed build record to another torch release: the loader must refuse, naming both."""
    prebuilt = _load("_prebuilt")
    path = prebuilt.record_path(so)
    original = prebuilt.read(path)
    other = "1.0.0"
    prebuilt.write(path, dict(original, torch=other))
    try:
        out = run_check(venv, env, cwd, ops)
    finally:
        prebuilt.write(path, original)
    import torch
    msg = out["error"] or ""
    if out["loaded_from"] is not None or other not in msg or torch.__version__ not in msg:
        return [f"a record of torch {other} was not refused with both versions named: {out['error']!r}"]
    return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheel")
    ap.add_argument("--venv", default=os.path.join(ROOT, "build", "wheel-venv"))
    ap.add_argument("--archs", help="the architectures the wheel was built for (default: DSPARK_CUDA_ARCHS, else "
                                    "the wheel's default)")
    ap.add_argument("--extract", metavar="PATH", help="copy the wheel's library here")
    args = ap.parse_args()
    build = _load("_build")
    archs = build.arch_targets(build.cuda_archs(args.archs))
    ops = build.registered_ops()
    site = make_venv(os.path.abspath(args.venv), os.path.abspath(args.wheel))
    so = library(site)
    work = tempfile.mkdtemp(prefix="dspark_check_wheel_")
    log = os.path.join(work, "compiler_calls.log")
    env = clean_env(os.path.abspath(args.venv), os.path.join(work, "bin"), log)
    out = run_check(os.path.abspath(args.venv), env, work, ops)
    bad = check_loaded(out, site, ops, archs)
    listed = binary_archs(so)
    if listed is not None and listed != archs:
        bad.append(f"the library holds SASS {listed[0]} and PTX {listed[1]}; expected {archs}")
    bad += check_refusal(os.path.abspath(args.venv), env, work, so, ops)
    if os.path.exists(log):
        bad.append(f"a compiler or build tool was called: {open(log).read().strip()}")
    if args.extract:
        os.makedirs(os.path.dirname(os.path.abspath(args.extract)), exist_ok=True)
        shutil.copyfile(so, args.extract)
    size = os.path.getsize(args.wheel) / 2 ** 20
    pre = out["info"].get("prebuilt") or {}
    print(f"check_wheel: {os.path.basename(args.wheel)} ({size:.1f} MiB; library {os.path.getsize(so) / 2 ** 20:.1f} "
          f"MiB): loaded {out['loaded_from']}; build_info(): SASS {pre.get('sass')}, PTX {pre.get('ptx')}; "
          f"{len(ops) - len(out['missing'])} of {len(ops)} ops with a CUDA kernel")
    for b in bad:
        print(f"check_wheel: FAIL: {b}", file=sys.stderr)
    shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
