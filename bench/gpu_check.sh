#!/usr/bin/env bash
# The one prepared GPU check (one H100 or H200, no network, its own torch and triton; under 9 minutes from a fresh checkout):
#
#   bash bench/gpu_check.sh OUTDIR [WHEEL]
#
# 1. installs the package from WHEEL when one is given (pip install --no-deps: the shipped artifact, whose prebuilt
#    CUDA extension must then load), else from a wheel built here for the GPU's own architecture only
#    (DSPARK_CUDA_ARCHS=<it> DSPARK_CUDA_PTX=0 pip wheel --no-build-isolation); the checkout with the just-in-time
#    build if neither loads; dk.build_info() goes to build_info.json. The tests and benchmarks then import the
#    installed package (DSPARK_USE_INSTALLED=1), not the checkout,
# 2. runs the GPU tests (pytest -m gpu; on 4 workers with pytest-xdist, in the background beside step 3), with the
#    ptxas register / spill table (tools/check_cuda.py --json) read from the wheel build's nvcc logs and the
#    installed library's SASS (else compiled alongside on the CPU, or taken from GPU_CHECK_PTXAS: that table built
#    on a CPU machine with the same nvcc),
# 3. runs compute-sanitizer memcheck and racecheck on small cases of every CUDA kernel (bench/sanitizer_cases.py),
# 4. runs the decode step end to end (bench/step.py, under 3 minutes: a Qwen3-8B-shaped target alone against the
#    speculative step, both CUDA-graphed, acceptance forced; <machine>_step.json, written after every run),
# 5. reads Nsight Compute's measured counters (duration, DRAM bytes, throughput, occupancy, warp instructions) for
#    every launch of the headline ops at N = 1 and 64 where ncu can read the counters (bench/ncu.py, ncu.json),
# 6. times the rows the open issues' goals are judged on (bench/run.py --goals: cases.GOALS, in priority order),
# 7. runs bench/run.py --full on the headline shapes (K = 7, V = 151936; N 1..256, bf16 / fp32, greedy / sampled),
#    draft_block and verify_chain first (GPU_CHECK_OPS: which ops, in order), with whatever time is left; then judges
#    the goals on what steps 4, 6 and 7 measured (bench/goals.py: goals.txt, goals.json, the counts in the summary),
# 8. with GPU_CHECK_VARIANTS="NAME:CONSTANT=VALUE ...": an A/B of tuning constants on the same GPU. Each variant is
#    a copy of the checkout with one `constexpr` of csrc/include/dspark changed, built just in time while the tests
#    run; draft_block's CUDA rows (bf16, greedy; GPU_CHECK_VARIANT_N: which N) run on each after the main build's,
#    then its GPU tests of draft_block with what time is left (variant_NAME.{json,csv}, variant_NAME_tests.log),
# and writes everything (logs, JUnit XML, sanitizer logs, ptxas.json, the bench JSON / CSV / PNGs, summary.txt)
# into OUTDIR, and all of it but the wheel and object files into OUTDIR/gpu_check.tar.gz (one file to bring back).
# Exit status 1 if any step failed. Nothing here installs torch or triton or assumes their versions.
#
# Time (GPU_CHECK_SECONDS, default 525): steps 1-3 stop GPU_CHECK_STEP_SECONDS (180) + GPU_CHECK_BENCH_RESERVE (90)
# short of the deadline, so the decode step always gets its three minutes and the benchmark at least its reserve;
# the CPU work beside the tests (the ptxas table, FlashInfer's build) runs at a lower priority and ends by the same
# time, so nothing runs beside the timed steps but the variants' builds (step 8), when there are variants.
#
# What is missing on the GPU machine travels as wheels in .whl/ (ignored by git; carried with the call, 64 MiB at
# most): fetch them on a machine with network with `bash bench/gpu_check.sh --fetch-wheels [PYTHON_VERSION]` (default
# 3.12, the GPU image's): FlashInfer (the peer of verify_chain; its kernels compile on first use there, in the
# background while the tests run) and the one package it needs that the image lacks. pytest, matplotlib and
# compute-sanitizer are in the image; a wheel is used only where the machine lacks the package.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
PY=${PYTHON:-$(command -v python3 || command -v python)}

