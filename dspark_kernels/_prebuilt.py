"""The prebuilt CUDA extension of a wheel (``dspark_kernels._C``) and its build record (``_C_build.json`` beside it).

A wheel built with a CUDA toolkit (``setup.py``) holds the compiled library and the record of what it was built
for: the torch release, its CUDA version and C++ ABI, the nvcc release, the architectures in the binary (SASS, and
PTX for newer GPUs), the ops it registers and a digest of the sources it was compiled from. ``_ext.load`` imports the
library only when :func:`problem` finds nothing wrong: a torch extension runs only with the torch minor release, the
CUDA major version and the C++ ABI it was built against, only on a GPU its binary covers, and only with the sources
beside it (a stale in-place build is refused). Otherwise it says why, and the loader falls back.

Imports nothing of the package (``setup.py`` loads this file by path to write the record).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
from typing import Dict, List, Optional, Sequence, Tuple

MODULE = "dspark_kernels._C"
RECORD = "_C_build.json"
FORMAT = 1
_TARGET = re.compile(r"^(sm|compute)_(\d+)(\d)([af]?)$")


# ------------------------------------------------------------------------------------------------ the record

def record(*, package: str, torch_version: str, torch_cuda: str, cxx11_abi: bool, nvcc: str, python: str,
           sass: Sequence[str], ptx: Sequence[str], ops: Sequence[str], sources: str) -> Dict[str, object]:
    """The build record of a compiled extension (what :func:`problem` compares with the running torch and GPU)."""
    return dict(format=FORMAT, package=package, torch=torch_version, torch_cuda=torch_cuda, cxx11_abi=bool(cxx11_abi),
                nvcc=nvcc, python=python, sass=list(sass), ptx=list(ptx), ops=sorted(ops), sources=sources)


def record_path(module_file: str) -> str:
    return os.path.join(os.path.dirname(module_file), RECORD)


def write(path: str, rec: Dict[str, object]) -> None:
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")


def read(path: str) -> Dict[str, object]:
    """The record at ``path``; a ValueError naming the file when it is missing, unreadable or of another format."""
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"its build record {path} cannot be read ({e}); rebuild the extension") from e
    if not isinstance(rec, dict) or rec.get("format") != FORMAT:
        raise ValueError(f"its build record {path} is not of format {FORMAT}; rebuild the extension")
    return rec


def sources_digest(csrc: str) -> str:
    """A digest of the relative path and content of every file under ``csrc/kernels``, ``csrc/torch`` and
    ``csrc/include`` (the extension's sources; the same in a checkout and in the ``dspark_kernels/csrc`` a wheel
    ships)."""
    h = hashlib.sha1()
    for sub in ("kernels", "torch", "include"):
        root = os.path.join(csrc, sub)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                p = os.path.join(dirpath, name)
                h.update(os.path.relpath(p, csrc).replace(os.sep, "/").encode())
                with open(p, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ architectures

def parse_target(target: str) -> Tuple[str, int, int, str]:
    """``"sm_90a"`` -> ``("sm", 9, 0, "a")``; ``"compute_100"`` -> ``("compute", 10, 0, "")``."""
    m = _TARGET.match(target)
    if m is None:
        raise ValueError(f"not a CUDA target like sm_90a or compute_100: {target!r}")
    return m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)


def runs_on(target: str, capability: Tuple[int, int]) -> bool:
    """Whether code for ``target`` runs on a GPU of compute ``capability``: SASS of a plain target on the same major
    version and a minor one at least its own, of a family target (``f``) likewise, of an architecture-specific one
    (``a``) on exactly its own; plain PTX on its capability and every later one (the driver compiles it)."""
    kind, major, minor, suffix = parse_target(target)
    if suffix == "a":
        return (major, minor) == tuple(capability)
    if kind == "compute":
        return (major, minor) <= tuple(capability)
    return major == capability[0] and minor <= capability[1]


def covers(rec: Dict[str, object], capability: Tuple[int, int]) -> bool:
    return any(runs_on(t, capability) for t in list(rec["sass"]) + list(rec["ptx"]))


def _arch_spec(capability: Tuple[int, int]) -> str:
    major, minor = capability
    return f"{major}.{minor}" + ("a" if major >= 9 else "")


# ------------------------------------------------------------------------------------------------ compatibility

def release(version: str) -> Tuple[int, ...]:
    """``"2.14.1+cu130"`` -> ``(2, 14)``: the part of a version a torch extension's ABI depends on."""
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:2])


