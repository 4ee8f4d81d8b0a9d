"""The CUDA extension ``torch.ops.dspark_C``: a wheel's prebuilt module or a just-in-time build; and its SIMT twin.

``load()`` returns ``torch.ops.dspark_C`` once the extension is loaded:

1. the prebuilt module ``dspark_kernels._C`` of a wheel built with a CUDA toolkit (``setup.py``), when its build
   record says it runs here (``_prebuilt.problem``: this torch's minor release, CUDA major and C++ ABI, the sources
   beside it, and every GPU torch sees covered by its architectures); otherwise a warning says why not, once, and
2. a just-in-time build of ``csrc/kernels/*.cu`` + ``csrc/torch/*.cpp`` with ``torch.utils.cpp_extension.load``,
   cached in torch's extension folder (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``); the first
   build takes minutes.

``is_available()`` says whether that works (the extension builds and loads on a machine without a GPU; running its
ops needs one; the architecture check reads the GPUs' compute capabilities where torch sees any). Set
``DSPARK_NO_JIT=1`` to use only the prebuilt module. ``dk.build_info()`` (``_info.py``) says what was built and which
backend each op takes here, and why, without building anything.

Where the toolkit, the sources and the flags come from is ``_build.py`` (which ``setup.py`` and ``tools/`` share);
this module only builds them into libraries and loads those. Each op's fake is registered on a library when it
loads (``register_fake``; ``dspark_kernels.ops._registry`` declares them).

The SIMT build (``DSPARK_SIMT=1``; ``load_simt()``) compiles the same launchers and kernel templates with the host
C++ compiler against ``csrc/simt`` into a CPU extension whose ops (``torch.ops.dspark_simt``, the same schemas as
``dspark_C``) run the CUDA kernels on CPU tensors; ``dspark_kernels.simt`` drives it. It needs the CUDA headers only
(the toolkit's, or those of torch's CUDA wheels), no GPU and no nvcc. ``load_simt(counting=True)`` loads the counting
build beside it (the access model's hooks on every load and store; ops ``torch.ops.dspark_simt_counting``), which
``kernels()`` picks while ``use_counting(True)`` (``simt.record(access=True)`` sets it). ``DSPARK_SIMT_SANITIZE=1``
builds it with AddressSanitizer and UndefinedBehaviorSanitizer instead (no counting build then); Python must then
start with the ASan runtime preloaded (``LD_PRELOAD`` = ``asan_preload()``: the ASan runtime, then libstdc++).

The CPU kernels (``cpu_kernel(name)``; ``torch.ops.dspark_cpu``, dispatch key CPU) are ``csrc/cpu/*.cpp``, built with
the host C++ compiler on first use (``torch.utils.cpp_extension.load``, cached like the others; seconds to a minute
once). Their schemas are defined here from each op's ``define_op`` schema before the library loads. Where they
cannot be built (no compiler, ``DSPARK_NO_JIT=1``) a warning says so once and backend "auto" runs the reference on
CPU tensors; backend "cpu", named, raises with the reason (``cpu_error()``).
"""

from __future__ import annotations

import glob
import importlib
import os
import sys
import threading
import warnings
from typing import Optional

import torch

from . import _build, _prebuilt
from ._build import CPU_LIBRARY, LIBRARY, SIMT_COUNTING_LIBRARY, SIMT_LIBRARY, asan_preload, cuda_home

__all__ = ["load", "is_available", "has_op", "kernels", "load_simt", "simt_enabled", "register_fake", "cuda_home",
           "asan_preload", "cpu_available", "cpu_kernel", "LIBRARY", "SIMT_LIBRARY", "SIMT_COUNTING_LIBRARY",
           "CPU_LIBRARY", "loaded_simt", "use_counting", "prebuilt_status"]

_lock = threading.RLock()
_ops = None                    # torch.ops.dspark_C once loaded
_loaded_from: Optional[str] = None  # "prebuilt <file>" or "just-in-time build in <folder>"
_prebuilt_checked: Optional[tuple] = None  # prebuilt_status() once computed
_error: Optional[str] = None   # why loading failed (cached: no rebuild attempt per call)
_available: Optional[bool] = None
_simt_modules: dict = {}       # SIMT builds once loaded: False -> the plain (or sanitized) one, True -> counting
_simt_errors: dict = {}        # why a SIMT build failed (cached like _error)
_simt_counting = False         # kernels() gives CPU tensors the counting build (inside simt.record(access=True))
_fakes: dict = {}              # op name -> fake implementation, registered on both libraries when they load
_cpu_schemas: dict = {}        # op name -> schema (without backend) of the ops the CPU library defines
_cpu_library = None            # the torch.library.Library defining torch.ops.dspark_cpu's schemas
_cpu_error: Optional[str] = None


# ------------------------------------------------------------------------------------------------ loading

