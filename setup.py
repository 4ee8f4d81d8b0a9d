"""Build script: a wheel with the CUDA extension prebuilt where a CUDA toolkit is found; pure Python otherwise.

* ``pip wheel --no-build-isolation .`` (or ``python -m build --no-isolation --wheel``) with a CUDA toolkit compiles
  the CUDA extension into the wheel as ``dspark_kernels._C`` for ``DSPARK_CUDA_ARCHS`` (default ``8.0;9.0a;10.0a``,
  plus PTX of the highest) against the torch of the build environment, with the record of what it was built for
  beside it (``_C_build.json``, ``dspark_kernels/_prebuilt.py``). An isolated build (plain ``pip wheel .``) gets
  torch from ``tools/build_backend.py``; the wheel then runs with that torch only.
* ``DSPARK_BUILD_CUDA=0``: never build it; ``=1``: fail when it cannot be built (no toolkit, no torch).
* Without a toolkit, and for editable installs (``pip install -e .``), the wheel is pure Python and the extension is
  built just in time on first use (``dspark_kernels/_ext.py``). The CUDA sources ship inside the wheel as
  ``dspark_kernels/csrc`` (copied by ``build_py`` below; ``MANIFEST.in`` puts them in the sdist) for that build.
* ``MAX_JOBS``: nvcc processes at once (default: the CPU count). ``DSPARK_BUILD_LOGS``: where each unit's nvcc log
  (with ptxas's registers and spills) and ``units.json`` go (default: the build's temporary folder), for
  ``tools/check_cuda.py --from-build``.
Nothing here probes for a GPU.
"""

import glob
import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import time

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC_SUFFIXES = (".cu", ".cuh", ".cpp", ".h", ".hpp")
CUDA_MODULE = "dspark_kernels._C"


