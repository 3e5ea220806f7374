#!/usr/bin/env bash
# The GPU check: ONE prepared run on a lent GPU machine (an H200: Python 3.12, torch with CUDA,
# nvcc, cmake, ninja, pybind11, scikit-build-core, transformers; no network), in the repository
# root of a copy of the tree, writing to $OUT. It finishes in under 7 minutes, so that a rerun
# fits in a session's 15 minutes of GPU time:
#
#   1. build pagedserve in place (pip -e, no build isolation, no downloads, CUDA required)
#   2. pytest -m cuda tests/cuda: every op against the torch references, the engine against HF
#   3. tools/bench_cuda.py: paged decode GB/s against a device-to-device copy and time against
#      contiguous SDPA decode (multi-head, grouped-query, multi-query, one 32k sequence);
#      prefill over the paged cache against causal flash SDPA; cache op bandwidths
#   4. tools/bench_gpu_e2e.py: Llama-3-8B-shaped bfloat16 model (grouped-query), ShareGPT-like
#      trace, pagedserve against the trace's decode memory roofline and HF generate_batch and
#      generate (gets whatever time is left)
#   5. $OUT/gpu_check.json and $OUT/gpu_check.md: the summary, with issues 6's and 37's targets
#      checked
#
# Packages the image may lack or have too old (pyzmq, msgpack, gguf, jinja2 and markupsafe,
# which the engine imports; pytest and its dependencies; scikit-build-core, pathspec and
# pybind11, which the build needs) travel as wheels in .whl/, carried by the caller and fetched
# beforehand on a machine with the registry:
#   pip download pyzmq msgpack gguf jinja2 markupsafe pytest pluggy iniconfig pygments \
#       scikit-build-core pathspec pybind11 --only-binary=:all: --no-deps -d .whl \
#       --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any
# Each one the image lacks (or has older than the project needs) is installed to /tmp/site,
# which goes first on PYTHONPATH; the image's other packages are kept.
#
#   OUT=/tmp/out bash tools/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
LIMIT_S=${GPU_CHECK_LIMIT_S:-400}  # leave the 7 minutes some slack
START=$(date +%s)
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

elapsed() { echo $(($(date +%s) - START)); }
left() { echo $((LIMIT_S - $(elapsed))); }
say() { echo "gpu_check [$(elapsed) s]: $*"; }

PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

# --- 0. packages the image lacks ---------------------------------------------------------------
# lacks MODULE DISTRIBUTION MINIMUM: true when the module does not import or the distribution is
# older than MINIMUM.
lacks() {
  "$PYTHON" - "$1" "$2" "$3" <<'PY' 2>/dev/null
import importlib, importlib.metadata, sys
module, distribution, minimum = sys.argv[1:]
try:
    importlib.import_module(module)
    version = importlib.metadata.version(distribution)
except Exception:
    sys.exit(0)
def parse(text):
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())
sys.exit(0 if parse(version) < parse(minimum) else 1)
PY
}
missing_wheels=()
# module, distribution, wheel file prefix, minimum version
while read -r module distribution prefix minimum; do
  if lacks "$module" "$distribution" "$minimum"; then
    wheel=$(compgen -G ".whl/${prefix}-*.whl" | head -n 1 || true)
    if [ -n "$wheel" ]; then
      missing_wheels+=("$wheel")
    else
      say "$distribution >= $minimum is missing and .whl/ holds no wheel of it"
    fi
  fi
done <<'LIST'
zmq pyzmq pyzmq 25
msgpack msgpack msgpack 1.0
gguf gguf gguf 0.17
jinja2 jinja2 jinja2 3.1
markupsafe markupsafe markupsafe 2.0
pytest pytest pytest 8
pluggy pluggy pluggy 1.5
iniconfig iniconfig iniconfig 1
pygments pygments pygments 2
scikit_build_core scikit-build-core scikit_build_core 0.10
pathspec pathspec pathspec 0.10
pybind11 pybind11 pybind11 2.12
LIST
if [ "${#missing_wheels[@]}" -gt 0 ]; then
  say "installing ${missing_wheels[*]} to /tmp/site"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "${missing_wheels[@]}" || say "installing the wheels failed; going on without them"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# --- 1. build ----------------------------------------------------------------------------------
say "building"
build_start=$(date +%s)
build_rc=0
PAGEDSERVE_BUILD_CUDA=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  timeout 220 "$PYTHON" -m pip install -q --no-build-isolation --no-deps -e . || build_rc=$?
build_s=$(($(date +%s) - build_start))
say "build rc=$build_rc in $build_s s"

tests_rc=-1 bench_rc=-1 e2e_rc=-1
if [ "$build_rc" -eq 0 ]; then
  # --- 2. tests --------------------------------------------------------------------------------
  say "pytest -m cuda tests/cuda"
  tests_rc=0
  timeout 180 "$PYTHON" -m pytest -q -m cuda tests/cuda -p no:cacheprovider --durations=15 \
    --junitxml="$OUT/pytest.xml" || tests_rc=$?

  # --- 3. kernel microbenchmarks ---------------------------------------------------------------
  say "tools/bench_cuda.py"
  bench_rc=0
  timeout 90 "$PYTHON" tools/bench_cuda.py --json "$OUT/bench_cuda.json" || bench_rc=$?

  # --- 4. end to end, in the time left ---------------------------------------------------------
  model_dir=/dev/shm/pagedserve-e2e-random  # 16 GB of bfloat16 weights
  shm_kb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
  if [ "${shm_kb:-0}" -lt $((20 * 1024 * 1024)) ]; then model_dir=/tmp/pagedserve-e2e-random; fi
  budget=$(($(left) - 15))
  if [ "$budget" -gt 60 ]; then
    say "tools/bench_gpu_e2e.py with $budget s"
    e2e_rc=0
    timeout "$budget" "$PYTHON" tools/bench_gpu_e2e.py --model-dir "$model_dir" \
      --deadline-s $((budget - 45)) --json "$OUT/e2e.json" || e2e_rc=$?
    rm -rf "$model_dir"
  else
    say "no time left for the end-to-end run ($budget s)"
  fi
fi

# --- 5. summary --------------------------------------------------------------------------------
say "summary"
BUILD_RC=$build_rc BUILD_S=$build_s TESTS_RC=$tests_rc BENCH_RC=$bench_rc E2E_RC=$e2e_rc \
  TOTAL_S=$(elapsed) OUT="$OUT" "$PYTHON" tools/gpu_check_summary.py
say "done"
[ "$build_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ]
