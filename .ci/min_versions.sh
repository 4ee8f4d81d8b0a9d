#!/usr/bin/env bash
# CI leg: the Triton and reference tests under the lowest versions the package claims (pyproject.toml): torch 2.11.0
# with triton 3.6.0 (what the GPU machine has), in a venv of their own, the Triton kernels in the interpreter.
#
#   bash .ci/min_versions.sh             # venv in $MINV_VENV (default /tmp/dspark-min-versions), reused when it
#                                        # already holds these versions
#   bash .ci/min_versions.sh --install-only   # only make that venv (.ci/run does this in the background, early)
#
# Cost here (2 cores, package registry reachable): torch 2.11.0's Linux wheel is a CUDA build, 531 MB, and pulls
# its CUDA libraries (cuda-toolkit 13.0.2 parts, cuDNN, NCCL, NVSHMEM, cuSPARSELt): 2.6 GB of wheels, about
# 30 s to download and 70 s to install (4.6 GB venv); the tests then take a few minutes. torch will not import
# without those libraries (libtorch_cuda.so links them), so there is no leaner install of this exact version.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MINV_VENV:-/tmp/dspark-min-versions}
TORCH_VERSION=${MINV_TORCH:-2.11.0}
TRITON_VERSION=${MINV_TRITON:-3.6.0}
T0=$(date +%s)
step() { echo "=== [min-versions $(( $(date +%s) - T0 )) s] $*"; }

have_versions() {
  [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" - "$TORCH_VERSION" "$TRITON_VERSION" <<'EOF' 2>/dev/null
import sys, torch, triton, numpy, pytest  # noqa: F401
sys.exit(0 if torch.__version__.split("+")[0] == sys.argv[1] and triton.__version__ == sys.argv[2] else 1)
EOF
}

if have_versions; then
  step "reusing $VENV (torch $TORCH_VERSION, triton $TRITON_VERSION)"
else
  step "fresh venv $VENV: torch==$TORCH_VERSION triton==$TRITON_VERSION numpy pytest"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --progress-bar off "torch==$TORCH_VERSION" "triton==$TRITON_VERSION" \
    numpy "pytest>=8,<10"
fi
if [[ "${1:-}" == "--install-only" ]]; then
  step "venv ready (--install-only)"
  exit 0
fi
step "install the repo (--no-deps)"
# one editable install of this checkout at a time (CI runs this script beside the other one, and both write the
# checkout's egg-info)
mkdir -p build
flock build/.editable-install.lock "$VENV/bin/python" -m pip install --quiet --no-deps -e .
"$VENV/bin/python" -c "import torch, triton, numpy, dspark_kernels as dk; print('torch', torch.__version__, \
'triton', triton.__version__, 'numpy', numpy.__version__, 'dspark_kernels', dk.__file__)"

# an extension cache of its own: never share built modules (or build locks) with another torch's environment
export TORCH_EXTENSIONS_DIR="$VENV/torch_extensions"

step "Triton (interpreter) and reference tests"
# the decode tests need the decode / hf extras, and the SIMT and CPU-kernel tests a C++ build of their own: none is
# this leg's business (the marker and test_cpu_, as -k also matches the CUDA and CPU twins of tests named
# "..._reference")
set +e
TRITON_INTERPRET=1 "$VENV/bin/python" -m pytest python_tests -q -p no:cacheprovider -m "not gpu and not simt" \
  -k "(triton or reference) and not test_cpu_" --ignore-glob="python_tests/test_decode_*" \
  --ignore=python_tests/test_simt.py
rc=$?
set -e
step "done (exit $rc)"
exit $rc