def _load(name):
    """dspark_kernels/<name>.py by path (the package itself imports torch and everything else)."""
    spec = importlib.util.spec_from_file_location(f"_dspark_{name}", os.path.join(ROOT, "dspark_kernels", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def _toolkit(build):
    """The CUDA toolkit root, or a SystemExit saying why there is none."""
    home = build.cuda_home()
    if not build.is_toolkit(home):
        raise SystemExit(f"dspark_kernels: no CUDA toolkit to build the CUDA extension (CUDA_HOME={home!r}); set "
                         "CUDA_HOME to the folder holding bin/nvcc, or DSPARK_BUILD_CUDA=0 for a wheel without it")
    return home


def _torch(build, home):
    """torch of the build environment, checked against the toolkit's CUDA major version."""
    try:
        import torch
    except ImportError as e:
        raise SystemExit("dspark_kernels: building the CUDA extension needs torch in the build environment (the "
                         "wheel runs with that torch only): pip wheel --no-build-isolation . with torch installed, "
                         "or DSPARK_BUILD_CUDA=0 for a wheel without it") from e
    nvcc = build.nvcc_release(home)
    if torch.version.cuda is None or nvcc.split(".")[0] != torch.version.cuda.split(".")[0]:
        raise SystemExit(f"dspark_kernels: the CUDA toolkit {home} is CUDA {nvcc} but torch {torch.__version__} is "
                         f"built for CUDA {torch.version.cuda}: install the toolkit of torch's CUDA major version "
                         "and set CUDA_HOME to it, or install the torch built for this toolkit")
    return torch, nvcc


class BuildCudaExtension(build_ext):
    """Compiles ``dspark_kernels._C`` with nvcc (``_build.py``: one call per unit, ``-Xptxas -v``), links it as
    torch's extension build does, and writes its build record beside it."""

    def build_extension(self, ext):
        if ext.name != CUDA_MODULE:
            return super().build_extension(ext)
        build, prebuilt = _load("_build"), _load("_prebuilt")
        home = _toolkit(build)
        torch, nvcc = _torch(build, home)
        sources = self._sources_digest(build, prebuilt)
        archs = build.cuda_archs()
        sass, ptx = build.arch_targets(archs)
        logs = os.path.abspath(os.environ.get("DSPARK_BUILD_LOGS") or os.path.join(self.build_temp, "dspark_C"))
        objects = self._compile(build, home, archs, logs)
        out = os.path.abspath(self.get_ext_fullpath(ext.name))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        self._run(build.link_command(out, objects, home), "link")
        prebuilt.write(prebuilt.record_path(out), prebuilt.record(
            package=self.distribution.get_version(), torch_version=torch.__version__, torch_cuda=torch.version.cuda,
            cxx11_abi=torch._C._GLIBCXX_USE_CXX11_ABI, nvcc=nvcc, python=sysconfig.get_config_var("SOABI") or "",
            sass=sass, ptx=ptx, ops=build.registered_ops(), sources=sources))
        print(f"dspark_kernels: built {out} ({' '.join(sass + ptx)}; torch {torch.__version__}, CUDA {nvcc})",
              flush=True)

    def _sources_digest(self, build, prebuilt):
        """The digest of the sources that ship: build_py's copy in the wheel, else the checkout's."""
        shipped = os.path.join(self.build_lib, "dspark_kernels", "csrc")
        return prebuilt.sources_digest(shipped if os.path.isdir(shipped) else build.csrc_dir())

    def _compile(self, build, home, archs, logs):
        flags = build.torch_unit_flags(home, "_C")
        units, objects = [], []
        for src in build.sources():
            rel = os.path.relpath(src, ROOT)
            objects.append(os.path.join(logs, build.unit_name(rel) + ".o"))
            units.append((rel, build.unit_command(home, src, objects[-1], flags, archs)))
        jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
        print(f"dspark_kernels: compiling {len(units)} CUDA units for {' '.join(build.gencode_flags(archs))} "
              f"({jobs} at a time; logs in {logs})", flush=True)
        t0 = time.time()
        results = build.compile_units(units, logs, jobs, ROOT)
        for rel, rc, log, seconds in results:
            print(f"dspark_kernels: {rel}: {'ok' if rc == 0 else 'FAILED'} in {seconds:.0f} s", flush=True)
            if rc != 0:
                raise SystemExit(f"dspark_kernels: nvcc failed on {rel}:\n{log[-4000:]}")
        with open(os.path.join(logs, "units.json"), "w") as f:
            json.dump(dict(seconds=round(time.time() - t0), units=[
                dict(unit=rel, log=build.unit_name(rel) + ".log", seconds=round(s)) for rel, _, _, s in results]),
                f, indent=1)
        return objects

    @staticmethod
    def _run(cmd, what):
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"dspark_kernels: {what} failed: {' '.join(cmd)}\n{p.stdout}{p.stderr}")

    def get_outputs(self):
        outs = super().get_outputs()
        record = _load("_prebuilt").RECORD
        return outs + [os.path.join(os.path.dirname(p), record) for p in outs if os.path.basename(p).startswith("_C.")]


def _builds_cuda():
    """Whether this build compiles the extension: DSPARK_BUILD_CUDA=1, or (unset) a toolkit is found; never for an
    editable install (``editable_wheel``: the just-in-time build serves development)."""
    flag = os.environ.get("DSPARK_BUILD_CUDA", "")
    if flag not in ("", "0", "1"):
        raise SystemExit(f"DSPARK_BUILD_CUDA must be 0 or 1 (unset: build when a CUDA toolkit is found), got {flag!r}")
    if "editable_wheel" in sys.argv:
        if flag == "1":
            raise SystemExit("DSPARK_BUILD_CUDA=1 builds the CUDA extension into a wheel (pip wheel / pip install "
                             "without -e); an editable install builds it just in time on first use")
        return False
    if flag:
        return flag == "1"
    build = _load("_build")
    return build.is_toolkit(build.cuda_home())


setup(cmdclass={"build_py": BuildPyWithCsrc, "build_ext": BuildCudaExtension},
      ext_modules=[Extension(CUDA_MODULE, sources=[])] if _builds_cuda() else [])