def _jit_build() -> str:
    if torch.version.cuda is None:
        raise RuntimeError("dspark_kernels: this torch is a CPU-only build, so the CUDA extension cannot be built; "
                           "install a CUDA build of torch")
    home = cuda_home()
    if not _build.is_toolkit(home):
        where = f"CUDA_HOME={home!r} holds no bin/nvcc and include/cuda_runtime.h" if home else \
            "none found in CUDA_HOME, CUDA_PATH, the nvcc on PATH or /usr/local/cuda"
        raise RuntimeError(
            f"dspark_kernels: no CUDA toolkit to build the CUDA extension ({where}). Install the CUDA toolkit "
            f"matching torch (CUDA {torch.version.cuda}) and set CUDA_HOME to its root, the folder holding bin/nvcc "
            f"(e.g. export CUDA_HOME=/usr/local/cuda-{torch.version.cuda}); or use backend='triton'")
    cpp_extension = _build.import_cpp_extension(home)
    srcs = _build.sources()
    digest = _build.digest("include")  # headers are not part of torch's rebuild check: make them part of the flags
    build_dir = cpp_extension._get_build_directory(LIBRARY, verbose=False)
    _build.clear_stale_lock(build_dir)
    built = glob.glob(os.path.join(build_dir, f"{LIBRARY}*.so"))
    newest_src = max(os.path.getmtime(p) for p in
                     srcs + glob.glob(os.path.join(_build.csrc_dir(), "include", "**", "*"), recursive=True))
    if not built or max(os.path.getmtime(p) for p in built) < newest_src:
        print(f"dspark_kernels: building the CUDA extension {LIBRARY} just-in-time in {build_dir} "
              f"(CUDA_HOME={home}; takes a few minutes once, then it is cached)", file=sys.stderr, flush=True)
    cpp_extension.load(
        name=LIBRARY,
        sources=srcs,
        extra_include_paths=_build.include_dirs(),
        extra_cflags=_build.cxx_flags() + [f"-DDSPARK_HEADERS={digest}"],
        extra_cuda_cflags=_build.nvcc_flags() + [f"-DDSPARK_HEADERS={digest}"],
        build_directory=build_dir,
        is_python_module=False,
        verbose=os.environ.get("DSPARK_VERBOSE_BUILD") == "1",
    )
    return build_dir


def register_fake(name: str, fn) -> None:
    """Register ``fn`` as the fake (meta) implementation of ``dspark_C::<name>`` and ``dspark_simt::<name>``, now for
    a library already loaded, else when it loads (``dspark_kernels.ops._registry.define_op`` calls this)."""
    _fakes[name] = fn
    if _ops is not None:
        _register_fake(LIBRARY, name, fn)
    for counting in _simt_modules:
        _register_fake(SIMT_COUNTING_LIBRARY if counting else SIMT_LIBRARY, name, fn)
    if _cpu_library is not None:
        _register_fake(CPU_LIBRARY, name, fn)


def _register_fake(lib: str, name: str, fn) -> None:
    if hasattr(getattr(torch.ops, lib), name):
        torch.library.register_fake(f"{lib}::{name}")(fn)


def _register_fakes(lib: str) -> None:
    for name, fn in _fakes.items():
        _register_fake(lib, name, fn)


def prebuilt_status() -> tuple:
    """``(file, record, why not)`` of the prebuilt extension: ``(None, None, None)`` when the package has none; ``why
    not`` None when it may load here (checked once per process; imports nothing)."""
    global _prebuilt_checked
    if _prebuilt_checked is None:
        path, rec, why = _prebuilt.module_file(), None, None
        if path is not None:
            try:
                rec = _prebuilt.read(_prebuilt.record_path(path))
                why = _prebuilt.problem(rec, _prebuilt.environment(_build.csrc_dir()))
            except (ValueError, RuntimeError) as e:  # an unreadable record, no sources beside it
                why = str(e)
        _prebuilt_checked = (path, rec, why)
    return _prebuilt_checked


def _import_prebuilt() -> tuple:
    """``(loaded, why not)``: imports the prebuilt extension when :func:`prebuilt_status` allows; warns once when a
    prebuilt one is there but not loaded."""
    path, _, why = prebuilt_status()
    if path is None:
        return False, None
    if why is None:
        try:
            importlib.import_module(_prebuilt.MODULE)
            return True, None
        except Exception as e:  # noqa: BLE001 - a library missing on this machine, ...
            why = f"it failed to import: {e}"
    why = f"dspark_kernels: the prebuilt CUDA extension {path} is not loaded: {why}"
    warnings.warn(why, RuntimeWarning, stacklevel=5)
    return False, why


