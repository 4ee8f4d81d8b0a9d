#!/usr/bin/env python
"""Compile every CUDA translation unit for sm_80 and sm_90a with ``-Xptxas -v``; fail on errors or spills.

Usage: ``python tools/check_cuda.py [-j JOBS] [--keep DIR] [--json PATH] [--link PATH] [files...]`` (default:
csrc/torch/*.cu, csrc/torch/*.cpp, csrc/capi/*.cu). The torch translation units get the same include folders and
flags as the extension build (dspark_kernels/_build.py); csrc/capi/*.cu gets only csrc/include. Prints a
per-kernel resource table (registers, stack frame, spill bytes) and exits 1 if any compile fails or any kernel
spills (non-zero "bytes spill" line). Needs no GPU. CUDA_HOME is resolved like the extension does (CUDA_HOME /
CUDA_PATH, nvcc on PATH, ...).

With ``--json PATH`` each kernel's entry also has its static shared memory, resident CTAs per SM at 128 / 256 /
512 / 1024 threads (from registers and static shared memory), and for sm_90a a ``sass`` key: opcode counts and the
innermost loops of its disassembly (``tools/sass.py``; cuobjdump from the toolkit or the Triton wheel). The kernel
tests read that report through ``python_tests/sass_facts.py`` (CI writes it to build/check_cuda.json first).

With ``--link PATH`` the csrc/torch objects are also linked into the extension library (CI: build/dspark_C.so), which
``python_tests/test_gpu_build.py`` loads without a GPU to compare its registered schemas with the SIMT build's.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH_FLAGS = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a"]


def _load_ext():
    """dspark_kernels/_ext.py by path (not the whole package: only its flag and path helpers are needed)."""
    spec = importlib.util.spec_from_file_location("_dspark_build", os.path.join(ROOT, "dspark_kernels", "_build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _torch_flags(ext, home):
    import torch

    cpp_extension = ext._import_cpp_extension(home)  # torch's include folders, with CUDA_HOME set first

    incs = cpp_extension.include_paths() + [os.path.join(home, "include"), sysconfig.get_paths()["include"]]
    defines = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-DTORCH_EXTENSION_NAME=dspark_C",
               "-DTORCH_API_INCLUDE_EXTENSION_H"]
    common = list(getattr(cpp_extension, "COMMON_NVCC_FLAGS", []))
    return ["-std=c++20"] + [f"-I{p}" for p in ext.include_dirs() + incs] + defines + common


def _link(path, objects, home):
    """Links the extension's objects into the shared library at `path`, as torch's extension build links them
    (torch's libraries and the CUDA runtime); returns [] or ["link"] on failure."""
    import torch

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    cuda_lib = os.path.join(home, "lib64")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    cmd = [os.environ.get("CXX", "c++"), "-shared", "-o", path] + objects + [
        f"-L{torch_lib}", f"-L{cuda_lib}", f"-Wl,-rpath,{torch_lib}", f"-Wl,-rpath,{cuda_lib}", "-lc10", "-ltorch",
        "-ltorch_cpu", "-ltorch_python", "-lc10_cuda", "-ltorch_cuda", "-lcudart"]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    print(f"check_cuda: link {path}: {'ok' if p.returncode == 0 else 'FAILED'} in {time.time() - t0:.0f} s")
    if p.returncode != 0:
        print(" ".join(cmd) + "\n" + p.stdout + p.stderr, file=sys.stderr)
        return ["link"]
    return []


def _add_sass(kernels, outdir, home):
    """Adds resident CTAs per SM to every kernel entry and the SASS facts (tools/sass.py) to the sm_90a ones, from
    the objects in `outdir`; returns the cuobjdump used (None: no disassembler, no `sass` keys)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import sass

    for k in kernels:
        arch = k["arch"] if k["arch"] in sass.ARCH_LIMITS else "sm_90a"
        k["ctas_per_sm"] = {t: sass.resident_ctas(k["registers"] or 0, t, k["static_smem"], arch)
                            for t in (128, 256, 512, 1024)}
    tool = sass.cuobjdump(home)
    if tool is None:
        print("check_cuda: no cuobjdump (toolkit, Triton wheel or nvidia-cuda-cuobjdump): no SASS facts",
              file=sys.stderr)
        return None
    facts = {}
    for obj in sorted(glob.glob(os.path.join(outdir, "*.o"))):
        for name, f in sass.object_facts(obj, tool).items():
            facts[f["mangled"]] = dict(f, demangled=name)
    for k in kernels:
        f = facts.get(k["kernel"])
        if k["arch"] == "sm_90a" and f is not None:  # a kernel in two units (torch and C ABI) gets its own copy
            f = {key: v for key, v in f.items() if key != "mangled"}
            k["demangled"] = f.pop("demangled")
            k["sass"] = f
    return tool


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--keep", help="write objects and full ptxas logs here (default: a temporary folder, removed "
                                   "when everything passes)")
    ap.add_argument("--link", metavar="PATH", help="also link the csrc/torch objects into the extension library at "
                                                   "PATH (what python_tests/test_gpu_build.py loads)")
    ap.add_argument("--json", metavar="PATH", help="also write the per-kernel table (and failures, spills) as JSON "
                                                   "(read by bench/run.py --ptxas-json)")
    args = ap.parse_args()

    ext = _load_ext()
    home = ext.cuda_home()
    nvcc = os.path.join(home or "", "bin", "nvcc")
    if not home or not os.path.isfile(nvcc):
        print(f"check_cuda: no CUDA toolkit (CUDA_HOME={home!r}); set CUDA_HOME to the folder holding bin/nvcc",
              file=sys.stderr)
        return 2
    files = args.files or (sorted(glob.glob(os.path.join(ROOT, "csrc/torch/*.cu")))
                           + sorted(glob.glob(os.path.join(ROOT, "csrc/torch/*.cpp")))
                           + sorted(glob.glob(os.path.join(ROOT, "csrc/capi/*.cu"))))
    torch_flags = None
    outdir = args.keep or tempfile.mkdtemp(prefix="dspark_check_cuda_")
    os.makedirs(outdir, exist_ok=True)

    base = ["-O3", "-lineinfo", "-Xcompiler", "-fPIC", "-Xptxas", "-v"] + ARCH_FLAGS
    jobs = []
    for f in files:
        rel = os.path.relpath(f, ROOT)
        if "/capi/" in f.replace(os.sep, "/"):
            flags = ["-std=c++17", f"-I{os.path.join(ROOT, 'csrc', 'include')}"]
        else:
            if torch_flags is None:
                torch_flags = _torch_flags(ext, home)
            flags = torch_flags
        obj = os.path.join(outdir, rel.replace(os.sep, "_") + ".o")
        jobs.append((rel, [nvcc, "-c", f, "-o", obj] + base + flags))

    def run(job):
        rel, cmd = job
        t0 = time.time()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        with open(os.path.join(outdir, rel.replace(os.sep, "_") + ".log"), "w") as fh:
            fh.write(" ".join(cmd) + "\n" + p.stdout + p.stderr)
        return rel, p.returncode, p.stdout + p.stderr, time.time() - t0

    t_all = time.time()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(run, jobs))

    failed, spills, rows, static_smem = [], [], [], {}
    for rel, rc, log, dt in results:
        print(f"check_cuda: {rel}: {'ok' if rc == 0 else 'FAILED'} in {dt:.0f} s")
        if rc != 0:
            failed.append(rel)
            print(log, file=sys.stderr)
            continue
        func, arch = "?", "?"
        for line in log.splitlines():
            m = re.search(r"Compiling entry function '([^']+)' for '(sm_\w+)'", line)
            if m:
                func, arch = m.group(1), m.group(2)
                continue
            m = re.search(r"Function properties for (\S+)", line)
            if m:
                func = m.group(1)
                continue
            m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
            if m:
                stack, st, ld = (int(x) for x in m.groups())
                if st or ld:
                    spills.append(f"{rel} {arch} {func}: {st} bytes spill stores, {ld} bytes spill loads")
                rows.append([rel, arch, func, None, stack, st + ld])
                continue
            m = re.search(r"Used (\d+) registers", line)
            if m and rows and rows[-1][3] is None:
                rows[-1][3] = int(m.group(1))
                smem = re.search(r"(\d+) bytes smem", line)
                static_smem[(rel, rows[-1][1], rows[-1][2])] = int(smem.group(1)) if smem else 0
    if rows:
        print(f"{'unit':28} {'arch':6} {'regs':>4} {'stack':>5} {'spill':>5}  kernel")
        for rel, arch, func, regs, stack, spill in rows:
            print(f"{rel:28} {arch:6} {regs if regs is not None else '?':>4} {stack:>5} {spill:>5}  {func[:80]}")
    if args.json:
        import json
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        kernels = [dict(unit=rel, arch=arch, kernel=func, registers=regs, stack_bytes=stack, spill_bytes=spill,
                        static_smem=static_smem.get((rel, arch, func), 0))
                   for rel, arch, func, regs, stack, spill in rows]
        sass_tool = _add_sass(kernels, outdir, home)
        with open(args.json, "w") as fh:
            json.dump(dict(nvcc=nvcc, cuobjdump=sass_tool, kernels=kernels, failed=failed, spills=spills), fh, indent=1)
        print(f"check_cuda: wrote the table to {args.json}")
    if args.link and not failed:
        failed += _link(args.link, [os.path.join(outdir, os.path.relpath(f, ROOT).replace(os.sep, "_") + ".o")
                                    for f in files if "/torch/" in f.replace(os.sep, "/")], home)
    bad = bool(failed or spills)
    if args.keep or bad:
        print(f"check_cuda: {len(results)} units in {time.time() - t_all:.0f} s (logs in {outdir})")
    else:
        shutil.rmtree(outdir, ignore_errors=True)
        print(f"check_cuda: {len(results)} units in {time.time() - t_all:.0f} s, all ok")
    for s in spills:
        print(f"check_cuda: SPILL: {s}", file=sys.stderr)
    if failed:
        print(f"check_cuda: compile errors in {', '.join(failed)}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
