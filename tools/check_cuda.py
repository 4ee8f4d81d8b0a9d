#!/usr/bin/env python
"""Compile every CUDA translation unit with ``-Xptxas -v`` (or read a wheel build's logs); fail on errors or spills.

Usage: ``python tools/check_cuda.py [-j JOBS] [--archs A] [--keep DIR] [--json PATH] [--link PATH] [--from-build DIR]
[--ptxas-log UNIT=LOG] [--binary SO] [files...]`` (default files: csrc/kernels/*.cu, csrc/torch/*.cpp,
csrc/capi/dspark_capi.cpp; with ``--from-build`` or ``--ptxas-log``: none). The extension's units get the include
folders and flags of its build (dspark_kernels/_build.py); the C ABI's (host code over the kernel units) gets only
csrc/include. Architectures: ``--archs``, else ``DSPARK_CUDA_ARCHS``, else the wheel's default (8.0;9.0a;10.0a, PTX
of the highest). Prints a per-kernel resource table (registers, stack frame, spill bytes) and exits 1 if any compile
fails or any kernel spills (non-zero "bytes spill" line). Needs no GPU. CUDA_HOME is resolved like the extension
does (CUDA_HOME / CUDA_PATH, nvcc on PATH, ...).

``--from-build DIR`` reads the nvcc logs a wheel build wrote (``DSPARK_BUILD_LOGS=DIR pip wheel ...``: one per
unit, listed in ``DIR/units.json``) instead of compiling those units again, ``--ptxas-log UNIT=LOG`` a unit's ptxas
lines from another build's log (a CMake build with ``-DCMAKE_CUDA_FLAGS="-Xptxas -v"``), and each ``--binary SO`` (the
wheel's ``dspark_kernels/_C*.so``, ``libdspark_capi.so``) is disassembled for the SASS facts: the report is then that
of the binaries that ship. Files named besides are compiled and added.

With ``--json PATH`` each kernel's entry also has its static shared memory, resident CTAs per SM at 128 / 256 /
512 / 1024 threads (from registers and static shared memory), and for sm_90a a ``sass`` key: opcode counts and the
innermost loops of its disassembly (``tools/sass.py``; cuobjdump from the toolkit or the Triton wheel); ``binaries``
lists the SASS and PTX architectures each disassembled file holds. The kernel tests read that report through
``python_tests/sass_facts.py`` (CI writes it to build/check_cuda.json first).

With ``--link PATH`` the compiled extension objects (csrc/kernels, csrc/torch) are also linked into its library, which
``python_tests/test_gpu_build.py`` loads without a GPU to compare its registered schemas with the SIMT build's.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_build():
    """dspark_kernels/_build.py by path (not the whole package: only its flag and path helpers are needed)."""
    spec = importlib.util.spec_from_file_location("_dspark_build", os.path.join(ROOT, "dspark_kernels", "_build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compile(build, home, files, outdir, jobs, archs):
    """Compiles `files` into `outdir` (objects and logs); ``(rel, returncode, log, seconds)`` per file."""
    torch_flags = None
    units = []
    for f in files:
        rel = os.path.relpath(f, ROOT)
        if "/capi/" in f.replace(os.sep, "/"):
            flags = build.capi_unit_flags()
        else:
            torch_flags = torch_flags or build.torch_unit_flags(home, build.LIBRARY)
            flags = torch_flags
        obj = os.path.join(outdir, build.unit_name(rel) + ".o")
        units.append((rel, build.unit_command(home, f, obj, flags, archs)))
    return build.compile_units(units, outdir, jobs, ROOT)


def _from_build(logs):
    """The results a wheel build logged in `logs` (``units.json`` and one nvcc log per unit), as ``_compile``'s."""
    try:
        with open(os.path.join(logs, "units.json")) as f:
            units = json.load(f)["units"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"check_cuda: --from-build {logs}: no build's units.json there ({e}); build the wheel with "
                         f"DSPARK_BUILD_LOGS={logs}")
    out = []
    for u in units:
        with open(os.path.join(logs, u["log"])) as f:
            out.append((u["unit"], 0, f.read().split("\n", 1)[1], u["seconds"]))
    return out


def _from_logs(pairs):
    """``UNIT=LOG`` pairs: each unit's ptxas lines read from a build's log (CI: the C ABI's CMake build with
    ``-Xptxas -v``), as ``_compile``'s results."""
    out = []
    for pair in pairs:
        unit, _, log = pair.partition("=")
        try:
            with open(log) as f:
                text = f.read()
        except OSError as e:
            raise SystemExit(f"check_cuda: --ptxas-log {pair}: cannot read {log!r} ({e})")
        if "Compiling entry function" not in text:
            raise SystemExit(f"check_cuda: --ptxas-log {pair}: no ptxas output in {log} (was {unit} compiled in "
                             "that build, with -Xptxas -v?)")
        out.append((unit, 0, text, 0))
    return out


