"""Build configuration of the CUDA extension and its SIMT twin: toolkit, sources, include folders, flags, digests.

Imports nothing of the package, so ``setup.py`` and ``tools/`` load this file by path; ``_ext.py`` builds and loads
the libraries with it. Nothing here probes for a GPU.

The CUDA toolkit is found from ``CUDA_HOME`` / ``CUDA_PATH``, else torch's guess if it holds a toolkit, else the
``nvcc`` on ``PATH`` (following a symlink or a wrapper script that names the real one), else ``/usr/local/cuda``.
Architectures: ``DSPARK_CUDA_ARCHS`` (default ``8.0;9.0a;10.0a``) plus PTX of the highest, for newer GPUs
(``DSPARK_CUDA_PTX=0``: none); the just-in-time build leaves them to torch when only ``TORCH_CUDA_ARCH_LIST`` is
set.

The ahead-of-time build (``setup.py``'s wheel; ``tools/check_cuda.py`` without a wheel) compiles each translation
unit with one nvcc call (:func:`unit_command`, ``-Xptxas -v``: registers and spills in its log), several at once
(:func:`compile_units`), and links them (:func:`link_command`) as torch's extension build does.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence, Tuple

LIBRARY = "dspark_C"          # the torch.ops namespace of the CUDA extension
SIMT_LIBRARY = "dspark_simt"  # the torch.ops namespace of its SIMT build (CPU dispatch)
SIMT_COUNTING_LIBRARY = "dspark_simt_counting"  # that of the SIMT build with the access model's hooks
CPU_LIBRARY = "dspark_cpu"    # the torch.ops namespace of the CPU kernels (csrc/cpu)
DEFAULT_CUDA_ARCHS = "8.0;9.0a;10.0a"
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------------------------------ sources

def csrc_dir() -> str:
    """The CUDA sources: ``dspark_kernels/csrc`` in an installed wheel, ``<repo>/csrc`` in a checkout."""
    for d in (os.path.join(_PKG_DIR, "csrc"), os.path.join(os.path.dirname(_PKG_DIR), "csrc")):
        if os.path.isfile(os.path.join(d, "include", "dspark", "rng.cuh")):
            return d
    raise RuntimeError(f"dspark_kernels: the CUDA sources (csrc/) are missing next to {_PKG_DIR}; "
                       "reinstall the package")


def sources() -> List[str]:
    """The extension's translation units: the kernels, ``csrc/kernels/*.cu`` (no torch headers), then the torch
    launchers and the op registration, ``csrc/torch/*.cpp`` (host C++, no device code)."""
    d = csrc_dir()
    return sorted(glob.glob(os.path.join(d, "kernels", "*.cu"))) + sorted(glob.glob(os.path.join(d, "torch", "*.cpp")))


def simt_sources() -> List[str]:
    """The SIMT build's translation units: the harness runtime and module, then the extension's (kernels and
    launchers)."""
    d = csrc_dir()
    return [os.path.join(d, "simt", "module.cpp"), os.path.join(d, "simt", "runtime.cpp")] + sources()


def cpu_sources() -> List[str]:
    """The CPU kernels, one ``csrc/cpu/<op>.cpp`` per op, and their registration."""
    return sorted(glob.glob(os.path.join(csrc_dir(), "cpu", "*.cpp")))


@functools.lru_cache(maxsize=None)
def digest(*subdirs: str) -> str:
    """A digest of the path and content of every file under ``csrc/<subdir>`` (computed once per process).

    torch's rebuild check sees only the sources it compiles, so the builds put this digest into their flags or
    their generated source: ``digest("include")`` for the CUDA extension, every folder for the SIMT unity build.
    """
    h = hashlib.sha1()
    for sub in subdirs:
        for p in sorted(glob.glob(os.path.join(csrc_dir(), sub, "**", "*"), recursive=True)):
            if os.path.isfile(p):
                h.update(p.encode())
                with open(p, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ toolkit

def is_toolkit(home: Optional[str]) -> bool:
    return bool(home) and os.path.isfile(os.path.join(home, "bin", "nvcc")) and \
        os.path.isfile(os.path.join(home, "include", "cuda_runtime.h"))


def _toolkit_from_nvcc(nvcc: str) -> Optional[str]:
    """The toolkit root of an ``nvcc`` executable: follow symlinks, or read a wrapper script's target."""
    real = os.path.realpath(nvcc)
    home = os.path.dirname(os.path.dirname(real))
    if is_toolkit(home):
        return home
    try:
        with open(real, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if head.startswith(b"#!"):
        for m in re.finditer(rb"(/[^\s'\"]*?)/bin/nvcc\b", head):
            cand = m.group(1).decode(errors="replace")
            if is_toolkit(cand):
                return cand
    return None


def cuda_home() -> Optional[str]:
    """The CUDA toolkit root (the folder holding ``bin/nvcc``), or None when none is found."""
    env = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if env:
        return env
    cpp_ext = sys.modules.get("torch.utils.cpp_extension")
    guess = getattr(cpp_ext, "CUDA_HOME", None) if cpp_ext is not None else None
    if guess is None:  # torch's own guess, without importing cpp_extension (which logs about it)
        nvcc = shutil.which("nvcc")
        guess = os.path.dirname(os.path.dirname(nvcc)) if nvcc else "/usr/local/cuda"
    if is_toolkit(guess):
        return guess
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = _toolkit_from_nvcc(nvcc)
        if home:
            return home
    return "/usr/local/cuda" if is_toolkit("/usr/local/cuda") else None


def import_cpp_extension(home: str):
    """``torch.utils.cpp_extension`` with its CUDA_HOME set to ``home`` (torch guesses from PATH otherwise)."""
    if "torch.utils.cpp_extension" not in sys.modules:
        saved = os.environ.get("CUDA_HOME")
        os.environ["CUDA_HOME"] = home  # only while importing: its module-level guess reads the environment
        try:
            from torch.utils import cpp_extension
        finally:
            if saved is None:
                os.environ.pop("CUDA_HOME", None)
            else:
                os.environ["CUDA_HOME"] = saved
    from torch.utils import cpp_extension
    cpp_extension.CUDA_HOME = home
    return cpp_extension


_import_cpp_extension = import_cpp_extension  # the name tools/check_cuda.py calls


def _nvidia_wheel_includes() -> List[str]:
    """``<site-packages>/nvidia/cu13/include`` (torch's CUDA wheels: cusparse.h etc. that torch headers include)."""
    try:
        import nvidia  # namespace package installed with torch's CUDA wheels
        import torch
    except ImportError:
        return []
    out = []
    major = (torch.version.cuda or "").split(".")[0]
    for root in getattr(nvidia, "__path__", []):
        for sub in ([f"cu{major}"] if major else []) + ["cuda_runtime"]:
            inc = os.path.join(root, sub, "include")
            if os.path.isdir(inc) and inc not in out:
                out.append(inc)
    return out


def cuda_header_dirs() -> List[str]:
    """Folders holding cuda_runtime.h / cuda_bf16.h: the toolkit's, else those of torch's CUDA wheels."""
    home = cuda_home()
    dirs = [os.path.join(home, "include")] if is_toolkit(home) else []
    dirs += [d for d in _nvidia_wheel_includes() if os.path.isfile(os.path.join(d, "cuda_runtime.h"))]
    return dirs


# ------------------------------------------------------------------------------------------------ flags

def include_dirs() -> List[str]:
    """Include folders of the CUDA extension (the package headers, then torch's CUDA wheel headers)."""
    return [os.path.join(csrc_dir(), "include")] + _nvidia_wheel_includes()


def nvcc_flags(arch_flags: bool = True) -> List[str]:
    """nvcc's flags (the just-in-time build adds torch's); the architectures' unless ``TORCH_CUDA_ARCH_LIST`` alone
    names them (torch then adds its own)."""
    flags = ["-O3", "-lineinfo"]  # torch adds -std=c++20 (its headers need it)
    if arch_flags and (os.environ.get("DSPARK_CUDA_ARCHS") or not os.environ.get("TORCH_CUDA_ARCH_LIST")):
        flags += gencode_flags(cuda_archs())
    return flags


_ARCH = re.compile(r"^(\d+)\.(\d)([af]?)$")


def cuda_archs(spec: Optional[str] = None) -> List[Tuple[int, int, str]]:
    """``(major, minor, suffix)`` of each architecture in ``spec`` (default ``DSPARK_CUDA_ARCHS``, else
    ``DEFAULT_CUDA_ARCHS``): ``;``-separated like ``8.0;9.0a;10.0a`` (``a``: architecture-specific, ``f``: family),
    sorted; a ValueError naming the variable for anything else."""
    spec = spec if spec is not None else (os.environ.get("DSPARK_CUDA_ARCHS") or DEFAULT_CUDA_ARCHS)
    out = set()
    for entry in filter(None, (e.strip() for e in re.split(r"[;,\s]+", spec))):
        m = _ARCH.match(entry)
        if m is None:
            raise ValueError(f"DSPARK_CUDA_ARCHS: {entry!r} is not an architecture like 8.0, 9.0a or 10.0f "
                             f"(';'-separated; got {spec!r})")
        if int(m.group(1)) < 8:
            raise ValueError(f"DSPARK_CUDA_ARCHS: {entry!r} is below 8.0, the oldest the kernels support "
                             "(cp.async, bfloat16)")
        out.add((int(m.group(1)), int(m.group(2)), m.group(3)))
    if not out:
        raise ValueError(f"DSPARK_CUDA_ARCHS names no architecture (got {spec!r})")
    return sorted(out)


def ptx_wanted() -> bool:
    """``DSPARK_CUDA_PTX``: ``1`` (the default) adds PTX of the highest architecture, ``0`` none (a build for known
    GPUs only, one front-end pass fewer); a ValueError naming the variable for anything else."""
    flag = os.environ.get("DSPARK_CUDA_PTX", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"DSPARK_CUDA_PTX must be 0 or 1, got {flag!r}")
    return flag == "1"


def arch_targets(archs: Sequence[Tuple[int, int, str]]) -> Tuple[List[str], List[str]]:
    """``(SASS targets, PTX targets)`` of ``archs``: SASS of each, plus (:func:`ptx_wanted`) PTX of the highest
    without its suffix (an ``a`` / ``f`` PTX runs only on its own architecture or family; a plain one on every later
    GPU)."""
    major, minor, _ = archs[-1]
    return [f"sm_{a}{b}{s}" for a, b, s in archs], [f"compute_{major}{minor}"] if ptx_wanted() else []


def gencode_flags(archs: Sequence[Tuple[int, int, str]]) -> List[str]:
    """nvcc's ``-gencode`` flags for :func:`arch_targets` (the plain highest one's SASS and PTX from one pass)."""
    ptx = ptx_wanted()
    flags = []
    for i, (major, minor, suffix) in enumerate(archs):
        v = f"{major}{minor}"
        code = f"[sm_{v},compute_{v}]" if ptx and i == len(archs) - 1 and not suffix else f"sm_{v}{suffix}"
        flags.append(f"-gencode=arch=compute_{v}{suffix},code={code}")
    major, minor, suffix = archs[-1]
    if ptx and suffix:
        flags.append(f"-gencode=arch=compute_{major}{minor},code=compute_{major}{minor}")
    return flags


def cxx_flags() -> List[str]:
    return ["-O3"]


# ------------------------------------------------------------------------------------------------ ahead of time

def registered_ops(subdir: str = "torch") -> List[str]:
    """The ops whose kernels ``csrc/<subdir>`` registers (every ``m.impl("<name>", ...)``), sorted."""
    names = set()
    for p in glob.glob(os.path.join(csrc_dir(), subdir, "*.c*")):
        with open(p) as f:
            names.update(re.findall(r'\bm\.impl\(\s*"(\w+)"', f.read()))
    return sorted(names)


def nvcc_release(home: str) -> str:
    """The toolkit's release, e.g. ``"13.0"`` (from ``nvcc --version``)."""
    out = subprocess.run([os.path.join(home, "bin", "nvcc"), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    if m is None:
        raise RuntimeError(f"cannot read the release of {home}/bin/nvcc from: {out.strip()[-200:]!r}")
    return m.group(1)


def torch_unit_flags(home: str, extension_name: str) -> List[str]:
    """nvcc's flags for an extension unit besides the architectures: the extension's include folders, torch's
    and Python's, torch's defines and nvcc flags, as torch's extension build passes them."""
    import sysconfig

    import torch

    cpp_extension = import_cpp_extension(home)
    incs = include_dirs() + cpp_extension.include_paths() + [os.path.join(home, "include"),
                                                             sysconfig.get_paths()["include"]]
    defines = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               f"-DTORCH_EXTENSION_NAME={extension_name}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    return (nvcc_flags(arch_flags=False) + ["-std=c++20", "-Xcompiler", "-fPIC", "-Xptxas", "-v"]
            + [f"-I{p}" for p in incs] + defines + list(getattr(cpp_extension, "COMMON_NVCC_FLAGS", [])))


def capi_unit_flags() -> List[str]:
    """nvcc's flags for a ``csrc/capi`` unit besides the architectures (csrc/include only, no torch)."""
    return nvcc_flags(arch_flags=False) + ["-std=c++17", "-Xcompiler", "-fPIC", "-Xptxas", "-v",
                                           f"-I{os.path.join(csrc_dir(), 'include')}"]


def unit_name(rel: str) -> str:
    """The file-name stem of a unit's object and log: ``csrc/kernels/x.cu`` -> ``csrc_kernels_x.cu``."""
    return rel.replace(os.sep, "_").replace("/", "_")


def unit_command(home: str, src: str, obj: str, flags: Sequence[str], archs) -> List[str]:
    return [os.path.join(home, "bin", "nvcc"), "-c", src, "-o", obj] + list(flags) + gencode_flags(archs)


def included_bytes(path: str, seen: Optional[set] = None) -> int:
    """Bytes of ``path`` and of every file it includes by ``#include "..."`` (found beside the includer or under
    ``csrc/include``), each counted once: the device code a unit's compile sees."""
    seen = set() if seen is None else seen
    path = os.path.abspath(path)
    if path in seen or not os.path.isfile(path):
        return 0
    seen.add(path)
    with open(path) as f:
        names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read(), re.M)
    total = os.path.getsize(path)
    for name in names:
        for base in (os.path.dirname(path), os.path.join(csrc_dir(), "include")):
            if os.path.isfile(os.path.join(base, name)):
                total += included_bytes(os.path.join(base, name), seen)
                break
    return total


def compile_units(units: Sequence[Tuple[str, List[str]]], outdir: str, jobs: int, cwd: str) -> List[tuple]:
    """Run each ``(rel, command)``, ``jobs`` at a time, each writing ``<outdir>/<unit_name(rel)>.log`` (the command,
    then its output: ptxas's registers and spills); ``(rel, returncode, output, seconds)`` per unit, in order. The
    units start largest first (:func:`included_bytes`), so that a long compile does not start last and run alone."""
    os.makedirs(outdir, exist_ok=True)

    def run(unit):
        rel, cmd = unit
        t0 = time.time()
        p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
        with open(os.path.join(outdir, unit_name(rel) + ".log"), "w") as fh:
            fh.write(" ".join(cmd) + "\n" + p.stdout + p.stderr)
        return rel, p.returncode, p.stdout + p.stderr, time.time() - t0

    order = sorted(range(len(units)), key=lambda i: -included_bytes(os.path.join(cwd, units[i][0])))
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        done = dict(zip(order, pool.map(run, [units[i] for i in order])))
    return [done[i] for i in range(len(units))]


def link_command(path: str, objects: Sequence[str], home: str) -> List[str]:
    """Link the extension's objects into the shared library ``path`` as torch's extension build links them: torch's
    libraries and the CUDA runtime by name, no run path (``import torch`` has loaded them when it loads)."""
    import torch

    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return [os.environ.get("CXX", "c++"), "-shared", "-o", path] + list(objects) + [
        f"-L{torch_lib}", f"-L{os.path.join(home, 'lib64')}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
        "-lc10_cuda", "-ltorch_cuda", "-lcudart"]


def cpu_include_dirs() -> List[str]:
    return [os.path.join(csrc_dir(), "include"), os.path.join(csrc_dir(), "cpu")]


def cpu_flags() -> tuple:
    """``(compile flags, link flags)`` of the CPU kernels: OpenMP for ATen's parallel_for and ``omp simd`` loops
    (torch's own libgomp serves it at run time); no errno and no floating-point traps, so the sweeps' selects
    if-convert and vectorize (IEEE results unchanged); FMA contraction where an instruction set has it. No
    instruction-set flag: the hot sweeps carry GCC's ``target_clones`` (x86-64-v4 = AVX-512, x86-64-v3 = AVX2 + FMA,
    the baseline) and the loader picks the clone for the CPU it runs on."""
    return ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast"], ["-fopenmp"]


def simt_include_dirs() -> List[str]:
    d = csrc_dir()
    return [os.path.join(d, "include"), os.path.join(d, "simt"), os.path.join(d, "torch")] + cuda_header_dirs()


# The counting SIMT build's access model (csrc/simt/access_model.h): GCC's kernel-address instrumentation in call
# mode turns every load and store into a call of a hook the runtime defines (no shadow memory, no sanitizer runtime);
# scalar replacement of aggregates, store merging, vectorisation and loop-to-memcpy rewriting stay off, so that a
# 16-byte vector access stays one 16-byte access and scalar ones stay scalar, as nvcc compiles them. Its ops are
# torch.ops.dspark_simt_counting (csrc/torch/common.h), so it loads beside the plain build in one process.
SIMT_MODEL_FLAGS = ["-DDSPARK_SIMT_MODEL", "-fsanitize=kernel-address", "--param",
                    "asan-instrumentation-with-call-threshold=0", "--param", "asan-stack=0", "--param",
                    "asan-globals=0", "-fno-tree-sra", "-fno-ipa-sra", "-fno-store-merging", "-fno-tree-vectorize",
                    "-fno-tree-loop-distribute-patterns"]


def simt_flags(sanitize: bool, counting: bool = False) -> tuple:
    """``(compile flags, link flags)`` of the SIMT build: the plain build has no instrumentation (the correctness
    tests run on it); ``counting`` adds the access model's (``simt.record(access=True)`` and the cp.async
    destination check load that build); ``sanitize`` builds with AddressSanitizer + UBSan instead (the sanitizer
    and the model's instrumentation cannot be combined)."""
    # Line tables (-g1) only where they are read: the sanitizers' reports and the counting build's by_line
    # (addr2line). Full debug information would add half again to those builds' compile time; without any, the plain
    # build compiles in two thirds of the time. The counting build runs only small access-model cases: -O1 compiles
    # it faster. UBSan's null and pointer-overflow checks are left out of the sanitized build: a null dereference
    # faults there anyway (ASan reports the SEGV with its stack), and ASan checks every access a wrapped pointer makes;
    # they were 13 % of its compile time (282 s against 326 s, g++ 12, one core). Alignment stays checked (the
    # kernels' 16-byte vector accesses).
    if sanitize:
        san = ["-fsanitize=address,undefined", "-fno-sanitize=null,pointer-overflow", "-fno-sanitize-recover=undefined",
               "-fno-omit-frame-pointer"]
        return ["-DDSPARK_SIMT", "-g1", "-O1"] + san, san
    return ["-DDSPARK_SIMT"] + (["-O1", "-g1"] + SIMT_MODEL_FLAGS if counting else ["-O2"]), []


def simt_unity_source() -> str:
    """The SIMT build's one translation unit: the runtime first (its keyword macros precede every CUDA header),
    then every source; the text holds the digest of every source and header, so torch's rebuild check sees them."""
    sources_digest = digest("include", "kernels", "simt", "torch")
    return (f"// generated by dspark_kernels/_build.py (sources digest {sources_digest})\n"
            '#include "dspark_simt/runtime.h"\n' + "".join(f'#include "{p}"\n' for p in simt_sources()))


def torch_locks_by_existence() -> bool:
    """True when torch's JIT build lock blocks by the mere existence of ``<build_dir>/lock`` (its ``FileBaton``,
    torch < 2.14), so a killed build leaves a lock that blocks every later one; False when torch holds an OS-level
    flock on that file instead (torch >= 2.14: the kernel releases it when the holder dies, and the file stays)."""
    from torch.utils import cpp_extension

    return hasattr(cpp_extension, "FileBaton")


def clear_stale_lock(build_dir: str, max_age_s: float = 600.0, *, by_existence: Optional[bool] = None) -> None:
    """torch's JIT build holds ``<build_dir>/lock`` while it compiles; with a lock that blocks by existence
    (``by_existence``, default :func:`torch_locks_by_existence`) a build killed midway leaves it behind and every
    later build waits on it forever. Remove such a lock older than ``max_age_s`` when no process is building in
    that folder (none has it as its working directory, as ninja does), saying so; raise naming the file when that
    cannot be told (no /proc). Processes that start together (pytest -n workers) decide one at a time, under an
    flock of ``<build_dir>/lock.clear``: a lock that another one removed, or that a fresh build made since, stays.
    An flock-style lock is never stale and is left alone (removing its file could let two builds run at once)."""
    import fcntl

    if by_existence is None:
        by_existence = torch_locks_by_existence()
    if not by_existence:
        return
    lock = os.path.join(build_dir, "lock")
    if _lock_age(lock) is None:
        return  # no lock: nothing to do
    with open(os.path.join(build_dir, "lock.clear"), "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        age = _lock_age(lock)
        if age is None or age < max_age_s:
            return  # removed by another process, or a build may be running right now: torch waits for it
        if not os.path.isdir("/proc/self"):
            raise RuntimeError(f"dspark_kernels: the extension build lock {lock} is {age / 60:.0f} minutes old; if "
                               f"no build of the extension is running, delete that file and retry")
        if _building_in(build_dir):
            return  # a live build (ninja / nvcc run in the build folder): leave its lock alone
        try:
            os.remove(lock)
        except FileNotFoundError:
            return
        except OSError as e:
            raise RuntimeError(f"dspark_kernels: the extension build lock {lock} is stale ({age / 60:.0f} minutes "
                               f"old, no build running) and could not be removed ({e}); delete it and retry") from e
    print(f"dspark_kernels: removed a stale build lock {lock} ({age / 60:.0f} minutes old, no build running; "
          f"left by a build that was killed)", file=sys.stderr, flush=True)


def _lock_age(lock: str):
    """Seconds since ``lock`` was last modified, or None when it does not exist."""
    import time

    try:
        return time.time() - os.path.getmtime(lock)
    except OSError:
        return None


def _building_in(build_dir: str) -> bool:
    """True when a process (ninja, nvcc, the compiler) has ``build_dir`` as its working directory."""
    target = os.path.realpath(build_dir)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) == target:
                return True
        except OSError:
            continue
    return False


def asan_preload() -> str:
    """The LD_PRELOAD value a sanitized SIMT run needs: the compiler's ASan runtime, then libstdc++ (so ASan's
    exception interceptors find the real __cxa_throw)."""
    cxx = os.environ.get("CXX", "c++")
    libs = [subprocess.run([cxx, f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
            for lib in ("libasan.so", "libstdc++.so")]
    return " ".join(libs)
