"""The GPU extension as nvcc builds it (the wheel's ``dspark_kernels/_C`` library, which CI's ``.ci/run`` copies to
build/dspark_C.so; or ``tools/check_cuda.py --link``) loads without a GPU, registers exactly the schemas of the SIMT
build (one launcher source, two builds) and a CUDA kernel for every op the sources ``m.impl``. Marked ``gpu_build``:
deselected unless that library exists (making it is minutes of nvcc, which the README's test command does not
spend)."""

import json
import os
import subprocess
import sys

import pytest

from conftest import gpu_build_path
from cpp_sources import registered_schemas
from dspark_kernels import _build, _ext

pytestmark = pytest.mark.gpu_build

_LIST = """
import json, sys, torch
from cpp_sources import registered_schemas
torch.ops.load_library(sys.argv[1])
schemas = registered_schemas("dspark_C")
cuda = [n for n in schemas if torch._C._dispatch_has_kernel_for_dispatch_key(f"dspark_C::{n}", "CUDA")]
print(json.dumps(dict(schemas=schemas, cuda=cuda)))
"""


def _gpu_library() -> dict:
    """Its schemas and the ops with a CUDA kernel, loaded in a child process: the test process may hold another
    build of the same library."""
    p = subprocess.run([sys.executable, "-c", _LIST, gpu_build_path()], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.abspath(__file__)))
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_gpu_build_registers_the_simt_build_schemas(monkeypatch):
    monkeypatch.setenv("DSPARK_SIMT", "1")
    _ext.load_simt()
    simt = {n: s.replace("dspark_simt::", "dspark_C::") for n, s in registered_schemas("dspark_simt").items()}
    gpu = _gpu_library()
    assert "rng_uniform_" in gpu["schemas"] and "verify_chain" in gpu["schemas"]
    assert gpu["schemas"] == simt
    assert sorted(gpu["cuda"]) == _build.registered_ops()