def _link(build, path, objects, home):
    """Links the extension's objects into the shared library at `path`; returns [] or ["link"] on failure."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    cmd = build.link_command(path, objects, home)
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    print(f"check_cuda: link {path}: {'ok' if p.returncode == 0 else 'FAILED'} in {time.time() - t0:.0f} s")
    if p.returncode != 0:
        print(" ".join(cmd) + "\n" + p.stdout + p.stderr, file=sys.stderr)
        return ["link"]
    return []


def _add_sass(kernels, binaries, home):
    """Adds resident CTAs per SM to every kernel entry and the SASS facts (tools/sass.py) of `binaries` (objects or
    the wheel's library) to the sm_90a ones; returns ``(cuobjdump used, {binary: its architectures})`` (no
    disassembler: ``(None, {})``, no `sass` keys)."""
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
        return None, {}
    facts = {}
    for binary in binaries:
        for name, f in sass.object_facts(binary, tool).items():
            facts[f["mangled"]] = dict(f, demangled=name)
    for k in kernels:
        f = facts.get(k["kernel"])
        if k["arch"] == "sm_90a" and f is not None:  # a kernel in two units (torch and C ABI) gets its own copy
            f = {key: v for key, v in f.items() if key != "mangled"}
            k["demangled"] = f.pop("demangled")
            k["sass"] = f
    return tool, {b: sass.binary_archs(b, tool) for b in binaries}


def _parse(results):
    """ptxas's lines of each unit's log -> (failed units, spills, rows [unit, arch, kernel, regs, stack, spill],
    static shared memory per (unit, arch, kernel))."""
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
    return failed, spills, rows, static_smem


def _print_table(rows):
    if rows:
        print(f"{'unit':28} {'arch':7} {'regs':>4} {'stack':>5} {'spill':>5}  kernel")
        for rel, arch, func, regs, stack, spill in rows:
            print(f"{rel:28} {arch:7} {regs if regs is not None else '?':>4} {stack:>5} {spill:>5}  {func[:80]}")


def _write_json(path, nvcc, rows, static_smem, binaries, home, failed, spills):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    kernels = [dict(unit=rel, arch=arch, kernel=func, registers=regs, stack_bytes=stack, spill_bytes=spill,
                    static_smem=static_smem.get((rel, arch, func), 0))
               for rel, arch, func, regs, stack, spill in rows]
    sass_tool, archs = _add_sass(kernels, binaries, home)
    with open(path, "w") as fh:
        json.dump(dict(nvcc=nvcc, cuobjdump=sass_tool, binaries=archs, kernels=kernels, failed=failed, spills=spills),
                  fh, indent=1)
    print(f"check_cuda: wrote the table to {path}")


def _args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--archs", help="architectures like 8.0;9.0a (default: DSPARK_CUDA_ARCHS, else the wheel's)")
    ap.add_argument("--keep", help="write objects and full ptxas logs here (default: a temporary folder, removed "
                                   "when everything passes)")
    ap.add_argument("--link", metavar="PATH", help="also link the compiled extension objects into the extension "
                                                   "library at PATH (what python_tests/test_gpu_build.py loads)")
    ap.add_argument("--json", metavar="PATH", help="also write the per-kernel table (and failures, spills) as JSON "
                                                   "(read by bench/run.py --ptxas-json)")
    ap.add_argument("--from-build", metavar="DIR", help="read the nvcc logs a wheel build wrote to DIR "
                                                        "(DSPARK_BUILD_LOGS) instead of compiling those units")
    ap.add_argument("--ptxas-log", action="append", default=[], metavar="UNIT=LOG",
                    help="read UNIT's ptxas output from LOG, a build's log (CI: the C ABI's CMake build)")
    ap.add_argument("--binary", action="append", default=[], metavar="SO",
                    help="disassemble this library too for the SASS facts (the wheel's dspark_kernels/_C*.so)")
    return ap.parse_args()


def main() -> int:
    args = _args()
    build = _load_build()
    home = build.cuda_home()
    nvcc = os.path.join(home or "", "bin", "nvcc")
    if not home or not os.path.isfile(nvcc):
        print(f"check_cuda: no CUDA toolkit (CUDA_HOME={home!r}); set CUDA_HOME to the folder holding bin/nvcc",
              file=sys.stderr)
        return 2
    files = args.files or ([] if args.from_build or args.ptxas_log else
                           build.sources() + [os.path.join(ROOT, "csrc", "capi", "dspark_capi.cpp")])
    outdir = args.keep or tempfile.mkdtemp(prefix="dspark_check_cuda_")
    t_all = time.time()
    results = (_from_build(args.from_build) if args.from_build else []) + _from_logs(args.ptxas_log)
    results += _compile(build, home, files, outdir, args.jobs, build.cuda_archs(args.archs))
    failed, spills, rows, static_smem = _parse(results)
    _print_table(rows)
    objects = sorted(glob.glob(os.path.join(outdir, "*.o")))
    if args.json:
        _write_json(args.json, nvcc, rows, static_smem, args.binary + objects, home, failed, spills)
    if args.link and not failed:
        failed += _link(build, args.link, [os.path.join(outdir, build.unit_name(os.path.relpath(f, ROOT)) + ".o")
                                           for f in files if "/capi/" not in f.replace(os.sep, "/")], home)
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
