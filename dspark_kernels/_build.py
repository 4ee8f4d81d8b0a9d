"""Build configuration of the CUDA extension and its SIMT twin: toolkit, sources, include folders, flags, digests.

Imports nothing of the package, so ``setup.py`` and ``tools/`` load this file by path; ``_ext.py`` builds and loads
the libraries with it. Nothing here probes for a GPU.

The CUDA toolkit is found from ``CUDA_HOME`` / ``CUDA_PATH``, else torch's guess if it holds a toolkit, else the
``nvcc`` on ``PATH`` (following a symlink or a wrapper script that names the real one), else ``/usr/local/cuda``.
Architectures: sm_80 (+ PTX) and sm_90a, unless ``TORCH_CUDA_ARCH_LIST`` is set.
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
from typing import List, Optional

LIBRARY = "dspark_C"          # the torch.ops namespace of the CUDA extension
SIMT_LIBRARY = "dspark_simt"  # the torch.ops namespace of its SIMT build (CPU dispatch)
SIMT_COUNTING_LIBRARY = "dspark_simt_counting"  # that of the SIMT build with the access model's hooks
CPU_LIBRARY = "dspark_cpu"    # the torch.ops namespace of the CPU kernels (csrc/cpu)
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
    """The torch launchers and the op registration, ``csrc/torch/*.cu`` then ``*.cpp``."""
    d = os.path.join(csrc_dir(), "torch")
    return sorted(glob.glob(os.path.join(d, "*.cu"))) + sorted(glob.glob(os.path.join(d, "*.cpp")))


def simt_sources() -> List[str]:
    """The SIMT build's translation units: the harness runtime and module, then the same launchers."""
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
    flags = ["-O3", "-lineinfo"]  # torch adds -std=c++20 (its headers need it)
    if arch_flags and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        flags += ["-gencode=arch=compute_80,code=[sm_80,compute_80]", "-gencode=arch=compute_90a,code=sm_90a"]
    return flags


def cxx_flags() -> List[str]:
    return ["-O3"]


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
    if sanitize:
        san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]
        return ["-DDSPARK_SIMT", "-g", "-O1"] + san, san
    # -g only where it is read: the counting build's by_line (addr2line); without it the plain build compiles in
    # two thirds of the time
    return ["-DDSPARK_SIMT", "-O2"] + (["-g"] + SIMT_MODEL_FLAGS if counting else []), []


def simt_unity_source() -> str:
    """The SIMT build's one translation unit: the runtime first (its keyword macros precede every CUDA header),
    then every source; the text holds the digest of every source and header, so torch's rebuild check sees them."""
    return (f"// generated by dspark_kernels/_build.py (sources digest {digest('include', 'simt', 'torch')})\n"
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
