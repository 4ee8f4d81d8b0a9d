"""The CUDA extension ``torch.ops.dspark_C``: ahead-of-time module or just-in-time build; and its SIMT twin.

``load()`` returns ``torch.ops.dspark_C`` once the extension is loaded:

1. the ahead-of-time module ``dspark_kernels._C`` (``DSPARK_BUILD_CUDA=1 pip install --no-build-isolation .``), else
2. a just-in-time build of ``csrc/torch/*.cu`` + ``*.cpp`` with ``torch.utils.cpp_extension.load``, cached in torch's
   extension folder (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``); the first build takes minutes.

``is_available()`` says whether that works, without ever probing for a GPU (the extension builds and loads on a
machine without one; running its ops needs one). Set ``DSPARK_NO_JIT=1`` to use only the ahead-of-time module.

The CUDA toolkit is found from ``CUDA_HOME`` / ``CUDA_PATH``, else torch's guess if it holds a toolkit, else the
``nvcc`` on ``PATH`` (following a symlink or a wrapper script that names the real one), else ``/usr/local/cuda``.
Architectures: sm_80 (+ PTX) and sm_90a, unless ``TORCH_CUDA_ARCH_LIST`` is set.

The SIMT build (``DSPARK_SIMT=1``; ``load_simt()``) compiles the same launchers and kernel templates with the host
C++ compiler against ``csrc/simt`` into a CPU extension whose ops (``torch.ops.dspark_simt``, the same schemas as
``dspark_C``) run the CUDA kernels on CPU tensors; ``dspark_kernels.simt`` drives it. It needs the CUDA headers only
(the toolkit's, or those of torch's CUDA wheels), no GPU and no nvcc. ``DSPARK_SIMT_SANITIZE=1`` builds it with
AddressSanitizer and UndefinedBehaviorSanitizer; Python must then start with the ASan runtime preloaded
(``LD_PRELOAD`` = ``asan_preload()``: the ASan runtime, then libstdc++).
"""

from __future__ import annotations

import glob
import hashlib
import importlib
import os
import re
import shutil
import sys
import threading
from typing import List, Optional

import torch

__all__ = ["load", "is_available", "has_op", "kernels", "load_simt", "simt_enabled", "register_fake", "cuda_home",
           "csrc_dir", "include_dirs", "nvcc_flags", "cxx_flags", "sources", "LIBRARY", "SIMT_LIBRARY"]

LIBRARY = "dspark_C"  # the torch.ops namespace of the extension
SIMT_LIBRARY = "dspark_simt"  # the torch.ops namespace of its SIMT build (CPU dispatch)
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))

_lock = threading.RLock()
_ops = None                    # torch.ops.dspark_C once loaded
_error: Optional[str] = None   # why loading failed (cached: no rebuild attempt per call)
_available: Optional[bool] = None
_simt_module = None            # the SIMT build's Python module once loaded
_simt_error: Optional[str] = None
_fakes: dict = {}              # op name -> fake implementation, registered on both libraries when they load


# ------------------------------------------------------------------------------------------------ locations

def csrc_dir() -> str:
    """The CUDA sources: ``dspark_kernels/csrc`` in an installed wheel, ``<repo>/csrc`` in a checkout."""
    for d in (os.path.join(_PKG_DIR, "csrc"), os.path.join(os.path.dirname(_PKG_DIR), "csrc")):
        if os.path.isfile(os.path.join(d, "include", "dspark", "rng.cuh")):
            return d
    raise RuntimeError(f"dspark_kernels: the CUDA sources (csrc/) are missing next to {_PKG_DIR}; "
                       "reinstall the package")


def sources() -> List[str]:
    d = os.path.join(csrc_dir(), "torch")
    return sorted(glob.glob(os.path.join(d, "*.cu"))) + sorted(glob.glob(os.path.join(d, "*.cpp")))


def _is_toolkit(home: Optional[str]) -> bool:
    return bool(home) and os.path.isfile(os.path.join(home, "bin", "nvcc")) and \
        os.path.isfile(os.path.join(home, "include", "cuda_runtime.h"))


def _toolkit_from_nvcc(nvcc: str) -> Optional[str]:
    """The toolkit root of an ``nvcc`` executable: follow symlinks, or read a wrapper script's target."""
    real = os.path.realpath(nvcc)
    home = os.path.dirname(os.path.dirname(real))
    if _is_toolkit(home):
        return home
    try:
        with open(real, "rb") as f:
            head = f.read(4096)
    except OSError:
        return None
    if head.startswith(b"#!"):
        for m in re.finditer(rb"(/[^\s'\"]*?)/bin/nvcc\b", head):
            cand = m.group(1).decode(errors="replace")
            if _is_toolkit(cand):
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
    if _is_toolkit(guess):
        return guess
    nvcc = shutil.which("nvcc")
    if nvcc:
        home = _toolkit_from_nvcc(nvcc)
        if home:
            return home
    return "/usr/local/cuda" if _is_toolkit("/usr/local/cuda") else None