def _major(cuda: Optional[str]) -> Optional[int]:
    return int(cuda.split(".")[0]) if cuda else None


def version_problem(rec: Dict[str, object], torch_version: str, torch_cuda: Optional[str],
                    cxx11_abi: bool) -> Optional[str]:
    """Why an extension built as ``rec`` says cannot load into this torch (None: it can)."""
    built = f"torch {rec['torch']} with CUDA {rec['torch_cuda']}"
    here = f"torch {torch_version} with " + (f"CUDA {torch_cuda}" if torch_cuda else "no CUDA (a CPU-only build)")
    if release(torch_version) == release(str(rec["torch"])) and _major(torch_cuda) == _major(str(rec["torch_cuda"])):
        if bool(cxx11_abi) == bool(rec["cxx11_abi"]):
            return None
        built += f" and _GLIBCXX_USE_CXX11_ABI={int(bool(rec['cxx11_abi']))}"
        here += f" and _GLIBCXX_USE_CXX11_ABI={int(bool(cxx11_abi))}"
    want = ".".join(str(x) for x in release(str(rec["torch"])))
    return (f"it was built for {built}, but this is {here}: a torch extension runs only with the torch minor "
            f"release, CUDA major version and C++ ABI it was built against. Install torch {want} built for CUDA "
            f"{_major(str(rec['torch_cuda']))}, or build dspark_kernels for this torch from its source "
            f"(pip wheel --no-build-isolation .)")


def arch_problem(rec: Dict[str, object], gpus: Sequence[Tuple[str, Tuple[int, int]]]) -> Optional[str]:
    """Why the binary cannot run on one of ``gpus`` (``(name, (major, minor))``; None: it runs on all of them)."""
    for name, capability in gpus:
        if covers(rec, capability):
            continue
        ptx = ", ".join(f"PTX {t}" for t in rec["ptx"])
        gpu = f"this GPU ({name}, compute capability {capability[0]}.{capability[1]}) is not among its architectures " \
            f"({', '.join(list(rec['sass']))}" + (f"; {ptx} for newer GPUs" if ptx else "") + ")"
        if tuple(capability) < (8, 0):
            return f"{gpu}, and the kernels need compute capability 8.0 or newer (cp.async, bfloat16)"
        return (f"{gpu}: build the wheel for it with DSPARK_CUDA_ARCHS={_arch_spec(capability)} "
                "pip wheel --no-build-isolation .")
    return None


def problem(rec: Dict[str, object], env: Dict[str, object]) -> Optional[str]:
    """Why the extension built as ``rec`` must not load in ``env`` (:func:`environment`); None when it may."""
    why = version_problem(rec, str(env["torch"]), env["torch_cuda"], bool(env["cxx11_abi"]))
    if why is None and env.get("sources") is not None and env["sources"] != rec.get("sources"):
        why = (f"it was built from other sources (digest {rec.get('sources')}) than those beside it "
               f"({env['sources']}): rebuild it (pip wheel --no-build-isolation .), or remove it to use the "
               "just-in-time build")
    return why or arch_problem(rec, list(env.get("gpus", [])))


def gpus() -> List[Tuple[str, Tuple[int, int]]]:
    """``(name, (major, minor))`` of every GPU torch sees; none without a driver or device (nothing is probed
    otherwise: torch.cuda answers from the driver)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [(torch.cuda.get_device_name(i), tuple(torch.cuda.get_device_capability(i)))
            for i in range(torch.cuda.device_count())]


def environment(csrc: Optional[str]) -> Dict[str, object]:
    """What :func:`problem` compares a record with: this torch, its CUDA and C++ ABI, the GPUs, the sources digest of
    ``csrc`` (None: not compared)."""
    import torch

    return dict(torch=torch.__version__, torch_cuda=torch.version.cuda, cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI),
                gpus=gpus(), sources=sources_digest(csrc) if csrc else None)


def module_file() -> Optional[str]:
    """The prebuilt library's file, or None when the package has none (a source or editable install)."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None