FLASHINFER=${GPU_CHECK_FLASHINFER:-flashinfer-python==0.6.0}
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  pyver=${2:-3.12}
  mkdir -p .whl
  "$PY" -m pip download --dest .whl --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
    "$FLASHINFER" "apache-tvm-ffi>=0.1.6,<0.2"
  du -sh .whl
  exit 0
fi

OUT=${1:?usage: bash bench/gpu_check.sh OUTDIR [WHEEL]   (or --fetch-wheels [PYTHON_VERSION])}
WHEEL=${2:+$(cd "$(dirname "$2")" && pwd)/$(basename "$2")}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
T0=$(date +%s)
DEADLINE=$(( T0 + ${GPU_CHECK_SECONDS:-525} ))
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/dspark_torch_extensions}
export PYTHONUNBUFFERED=1
export PIP_DISABLE_PIP_VERSION_CHECK=1  # no network there: pip asks no index, not even for its own version
unset TRITON_INTERPRET DSPARK_SIMT DSPARK_BACKEND

step() { echo; echo "=== [$(( $(date +%s) - T0 )) s] $*"; }
# each step stops RESERVE seconds short of the deadline: the time the timed steps after it are sure of
STEP_SECONDS=${GPU_CHECK_STEP_SECONDS:-180}
BENCH_RESERVE=${GPU_CHECK_BENCH_RESERVE:-90}
RESERVE=$(( STEP_SECONDS + BENCH_RESERVE ))
left() { echo $(( DEADLINE - RESERVE - $(date +%s) )); }
# cap SECONDS: the smaller of SECONDS and the time left before the deadline (at least 10)
cap() { local l; l=$(left); (( l < $1 )) && echo $(( l > 10 ? l : 10 )) || echo "$1"; }
record() {  # record NAME RC SECONDS [NOTE]
  local res="ok"
  if [[ "$2" == skip ]]; then res="skipped"; elif [[ "$2" != 0 ]]; then res="FAILED (exit $2)"; FAILED=1; fi
  printf '%-22s %-18s %5s s  %s\n' "$1" "$res" "$3" "${4:-}" | tee -a "$SUMMARY"
}
pip_offline() {  # install from .whl/ only, never the network
  [[ -d .whl ]] && "$PY" -m pip install --no-index --find-links .whl --quiet "$@"
}

step "machine"
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "no nvidia-smi"
  "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton not importable:", e)
EOF
  git -C "$REPO" rev-parse HEAD 2>/dev/null || echo "no git"
  git -C "$REPO" status --short 2>/dev/null | head -20
} | tee "$OUT/machine.txt"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "gpu_check: torch sees no GPU"; record machine 1 0 "torch.cuda.is_available() is False"; exit 1; }

CUDA_HOME=${CUDA_HOME:-$("$PY" - <<'EOF'
import importlib.util, os
spec = importlib.util.spec_from_file_location("_dspark_build", os.path.join("dspark_kernels", "_build.py"))
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
print(build.cuda_home() or "")
EOF
)}
export CUDA_HOME
echo "CUDA_HOME=$CUDA_HOME"
ARCH=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}.{n}' + ('a' if m >= 9 else ''))")
# every build here is for this GPU alone: its SASS and no PTX for later GPUs, whose front-end pass would be a third of
# each unit's compile (39 of draft_block.cu's 122 s for 9.0a on one core) and of the build's longest path
export DSPARK_CUDA_PTX=0
RUN="$OUT/run"   # the tests and benchmarks run here, so that they import the installed package, not the checkout
mkdir -p "$RUN"