def _nvidia_wheel_includes() -> List[str]:
    """``<site-packages>/nvidia/cu13/include`` (torch's CUDA wheels: cusparse.h etc. that torch headers include)."""
    try:
        import nvidia  # namespace package installed with torch's CUDA wheels
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


def include_dirs() -> List[str]:
    """Include folders of our sources (the package headers, then torch's CUDA wheel headers)."""
    return [os.path.join(csrc_dir(), "include")] + _nvidia_wheel_includes()


def nvcc_flags(arch_flags: bool = True) -> List[str]:
    flags = ["-O3", "-lineinfo"]  # torch adds -std=c++20 (its headers need it)
    if arch_flags and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        flags += ["-gencode=arch=compute_80,code=[sm_80,compute_80]", "-gencode=arch=compute_90a,code=sm_90a"]
    return flags


def cxx_flags() -> List[str]:
    return ["-O3"]


def _headers_digest() -> str:
    h = hashlib.sha1()
    for p in sorted(glob.glob(os.path.join(csrc_dir(), "include", "**", "*"), recursive=True)):
        if os.path.isfile(p):
            h.update(p.encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:12]


# ------------------------------------------------------------------------------------------------ loading

def _import_cpp_extension(home: str):
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


def _clear_stale_lock(build_dir: str, max_age_s: float = 600.0) -> None:
    """torch's JIT build holds ``<build_dir>/lock`` while it compiles; a build killed midway leaves it behind and
    every later build waits on it forever. Remove a lock older than ``max_age_s`` when no process is building in
    that folder (none has it as its working directory, as ninja does), saying so; raise naming the file when that
    cannot be told (no /proc)."""
    import time

    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return  # no lock: nothing to do
    if age < max_age_s:
        return  # a build may be running right now: torch waits for it
    if not os.path.isdir("/proc/self"):
        raise RuntimeError(f"dspark_kernels: the extension build lock {lock} is {age / 60:.0f} minutes old; if no "
                           f"build of the extension is running, delete that file and retry")
    target = os.path.realpath(build_dir)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.path.realpath(os.readlink(f"/proc/{pid}/cwd")) == target:
                return  # a live build (ninja / nvcc run in the build folder): leave its lock alone
        except OSError:
            continue
    try:
        os.remove(lock)
    except OSError as e:
        raise RuntimeError(f"dspark_kernels: the extension build lock {lock} is stale ({age / 60:.0f} minutes old, no "
                           f"build running) and could not be removed ({e}); delete it and retry") from e
    print(f"dspark_kernels: removed a stale build lock {lock} ({age / 60:.0f} minutes old, no build running; "
          f"left by a build that was killed)", file=sys.stderr, flush=True)


def _jit_build() -> None:
    if torch.version.cuda is None:
        raise RuntimeError("dspark_kernels: this torch is a CPU-only build, so the CUDA extension cannot be built; "
                           "install a CUDA build of torch")
    home = cuda_home()
    if not _is_toolkit(home):
        where = f"CUDA_HOME={home!r} holds no bin/nvcc and include/cuda_runtime.h" if home else \
            "none found in CUDA_HOME, CUDA_PATH, the nvcc on PATH or /usr/local/cuda"
        raise RuntimeError(
            f"dspark_kernels: no CUDA toolkit to build the CUDA extension ({where}). Install the CUDA toolkit "
            f"matching torch (CUDA {torch.version.cuda}) and set CUDA_HOME to its root, the folder holding bin/nvcc "
            f"(e.g. export CUDA_HOME=/usr/local/cuda-{torch.version.cuda}); or use backend='triton'")
    cpp_extension = _import_cpp_extension(home)
    srcs = sources()
    digest = _headers_digest()  # headers are not part of torch's rebuild check: make them part of the flags
    build_dir = cpp_extension._get_build_directory(LIBRARY, verbose=False)
    _clear_stale_lock(build_dir)
    built = glob.glob(os.path.join(build_dir, f"{LIBRARY}*.so"))
    newest_src = max(os.path.getmtime(p) for p in srcs + glob.glob(os.path.join(csrc_dir(), "include", "**", "*"),
                                                                    recursive=True))
    if not built or max(os.path.getmtime(p) for p in built) < newest_src:
        print(f"dspark_kernels: building the CUDA extension {LIBRARY} just-in-time in {build_dir} "
              f"(CUDA_HOME={home}; takes a few minutes once, then it is cached)", file=sys.stderr, flush=True)
    cpp_extension.load(
        name=LIBRARY,
        sources=srcs,
        extra_include_paths=include_dirs(),
        extra_cflags=cxx_flags() + [f"-DDSPARK_HEADERS={digest}"],
        extra_cuda_cflags=nvcc_flags() + [f"-DDSPARK_HEADERS={digest}"],
        build_directory=build_dir,
        is_python_module=False,
        verbose=os.environ.get("DSPARK_VERBOSE_BUILD") == "1",
    )


