"""The build backend (pyproject.toml): setuptools', plus torch among an isolated wheel build's requirements when
that build compiles the CUDA extension (setup.py: DSPARK_BUILD_CUDA=1, or unset and a CUDA toolkit is found).

The torch requirement is the package's own (pyproject.toml's dependencies), so an isolated build compiles against
the newest torch the package supports and the wheel runs with that torch only; ``pip wheel --no-build-isolation .``
builds against the torch installed. Editable installs and sdists never need torch to build.
"""

import importlib.util
import os
import re

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 - every hook not defined here is setuptools'

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torch_requirement(pyproject: str = os.path.join(ROOT, "pyproject.toml")) -> str:
    """The torch requirement of pyproject.toml's ``dependencies`` (e.g. ``torch>=2.11,<2.16``)."""
    with open(pyproject) as f:
        deps = re.search(r"^dependencies\s*=\s*\[([^\]]*)\]", f.read(), re.M)
    found = re.search(r"[\"'](torch\b[^\"']*)[\"']", deps.group(1)) if deps else None
    if found is None:
        raise RuntimeError(f"{pyproject}: no torch requirement in [project] dependencies")
    return found.group(1)


def builds_cuda() -> bool:
    """Whether a (non-editable) wheel build compiles the CUDA extension, as setup.py decides."""
    flag = os.environ.get("DSPARK_BUILD_CUDA", "")
    if flag:
        return flag == "1"
    spec = importlib.util.spec_from_file_location("_dspark_build", os.path.join(ROOT, "dspark_kernels", "_build.py"))
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build.is_toolkit(build.cuda_home())


def get_requires_for_build_wheel(config_settings=None):
    extra = [torch_requirement()] if builds_cuda() else []
    return _setuptools.get_requires_for_build_wheel(config_settings) + extra