# FlashInfer, the peer of verify_chain: from .whl/ (--no-deps: the image has the rest it needs for sampling), its
# chain_speculative_sampling compiled (JIT, nvcc) in the background from here on, beside the build and the tests
# (it needs nothing of this package)
if ! "$PY" -c "import flashinfer" 2>/dev/null && compgen -G ".whl/flashinfer_python-*.whl" > /dev/null; then
  "$PY" -m pip install --no-index --no-deps --quiet .whl/flashinfer_python-*.whl .whl/apache_tvm_ffi-*.whl \
    > "$OUT/flashinfer.log" 2>&1 || echo "gpu_check: FlashInfer did not install (flashinfer.log)"
fi
# its sampling kernels include <curand.h>: where CUDA_HOME has none, the headers of an nvidia cuRAND wheel
FI_ENV=()  # what FlashInfer's build adds to the environment
if [[ ! -f "$CUDA_HOME/include/curand.h" ]]; then
  inc=$("$PY" - <<'EOF'
import glob, os, site
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for h in glob.glob(os.path.join(d, "nvidia", "*", "include", "curand.h")):
        print(os.path.dirname(h)); raise SystemExit
EOF
)
  [[ -n "$inc" ]] && FI_ENV+=("CPATH=$inc${CPATH:+:$CPATH}") && echo "gpu_check: FlashInfer's build reads $inc"