def _load_unlocked():
    global _ops, _loaded_from
    if _ops is not None:
        return _ops
    if _error is not None:
        raise RuntimeError(_error)
    loaded, why = _import_prebuilt()
    _loaded_from = f"prebuilt {prebuilt_status()[0]}" if loaded else _load_jit(why)
    _ops = getattr(torch.ops, LIBRARY)
    _register_fakes(LIBRARY)
    return _ops


def _load_jit(why: Optional[str]) -> str:
    """Builds and loads the extension just in time (``why``: why no prebuilt one loaded); returns where it was
    built, or raises (and keeps) why it cannot be."""
    global _error
    if os.environ.get("DSPARK_NO_JIT") == "1":
        _error = (why or "dspark_kernels: the package has no prebuilt CUDA extension") + \
            "; DSPARK_NO_JIT=1 forbids the just-in-time build"
        raise RuntimeError(_error)
    try:
        return f"just-in-time build in {_jit_build()}"
    except Exception as e:
        msg = str(e) if isinstance(e, RuntimeError) and str(e).startswith("dspark_kernels:") else \
            f"dspark_kernels: building the CUDA extension failed: {e}"
        _error = msg + (f" (also: {why})" if why else "")
        raise RuntimeError(_error) from e


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


def _asan_preloaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libasan" in f.read()
    except OSError:
        return False


def _simt_build(counting: bool):
    headers = _build.cuda_header_dirs()
    if not headers:
        raise RuntimeError("dspark_kernels: the SIMT build needs the CUDA headers (cuda_runtime.h, cuda_bf16.h): "
                           "install the CUDA toolkit and set CUDA_HOME, or install a CUDA build of torch")
    sanitize = _simt_sanitized()
    if sanitize and not _asan_preloaded():
        raise RuntimeError("dspark_kernels: DSPARK_SIMT_SANITIZE=1 needs the AddressSanitizer runtime loaded first: "
                           f"run Python with LD_PRELOAD='{asan_preload()}' ASAN_OPTIONS=detect_leaks=0")
    from torch.utils import cpp_extension
    name = "dspark_simt_asan" if sanitize else SIMT_COUNTING_LIBRARY if counting else SIMT_LIBRARY
    build_dir = cpp_extension._get_build_directory(name, verbose=False)
    _build.clear_stale_lock(build_dir)
    unity = os.path.join(build_dir, "dspark_simt_unity.cpp")
    text = _build.simt_unity_source()
    if not os.path.isfile(unity) or open(unity).read() != text:
        with open(unity, "w") as f:
            f.write(text)
        print(f"dspark_kernels: building the SIMT harness {name} in {build_dir} with the CUDA headers of "
              f"{os.path.dirname(headers[0])} (needs no GPU and no nvcc; a minute or two once, then cached)",
              file=sys.stderr, flush=True)
    cflags, ldflags = _build.simt_flags(sanitize, counting)
    return cpp_extension.load(
        name=name,
        sources=[unity],
        extra_include_paths=_build.simt_include_dirs(),
        extra_cflags=cflags,
        extra_ldflags=ldflags,
        build_directory=build_dir,
        is_python_module=True,
        verbose=os.environ.get("DSPARK_VERBOSE_BUILD") == "1",
    )


def load_simt(counting: bool = False):
    """The SIMT build's Python module (settings, records, self-tests), building it first if needed; its ops are
    ``torch.ops.dspark_simt``. ``counting``: the counting build instead (the access model's hooks; its ops are
    ``torch.ops.dspark_simt_counting``), except under ``DSPARK_SIMT_SANITIZE=1``, whose one build has no model.
    Raises RuntimeError saying why it cannot be built."""
    counting = counting and not _simt_sanitized()
    with _lock:
        if counting in _simt_modules:
            return _simt_modules[counting]
        if counting in _simt_errors:
            raise RuntimeError(_simt_errors[counting])
        try:
            module = _simt_build(counting)
        except Exception as e:
            msg = str(e) if isinstance(e, RuntimeError) and str(e).startswith("dspark_kernels:") else \
                f"dspark_kernels: building the SIMT harness failed: {e}"
            _simt_errors[counting] = msg
            raise RuntimeError(msg) from e
        _simt_modules[counting] = module
        _register_fakes(SIMT_COUNTING_LIBRARY if counting else SIMT_LIBRARY)
        return module


def loaded_simt() -> list:
    """The SIMT builds loaded so far, the plain (or sanitized) one first."""
    return [_simt_modules[c] for c in (False, True) if c in _simt_modules]


def use_counting(on: bool) -> bool:
    """Route CPU tensors to the counting build (``on``, which must be loaded) or the plain one; returns the previous
    choice. ``simt.record(access=True)`` sets it for its body."""
    global _simt_counting
    old, _simt_counting = _simt_counting, bool(on)
    return old


