"""``dk.build_info()``: what this install holds and which backend each op takes on this machine, and why.

Builds nothing and loads nothing: it reads the prebuilt extension's build record, what the loaders have done so far
in this process, and the environment (``DSPARK_BACKEND``, ``DSPARK_NO_JIT``, the CUDA toolkit, the C++ compiler).
The ops are those whose CUDA kernels the extension registers (``m.impl`` in ``csrc/torch``).
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, Optional, Tuple

import torch

from . import _build, _ext, _prebuilt

Route = Dict[str, Optional[str]]  # {"backend": ..., "why": ...}


def _env_backend() -> Optional[str]:
    chosen = os.environ.get("DSPARK_BACKEND", "auto") or "auto"
    return None if chosen == "auto" else chosen


def _no_jit() -> bool:
    return os.environ.get("DSPARK_NO_JIT") == "1"


def _prebuilt_info() -> Optional[Dict[str, object]]:
    path, rec, why = _ext.prebuilt_status()
    if path is None:
        return None
    return dict(rec or {}, file=path, loads=why is None, why_not=why)


def _cuda_route(sources: set) -> Tuple[Optional[str], str, set]:
    """``(backend, why, ops with a CUDA kernel)`` that "auto" takes for tensors on a GPU; ``sources``: the ops the
    sources register (a just-in-time build's)."""
    if _ext._ops is not None:
        return "cuda", f"the CUDA extension is loaded ({_ext._loaded_from})", \
            {op for op in sources if hasattr(_ext._ops, op)}
    if _ext._error is not None:
        return "triton", _ext._error, set()
    path, rec, why = _ext.prebuilt_status()
    if path is not None and why is None:
        return "cuda", f"the prebuilt extension {path} ({', '.join(rec['sass'] + rec['ptx'])}) runs here", \
            set(rec["ops"])
    because = why or "the package has no prebuilt CUDA extension"
    if _no_jit():
        return "triton", f"{because}; DSPARK_NO_JIT=1 forbids the just-in-time build", set()
    home = _build.cuda_home()
    if _build.is_toolkit(home):
        return "cuda", f"{because}; the just-in-time build (CUDA_HOME={home}) compiles it on first use", sources
    return "triton", f"{because}; no CUDA toolkit for the just-in-time build", set()


def _cpu_route(op: str) -> Route:
    """What "auto" takes for ``op`` on CPU tensors."""
    if op not in _build.registered_ops("cpu"):
        return _route("reference", f"the CPU kernels (csrc/cpu) have no {op} kernel")
    if _ext._cpu_library is not None:
        return _route("cpu", "the CPU kernels are loaded")
    if _ext._cpu_error is not None:
        return _route("reference", _ext._cpu_error)
    if _no_jit():
        return _route("reference", "DSPARK_NO_JIT=1 forbids building the CPU kernels")
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        return _route("reference", "no C++ compiler to build the CPU kernels")
    return _route("cpu", f"the CPU kernels (csrc/cpu), built on first use with {compiler}")


def _route(backend: Optional[str], why: str) -> Route:
    return dict(backend=backend, why=why)


def _op_routes(op: str, cuda: Tuple[Optional[str], str, set], have_gpu: bool) -> Dict[str, Route]:
    forced = _env_backend()
    if forced is not None:
        return dict(gpu=_route(forced, "DSPARK_BACKEND"), cpu=_route(forced, "DSPARK_BACKEND"))
    backend, why, ops = cuda
    if backend == "cuda" and op not in ops:
        backend, why = "triton", f"the CUDA extension has no {op} kernel"
    if not have_gpu:
        backend, why = None, f"no GPU here (torch.cuda.is_available() is False); on one: {backend}, as {why}"
    return dict(gpu=_route(backend, why), cpu=_cpu_route(op))


def build_info() -> Dict[str, object]:
    """Versions (package, torch and its CUDA; the prebuilt extension's torch, CUDA, nvcc and architectures), the GPUs
    torch sees, and for each op the backend ``backend="auto"`` takes on GPU and on CPU tensors here, with the reason.
    Builds and loads nothing."""
    from . import __version__

    gpus = _prebuilt.gpus()
    sources = set(_build.registered_ops())
    cuda = _cuda_route(sources)
    return dict(
        package=__version__, torch=torch.__version__, torch_cuda=torch.version.cuda,
        gpus=[dict(name=name, capability=f"{c[0]}.{c[1]}") for name, c in gpus],
        prebuilt=_prebuilt_info(),
        cuda_extension=_route(cuda[0], cuda[1]),
        ops={op: _op_routes(op, cuda, bool(gpus)) for op in sorted(sources)},
    )
