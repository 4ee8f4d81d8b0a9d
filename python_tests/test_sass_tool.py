"""tools/sass.py on a real fat binary: the facts of one architecture are disassembled from that architecture alone
and equal those filtered from the whole listing; an architecture the binary lacks gives no facts."""

import os
import subprocess

import pytest

from dspark_kernels import _build
from sass_facts import sass_tool

KERNEL = r"""
extern "C" __global__ void axpy_probe(float a, const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
"""


@pytest.fixture(scope="module")
def fatbin(tmp_path_factory):
    home = _build.cuda_home()
    if not _build.is_toolkit(home):
        pytest.skip("no CUDA toolkit (nvcc)")
    tool = sass_tool().cuobjdump(home)
    if tool is None:
        pytest.skip("no cuobjdump")
    d = tmp_path_factory.mktemp("sass_tool")
    src, obj = d / "probe.cu", d / "probe.o"
    src.write_text(KERNEL)
    subprocess.run([os.path.join(home, "bin", "nvcc"), "-c", str(src), "-o", str(obj),
                    "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a"],
                   check=True, capture_output=True)
    return str(obj), tool


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_one_architecture_equals_the_whole_listing_filtered(fatbin, arch):
    obj, tool = fatbin
    sass = sass_tool()
    facts = sass.object_facts(obj, tool, arch)
    assert list(facts) == ["axpy_probe"]
    whole = subprocess.run([tool, "-sass", obj], capture_output=True, text=True, check=True).stdout
    funcs = [v for v in sass.parse_sass(whole).values() if v["arch"] == arch]
    assert len(funcs) == 1
    assert facts["axpy_probe"] == dict(mangled=funcs[0]["name"], **sass.kernel_facts(funcs[0]["insns"]))


def test_an_architecture_the_binary_lacks_gives_no_facts(fatbin):
    obj, tool = fatbin
    assert sass_tool().object_facts(obj, tool, "sm_100a") == {}
