#!/bin/bash
# What a user without a compiler gets, on a GPU machine, from the repository root:
#   tools/gpu_engines/run_gpu_wheel.sh tests   # the wheels from dist/, compiler hidden, nox -s gpu
#   tools/gpu_engines/run_gpu_wheel.sh bench   # benchmarks/vllm_gpu_kernels.py: wheel / JIT / no binary
# `nox -s build` (on any machine) makes dist/; .eng holds the vLLM bundle and nox's wheels
# (README.md here). The compiler is hidden from everything but the benchmark's JIT row:
# CUDA_HOME and CUDA_PATH are unset and every PATH entry holding nvcc is dropped. `tests` then
# checks that the wheel's kernels loaded (python -m lmcache.gpu_ops --require) and that nothing
# was compiled (no JIT build folder in ~/.cache/lmcache afterwards). Logs: $OUT or /tmp.
set -uo pipefail
STAGE=${1:-tests}
cd "$(dirname "$0")/../.."
LOGS=${LMC_GPU_LOGS:-${OUT:-/tmp/lmcache-gpu-run}}; mkdir -p "$LOGS"
CUDA_ROOT=${CUDA_HOME:-/usr/local/cuda}
unset CUDA_HOME CUDA_PATH
PATH=$(echo "$PATH" | tr ':' '\n' | while read -r d; do [ -x "$d/nvcc" ] || echo "$d"; done | paste -sd:)
export PATH
if command -v nvcc >/dev/null; then echo "nvcc still on PATH: $(command -v nvcc)"; exit 1; fi
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/lmcache
python3 -m pip install -q --no-index --no-deps --force-reinstall \
  dist/lmcache_core-*manylinux*.whl dist/lmcache_vllm-*.whl dist/lmcache_sglang-*.whl || exit 1
python3 -m nox --version >/dev/null 2>&1 ||
  python3 -m pip install -q --no-index --find-links .eng/nox-wheels nox || exit 1
python3 -m lmcache.gpu_ops --require 2>&1 | tee "$LOGS/gpu_ops.txt" || exit 1

if [ "$STAGE" = tests ]; then
  rm -rf "$CACHE"/kernels-*
  timeout -k 10 "${LMC_TESTS_S:-540}" python3 -m nox -s gpu >"$LOGS/tests.log" 2>&1; rc=$?
  echo "== nox -s gpu: exit $rc (log $LOGS/tests.log)"
  grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)|nox > (Session|.*no bundle)" "$LOGS/tests.log" | tail -n 30
  built=$(ls -d "$CACHE"/kernels-* 2>/dev/null)
  if [ -n "$built" ]; then echo "compiled during the tests: $built"; rc=1; else echo "nothing compiled"; fi
  exit $rc
fi
export PYTHONPATH=/tmp/lmcache-vllm-site${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
python3 - <<'EOF'
import pathlib, sys
sys.path.insert(0, "tools/gpu_engines")
from bundles import gpu_bundles, unpack_bundle
for engine, path in gpu_bundles().items():
    unpack_bundle(engine, path)
EOF
timeout -k 10 "${LMC_BENCH_S:-540}" python3 benchmarks/vllm_gpu_kernels.py --cuda-home "$CUDA_ROOT" \
  "${@:2}" 2>&1 | tee "$LOGS/vllm_gpu_kernels.log" | sed -n '/^=== /,$p'