def register_fake(name: str):
    """Decorator: ``fn`` is the fake (meta) implementation of ``dspark_C::<name>`` and ``dspark_simt::<name>``,
    registered when each library loads. Each op's Python module (``dspark_kernels/ops``) declares its own."""
    def deco(fn):
        _fakes[name] = fn
        for lib in (LIBRARY, SIMT_LIBRARY):
            if (_ops if lib == LIBRARY else _simt_module) is not None:
                _register_fake(lib, name, fn)
        return fn
    return deco


def _register_fake(lib: str, name: str, fn) -> None:
    if hasattr(getattr(torch.ops, lib), name):
        torch.library.register_fake(f"{lib}::{name}")(fn)


def _register_fakes(lib: str) -> None:
    from . import ops  # noqa: F401  (each op module declares its fake on import)
    for name, fn in _fakes.items():
        _register_fake(lib, name, fn)


def _load_unlocked():
    global _ops, _error
    if _ops is not None:
        return _ops
    if _error is not None:
        raise RuntimeError(_error)
    aot_error = None
    try:
        importlib.import_module("dspark_kernels._C")
    except ModuleNotFoundError as e:
        if e.name != "dspark_kernels._C":
            aot_error = f"dspark_kernels._C failed to import: {e}"
        loaded = False
    except Exception as e:  # built for another torch, missing libraries, ...
        aot_error, loaded = f"dspark_kernels._C failed to import: {e}", False
    else:
        loaded = True
    if not loaded:
        if os.environ.get("DSPARK_NO_JIT") == "1":
            _error = "dspark_kernels: the CUDA extension is not built ahead of time and DSPARK_NO_JIT=1" + \
                (f" ({aot_error})" if aot_error else "")
            raise RuntimeError(_error)
        try:
            _jit_build()
        except Exception as e:
            msg = str(e) if isinstance(e, RuntimeError) and str(e).startswith("dspark_kernels:") else \
                f"dspark_kernels: building the CUDA extension failed: {e}"
            _error = msg + (f" (also: {aot_error})" if aot_error else "")
            raise RuntimeError(_error) from e
    _ops = getattr(torch.ops, LIBRARY)
    _register_fakes(LIBRARY)
    return _ops


def load():
    """``torch.ops.dspark_C``, loading or building the extension first; raises RuntimeError saying why not."""
    with _lock:
        return _load_unlocked()


def is_available() -> bool:
    """True if the CUDA extension is loaded or can be loaded/built (cached; builds on first call if needed)."""
    global _available
    if _available is None:
        with _lock:
            if _available is None:
                try:
                    _load_unlocked()
                    _available = True
                except RuntimeError:
                    _available = False
    return _available


def has_op(name: str) -> bool:
    """True if the extension is available and registers ``torch.ops.dspark_C.<name>`` (an op with a CUDA kernel)."""
    return is_available() and hasattr(load(), name)


# ------------------------------------------------------------------------------------------------ SIMT build

def simt_enabled() -> bool:
    """True when ``DSPARK_SIMT=1``: ``backend="cuda"`` then runs the CUDA kernels on CPU tensors."""
    return os.environ.get("DSPARK_SIMT") == "1"


def _simt_sanitized() -> bool:
    return os.environ.get("DSPARK_SIMT_SANITIZE", "0") not in ("", "0")


def _cuda_header_dirs() -> List[str]:
    """Folders holding cuda_runtime.h / cuda_bf16.h: the toolkit's, else those of torch's CUDA wheels."""
    home = cuda_home()
    dirs = [os.path.join(home, "include")] if _is_toolkit(home) else []
    dirs += [d for d in _nvidia_wheel_includes() if os.path.isfile(os.path.join(d, "cuda_runtime.h"))]
    return dirs


