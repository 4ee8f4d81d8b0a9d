"""Build script: a pure-Python install by default; ``DSPARK_BUILD_CUDA=1`` also builds ``dspark_kernels._C``.

* ``pip install .`` (or ``-e .``) needs no GPU and no CUDA toolkit and takes seconds; the CUDA extension is then
  built just-in-time on first use (``dspark_kernels/_ext.py``, configured by ``_build.py``). The CUDA sources ship
  inside the wheel as ``dspark_kernels/csrc`` (copied by ``build_py`` below; ``MANIFEST.in`` puts them in the
  sdist), so a non-editable install can build them too.
* ``DSPARK_BUILD_CUDA=1 pip install --no-build-isolation .`` builds the extension ahead of time with
  ``CUDAExtension`` (the same sources and flags as the JIT build; torch must be importable, hence no isolation).
  Architectures: sm_80 (+PTX) and sm_90a unless ``TORCH_CUDA_ARCH_LIST`` is set; ``CUDA_HOME`` as in ``_build.py``.
Nothing here probes for a GPU.
"""

import glob
import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC_SUFFIXES = (".cu", ".cuh", ".cpp", ".h", ".hpp")


def _csrc_files():
    out = []
    for p in sorted(glob.glob(os.path.join(ROOT, "csrc", "**", "*"), recursive=True)):
        if os.path.isfile(p) and p.endswith(CSRC_SUFFIXES):
            out.append(os.path.relpath(p, os.path.join(ROOT, "csrc")))
    return out


class BuildPyWithCsrc(build_py):
    """Copy csrc/ into the built package as dspark_kernels/csrc (not needed for editable installs)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # the checkout's csrc/ is found next to the package
        for rel in _csrc_files():
            dst = os.path.join(self.build_lib, "dspark_kernels", "csrc", rel)
            self.mkpath(os.path.dirname(dst))
            self.copy_file(os.path.join(ROOT, "csrc", rel), dst)

    def get_outputs(self, include_bytecode=1):
        outs = super().get_outputs(include_bytecode)
        if not getattr(self, "editable_mode", False):
            outs += [os.path.join(self.build_lib, "dspark_kernels", "csrc", rel) for rel in _csrc_files()]
        return outs


def _cuda_extension():
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise SystemExit("DSPARK_BUILD_CUDA=1 needs torch in the build environment: "
                         "DSPARK_BUILD_CUDA=1 pip install --no-build-isolation .") from e
    spec = importlib.util.spec_from_file_location("_dspark_build", os.path.join(ROOT, "dspark_kernels", "_build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    home = build.cuda_home()
    if not home or not os.path.isfile(os.path.join(home, "bin", "nvcc")):
        raise SystemExit(f"DSPARK_BUILD_CUDA=1: no CUDA toolkit found (CUDA_HOME={home!r}); set CUDA_HOME to the "
                         "folder holding bin/nvcc")
    cpp_extension = build.import_cpp_extension(home)
    sources = [os.path.relpath(p, ROOT) for p in build.sources()]
    module = cpp_extension.CUDAExtension(
        "dspark_kernels._C",
        sources=sources,
        include_dirs=build.include_dirs(),
        extra_compile_args={"cxx": build.cxx_flags(), "nvcc": build.nvcc_flags()},
    )
    return module, cpp_extension.BuildExtension


cmdclass = {"build_py": BuildPyWithCsrc}
ext_modules = []
if os.environ.get("DSPARK_BUILD_CUDA", "0") == "1":
    _module, cmdclass["build_ext"] = _cuda_extension()
    ext_modules.append(_module)

setup(cmdclass=cmdclass, ext_modules=ext_modules)