fi
# and it links with -lcuda: where CUDA_HOME has no stub library, the driver's own (the one torch loads)
if [[ ! -e "$CUDA_HOME/lib64/stubs/libcuda.so" && ! -e "$CUDA_HOME/lib64/libcuda.so" ]]; then
  drv=$("$PY" -c "import torch; torch.cuda.init()
print(next(line.split()[-1] for line in open('/proc/self/maps') if '/libcuda.so' in line))" 2>/dev/null)
  if [[ -n "$drv" ]] && mkdir -p /tmp/dspark_libcuda && ln -sf "$drv" /tmp/dspark_libcuda/libcuda.so; then
    FI_ENV+=("LIBRARY_PATH=/tmp/dspark_libcuda${LIBRARY_PATH:+:$LIBRARY_PATH}")
    echo "gpu_check: FlashInfer's build links the driver's $drv"
  fi
fi
( cd "$RUN" && env "${FI_ENV[@]}" timeout "$(cap 300)" nice -n 10 "$PY" - >> "$OUT/flashinfer.log" 2>&1 <<'EOF'
import torch
from flashinfer.sampling import chain_speculative_sampling
b, k, v = 2, 3, 1024
q = torch.softmax(torch.randn(b, k, v, device="cuda"), -1)
p = torch.softmax(torch.randn(b, k + 1, v, device="cuda"), -1)
chain_speculative_sampling(q, torch.randint(0, v, (b, k), device="cuda", dtype=torch.int32), p)
torch.cuda.synchronize()
print("flashinfer: chain_speculative_sampling compiled and ran")
EOF
  echo $? > "$OUT/flashinfer.rc" ) &
FLASHINFER_PID=$!

step "1. install the package with its prebuilt CUDA extension (${WHEEL:-a wheel built here for $ARCH})"
t=$(date +%s)
how="wheel $WHEEL"
if [[ -z "$WHEEL" ]]; then
  how="wheel built here for $ARCH"
  DSPARK_CUDA_ARCHS="$ARCH" DSPARK_BUILD_LOGS="$OUT/wheel-logs" MAX_JOBS=${MAX_JOBS:-$(nproc)} timeout "$(cap 270)" \
    "$PY" -m pip wheel --no-index --no-build-isolation --no-deps -w "$OUT/wheel" . > "$OUT/build.log" 2>&1
  WHEEL=$(ls "$OUT"/wheel/dspark_kernels-*.whl 2>/dev/null | head -1)
fi
rc=1
if [[ -n "$WHEEL" ]] && "$PY" -m pip install --no-deps --no-index --force-reinstall "$WHEEL" >> "$OUT/build.log" 2>&1
then
  (cd "$RUN" && DSPARK_NO_JIT=1 "$PY" -c "import dspark_kernels; from dspark_kernels import _ext; _ext.load()
assert _ext._loaded_from.startswith('prebuilt'), _ext._loaded_from
print('loaded', _ext._loaded_from, 'from', dspark_kernels.__file__)" >> "$OUT/build.log" 2>&1)
  rc=$?
  [[ $rc -eq 0 ]] && export DSPARK_USE_INSTALLED=1
fi
if [[ $rc -ne 0 ]]; then
  tail -20 "$OUT/build.log"
  echo "gpu_check: no prebuilt extension loads (exit $rc); the checkout with the just-in-time build instead"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  DSPARK_CUDA_ARCHS="$ARCH" timeout "$(cap 240)" "$PY" -c "from dspark_kernels import _ext; _ext.load(); print('ok')" \
    >> "$OUT/build.log" 2>&1
  how="$how did not load; just in time (exit $?)"
fi
(cd "$RUN" && "$PY" -c "import json, dspark_kernels as dk; print(json.dumps(dk.build_info(), indent=1))" \
  > "$OUT/build_info.json" 2>> "$OUT/build.log")
tail -3 "$OUT/build.log"
record build "$rc" $(( $(date +%s) - t )) "$how; log build.log, build_info.json"


# the variants build in the background while the tests run (each in its own copy and extension folder)
VARIANTS=(${GPU_CHECK_VARIANTS:-})
VARIANT_PIDS=()
VARIANT_SECONDS=${GPU_CHECK_VARIANT_SECONDS:-50}  # each variant's benchmark; the main one leaves them this much
variant_build() {  # NAME CONSTANT VALUE: copy, change the one constexpr, build just in time
  local dir="/tmp/dspark_variant_$1" hdr
  rm -rf "$dir" && mkdir -p "$dir" &&
    tar -C "$REPO" --exclude=./.git --exclude=./.whl --exclude=./build -cf - . | tar -C "$dir" -xf -
  hdr=$(grep -l -E "^constexpr [A-Za-z0-9_]+ $2 = " "$dir"/csrc/include/dspark/*.cuh)
  [[ $(echo "$hdr" | grep -c .) == 1 ]] ||
    { echo "variant $1: $2 is not one constexpr of csrc/include/dspark"; return 1; }
  sed -i -E "s/^(constexpr [A-Za-z0-9_]+ $2 = )[^;]+;/\\1$3;/" "$hdr"
  grep -E "^constexpr [A-Za-z0-9_]+ $2 = " "$hdr"
  (cd "$dir" && DSPARK_CUDA_ARCHS="$ARCH" MAX_JOBS=4 TORCH_EXTENSIONS_DIR="$dir.ext" DSPARK_USE_INSTALLED= \
     timeout "$(RESERVE=$BENCH_RESERVE cap 300)" nice -n 10 \
       "$PY" -c "from dspark_kernels import _ext; _ext.load(); print('built', _ext._loaded_from)")
}
for v in "${VARIANTS[@]}"; do
  name=${v%%:*}; kv=${v#*:}
  ( variant_build "$name" "${kv%%=*}" "${kv#*=}" > "$OUT/variant_${name}_build.log" 2>&1
    echo $? > "$OUT/variant_${name}_build.rc" ) &
  VARIANT_PIDS+=($!)
done
export DSPARK_CUDA_ARCHS="$ARCH"  # the variants' loads find their builds (the same flags)

step "2. GPU tests (pytest -m gpu, in the background beside step 3), the ptxas table built alongside"
PTXAS_PID=""
if [[ -n "${GPU_CHECK_PTXAS:-}" && -f "$GPU_CHECK_PTXAS" ]]; then  # the same table built on a CPU machine (same nvcc)
  cp "$GPU_CHECK_PTXAS" "$OUT/ptxas.json" && echo 0 > "$OUT/check_cuda.rc"
else
  # what ships, compiled once: the ptxas lines of the wheel's build and the installed library's SASS; else (no build
  # logs: a wheel given, or the just-in-time build) every unit compiled again for sm_80 and sm_90a
  so=$(cd "$RUN" && "$PY" -c "import glob, os, dspark_kernels as d
print(glob.glob(os.path.join(os.path.dirname(d.__file__), '_C*.so'))[0])" 2>/dev/null)
  if [[ "${DSPARK_USE_INSTALLED:-}" == 1 && -f "$OUT/wheel-logs/units.json" && -n "$so" ]]; then
    how_ptxas=(--from-build "$OUT/wheel-logs" --binary "$so")
  else
    how_ptxas=(-j "$(( $(nproc) / 2 > 1 ? $(nproc) / 2 : 1 ))" --archs "8.0;9.0a")
  fi
  ( timeout "$(cap 240)" nice -n 10 "$PY" tools/check_cuda.py "${how_ptxas[@]}" --json "$OUT/ptxas.json" \
      > "$OUT/check_cuda.log" 2>&1; echo $? > "$OUT/check_cuda.rc" ) &
  PTXAS_PID=$!
fi
t_tests=$(date +%s)
TESTS_PID=""
"$PY" -c "import pytest" 2>/dev/null || pip_offline pytest || true
if "$PY" -c "import pytest" 2>/dev/null; then
  # in the background, beside the sanitizer (both check correctness; nothing there is timed), on 4 workers where
  # pytest-xdist is installed (the image has it)
  XDIST=""
  "$PY" -c "import xdist" 2>/dev/null && XDIST="-n 4"
  # stopped by SIGINT, not SIGTERM: interrupted, pytest still names the failures so far and writes its JUnit XML
  ( cd "$RUN" && DSPARK_SLOW=1 timeout -s INT -k 15 "$(cap 160)" "$PY" -m pytest "$REPO/python_tests" -m gpu -q $XDIST \
      -p no:cacheprovider --durations=15 -rfEs --junitxml="$OUT/pytest_gpu.xml" > "$OUT/pytest_gpu.log" 2>&1
    echo $? > "$OUT/pytest_gpu.rc" ) &
  TESTS_PID=$!
else
  record "gpu tests" 1 0 "pytest is not installed and .whl/ has none (bash bench/gpu_check.sh --fetch-wheels)"
fi
gpu_tests_done() {  # wait for the GPU tests and record them, with the near-ties the production-shape tests excused
  [[ -z "$TESTS_PID" ]] && return
  wait "$TESTS_PID" 2>/dev/null
  tail -15 "$OUT/pytest_gpu.log"
  record "gpu tests" "$(cat "$OUT/pytest_gpu.rc" 2>/dev/null || echo 1)" $(( $(date +%s) - t_tests )) \
    "$(tail -1 "$OUT/pytest_gpu.log")"
  "$PY" - "$OUT/pytest_gpu.xml" <<'PYEOF' 2>/dev/null | tee -a "$SUMMARY"
import sys, xml.etree.ElementTree as ET
cases = [(c.get("name"), int(p.get("value"))) for c in ET.parse(sys.argv[1]).iter("testcase")
         for p in c.iter("property") if p.get("name") == "excused_near_ties"]
print(f"{'near-ties excused':<22} {sum(v for _, v in cases)} over {len(cases)} production-shape token tests"
      + "".join(f"; {n}: {v}" for n, v in cases if v))
PYEOF
}

step "3. compute-sanitizer on small cases of every CUDA kernel"
SAN=""
for c in "$CUDA_HOME/bin/compute-sanitizer" "$CUDA_HOME/compute-sanitizer/compute-sanitizer" \
         "$(command -v compute-sanitizer 2>/dev/null)"; do
  [[ -n "$c" && -x "$c" ]] && { SAN=$c; break; }
done
if [[ -z "$SAN" ]]; then  # the nvidia-cuda-sanitizer-api wheel: installed with pip, or in .whl/
  SAN=$("$PY" - <<'EOF'
import glob, os, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for p in glob.glob(os.path.join(d, "nvidia", "*", "bin", "compute-sanitizer")):
        print(p); sys.exit()
EOF
)
fi
if [[ -z "$SAN" ]] && compgen -G ".whl/nvidia_cuda_sanitizer_api-*.whl" > /dev/null; then
  mkdir -p /tmp/dspark_sanitizer && "$PY" -m zipfile -e "$(ls .whl/nvidia_cuda_sanitizer_api-*.whl | head -1)" \
    /tmp/dspark_sanitizer && SAN=$(ls /tmp/dspark_sanitizer/nvidia/*/bin/compute-sanitizer | head -1) && \
    chmod +x "$SAN" && echo "using compute-sanitizer from .whl/: $SAN"
fi
if [[ -z "$SAN" ]]; then
  record sanitizer skip 0 "no compute-sanitizer (not in CUDA_HOME, PATH, site-packages or .whl/)"
else
  "$SAN" --version | tail -1
  for tool in memcheck racecheck; do
    t=$(date +%s)
    # no caching allocator: each tensor is its own allocation, so an out-of-bounds access is not hidden in a pool
    # only our kernels (namespace dspark) are instrumented: torch's own kernels are not ours to check, and skipping
    # them keeps racecheck fast
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(cap 80)" "$SAN" --tool "$tool" --error-exitcode 3 \
      --kernel-name kns=dspark "$PY" bench/sanitizer_cases.py > "$OUT/sanitizer_$tool.log" 2>&1
    rc=$?
    # not run (the kernel filter refused, say): again without it; one stopped by its time limit ran, slowly, and
    # would only be slower without the filter
    if [[ $rc -ne 0 && $rc -ne 124 ]] && ! grep -q "calls ran" "$OUT/sanitizer_$tool.log"; then
      echo "gpu_check: $tool did not run the cases (exit $rc); again without the kernel filter"
      tail -5 "$OUT/sanitizer_$tool.log"
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout "$(cap 100)" "$SAN" --tool "$tool" --error-exitcode 3 \
        "$PY" bench/sanitizer_cases.py > "$OUT/sanitizer_$tool.log" 2>&1
      rc=$?
    fi
    grep -E "SKIP|FAIL|calls ran|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitizer_$tool.log" | tail -12
    record "sanitizer $tool" "$rc" $(( $(date +%s) - t )) "log sanitizer_$tool.log"
  done
fi

gpu_tests_done
# the CPU work begun beside the tests ends by the same deadline, so that nothing runs beside the timed steps
wait "$FLASHINFER_PID" 2>/dev/null
FLASHINFER_RC=$(cat "$OUT/flashinfer.rc" 2>/dev/null || echo 1)
record flashinfer "$FLASHINFER_RC" - "$(tail -1 "$OUT/flashinfer.log" 2>/dev/null)"
[[ -n "$PTXAS_PID" ]] && wait "$PTXAS_PID" 2>/dev/null
record "ptxas table" "$(cat "$OUT/check_cuda.rc" 2>/dev/null || echo 1)" - "tools/check_cuda.py --json: ptxas.json, check_cuda.log"

step "4. the decode step end to end (bench/step.py: a Qwen3-8B-shaped target alone against the speculative step)"
# both CUDA-graphed, random weights on the device, acceptance forced (tau 1, 3.6, 6.2), batch 1, 8, 64; the JSON is
# written after every run, so a step stopped by its time limit keeps the runs it measured
RESERVE=$BENCH_RESERVE
t=$(date +%s)
timeout "$(cap "$STEP_SECONDS")" "$PY" bench/step.py --out-dir "$OUT" > "$OUT/step.log" 2>&1
rc=$?
tail -12 "$OUT/step.log"
record "decode step" "$rc" $(( $(date +%s) - t )) "$("$PY" - "$OUT" <<'PYEOF' 2>/dev/null
import glob, json, sys
for path in glob.glob(sys.argv[1] + "/*_step.json")[:1]:
    rec = json.load(open(path))
    print(f"{path.rsplit('/', 1)[-1]}: {len(rec['runs'])} runs"
          + ("" if rec["machine"].get("complete") else " (INCOMPLETE: cut short)") + ";", end=" ")
PYEOF
)step.log"

step "5. Nsight Compute's counters for the headline ops (bench/ncu.py)"
NCU=$(command -v ncu 2>/dev/null || ls /opt/nvidia/nsight-compute/*/ncu "$CUDA_HOME/bin/ncu" 2>/dev/null | head -1)
if [[ -z "$NCU" ]]; then
  record ncu skip 0 "no ncu on PATH, in CUDA_HOME or /opt/nvidia/nsight-compute"
elif (( $(left) < 30 )); then  # the counters explain the benchmark's times; they never take its reserve
  record ncu skip 0 "no time left before the benchmark's reserve"
else
  t=$(date +%s)
  # a case takes seconds under ncu (a python start, replays): the ops take turns within the budget, the cases it
  # leaves out are rows saying so, and ncu.json is written after each case
  ncu_s=$(cap 60)
  (cd "$RUN" && timeout "$ncu_s" "$PY" "$REPO/bench/ncu.py" --ncu "$NCU" --json "$OUT/ncu.json" \
     --time-budget $(( ncu_s > 20 ? ncu_s - 10 : ncu_s / 2 )) --timeout 30 \
     --op ${GPU_CHECK_NCU_OPS:-draft_block verify_chain} --N 1 64 > "$OUT/ncu.log" 2>&1)
  rc=$?
  tail -4 "$OUT/ncu.log"
  if [[ $rc -ne 0 ]] && ! grep -q '"duration_us"' "$OUT/ncu.log"; then  # gVisor: ncu cannot read the counters
    record ncu skip $(( $(date +%s) - t )) "ncu read no counters (exit $rc): ncu.log"
  else
    record ncu "$rc" $(( $(date +%s) - t )) "ncu.json, ncu.log"
  fi
fi

RESERVE=0
"$PY" -c "import matplotlib" 2>/dev/null || pip_offline matplotlib || echo "gpu_check: no matplotlib: no plots"
bench_pass() {  # NAME LOG ARGS...: bench/run.py with the time left, less 40 s to write its files and the variants' time
  local name=$1 log=$2 t budget rc
  shift 2
  t=$(date +%s)
  budget=$(( $(left) - 40 - ${#VARIANTS[@]} * VARIANT_SECONDS ))
  if (( budget < 30 )); then
    record "$name" skip 0 "no time left"
    return
  fi
  timeout "$(( budget + 30 ))" "$PY" bench/run.py "$@" --out-dir "$OUT" --no-structural --no-e2e \
    --time-budget "$budget" > "$OUT/$log" 2>&1
  rc=$?
  sed -n '/^op /,/^$/p' "$OUT/$log" | head -80
  tail -8 "$OUT/$log"
  record "$name" "$rc" $(( $(date +%s) - t )) "time budget ${budget} s; log $log"
}

# without FlashInfer's kernels built above, its rows would build them inside the benchmark's time: left out
GOAL_BACKENDS=() FULL_BACKENDS=()
if [[ "$FLASHINFER_RC" != 0 ]]; then
  GOAL_BACKENDS=(--backend cuda triton cublas) FULL_BACKENDS=(--backend cuda triton cpu reference cublas)
fi

step "6. the rows the issues' goals are judged on, first (bench/run.py --goals: cases.GOALS)"
bench_pass "bench goals" bench_goals.log --goals --no-plot "${GOAL_BACKENDS[@]}"

step "7. bench/run.py --full on the headline shapes, with the time left"
# the kernels this project is judged by first; the time budget leaves out the tail. The SIMT structural report and
# the tiny-model end-to-end rows need no GPU: a CPU machine runs them
BENCH_OPS=${GPU_CHECK_OPS:-"draft_block verify_chain accept_prefix_scan schedule_verify_lens rng_uniform \
dist_verify_stats dist_verify_decide dist_verify_residual dist_draft_step"}
bench_pass bench bench.log --full --K 7 --V 151936 --op $BENCH_OPS --ptxas-json "$OUT/ptxas.json" "${FULL_BACKENDS[@]}"

# the goals judged on what was measured: the --goals rows first, then the full grid's, the decode step's record and
# the last record of this GPU under bench/records (goals.txt, goals.json; the counts go into the summary)
shopt -s nullglob
judged=("$OUT"/*_goals.json "$OUT"/*_full.json)
steps=("$OUT"/*_step.json)
"$PY" bench/goals.py "${judged[@]}" ${steps:+--step "${steps[0]}"} --json "$OUT/goals.json" > "$OUT/goals.txt" 2>&1
record goals $? - "goals.txt: $(grep '^goals #' "$OUT/goals.txt" | sed 's/^goals //' | paste -sd';' - | sed 's/;/; /g')"
shopt -u nullglob

if (( ${#VARIANTS[@]} > 0 )); then
  step "8. the variants: draft_block's CUDA rows on each, then their draft_block GPU tests"
  (( ${#VARIANT_PIDS[@]} )) && wait "${VARIANT_PIDS[@]}"  # their builds
  VN=${GPU_CHECK_VARIANT_N:-1 8 64 256}
  for v in "${VARIANTS[@]}"; do
    name=${v%%:*}; dir="/tmp/dspark_variant_$name"; t=$(date +%s)
    if [[ "$(cat "$OUT/variant_${name}_build.rc" 2>/dev/null)" != 0 ]]; then
      tail -5 "$OUT/variant_${name}_build.log"; record "variant $name" 1 0 "build failed: variant_${name}_build.log"
      continue
    fi
    (cd "$dir" && DSPARK_USE_INSTALLED= TORCH_EXTENSIONS_DIR="$dir.ext" timeout "$VARIANT_SECONDS" "$PY" bench/run.py \
       --full --op draft_block --backend cuda --dtype bf16 --mode greedy --K 7 --V 151936 --N $VN \
       --no-structural --no-e2e --no-plot --out-dir "$OUT" \
       --name "variant_$name" > "$OUT/variant_${name}_bench.log" 2>&1)
    rc=$?
    sed -n '/^op /,/^$/p' "$OUT/variant_${name}_bench.log" | head -20
    record "variant $name" "$rc" $(( $(date +%s) - t )) "$v: variant_$name.json, variant_${name}_bench.log"
  done
  for v in "${VARIANTS[@]}"; do
    name=${v%%:*}; dir="/tmp/dspark_variant_$name"
    [[ "$(cat "$OUT/variant_${name}_build.rc" 2>/dev/null)" == 0 ]] || continue
    budget=$(( DEADLINE - $(date +%s) ))
    (( budget < 20 )) && { record "variant $name tests" skip 0 "no time left"; continue; }
    t=$(date +%s)
    (cd "$dir" && DSPARK_USE_INSTALLED= TORCH_EXTENSIONS_DIR="$dir.ext" timeout -s INT -k 10 "$budget" "$PY" -m pytest \
       python_tests/test_draft_block.py -m gpu -q -x -p no:cacheprovider > "$OUT/variant_${name}_tests.log" 2>&1)
    rc=$?
    record "variant $name tests" "$rc" $(( $(date +%s) - t )) "$(tail -1 "$OUT/variant_${name}_tests.log")"
  done
fi

step "done in $(( $(date +%s) - T0 )) s; results in $OUT"
cat "$SUMMARY"
# one file to bring back: everything here but the wheel, the object files and the run folder (gpu_check.log up to
# this line: tee is still writing it, which GNU tar reports with exit status 1)
tar -C "$OUT" -czf "$OUT/gpu_check.tar.gz" --warning=no-file-changed --exclude=./gpu_check.tar.gz --exclude=./wheel \
  --exclude=./run --exclude='*.o' .
(( $? <= 1 )) && echo "bundle: $OUT/gpu_check.tar.gz ($(du -k "$OUT/gpu_check.tar.gz" | cut -f1) KiB)"
exit $FAILED
