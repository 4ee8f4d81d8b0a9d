"""SASS facts of the compiled kernels for the kernel tests: ``sass_facts("verify_chain_stats")``.

Reads the report ``tools/check_cuda.py --json`` writes (``build/check_cuda.json`` in the checkout, or the file named
by ``DSPARK_SASS_REPORT``); CI's ``.ci/run`` writes it before the tests run, from the ptxas logs of its wheel's build
and the disassembly of that wheel's library (``--from-build``, ``--binary``): the facts are those of what ships.
Each fact is an sm_90a kernel's entry: ``registers``, ``spill_bytes``, ``static_smem``, ``ctas_per_sm`` ({threads:
CTAs}), and ``sass``: ``instructions``, opcode counts as SASS spells them (``"LDG.E.128"``, ``"LDGSTS"``, ``"LDSM"``,
``"HMMA"``, ``"LDS"``, ``"STS"``, ``"BAR"``, ``"MUFU"``, ...) and ``loops`` (one dict per innermost loop:
``instructions`` and the same counts).

Tests that read it are marked ``sass``: conftest.py deselects them when the report is absent (making it is minutes of
nvcc, which the README's test command does not spend); CI's wheel step writes it, so they run there. Called
without the report (an unmarked test), ``report()`` skips when there is no nvcc and fails otherwise.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_REPORT = os.path.join(ROOT, "build", "check_cuda.json")

_cache: Dict[str, Any] = {}


def report_path() -> str:
    return os.environ.get("DSPARK_SASS_REPORT") or DEFAULT_REPORT


def _nvcc_present() -> bool:
    from dspark_kernels import _ext
    home = _ext.cuda_home()
    return bool(home) and os.path.isfile(os.path.join(home, "bin", "nvcc"))


def report() -> Dict[str, Any]:
    path = report_path()
    if path not in _cache:
        if not os.path.isfile(path):
            if not _nvcc_present():
                pytest.skip(f"no SASS report at {path}: nvcc is absent, so tools/check_cuda.py cannot make one")
            pytest.fail(f"no SASS report at {path}; run `python tools/check_cuda.py --json {path}` first "
                        "(CI's .ci/run does)")
        with open(path) as f:
            _cache[path] = json.load(f)
    return _cache[path]


def sass_tool():
    """tools/sass.py (its ``resident_ctas`` is the GPU's occupancy rule the report's ``ctas_per_sm`` uses)."""
    if "tools/sass.py" not in _cache:
        import importlib.util
        spec = importlib.util.spec_from_file_location("dspark_tools_sass", os.path.join(ROOT, "tools", "sass.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _cache["tools/sass.py"] = mod
    return _cache["tools/sass.py"]


def sass_facts(kernel: str) -> List[Dict[str, Any]]:
    """The sm_90a entries whose demangled name contains `kernel` (every template instance, once), each with a ``sass``
    key; fails when none matches or the report has no SASS (no disassembler when it was made)."""
    rep = report()
    found = list({k["kernel"]: k for k in rep["kernels"]  # one entry per kernel (the C ABI unit compiles them too)
                  if k["arch"] == "sm_90a" and kernel in k.get("demangled", k["kernel"])}.values())
    assert found, f"no sm_90a kernel named like {kernel!r} in {report_path()}"
    missing = [k["kernel"] for k in found if "sass" not in k]
    assert not missing, f"{report_path()} has no SASS for {missing[:3]} (made without cuobjdump)"
    return found
