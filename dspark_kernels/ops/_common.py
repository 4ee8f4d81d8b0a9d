"""What every public op shares: backend choice and argument checks that name the argument."""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch

BACKENDS = ("auto", "cpu", "cuda", "triton", "reference")
ENV_BACKEND = "DSPARK_BACKEND"


def resolve_backend(backend: Optional[str], device: torch.device, cuda_op: str) -> str:
    """The concrete backend for an op whose tensors live on ``device``.

    ``backend`` (or, when it is None or "auto", the environment variable ``DSPARK_BACKEND``) is one of
    "auto", "cpu", "cuda", "triton", "reference". "auto" picks "cuda" where the tensors are on a GPU and the CUDA
    extension loads and has this op's kernel (``torch.ops.dspark_C.<cuda_op>``), else "triton" on a GPU; on CPU
    tensors "cpu" where the CPU kernels build and load (``csrc/cpu``; an op or mode without a CPU kernel runs the
    reference there), else "reference". "cpu" on tensors elsewhere, or where the CPU kernels cannot be built,
    raises.
    "cuda" on CPU tensors runs the CUDA kernels through the SIMT harness when ``DSPARK_SIMT=1`` (as
    ``TRITON_INTERPRET=1`` runs Triton kernels on the CPU). Asking for "cuda" or "triton" where they cannot run
    raises a ValueError.
    """
    if backend is None or backend == "auto":
        backend = os.environ.get(ENV_BACKEND, "auto") or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if device.type == "cpu":
            from .. import _ext
            return "cpu" if _ext.cpu_available() else "reference"
        if device.type != "cuda":
            return "reference"
        from .. import _ext
        return "cuda" if _ext.has_op(cuda_op) else "triton"
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend='cpu' needs CPU tensors, got {device}")
        from .. import _ext
        if not _ext.cpu_available():
            raise RuntimeError(f"backend='cpu': {_ext.cpu_error()}; 'auto' runs the reference instead")
    if backend == "cuda":
        from .. import _ext
        if device.type == "cpu" and not _ext.simt_enabled():
            raise ValueError(f"backend='cuda' needs tensors on a CUDA device, got {device}; set DSPARK_SIMT=1 to run "
                             "the CUDA kernels on CPU tensors through the SIMT harness")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"backend='cuda' needs tensors on a CUDA device, got {device}")
        if not hasattr(_ext.kernels(device), cuda_op):  # raises with the build error if it cannot be built
            raise ValueError(f"backend='cuda': the CUDA extension has no {cuda_op} kernel; use 'triton'")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend='triton' needs tensors on a GPU, or TRITON_INTERPRET=1 for CPU tensors; "
                         f"got {device}")
    return backend


def requested_backend(backend: Optional[str]) -> str:
    """The backend the caller asked for: ``backend``, or ``DSPARK_BACKEND`` when it is None or "auto" ("auto"
    when neither names one). An op that refines "auto" (a kernel that cannot take some call) refines only this."""
    if backend is None or backend == "auto":
        return os.environ.get(ENV_BACKEND, "auto") or "auto"
    return backend


def check_tensor(name: str, t, *, ndim: Optional[int] = None, dtypes: Optional[Sequence[torch.dtype]] = None,
                 device: Optional[torch.device] = None, shape: Optional[Sequence[Optional[int]]] = None,
                 optional: bool = False) -> None:
    """Raise a ValueError naming ``name`` unless ``t`` is a tensor of the given rank, dtype, device and shape.

    ``shape`` entries that are None match any size.
    """
    if t is None:
        if optional:
            return
        raise ValueError(f"{name} is required")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions{_fmt(shape)}, got shape {tuple(t.shape)}")
    if shape is not None and any(s is not None and s != d for s, d in zip(shape, t.shape)):
        raise ValueError(f"{name} must have shape {_fmt(shape)[1:]}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (the device of the other inputs), got {t.device}")


def check_rng_key(rng_key, device: torch.device) -> None:
    """Raise a ValueError naming ``rng_key`` unless it is ``make_rng_key``'s int64 ``[2]``, on the host or on
    ``device``."""
    check_tensor("rng_key", rng_key, shape=(2,), dtypes=(torch.int64,))
    if rng_key.device not in (torch.device("cpu"), device):
        raise ValueError(f"rng_key must be on the host or on {device}, got {rng_key.device}")


def _fmt(shape) -> str:
    if shape is None:
        return ""
    return " [" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_DTYPES = (torch.int32, torch.int64)


def temperature_tensor(temperature, n: int, device: torch.device) -> Optional[torch.Tensor]:
    """float32 ``[n]`` per-request temperatures from a float or a tensor ``[n]`` (0 = greedy for that request),
    or None for a Python 0: every request greedy, known on the host, so the ops skip softmax and random numbers.

    Negative or NaN temperatures inside a tensor cannot be checked without a sync; they count as greedy.
    """
    if isinstance(temperature, torch.Tensor):
        check_tensor("temperature", temperature, shape=(n,), dtypes=FLOAT_DTYPES, device=device)
        t = temperature.to(torch.float32)
    else:
        temperature = float(temperature)
        if not temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if temperature == 0.0:
            return None
        t = torch.full((n,), temperature, dtype=torch.float32, device=device)
    return t