def asan_preload() -> str:
    """The LD_PRELOAD value a sanitized SIMT run needs: the compiler's ASan runtime, then libstdc++ (so ASan's
    exception interceptors find the real __cxa_throw)."""
    import subprocess
    cxx = os.environ.get("CXX", "c++")
    libs = [subprocess.run([cxx, f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
            for lib in ("libasan.so", "libstdc++.so")]
    return " ".join(libs)


def _asan_preloaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:
        return False


# The plain SIMT build's access model (csrc/simt/access_model.h): GCC's kernel-address instrumentation in call mode
# turns every load and store into a call of a hook the runtime defines (no shadow memory, no sanitizer runtime);
# scalar replacement of aggregates, store merging, vectorisation and loop-to-memcpy rewriting stay off, so that a
# 16-byte vector access stays one 16-byte access and scalar ones stay scalar, as nvcc compiles them.
_SIMT_MODEL_FLAGS = ["-DDSPARK_SIMT_MODEL", "-fsanitize=kernel-address", "--param",
                     "asan-instrumentation-with-call-threshold=0", "--param", "asan-stack=0", "--param",
                     "asan-globals=0", "-fno-tree-sra", "-fno-ipa-sra", "-fno-store-merging", "-fno-tree-vectorize",
                     "-fno-tree-loop-distribute-patterns"]


def _simt_sources() -> List[str]:
    d = csrc_dir()
    return ([os.path.join(d, "simt", "module.cpp"), os.path.join(d, "simt", "runtime.cpp")] +
            [p for p in sources()])


def _simt_build():
    headers = _cuda_header_dirs()
    if not headers:
        raise RuntimeError("dspark_kernels: the SIMT build needs the CUDA headers (cuda_runtime.h, cuda_bf16.h): "
                           "install the CUDA toolkit and set CUDA_HOME, or install a CUDA build of torch")
    sanitize = _simt_sanitized()
    if sanitize and not _asan_preloaded():
        raise RuntimeError("dspark_kernels: DSPARK_SIMT_SANITIZE=1 needs the AddressSanitizer runtime loaded first: "
                           f"run Python with LD_PRELOAD='{asan_preload()}' ASAN_OPTIONS=detect_leaks=0")
    from torch.utils import cpp_extension
    name = "dspark_simt_asan" if sanitize else "dspark_simt"
    build_dir = cpp_extension._get_build_directory(name, verbose=False)
    _clear_stale_lock(build_dir)
    # One translation unit (the runtime first, so its keyword macros precede every CUDA header); its text holds a
    # digest of every source and header, so that torch's rebuild check sees header changes.
    h = hashlib.sha1()
    for p in sorted(glob.glob(os.path.join(csrc_dir(), "**", "*"), recursive=True)):
        if os.path.isfile(p):
            h.update(p.encode())
            with open(p, "rb") as f:
                h.update(f.read())
    unity = os.path.join(build_dir, "dspark_simt_unity.cpp")
    text = (f"// generated by dspark_kernels/_ext.py (sources digest {h.hexdigest()[:16]})\n"
            '#include "dspark_simt/runtime.h"\n' + "".join(f'#include "{p}"\n' for p in _simt_sources()))
    if not os.path.isfile(unity) or open(unity).read() != text:
        with open(unity, "w") as f:
            f.write(text)
        print(f"dspark_kernels: building the SIMT harness {name} in {build_dir} (a minute or two once, then cached)",
              file=sys.stderr, flush=True)
    flags = ["-DDSPARK_SIMT", "-g"]
    ldflags = []
    if sanitize:
        san = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer"]
        flags += ["-O1"] + san
        ldflags += san
    else:
        flags += ["-O2"] + _SIMT_MODEL_FLAGS
    return cpp_extension.load(
        name=name,
        sources=[unity],
        extra_include_paths=[os.path.join(csrc_dir(), "include"), os.path.join(csrc_dir(), "simt"),
                             os.path.join(csrc_dir(), "torch")] + headers,
        extra_cflags=flags,
        extra_ldflags=ldflags,
        build_directory=build_dir,
        is_python_module=True,
        verbose=os.environ.get("DSPARK_VERBOSE_BUILD") == "1",
    )


def load_simt():
    """The SIMT build's Python module (settings, records, self-tests), building it first if needed; its ops are
    ``torch.ops.dspark_simt``. Raises RuntimeError saying why it cannot be built."""
    global _simt_module, _simt_error
    with _lock:
        if _simt_module is not None:
            return _simt_module
        if _simt_error is not None:
            raise RuntimeError(_simt_error)
        try:
            module = _simt_build()
        except Exception as e:
            msg = str(e) if isinstance(e, RuntimeError) and str(e).startswith("dspark_kernels:") else \
                f"dspark_kernels: building the SIMT harness failed: {e}"
            _simt_error = msg
            raise RuntimeError(msg) from e
        _simt_module = module
        _register_fakes(SIMT_LIBRARY)
        return module


def kernels(device: torch.device):
    """The op library whose kernels run on ``device``: ``torch.ops.dspark_C`` on a GPU, ``torch.ops.dspark_simt``
    for CPU tensors under ``DSPARK_SIMT=1``."""
    if device.type == "cpu":
        if not simt_enabled():
            raise ValueError("CUDA kernels run on CPU tensors only through the SIMT harness: set DSPARK_SIMT=1")
        load_simt()
        return getattr(torch.ops, SIMT_LIBRARY)
    return load()