def kernels(device: torch.device):
    """The op library whose kernels run on ``device``: ``torch.ops.dspark_C`` on a GPU, ``torch.ops.dspark_simt``
    for CPU tensors under ``DSPARK_SIMT=1`` (``dspark_simt_counting`` while :func:`use_counting` is on)."""
    if device.type == "cpu":
        if not simt_enabled():
            raise ValueError("CUDA kernels run on CPU tensors only through the SIMT harness: set DSPARK_SIMT=1")
        counting = _simt_counting and not _simt_sanitized()
        load_simt(counting)
        return getattr(torch.ops, SIMT_COUNTING_LIBRARY if counting else SIMT_LIBRARY)
    return load()


# ------------------------------------------------------------------------------------------------ CPU kernels

def _cpu_build() -> None:
    from torch.utils import cpp_extension
    build_dir = cpp_extension._get_build_directory(CPU_LIBRARY, verbose=False)
    _build.clear_stale_lock(build_dir)
    srcs = _build.cpu_sources()
    built = glob.glob(os.path.join(build_dir, f"{CPU_LIBRARY}*.so"))
    newest_src = max(os.path.getmtime(p) for p in srcs + glob.glob(os.path.join(_build.csrc_dir(), "cpu", "*")) +
                     glob.glob(os.path.join(_build.csrc_dir(), "include", "**", "*"), recursive=True))
    if not built or max(os.path.getmtime(p) for p in built) < newest_src:
        print(f"dspark_kernels: building the CPU kernels {CPU_LIBRARY} in {build_dir} (once, then cached)",
              file=sys.stderr, flush=True)
    cflags, ldflags = _build.cpu_flags()
    cpp_extension.load(
        name=CPU_LIBRARY,
        sources=srcs,
        extra_include_paths=_build.cpu_include_dirs(),
        extra_cflags=cflags + [f"-DDSPARK_SOURCES={_build.digest('include', 'cpu')}"],
        extra_ldflags=ldflags,
        build_directory=build_dir,
        is_python_module=False,
        verbose=os.environ.get("DSPARK_VERBOSE_BUILD") == "1",
    )


def define_cpu_schema(name: str, schema: str) -> None:
    """Declare ``dspark_cpu::<name>`` with ``schema`` (``dspark_kernels.ops._registry.define_op`` calls this for every
    op; ``import dspark_kernels`` defines them all before any kernel loads)."""
    if _cpu_library is not None:
        raise RuntimeError(f"dspark_cpu::{name} declared after the CPU kernels loaded")
    _cpu_schemas[name] = schema


def _define_cpu_library():
    """torch.ops.dspark_cpu with every declared op's schema, before its kernels load."""
    lib = torch.library.Library(CPU_LIBRARY, "DEF")
    for name, schema in _cpu_schemas.items():
        lib.define(name + schema)
    return lib


def load_cpu():
    """``torch.ops.dspark_cpu`` with its CPU kernels, building them first if needed; None (after one warning
    saying why) where they cannot be built."""
    global _cpu_library, _cpu_error
    with _lock:
        if _cpu_library is not None:
            return getattr(torch.ops, CPU_LIBRARY)
        if _cpu_error is not None:
            return None
        try:
            if os.environ.get("DSPARK_NO_JIT") == "1":
                raise RuntimeError("dspark_kernels: DSPARK_NO_JIT=1 forbids building the CPU kernels just-in-time")
            lib = _define_cpu_library()
            try:
                _cpu_build()
            except Exception:
                lib._destroy()
                raise
        except Exception as e:  # noqa: BLE001 - no compiler, a failed build: the reference serves the CPU
            _cpu_error = str(e) if str(e).startswith("dspark_kernels:") else \
                f"dspark_kernels: building the CPU kernels failed: {e}"
            warnings.warn(f"{_cpu_error}; the ops run the reference implementation on CPU tensors", RuntimeWarning,
                          stacklevel=3)
            return None
        _cpu_library = lib
        _register_fakes(CPU_LIBRARY)
        return getattr(torch.ops, CPU_LIBRARY)


def cpu_available() -> bool:
    """True when the CPU kernels are built and loaded (building them on the first call; later calls read a flag, so
    ``torch.compile`` traces them without a lock)."""
    if _cpu_library is not None or _cpu_error is not None:
        return _cpu_library is not None
    return load_cpu() is not None


def cpu_error() -> Optional[str]:
    """Why the CPU kernels cannot be built (None where they load, building them on the first call)."""
    return None if cpu_available() else _cpu_error


def cpu_kernel(name: str):
    """``torch.ops.dspark_cpu.<name>`` when the CPU kernels load and hold a kernel for ``name``, else None."""
    ops = load_cpu()
    if ops is None or not torch._C._dispatch_has_kernel_for_dispatch_key(f"{CPU_LIBRARY}::{name}", "CPU"):
        return None
    return getattr(ops, name)
